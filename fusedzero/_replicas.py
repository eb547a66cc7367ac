"""2-D mesh (HSDP): the average of each bucket's reduced shard over the replicas that hold the
same shard, after the shard reduction (`fusedzero._reduce`) is complete.

[Note: replicas and accumulation] The shard piece holds the step's accumulated average:
A (from earlier reducing backwards of this step, already averaged over replicas, so equal
on every replica) plus this backward's new part. Averaging it over the replicas again gives
A + the replicas' mean of the new part, by linearity, as stage 0 does across ranks: so every
reducing backward outside `no_sync` averages over replicas (FSDP2's default too), and a
backward inside it (stages 2-3 still reduce the shard) leaves the bucket stale, averaged
before the update. Replica all-reduces are issued in the launch order of the buckets (every
replica issues them in the same order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from fusedzero import _comm as comm, wire
from fusedzero._comm import CommContext, Handle
from fusedzero._reduce import Bucket
from fusedzero.wire import WireFormat


def shard_piece(b: Bucket) -> torch.Tensor:
    """Bucket b's piece of this rank's reduced grads, where the kernel reads it."""
    view, S = b.buf.grad_view(), b.buf.layout.shard_numel
    if isinstance(view, torch.Tensor):
        return view[b.k * S : (b.k + 1) * S]
    lo = b.k * view.stride + view.base  # as FlatBuffer.pieces, for this bucket only
    return view.tensor[lo : lo + S]


class ReplicaReduction:
    """2-D mesh (HSDP): average each bucket's reduced shard over the replicas that hold the same
    shard (`ctx` is the replicate group), started per bucket once its shard reduction is
    complete, at a fixed point of the launch order (see [Note: one order across communicators]
    in fusedzero/_buckets.py), while backward goes on.

    See [Note: replicas and accumulation]."""

    def __init__(self, ctx: CommContext, wire_format: WireFormat | None = None) -> None:
        self.ctx = ctx
        self.wire = wire_format
        self.handles: list[Handle] = []
        # Over a wire format (docs/wire.md): what completes each started all-reduce, in start
        # order (every replica completes them in the same order: their all-gathers match).
        self.finishes: list[Callable[[], None]] = []

    def start(self, b: Bucket) -> None:
        piece = shard_piece(b)
        self.ctx.record("replica_reduce", (b.buf.unit, b.buf.group_index, b.k))
        if wire.uses_wire(self.wire, b.buf.reduce_dtype, self.ctx.world_size):
            assert self.wire is not None  # every replica dequantizes the same bytes
            self.finishes.append(
                wire.all_reduce_start(piece, self.wire, self.ctx, 1.0 / self.ctx.world_size)
            )
        else:
            self.handles.append(comm.all_reduce_mean(piece, self.ctx))
        b.replica_stale = False

    def leftovers(self, buckets: Iterable[Bucket]) -> None:
        for b in buckets:
            if b.replica_stale:
                self.start(b)
        self.wait()

    def wait(self) -> None:
        for h in self.handles:
            self.ctx.wait(h, what="grad all-reduce across replicas")
        self.handles.clear()
        for finish in self.finishes:
            finish()
        self.finishes.clear()
