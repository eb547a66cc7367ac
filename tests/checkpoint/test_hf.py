"""Hugging Face transformers: a GPT-2 from config trained under ZeroAdamW (stages 0-3, 2 gloo
ranks) matches torch AdamW; our checkpoint goes to `AutoModelForCausalLM.from_pretrained` and
HF weights come back with `checkpoint.import_weights`. Skipped without the 'hf' extra."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedzero import checkpoint
from fusedzero.checkpoint import hf
from fusedzero.cli import main as cli_main
from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks or the CLI

transformers = pytest.importorskip(
    "transformers", reason="needs the 'hf' extra: pip install 'fusedzero[hf]'"
)

W, STEPS, BATCH, SEQ, LR = 2, 4, 4, 16, 1e-3
# GPT-2 has dropout on embeddings, attention and residuals: off, so both runs are deterministic.
CONFIG = dict(
    n_layer=2,
    n_embd=32,
    n_head=2,
    vocab_size=96,
    n_positions=SEQ,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
)
# fp32 on both sides; the ranks' grads differ from the reference's only in summation order
# (~1e-7 relative), which Adam's 1/sqrt(v) can amplify to ~lr * 1e-6 in elements with tiny
# grads (GPT-2's tied head gives every vocabulary row such small grads): 1e-3 of lr, the same
# bound as tests/zero/test_zero.py.
RTOL, ATOL = 1e-6, 1e-3 * LR


def assert_params_close(got: torch.Tensor, want: torch.Tensor, name: str, what: str) -> None:
    """Tight comparison, except GPT-2's attention *key* bias (the middle third of c_attn.bias):
    softmax is invariant to it, so its exact grad is zero and what both optimizers see there is
    rounding noise, which Adam normalises into sign-random steps of up to about lr. Those
    elements are only held to that bound: 2 lr per step."""
    got, want = got.detach(), want.detach()
    if name.endswith("attn.c_attn.bias"):
        C = CONFIG["n_embd"]
        noise = slice(C, 2 * C)
        assert (got[noise] - want[noise]).abs().max() <= 2 * STEPS * LR, f"{what} {name}"
        got, want = torch.cat([got[:C], got[2 * C :]]), torch.cat([want[:C], want[2 * C :]])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    return model.train()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)


def train_ranks(rank: int, world: int, ckpt_dir: str) -> list[dict[str, Any]]:
    from fusedzero import Precision
    from fusedzero.plan import PlanConfig, plan_model

    out = []
    for stage in (0, 1, 2, 3):
        model = make_model()
        opt = ZeroAdamW(model.parameters(), lr=LR, weight_decay=0.1, stage=stage, module=model)
        losses = []
        n = BATCH // world
        for step in range(STEPS):
            x = batch(step)[rank * n : (rank + 1) * n]
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        # The plan of this very run (fp32 params and reduction, one group) on real gloo ranks.
        with torch.device("meta"):
            meta = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
        want = plan_model(
            meta, PlanConfig(world_size=world, precision=Precision()), decay_split=False
        ).stages[stage]
        comm = opt.comm.total_bytes  # before the gathers of save / gathered_params below
        if stage == 3:
            checkpoint.save(opt, ckpt_dir, step=STEPS)
        with opt.gathered_params():
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
        out.append(
            {
                "params": params,
                "losses": losses,
                "memory": opt.memory().total,
                "comm": comm,
                "plan": want,
            }
        )
    return out


def reference() -> tuple[torch.nn.Module, list[float]]:
    """torch.optim.AdamW on the global batch, its mean loss taken as the mean of the W equal
    slices' means (mathematically the global mean). Each slice runs its own forward/backward on
    one thread, as a rank does, and the 1/W scale is a power of two (exact): the grads then
    equal the ranks' averaged grads up to the summation order of W terms, instead of differing
    by a whole matmul's reordering, which Adam's 1/sqrt(v) would amplify in elements whose
    grads cancel (GPT-2's attention key bias has an exact grad of zero)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        losses = []
        n = BATCH // W
        for step in range(STEPS):
            total = 0.0
            for r in range(W):
                x = batch(step)[r * n : (r + 1) * n]
                loss = model(input_ids=x, labels=x).loss
                (loss / W).backward()
                total += loss.item() / W
            opt.step()
            opt.zero_grad()
            losses.append(total)
    finally:
        torch.set_num_threads(threads)
    return model, losses


def test_gpt2_from_config_zero_0_to_3_matches_adamw_and_round_trips_through_hf(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    outs = run_ranks(train_ranks, W, str(ckpt))
    ref, ref_losses = reference()
    ref_params = dict(ref.named_parameters())
    for rank, per_stage in enumerate(outs):
        for stage, o in enumerate(per_stage):
            for name, r in ref_params.items():
                assert_params_close(o["params"][name], r, name, f"stage {stage} rank {rank}")
            assert o["memory"] == o["plan"].total_bytes, (stage, o["memory"], o["plan"])
            # comm is of the last step only if reset; here: STEPS steps (plan is per step).
            assert o["comm"] == STEPS * o["plan"].comm_bytes_per_step, stage
    # Losses: rank r's half of each batch; their mean is the reference's global mean.
    for stage in range(4):
        mean = [sum(o[stage]["losses"][s] for o in outs) / W for s in range(STEPS)]
        assert mean == pytest.approx(ref_losses, rel=1e-5), stage

    # Our checkpoint (stage 3, 2 ranks) -> an HF folder -> from_pretrained, one file and sharded.
    cfg_path = tmp_path / "config.json"
    transformers.GPT2Config(**CONFIG).save_pretrained(tmp_path)
    x = batch(99)
    with torch.no_grad():
        want = ref.eval()(input_ids=x).logits
    single, sharded = tmp_path / "hf", tmp_path / "hf_sharded"
    assert cli_main(["ckpt", "export", str(ckpt), str(single), "--hf-config", str(cfg_path)]) == 0
    hf.export_hf(ckpt, sharded, hf_config=cfg_path, max_shard_bytes=20_000)
    assert (single / "model.safetensors").is_file() and (single / "config.json").is_file()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for d in (single, sharded):
        model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        assert model.config.n_layer == CONFIG["n_layer"]
        for name, r in ref_params.items():
            assert_params_close(dict(model.named_parameters())[name], r, name, str(d))
        with torch.no_grad():
            got = model(input_ids=x).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # Back: an HF folder (save_pretrained: safetensors, tied lm_head left out) into ZeroAdamW.
    saved = tmp_path / "from_hf"
    ref.save_pretrained(saved)
    model = make_model(seed=1)  # other values, so the import must overwrite them
    opt = ZeroAdamW(model.parameters(), lr=LR, stage=1, module=model)
    checkpoint.import_weights(opt, saved)
    with opt.gathered_params():
        for name, p in model.named_parameters():
            assert torch.equal(p, ref_params[name]), name


def test_export_hf_refuses_a_config_of_another_model(tmp_path: Path) -> None:
    model = make_model()
    opt = ZeroAdamW(model.parameters(), lr=LR, stage=0, module=model)
    checkpoint.save(opt, tmp_path / "ckpt", step=0)
    other = dict(CONFIG, n_embd=64)
    with pytest.raises(ValueError, match=r"shape \[96, 32\] in the checkpoint, \[96, 64\]"):
        hf.export_hf(tmp_path / "ckpt", tmp_path / "out", hf_config=dict(other, model_type="gpt2"))
    with pytest.raises(ValueError, match="writes a folder"):
        hf.export_hf(tmp_path / "ckpt", tmp_path / "x.safetensors")
