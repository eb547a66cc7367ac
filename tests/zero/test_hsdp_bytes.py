"""HSDP (a 2-D mesh: shards within a group of 2, replicas across 2) counted in one process as
rank 0 of 4 in torch's fake process group: each step averages every bucket's reduced shard over
the replicas once (`fusedzero._replicas`), and nothing else crosses the replicate group. Bytes are
the ring formula, exactly: 2 (R - 1) / R of the shard per bucket, R = 2 replicas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedzero import Groups, Sharding, ZeroAdamW
from fusedzero.testing import fake_group


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_replica_average_bytes_per_step_fake_world_of_4(stage: int) -> None:
    with fake_group(0, 4):
        shard, rep = dist.new_group([0, 1]), dist.new_group([0, 2])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        opt = ZeroAdamW(
            model.parameters(),
            lr=1e-3,
            stage=stage,
            module=model,
            groups=Groups(shard=shard, replicate=rep),
            sharding=Sharding(bucket_numel=256),
        )
        x = torch.randn(4, 16)
        model(x).square().sum().backward()  # the first agrees on the bucket order, once
        opt.step()
        opt.comm.reset()
        model(x).square().sum().backward()
        opt.step()
        bufs = opt.flat_groups
        buckets = sum(b.layout.num_buckets for b in bufs)
        shard_bytes = sum(
            b.layout.num_buckets * b.layout.shard_numel * b.reduce_dtype.itemsize for b in bufs
        )
        assert buckets >= 2
        got = opt.comm.snapshot()
        # One replica all-reduce per bucket, plus the grad norm's scalar over the shard group.
        assert got["calls"]["all_reduce"] == buckets + 1, got
        assert got["bytes"]["all_reduce"] == 2 * (2 - 1) * shard_bytes // 2 + 4, got
        opt.close()
