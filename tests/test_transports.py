"""The transport is not part of the semantics: ZeroAdamW trained over shared memory
(fusedzero/shm.py), direct sends (fusedzero/direct.py) and torch's gloo collectives ends with the
same bits at every stage, in fp32 and with bf16 params and bf16 reduction.

Bit-identical only at W = 2, where every sum of two ranks' values is one rounded add (commutative:
any transport gets the same bits); at larger W the transports add in different orders, which
tests/test_shm.py and tests/test_direct.py bound against float64 instead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fusedzero import comm
from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

KINDS = ("shm", "direct", "torch")


def _train(rank: int, kind: str, stage: int, bf16: bool) -> dict[str, torch.Tensor]:
    group = dist.new_group([0, 1], backend="gloo")
    comm.set_gloo_collectives(group, kind)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5))
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, module=model, process_group=group,
                    max_grad_norm=0.05, bucket_numel=256,
                    param_dtype=torch.bfloat16 if bf16 else None,
                    reduce_dtype=torch.bfloat16 if bf16 else torch.float32)
    assert comm.gloo_collectives(group) == kind
    for step in range(3):
        x = torch.randn(6, 7, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x.to(torch.bfloat16) if bf16 else x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    return {"params": {k: v.float().clone() for k, v in model.state_dict().items()},
            "norm": opt.grad_norm.clone(), "state": sd["state"]}


def _worker(rank: int, world: int) -> dict:
    return {(kind, stage, bf16): _train(rank, kind, stage, bf16)
            for stage in range(4) for bf16 in (False, True) for kind in KINDS}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_every_transport_trains_to_the_same_bits_at_w2() -> None:
    ranks = run_ranks(_worker, 2, timeout=300)
    for rank, res in enumerate(ranks):
        for stage in range(4):
            for bf16 in (False, True):
                ref = res[("shm", stage, bf16)]
                # The run moved: a transport that dropped every update would agree with itself.
                assert float(ref["norm"]) > 0
                for kind in KINDS[1:]:
                    assert _equal(res[(kind, stage, bf16)], ref), (rank, stage, bf16, kind)
