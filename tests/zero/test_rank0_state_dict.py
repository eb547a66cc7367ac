"""`opt.full_state_dict(model, rank0_only=True)` on 2 gloo ranks at stage 3: every rank joins
each unit's param all-gather (a collective: as many as the plain full state dict), but only rank
0 keeps CPU copies of the params; rank 1 holds the buffers alone (before, every rank held a
copy of the whole model: W x the model in host RAM). `opt.state_dict_without_params(model)`
gathers nothing. See [Note: rank-0-only full state dict] in fusedzero/_model_state_dict.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fusedzero import ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks

CFG = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, n_embd=16)
GATHER = "all_gather"


def _cpu_bytes(sd: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))


def _ranks(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroAdamW(gpt_param_groups(model, 0.1), lr=1e-2, stage=3, module=model)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    ref = GPT(CFG).state_dict()  # a plain model: its fp32 params (tied ones under each name)
    out: dict[str, Any] = {"param_bytes": _cpu_bytes({k: ref[k] for k in params})}
    for what, call in (
        ("full", lambda: opt.full_state_dict(model)),
        ("rank0", lambda: opt.full_state_dict(model, rank0_only=True)),
        ("none", lambda: opt.state_dict_without_params(model)),
    ):
        opt.comm.reset()
        sd = call()
        out[what] = {
            "bytes": _cpu_bytes({k: v for k, v in sd.items() if k in params}),
            "keys": sorted(sd),
            "gathers": opt.comm.calls[GATHER],
            "sd": {k: v.clone() for k, v in sd.items()} if rank == 0 else None,
        }
    out["params"] = sorted(params)
    return out


def test_rank0_only_keeps_the_params_on_rank_0_alone() -> None:
    r0, r1 = run_ranks(_ranks, 2)
    full_bytes = r0["param_bytes"]
    for r in (r0, r1):
        assert r["full"]["bytes"] == full_bytes  # the plain full state dict: every rank a copy
        assert r["full"]["gathers"] > 0
        # rank0_only joins every gather the full one runs (a collective).
        assert r["rank0"]["gathers"] == r["full"]["gathers"]
        assert r["none"]["gathers"] == 0
        assert r["none"]["bytes"] == 0
        assert not set(r["none"]["keys"]) & set(r["params"])
    assert r0["rank0"]["bytes"] == full_bytes
    assert r1["rank0"]["bytes"] == 0, "rank 1 kept param copies"
    assert r1["rank0"]["keys"] == r1["none"]["keys"]  # the non-param entries alone
    for k, v in r0["full"]["sd"].items():
        assert torch.equal(r0["rank0"]["sd"][k], v), k
