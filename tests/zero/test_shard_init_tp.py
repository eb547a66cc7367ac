"""Stage-3 `model.load_state_dict` of a tensor-parallel model on a (dp=2, tp=2) mesh of 4 gloo
ranks: the DTensor params' local tensors are LocalParams while torch loads (fusedzero/
_shard_init.py), so nothing is gathered, and the gathered values are the given ones."""

from __future__ import annotations

import pytest
import torch
from test_tp import DP, TP, make, parallelize

from fusedzero import Groups, ZeroAdamW
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns 4 ranks


def _load(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    given = make("sp")
    parallelize(given, "sp", mesh["tp"])
    with torch.no_grad():
        for p in given.parameters():
            p.mul_(-2.0)  # other values than the model's own
    sd = given.state_dict()  # DTensors, as a tp model's state_dict gives them
    m = make("sp")
    parallelize(m, "sp", mesh["tp"])
    opt = ZeroAdamW(m.parameters(), stage=3, module=m, groups=Groups(shard=mesh["dp"].get_group()))
    assert opt.zero3 is not None
    m.load_state_dict(sd)
    bad = (
        [f"gathered {opt.zero3.max_gathered_numel} elements"]
        if opt.zero3.max_gathered_numel
        else []
    )
    with opt.gathered_params():
        got = {n: full(p) for n, p in m.named_parameters()}
    want = {n: full(v) for n, v in sd.items()}
    bad += [n for n in want if not torch.equal(got[n], want[n])]
    bad += [
        n
        for n, p in m.named_parameters()
        if isinstance(p, DTensor) and type(p._local_tensor) is not torch.Tensor
    ]  # the LocalParams are gone
    return bad


def test_tp_load_state_dict_at_stage_3_gathers_nothing() -> None:
    for rank, bad in enumerate(run_ranks(_load, DP * TP, timeout=300)):
        assert bad == [], (rank, bad)
