"""See [Note: dividing after the reduction] (fusedzero/_reduce.py): at W = 2 the first reduction
of a bucket sums raw grads and divides this rank's piece afterwards; that is bitwise the division
before (the only order at W = 3), at stages 1-3, fp32 and bf16 reduction, with micro-batches
reduced one by one (accumulation across reductions) and under no_sync. Only on 2 ranks: the
property is about W a power of two.

About an internal: fusedzero._reduce."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedzero import Precision, Sharding, ZeroAdamW, _reduce as reduce
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks or the CLI


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 7))


def _train(rank: int, stage: int, reduce_dtype: torch.dtype) -> list[torch.Tensor]:
    m = _model()
    opt = ZeroAdamW(
        m.parameters(),
        lr=1e-2,
        stage=stage,
        module=m,
        max_grad_norm=1.0,
        precision=Precision(reduce_dtype=reduce_dtype),
        sharding=Sharding(bucket_numel=256, units=nn.Linear),
    )
    for step in range(3):
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randn(5, 12, generator=g) * 3
            if step == 1 and micro == 0:
                with opt.no_sync():
                    m(x).square().mean().backward()
            else:  # steps 0 and 2: each micro-batch reduced (accumulation across reductions)
                m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        return [p.detach().clone() for p in m.parameters()] + [opt.grad_norm.clone()]


CASES = [(stage, dt) for stage in (1, 2, 3) for dt in (torch.float32, torch.bfloat16)]


def worker(rank: int, world: int) -> dict:
    """Every case in one spawn (the ranks' start-up dominates a case's time)."""
    real = reduce.divides_after
    out = {}
    for stage, dt in CASES:
        calls: list[bool] = []

        def spy(b, inv_world, calls=calls):
            calls.append(real(b, inv_world))
            return calls[-1]

        try:
            reduce.divides_after = spy
            after = _train(rank, stage, dt)
            reduce.divides_after = lambda b, inv_world: False
            before = _train(rank, stage, dt)
        finally:
            reduce.divides_after = real
        out[f"stage {stage}, reduce {dt}"] = {
            "after": after,
            "before": before,
            "took_after": any(calls),
        }
    return out


def test_dividing_after_the_reduction_is_bitwise_on_2_ranks() -> None:
    for rank, cases in enumerate(run_ranks(worker, 2)):
        assert len(cases) == len(CASES)
        for name, r in cases.items():
            assert r["took_after"], f"rank {rank}, {name}: the division after was not taken"
            for a, b in zip(r["after"], r["before"]):
                assert torch.equal(a, b), f"rank {rank}, {name}: {(a - b).abs().max()}"
