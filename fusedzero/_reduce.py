"""Grad buckets: where each grad lands, when each bucket is reduced, and how.

A `Bucket` is bucket k of one flat buffer. Backward counts its grads in; when the last one
arrives (or at the end of backward) it is launched in a fixed order, identical on every rank
(collectives must match). The stage decides *how* a bucket is reduced, one strategy each:

- stage 0 `AllReduceFull`: the full grad buffer is all-reduced (every rank holds the average);
- stage 1 `ReduceScatterInPlace`: the full grad buffer is reduce-scattered in place (only this
  rank's pieces hold reduced sums afterwards);
- stages 2-3 `ReduceIntoShard`: a transient full-size bucket buffer takes the grads, is
  reduce-scattered, and its piece is copied or added into the grad shard; then it is freed.

[Note: accumulating across reductions] Every reduction sums grads pre-divided by the world size
(as DDP and FSDP2: an fp16 sum of W ranks cannot overflow sooner than one rank's grad), so a
reduced buffer holds the average. A backward outside `no_sync` reduces what was accumulated so
far; a later micro-batch of the same step must add only its own new grads:
- stage 0: the bucket holds the average A, identical on every rank; the next micro-batch adds
  its local g; dividing by W and all-reducing gives A + mean(g) (linearity, as DDP).
- stage 1: after an in-place reduce-scatter only this rank's piece holds A; the other pieces
  hold local grads already contributed. Before new grads land in a reduced bucket those pieces
  are zeroed, and the new grads are added pre-divided (`.grad` is no longer a bucket view, so
  autograd cannot add them raw): the next reduce-scatter, which divides nothing, gives
  A + mean(g) in this rank's piece.
- stages 2-3: each backward reduces a fresh bucket and adds the result into grad_shard.

[Note: dividing after the reduction] Where W is a power of two, dividing by W is exact in
binary floating point (bar subnormals), so sum(g / W) == sum(g) / W bit for bit: the first
reduction of a bucket in a step then sums the raw grads and divides only this rank's piece
afterwards (1/W of the elements, fused into the copy into grad_shard at stages 2-3), instead of a
pass over the whole bucket before (stage 1's `mul_`, stages 2-3's scaling copy, which on CPU is
slower than a plain copy for bf16). fp16 keeps the division before: its sum of W raw grads could
overflow where the average does not. Other W keep it too (there the two orders round
differently, and the results stay those of DDP's order).

[Note: reductions over a wire format] A strategy built with `wire` (fusedzero.wire)
quantizes a bucket, all-to-alls it and sums this rank's chunks in fp32 instead of running
the collective in the reduce dtype. The sum is of raw grads and the 1/W of the average is
fused into the dequantize-sum (an fp32 sum cannot overflow where an fp16 one could), so such a
bucket is never pre-divided; grads added after a bucket was reduced still are.
See [Note: accumulating across reductions]. Its packed buffers are transient: the schedule
bounds how many are in flight, at every stage.

[Note: grads into a bucket, per bucket] A grad that autograd did not accumulate into a bucket
view itself (bf16 params over an fp32 buffer, stages 2-3, a stage-1 bucket already reduced) is
only kept by the grad hook (`Bucket.got`), in the dtype it arrives in: the hook path runs no
torch op per param, and each op there was a host call of microseconds and, on CUDA, a kernel
launch (tests/zero/test_hook_ops.py counts them, over a bare backward). When the bucket is
complete its grads go in by one foreach op over views of the bucket made once (`Part`), which
casts where the grad's dtype is not the bucket's (DDP's `gradient_as_bucket_view` has autograd
write into the bucket; FSDP2's `foreach_reduce` builds its reduce-scatter input by one
`chunk_cat`):
- stages 0-1: one `_foreach_add_` into the full grad buffer, at the bucket's completion (inside
  `no_sync` too) or at the end of backward;
- stages 2-3: a bucket's memory exists only from its launch to the end of its reduction: one
  tensor per bucket whose storage is resized (as a stage-3 unit's gathered buffer), so the views
  survive; at launch, one `_foreach_zero_` of its alignment holes (and of params that got no
  grad) and one `_foreach_copy_` of its grads. A grad lives until its bucket launches, as it
  would in a bucket buffer allocated at its first grad.
A param that straddles two buckets costs two views of its grad per bucket; there are at most
one per bucket boundary.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import torch

from fusedzero import _comm as comm, wire
from fusedzero._comm import CommContext, Handle
from fusedzero._flat import FlatBuffer
from fusedzero._streams import allocating_stream, free_storage
from fusedzero.stage import Stage
from fusedzero.wire import WireFormat

# Stages 2-3: reduce-scatters of transient bucket buffers allowed in flight at once. Two keep the
# network busy (one bucket reducing while the next is sent) and bound the full-size grad memory
# of a backward to a few buckets instead of the whole model.
MAX_INFLIGHT_BUCKETS = 2


def divides_after(b: Bucket, inv_world: float) -> bool:
    """See [Note: dividing after the reduction]: exact here (1/W a power of two below 1, not fp16),
    so the first reduction of a step sums raw grads and divides this rank's piece afterwards."""
    return (
        inv_world < 1.0 and math.frexp(inv_world)[0] == 0.5 and b.buf.reduce_dtype != torch.float16
    )


class WireChoice:
    """Where a bucket goes over a wire format: see [Note: reductions over a wire format]."""

    def __init__(self, wire_format: WireFormat | None = None, world_size: int = 1) -> None:
        self.wire = wire_format
        self.world_size = world_size
        self.transient = wire_format is not None and world_size > 1

    def fused(self, b: Bucket) -> bool:
        """This bucket goes over the wire format (quantize, all-to-all, fp32 sum)."""
        return wire.uses_wire(self.wire, b.buf.reduce_dtype, self.world_size)


class BucketStatus(enum.Enum):
    """Where a bucket stands in the current step; `BucketSchedule.reset_step` makes it EMPTY."""

    EMPTY = enum.auto()  # not reduced since the last step: grads accumulate as they come
    REDUCED = enum.auto()  # reduced at least once this step
    REDUCED_CLEAN = enum.auto()  # stage 1: reduced, and the pieces other ranks own zeroed since


class Part(NamedTuple):
    """Where one param's grad goes in a bucket (see [Note: grads into a bucket, per bucket])."""

    dst: torch.Tensor  # a view of the bucket's memory: in the param's shape where it is whole
    param_start: int | None  # a straddling param: where its run starts (flat); None: whole


class ShardPiece(NamedTuple):
    """Stages 2-3, made once per bucket: this rank's piece of the bucket's memory (what the
    reduce-scatter writes) and of the grad shard (where it is put)."""

    reduced: torch.Tensor
    dst: torch.Tensor


@dataclasses.dataclass(eq=False)
class Bucket:
    buf: FlatBuffer
    k: int
    slots: list[int]  # positions in buf.layout.params overlapping this bucket
    holes: list[tuple[int, int]]  # ranges of the bucket that belong to no param
    status: BucketStatus = BucketStatus.EMPTY
    pending: int = 0  # grads still expected in this backward
    launched: bool = False  # its reduction was launched in this backward
    grad: torch.Tensor | None = None  # stages 2-3: the transient full-size buffer, while alive
    # This backward's grads kept until they go into the bucket, by slot, and where each goes
    # (made once); see [Note: grads into a bucket, per bucket].
    got: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    parts: dict[int, Part] | None = None
    # Stages 2-3: the bucket's memory (storage resized: alive only from launch to finish) and
    # the views of its alignment holes and tail, made once.
    store: torch.Tensor | None = None
    # The stream `store`'s storage was last allocated on (None off CUDA): See [Note: freeing on
    # another stream] in _streams.py.
    store_stream: torch.cuda.Stream | None = None
    hole_views: list[torch.Tensor] = dataclasses.field(default_factory=list)
    piece: ShardPiece | None = None
    # Stages 0-1: its part of the full grad buffer is all zeros (emptied since its last flush
    # or launch) and autograd writes into none of it: kept grads can be copied in, not added.
    fresh: bool = True
    viewless: bool = False  # no param of it has `.grad` as a view of the bucket (made once)
    # 2-D mesh: the shard holds a reduction the replicas have not averaged (stages 2-3 inside
    # no_sync); `ReplicaReduction.leftovers` averages it before the update.
    replica_stale: bool = False

    def full_grad(self) -> torch.Tensor:
        assert self.buf.grad_flat is not None
        lo, hi = self.buf.layout.bucket_range(self.k)
        return self.buf.grad_flat[lo:hi]

    def own_piece(self) -> tuple[int, int]:
        """[lo, hi) of this rank's shard within the bucket."""
        L = self.buf.layout
        lo, hi = L.piece(self.k, self.buf.shard_rank)
        return lo - self.k * L.bucket_numel, hi - self.k * L.bucket_numel

    def make_parts(self, memory: torch.Tensor) -> dict[int, Part]:
        """Each param's `Part` over `memory`, the bucket's elements (1-D)."""
        L = self.buf.layout
        parts = {}
        for pos in self.slots:
            a, e, p = L.overlap(pos, self.k)
            slot = L.params[pos]
            whole = e - a == slot.numel
            parts[pos] = Part(
                memory[a:e].view(slot.shape) if whole else memory[a:e], None if whole else p
            )
        return parts

    def sources(
        self, into: list[torch.Tensor], zeros: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The kept grads, as the foreach op reads them, and (`into`) where they go; `zeros`
        (stages 2-3) gets the parts of params without a grad. Empties `got`."""
        assert self.parts is not None
        got, srcs = self.got, []
        if zeros is not None:
            for pos, part in self.parts.items():
                if pos not in got:  # a param that got no grad this backward contributes zeros
                    zeros.append(part.dst)
        for pos, g in got.items():
            dst, start = self.parts[pos]
            into.append(dst)
            # A straddling param: its run in this bucket (two views, at most one per boundary).
            srcs.append(g if start is None else g.reshape(-1)[start : start + dst.numel()])
        got.clear()
        return srcs

    def release(self) -> None:
        """Stages 2-3: free the bucket's memory (its views stay, over an empty storage)."""
        self.grad = None
        if self.store is not None:
            free_storage(self.store, self.store_stream)


Finish = Callable[[], None]


class Reduction(Protocol):
    """How one stage puts grads into a bucket and reduces it. `transient`: it holds a full-size
    bucket buffer per reduction in flight (their number is bounded by the schedule)."""

    transient: bool
    gathers_at_launch: bool  # stages 2-3: the kept grads go into the bucket at its launch
    range_name: str  # its launches' profiler range (fusedzero/_profiling.py)

    def flush(self, b: Bucket, inv_world: float) -> None:
        """Stages 0-1: add the grads kept in `b.got` into the full grad buffer."""

    def launch(self, b: Bucket, ctx: CommContext, inv_world: float) -> tuple[Handle, Finish | None]:
        """Issue b's reduction; return its handle and what to run once it is complete."""

    def before_step(self, buckets: Iterable[Bucket]) -> None:
        """Make every grad the kernel reads valid (buckets no reduction reached this step)."""


class AllReduceFull(WireChoice):
    """Stage 0: grads accumulate in the full buffer, which is all-reduced (every rank divides
    the whole bucket either way, so before: DDP's order)."""

    gathers_at_launch = False
    range_name = "fusedzero::all_reduce"

    def flush(self, b: Bucket, inv_world: float) -> None:
        _add_kept(b, 1.0)

    def launch(self, b: Bucket, ctx: CommContext, inv_world: float) -> tuple[Handle, Finish | None]:
        buf = b.full_grad()
        b.fresh = False
        if self.fused(b):
            assert self.wire is not None
            return None, wire.all_reduce_start(buf, self.wire, ctx, 1.0 / ctx.world_size)
        # The average: on NCCL the 1/W multiplication is the collective's own (premul_sum).
        return comm.all_reduce_mean(buf, ctx), None

    def before_step(self, buckets: Iterable[Bucket]) -> None:
        pass


class ReduceScatterInPlace(WireChoice):
    """Stage 1: the full buffer is reduce-scattered in place; see [Note: accumulating across
    reductions] for grads that arrive after a bucket was reduced."""

    @staticmethod
    def _clean(b: Bucket) -> None:
        """Zero the pieces other ranks own: their local grads were contributed already."""
        if b.status is BucketStatus.REDUCED_CLEAN:
            return
        lo, hi = b.own_piece()
        g = b.full_grad()
        g[:lo].zero_()
        g[hi:].zero_()
        b.status = BucketStatus.REDUCED_CLEAN

    gathers_at_launch = False
    range_name = "fusedzero::reduce_scatter"

    def flush(self, b: Bucket, inv_world: float) -> None:
        if b.status is BucketStatus.EMPTY:
            _add_kept(b, 1.0)
        else:
            self._clean(b)
            _add_kept(b, inv_world)

    def launch(self, b: Bucket, ctx: CommContext, inv_world: float) -> tuple[Handle, Finish | None]:
        buf = b.full_grad()
        b.fresh = False
        lo, hi = b.own_piece()
        after = mean = False
        fused = self.fused(b)
        if b.status is not BucketStatus.EMPTY:
            self._clean(b)  # new grads were added pre-divided: divide nothing again
        elif fused or (
            divides_after(b, inv_world) and comm.premul_sum_op(ctx, buf, inv_world) is None
        ):
            after = True  # (where the collective multiplies, dividing before costs no pass)
        else:
            mean = ctx.world_size > 1
        b.status = BucketStatus.REDUCED  # the other pieces are contributed again by this one
        if fused:  # over the wire: all-to-all, then dequantize and sum in fp32 (and divide)
            assert self.wire is not None
            red = wire.reduce_scatter_start(buf, self.wire, ctx)
            return red.handle, lambda: red.finish(buf[lo:hi], inv_world if after else 1.0)
        if mean:  # the average: on NCCL the 1/W multiplication is the collective's own
            h = comm.reduce_scatter_mean(buf[lo:hi], buf, ctx)
        else:
            h = comm.reduce_scatter(buf[lo:hi], buf, ctx.group, ctx.world_size, ctx.counter)
        if not after:
            return h, None
        return h, lambda: buf[lo:hi].mul_(inv_world)

    def before_step(self, buckets: Iterable[Bucket]) -> None:
        pass


class ReduceIntoShard(WireChoice):
    """Stages 2-3: a transient bucket buffer per backward, reduced into the grad shard."""

    gathers_at_launch = True
    range_name = "fusedzero::reduce_scatter"

    def __init__(self, wire_format: WireFormat | None = None, world_size: int = 1) -> None:
        super().__init__(wire_format, world_size)
        self.transient = True

    def flush(self, b: Bucket, inv_world: float) -> None:
        pass  # the grads go in at launch (`_gather`)

    def _gather(self, b: Bucket) -> torch.Tensor:
        """The transient bucket buffer: this backward's grads in bucket order, zeros elsewhere,
        by two foreach ops (see [Note: grads into a bucket, per bucket]): a grad in another
        dtype than the bucket's (bf16 params, fp32 reduce; a DTensor param whose local tensor
        was cast to param_dtype keeps its outer dtype, and autograd casts its grad to that) is
        cast by the copy, so the collective moves the reduce dtype's bytes."""
        store = b.store
        if store is None:
            L = b.buf.layout
            store = b.store = torch.empty(
                L.bucket_numel, dtype=b.buf.reduce_dtype, device=b.buf.device
            )
            b.parts = b.make_parts(store)
            b.hole_views = [store[a:e] for a, e in b.holes]
            lo, hi = b.own_piece()
            S = L.shard_numel
            assert b.buf.grad_shard is not None
            b.piece = ShardPiece(store[lo:hi], b.buf.grad_shard[b.k * S : (b.k + 1) * S])
        else:
            store.untyped_storage().resize_(store.numel() * store.element_size())
        b.store_stream = allocating_stream(store)
        zeros = list(b.hole_views)
        dsts: list[torch.Tensor] = []
        srcs = b.sources(dsts, zeros)
        if zeros:
            torch._foreach_zero_(zeros)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        b.grad = store
        return store

    def launch(self, b: Bucket, ctx: CommContext, inv_world: float) -> tuple[Handle, Finish | None]:
        buf = self._gather(b)
        if not (inv_world == 1.0 or self.fused(b) or divides_after(b, inv_world)):
            buf.mul_(inv_world)  # pre-divided: see [Note: dividing after the reduction]
        if self.fused(b):
            return self._launch_wire(b, ctx, inv_world)
        assert b.piece is not None
        piece, dst = b.piece
        h = comm.reduce_scatter(piece, buf, ctx.group, ctx.world_size, ctx.counter)
        scale = inv_world if divides_after(b, inv_world) else 1.0

        def finish() -> None:
            if b.status is BucketStatus.EMPTY:
                if scale == 1.0:
                    dst.copy_(piece)
                else:
                    torch.mul(piece, scale, out=dst)
                b.status = BucketStatus.REDUCED
            else:
                dst.add_(piece, alpha=scale)
            b.release()

        return h, finish

    def _launch_wire(
        self, b: Bucket, ctx: CommContext, inv_world: float
    ) -> tuple[Handle, Finish | None]:
        """The bucket (raw grads) over the wire; the finish dequantizes, sums, scales by 1/W and
        writes or adds into the grad shard in one launch."""
        assert self.wire is not None and b.grad is not None and b.piece is not None
        red = wire.reduce_scatter_start(b.grad, self.wire, ctx)
        dst = b.piece.dst

        def finish() -> None:
            red.finish(dst, inv_world, accumulate=b.status is not BucketStatus.EMPTY)
            b.status = BucketStatus.REDUCED
            b.release()

        return red.handle, finish

    def before_step(self, buckets: Iterable[Bucket]) -> None:
        """Shard pieces no reduction reached since the last step hold stale grads: zero them."""
        for b in buckets:
            if b.status is BucketStatus.EMPTY and b.buf.grad_shard is not None:
                S = b.buf.layout.shard_numel
                b.buf.grad_shard[b.k * S : (b.k + 1) * S].zero_()
                b.status = BucketStatus.REDUCED


def _add_kept(b: Bucket, alpha: float) -> None:
    """Stages 0-1: the grads kept in `b.got` added into the full grad buffer, one op: a copy
    where the bucket is still empty (on CUDA `_foreach_copy_` is one kernel across dtypes,
    where `_foreach_add_` of bf16 grads into fp32 takes torch's per-tensor path)."""
    if b.parts is None:
        b.parts = b.make_parts(b.full_grad())
        b.viewless = all(b.buf.param_grad_view(pos) is None for pos in b.slots)
    dsts: list[torch.Tensor] = []
    srcs = b.sources(dsts)
    if b.fresh and b.viewless and alpha == 1.0:
        torch._foreach_copy_(dsts, srcs)
    elif alpha == 1.0:
        torch._foreach_add_(dsts, srcs)
    else:
        torch._foreach_add_(dsts, srcs, alpha=alpha)
    b.fresh = False


def reduction_for(
    stage: Stage, wire_format: WireFormat | None = None, world_size: int = 1
) -> Reduction:
    """The stage's strategy; `wire_format` (None: the reduce dtype's own collective) over a
    group of `world_size` ranks, see [Note: reductions over a wire format]."""
    if not stage.shards_state:
        return AllReduceFull(wire_format, world_size)
    if stage.keeps_full_grads:
        return ReduceScatterInPlace(wire_format, world_size)
    return ReduceIntoShard(wire_format, world_size)
