"""HSDP: every rank issues its shard-group and replicate-group collectives in one order, a
function of the launch order alone (see [Note: one order across communicators] in
fusedzero/_buckets.py). NCCL requires it: where two communicators' kernels cannot run at once,
ranks that issued them in different orders wait on each other forever.

Played as rank 0 of a fake world of 4 (shards over 2, replicas over 2), with the shard
reductions' handles reporting complete at once, or never until waited on: the two traces of
issued collectives must be the same. Before: replica all-reduces started when a poll found
their shard reduction complete, so the first trace interleaved them, the second put them all
at the end of backward.

About an internal: fusedzero._comm.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedzero import Groups, Sharding, ZeroAdamW, _comm as comm
from fusedzero.testing import fake_group


class Work:
    """A shard reduction's handle, complete at once or only once waited on."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def issued(stage: int, done: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    monkeypatch.setattr(comm, "_reduce_scatter", lambda *a, **k: Work(done))
    with fake_group(0, 4):
        shard, rep = dist.new_group([0, 1]), dist.new_group([0, 2])
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        opt = ZeroAdamW(
            model.parameters(),
            lr=1e-3,
            stage=stage,
            module=model,
            trace=True,
            groups=Groups(shard=shard, replicate=rep),
            sharding=Sharding(bucket_numel=256, units=nn.Linear),
        )
        x = torch.randn(4, 16)
        for _ in range(2):  # the first backward agrees on the bucket order, once
            assert opt.trace is not None
            opt.trace.clear()
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        events = [(e, d) for e, d in opt.trace if e in ("reduce", "replica_reduce", "flush")]
        opt.close()
    return events


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_collective_order_does_not_depend_on_completion(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    early, late = issued(stage, True, monkeypatch), issued(stage, False, monkeypatch)
    assert early == late
    # During backward: every replica all-reduce but the last two launches' is issued before
    # backward ends (the flush), each after the bucket two launches later.
    kinds = [e for e, _ in early]
    reduces = kinds.count("reduce")
    assert reduces >= 4 and kinds.count("replica_reduce") == reduces
    assert kinds[: kinds.index("flush")].count("replica_reduce") >= reduces - 3, kinds
