"""ZeroTrainer(muon=...) against a plain loop of torch.optim.Muon (the hidden matrices) plus
torch.optim.AdamW (the rest, the Trainer's decay split) on the same data, at one rank: the
same lr schedule on both optimizers, clipping by the global norm. Refusals: stages 1-3 over
several ranks, and a run that would save checkpoints ZeroMuon's state cannot go into yet.
Skipped without the 'hf' extra.

About an internal: fusedzero.integrations._common (refuse_muon_layout, the constructor's check
of the stage and world size, called with 2 ranks without starting them)."""

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
from fusedzero.integrations import _common  # noqa: E402
from fusedzero.integrations.hf import ZeroTrainer  # noqa: E402

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


def test_zero_trainer_muon_matches_torch_muon_plus_adamw(tmp_path: Path) -> None:
    """Three steps: the params match the plain loop's within 2x its noise control (the loop
    against itself with each loss over two half batches; Newton-Schulz rounds its input to
    bf16, so an fp32 ulp of summation order can move an update by a bf16 ulp: bitwise is out of
    reach, as in tests/zero/test_zero_muon.py), the logged losses too (1e-4 relative, the first
    bitwise-close), and the Muon group's lr follows the Trainer's schedule."""
    base = tiny_llama()
    want, want_losses = reference(base, halves=False)
    noisy, _ = reference(base, halves=True)
    noise = max((noisy[n] - w).abs().max().item() for n, w in want.items())
    assert 0.0 < noise < 2e-3, noise  # well below an lr-sized step, or it would hide a bug
    model = copy.deepcopy(base)
    t = ZeroTrainer(model=model, args=training_args(tmp_path), train_dataset=Tokens(), muon=MUON)
    t.train()
    opt = t.zero_optimizer
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, False]
    assert opt.param_groups[0]["lr"] == 0.0 and opt.param_groups[1]["lr"] == 0.0  # linear -> 0
    got = {n: p.detach() for n, p in model.named_parameters()}
    for n, w in want.items():
        d = (got[n] - w).abs().max().item()
        assert d <= 2 * noise, f"{n}: max diff {d} > 2x the noise control {noise}"
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    torch.testing.assert_close(losses, want_losses, rtol=1e-4, atol=0)
    opt.close()


def test_muon_refusals() -> None:
    """One line each: stages 1-3 over several ranks (checked in the constructor), muon= with
    optimizers=."""
    with pytest.raises(
        ValueError, match=r"^ZeroTrainer\(muon=...\) at stage 2 over 2 ranks: .*use stage=0"
    ):
        _common.refuse_muon_layout(2, 2, "ZeroTrainer(muon=...)")  # the constructor's check
    model = tiny_llama()
    own = ZeroMuon(muon_param_groups(model), module=model, max_grad_norm=CLIP)
    with pytest.raises(TypeError, match="^ZeroTrainer got muon= and optimizers="):
        ZeroTrainer(model=model, muon={}, optimizers=(own, None))
    own.close()
