"""ZeroTrainer(muon=...) against a plain loop of torch.optim.Muon (the hidden matrices) plus
torch.optim.AdamW (the rest, the Trainer's decay split) on the same data: the same lr schedule on
both optimizers, clipping by the global norm; at one rank, and at stage 2 on 2 gloo ranks (the
Muon group in the owner layout, each matrix whole on one rank). Refused: muon= with
optimizers=. Skipped without the 'hf' extra."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs the 'hf' extra: pip install 'fusedzero[hf]'"
)
pytest.importorskip(
    "accelerate", reason="the Trainer needs accelerate: pip install 'fusedzero[hf]'"
)

from _tiny import LR, tiny_llama, tokens  # noqa: E402

from fusedzero import ZeroMuon, muon_param_groups  # noqa: E402
from fusedzero.integrations.hf import ZeroTrainer  # noqa: E402
from fusedzero.testing import run_ranks  # noqa: E402

N_SEQS, STEPS, CLIP = 8, 3, 0.5
MUON = dict(lr=0.02, weight_decay=0.1)  # lr exact enough: both sides read the same Python float


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = tokens(N_SEQS)

    def __len__(self) -> int:
        return N_SEQS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def training_args(out: Path, **over: Any) -> Any:
    """Every step the whole data set in one batch (the sampler's shuffle only reorders the
    batch), the Trainer's default linear decay, clipping active."""
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=N_SEQS,
        max_steps=STEPS,
        learning_rate=LR,
        weight_decay=0.1,
        max_grad_norm=CLIP,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        optim="adamw_torch",
    )
    kw.update(over)
    return transformers.TrainingArguments(**kw)


def reference(base: torch.nn.Module, halves: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """torch.optim.Muon + torch.optim.AdamW, each with the Trainer's linear schedule; `halves`:
    each loss as the mean of two half-batch losses (the noise control: the same math in
    another summation order)."""
    model = copy.deepcopy(base)
    muon, adamw = muon_param_groups(model)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = {id(p): n for n, p in model.named_parameters()}
    opts = [
        torch.optim.Muon(muon["params"], **MUON),
        torch.optim.AdamW(
            [
                {"params": [p for p in adamw["params"] if named[id(p)] in decay]},
                {
                    "params": [p for p in adamw["params"] if named[id(p)] not in decay],
                    "weight_decay": 0.0,
                },
            ],
            lr=LR,
            weight_decay=0.1,
        ),
    ]
    scheds = [transformers.get_linear_schedule_with_warmup(o, 0, STEPS) for o in opts]
    x, losses = tokens(N_SEQS), []
    for _ in range(STEPS):
        if halves:
            h = N_SEQS // 2
            loss = (
                model(input_ids=x[:h], labels=x[:h]).loss
                + model(input_ids=x[h:], labels=x[h:]).loss
            ) / 2
        else:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for o, s in zip(opts, scheds, strict=True):
            o.step()
            s.step()
            o.zero_grad()
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def noise_control(
    base: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], list[float], float]:
    """The plain loop's params and losses, and its noise control: the largest param difference
    between the loop and itself with each loss over two half batches (Newton-Schulz rounds its
    input to bf16, so an fp32 ulp of summation order can move an update by a bf16 ulp: bitwise
    is out of reach, as in tests/zero/test_zero_muon.py)."""
    want, want_losses = reference(base, halves=False)
    noisy, _ = reference(base, halves=True)
    noise = max((noisy[n] - w).abs().max().item() for n, w in want.items())
    assert 0.0 < noise < 2e-3, noise  # well below an lr-sized step, or it would hide a bug
    return want, want_losses, noise


def check_against_loop(
    got: dict[str, torch.Tensor], losses: list[float], base: torch.nn.Module
) -> None:
    """Params within 2x the loop's noise control, logged losses within 1e-4 relative."""
    want, want_losses, noise = noise_control(base)
    for n, w in want.items():
        d = (got[n] - w).abs().max().item()
        assert d <= 2 * noise, f"{n}: max diff {d} > 2x the noise control {noise}"
    torch.testing.assert_close(losses, want_losses, rtol=1e-4, atol=0)


def test_zero_trainer_muon_matches_torch_muon_plus_adamw(tmp_path: Path) -> None:
    """Three steps at one rank: the params match the plain loop's within 2x its noise control,
    the logged losses within 1e-4 relative, and the Muon group's lr follows the Trainer's
    schedule."""
    base = tiny_llama()
    model = copy.deepcopy(base)
    t = ZeroTrainer(model=model, args=training_args(tmp_path), train_dataset=Tokens(), muon=MUON)
    t.train()
    opt = t.zero_optimizer
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, False]
    assert opt.param_groups[0]["lr"] == 0.0 and opt.param_groups[1]["lr"] == 0.0  # linear -> 0
    got = {n: p.detach() for n, p in model.named_parameters()}
    check_against_loop(got, [h["loss"] for h in t.state.log_history if "loss" in h], base)
    opt.close()


def stage_2_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """ZeroTrainer(muon=..., stage=2) on this rank, half the batch each: its params after the
    run (stage 2 all-gathers them whole on every rank), its logged losses (the ranks' mean),
    and which rank owns each Muon matrix."""
    model = tiny_llama()
    t = ZeroTrainer(
        model=model,
        args=training_args(Path(root), per_device_train_batch_size=N_SEQS // world),
        train_dataset=Tokens(),
        muon=MUON,
        stage=2,
    )
    t.train()
    opt = t.zero_optimizer
    out = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "losses": [h["loss"] for h in t.state.log_history if "loss" in h],
        "owned": sum(
            len(buf.local_shard().whole_tensors())
            for buf in opt.flat_groups
            if opt.group_rules[buf.group_index].name == "muon"
        ),
    }
    opt.close()
    return out


@pytest.mark.slow  # spawns ranks
def test_zero_trainer_muon_stage_2_on_two_ranks(tmp_path: Path) -> None:
    """Stage 2 on 2 gloo ranks, 4 sequences each (the 8 the loop sees in one batch): the
    params on every rank match the plain loop's within 2x its noise control, the logged losses
    within 1e-4 relative, and both ranks own some of the Muon matrices (the owner layout
    spreads them; one rank owning all would be stage 0 in disguise)."""
    ranks = run_ranks(stage_2_ranks, 2, str(tmp_path), timeout=600)
    for r, got in enumerate(ranks):
        assert got["owned"] > 0, f"rank {r} owns no Muon matrix"
        check_against_loop(got["params"], got["losses"], tiny_llama())


def test_muon_with_optimizers_is_refused() -> None:
    """muon= with optimizers= is one line: muon= builds the optimizer."""
    model = tiny_llama()
    own = ZeroMuon(muon_param_groups(model), module=model, max_grad_norm=CLIP)
    with pytest.raises(TypeError, match="^ZeroTrainer got muon= and optimizers="):
        ZeroTrainer(model=model, muon={}, optimizers=(own, None))
    own.close()
