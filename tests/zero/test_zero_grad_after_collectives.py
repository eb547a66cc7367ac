"""`zero_grad()` empties the full grad buffers (stages 0-1) whatever wrote them since.

On NCCL the average's 1/W is the collective's own (premul_sum): no local `mul_` runs, and a
collective writes its result in place without moving the tensor's version counter. A buffer
that got no local grad this step (a param group this rank's batch does not use) but received
the other ranks' average from its reduction was then left holding that average: `reset_step`
skipped buffers whose version had not moved since their last zeroing (see [Note: zeroing once]),
and the next step reduced the stale average again. Played here as rank 1 of a fake world of 2,
its collectives writing as NCCL's do (through `.data`: no version bump).

About an internal: fusedzero._comm.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedzero import ZeroAdamW, _comm as comm
from fusedzero.testing import fake_group


@pytest.fixture
def nccl_like_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 1/W inside the collective; every float collective writes 0.25 (the other rank's
    average) into its output without a version bump."""
    monkeypatch.setattr(comm, "premul_sum_op", lambda ctx, t, factor: dist.ReduceOp.SUM)

    def all_reduce(t, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
        if t.is_floating_point():
            t.data.fill_(0.25)

    def reduce_scatter(out, inp, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
        out.data.fill_(0.25)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(comm, "_reduce_scatter", reduce_scatter)


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_grad_empties_a_buffer_only_a_collective_wrote(
    stage: int, nccl_like_writes: None
) -> None:
    with fake_group(1, 2):
        torch.manual_seed(0)
        used, unused = nn.Linear(4, 4), nn.Linear(4, 4)
        opt = ZeroAdamW(
            [{"params": used.parameters()}, {"params": unused.parameters()}], lr=1e-3, stage=stage
        )
        for _ in range(3):
            used(torch.randn(2, 4)).sum().backward()  # `unused`: no grad on this rank
            written = [float(buf.grad_flat.abs().sum()) for buf in opt.flat_groups]
            assert all(w > 0 for w in written), written  # its reduction wrote both buffers
            opt.step()
            opt.zero_grad()
            left = [float(buf.grad_flat.abs().sum()) for buf in opt.flat_groups]
            assert left == [0.0, 0.0], left
        opt.close()
