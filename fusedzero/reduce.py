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
"""
from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import torch

from fusedzero import comm, wire
from fusedzero.comm import CommContext, Handle
from fusedzero.flat import FlatBuffer
from fusedzero.stage import Stage
from fusedzero.wire import WireFormat

# Stages 2-3: reduce-scatters of transient bucket buffers allowed in flight at once. Two keep the
# network busy (one bucket reducing while the next is sent) and bound the full-size grad memory
# of a backward to a few buckets instead of the whole model.
MAX_INFLIGHT_BUCKETS = 2


def divides_after(b: Bucket, inv_world: float) -> bool:
    """[Note: dividing after the reduction]: exact here (1/W a power of two below 1, not fp16),
    so the first reduction of a step sums raw grads and divides this rank's piece afterwards."""
    return (inv_world < 1.0 and math.frexp(inv_world)[0] == 0.5
            and b.buf.reduce_dtype != torch.float16)


class WireChoice:
    """[Note: reductions over a wire format] A strategy built with `wire` (fusedzero.wire)
    quantizes a bucket, all-to-alls it and sums this rank's chunks in fp32 instead of running
    the collective in the reduce dtype. The sum is of raw grads and the 1/W of the average is
    fused into the dequantize-sum (an fp32 sum cannot overflow where an fp16 one could), so
    such a bucket is never pre-divided; grads added after a bucket was reduced still are (see
    [Note: accumulating across reductions]). Its packed buffers are transient: the schedule
    bounds how many are in flight, at every stage."""

    def __init__(self, wire_format: WireFormat | None = None, world_size: int = 1) -> None:
        self.wire = wire_format
        self.world_size = world_size
        self.transient = wire_format is not None and world_size > 1

    def fused(self, b: Bucket) -> bool:
        """This bucket goes over the wire format (quantize, all-to-all, fp32 sum)."""
        return wire.uses_wire(self.wire, b.buf.reduce_dtype, self.world_size)


class BucketStatus(enum.Enum):
    """Where a bucket stands in the current step; `GradReducer.reset_step` makes it EMPTY."""

    EMPTY = enum.auto()  # not reduced since the last step: grads accumulate as they come
    REDUCED = enum.auto()  # reduced at least once this step
    REDUCED_CLEAN = enum.auto()  # stage 1: reduced, and the pieces other ranks own zeroed since


class Part(NamedTuple):
    """A piece of a stage 2-3 bucket ([Note: gathering a bucket at launch]): a param's run of
    elements, or an alignment hole."""

    start: int  # [start, end) of the bucket
    end: int
    param_start: int | None  # where the run starts in the param; None: the bucket holds it whole
    slot: int | None  # the param's position in `buf.layout.params`; None: a hole
    zeros: torch.Tensor | None  # a hole: zeros of its length (a view of one shared tensor)


@dataclasses.dataclass(eq=False)
class Bucket:
    buf: FlatBuffer
    k: int
    slots: list[int]  # positions in buf.layout.params overlapping this bucket
    holes: list[tuple[int, int]]  # ranges of the bucket that belong to no param
    status: BucketStatus = BucketStatus.EMPTY
    pending: int = 0  # grads still expected in this backward
    grad: torch.Tensor | None = None  # stages 2-3: the transient full-size buffer
    # Stages 2-3 ([Note: gathering a bucket at launch]): this backward's grads by slot, and the
    # bucket's pieces in order (`Part`) and where its tail padding starts.
    got: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    parts: tuple[list[Part], int] | None = None  # (its pieces in order, where the tail starts)
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


Finish = Callable[[], None]


class Reduction(Protocol):
    """How one stage puts grads into a bucket and reduces it. `transient`: it holds a full-size
    bucket buffer per reduction in flight (their number is bounded by the schedule)."""

    transient: bool

    def accumulate(self, b: Bucket, pos: int, grad: torch.Tensor, inv_world: float) -> None:
        """Add the part of param `pos`'s grad (any shape: its flat order) that falls in
        bucket b."""

    def launch(self, b: Bucket, ctx: CommContext, inv_world: float) -> tuple[Handle, Finish | None]:
        """Issue b's reduction; return its handle and what to run once it is complete."""

    def before_step(self, buckets: Iterable[Bucket]) -> None:
        """Make every grad the kernel reads valid (buckets no reduction reached this step)."""


class AllReduceFull(WireChoice):
    """Stage 0: grads accumulate in the full buffer, which is all-reduced (every rank divides
    the whole bucket either way, so before: DDP's order)."""

    def accumulate(self, b: Bucket, pos: int, grad: torch.Tensor, inv_world: float) -> None:
        a, e, p = b.buf.layout.overlap(pos, b.k)
        b.full_grad()[a:e].add_(grad.reshape(-1)[p:p + e - a])

    def launch(self, b: Bucket, ctx: CommContext, inv_world: float) -> tuple[Handle, Finish | None]:
        buf = b.full_grad()
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

    def accumulate(self, b: Bucket, pos: int, grad: torch.Tensor, inv_world: float) -> None:
        a, e, p = b.buf.layout.overlap(pos, b.k)
        dst, src = b.full_grad()[a:e], grad.reshape(-1)[p:p + e - a]
        if b.status is BucketStatus.EMPTY:
            dst.add_(src)
        else:
            self._clean(b)
            dst.add_(src, alpha=inv_world)

    def launch(self, b: Bucket, ctx: CommContext, inv_world: float) -> tuple[Handle, Finish | None]:
        buf = b.full_grad()
        lo, hi = b.own_piece()
        after = mean = False
        fused = self.fused(b)
        if b.status is not BucketStatus.EMPTY:
            self._clean(b)  # new grads were added pre-divided: divide nothing again
        elif fused or (divides_after(b, inv_world)
                       and comm.premul_sum_op(ctx, buf, inv_world) is None):
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

    def __init__(self, wire_format: WireFormat | None = None, world_size: int = 1) -> None:
        super().__init__(wire_format, world_size)
        self.transient = True
        # Per (dtype, device): zeros as long as the longest alignment hole (`_parts`).
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def accumulate(self, b: Bucket, pos: int, grad: torch.Tensor, inv_world: float) -> None:
        # [Note: gathering a bucket at launch] Each param's grad arrives once per backward and
        # is only kept here; the bucket is built at launch by one `torch.cat` of its grads and
        # zero pieces (alignment holes, params without a grad), so a grad costs no torch call on
        # the hook path (and on CUDA the bucket is one kernel, not one copy per param). A
        # bucket's grads live until it launches, as they would in its transient buffer, which
        # exists only from the launch on; at the launch both exist for the length of the copy.
        b.got[pos] = grad

    def _parts(self, b: Bucket) -> tuple[list[Part], int]:
        """b's pieces in bucket order (hole zeros: views of one shared zero tensor, made once),
        and where the tail padding starts (zeroed apart, it can be long)."""
        if b.parts is None:
            L = b.buf.layout
            holes = list(b.holes)
            tail = L.bucket_numel
            if holes and holes[-1][1] == L.bucket_numel:
                tail = holes.pop()[0]
            key = (b.buf.reduce_dtype, b.buf.device)
            need = max((e - a for a, e in holes), default=0)
            z = self._zeros.get(key)
            if z is None or z.numel() < need:
                z = self._zeros[key] = torch.zeros(need, dtype=key[0], device=key[1])
            spans: list[Part] = []
            for pos in b.slots:
                a, e, p = L.overlap(pos, b.k)
                spans.append(Part(a, e, None if e - a == L.params[pos].numel else p, pos, None))
            spans += [Part(a, e, None, None, z[:e - a]) for a, e in holes]
            b.parts = (sorted(spans, key=lambda t: t.start), tail)
        return b.parts

    def _gather(self, b: Bucket) -> torch.Tensor:
        """The transient bucket buffer: this backward's grads in bucket order, zeros elsewhere.
        A grad the bucket holds whole goes in as it is, in its own shape; the flattening and
        the copies are one call into torch (no torch call per grad from Python: each costs a
        few us of host, see [Note: host cost per grad] in fusedzero/buckets.py). Grads in the
        bucket's dtype: one `cat` (`flatten_dense_tensors`). Grads to cast (bf16 params, fp32
        reduce): one `torch._foreach_copy_` into views of the bucket, since a mixed-dtype `cat`
        takes a slow path (bench/gpu/bucket_gather.py: `_foreach_copy_` 33 us, `cat` 80 us on an
        H200)."""
        parts, tail = self._parts(b)
        dt, dev, got = b.buf.reduce_dtype, b.buf.device, b.got
        B = b.buf.layout.bucket_numel
        pieces = []
        for a, e, p, pos, zeros in parts:
            g = zeros if pos is None else got.get(pos)
            if g is None:  # a param that got no grad this backward contributes zeros
                g = torch.zeros(e - a, dtype=dt, device=dev)
            elif p is not None and pos is not None:  # the part of a param that straddles buckets
                g = g.reshape(-1)[p:p + e - a]
            pieces.append(g)
        got.clear()
        # One `cat` only where every piece is in the reduce dtype: a grad in another dtype than
        # its param's buffer (a DTensor param whose local tensor was cast to param_dtype keeps
        # its outer dtype, and autograd casts its grad to that) would promote the whole bucket
        # to it, and the collective would move that dtype's bytes.
        if all(g.dtype == dt for g in pieces):
            if tail < B:
                pieces.append(torch.zeros(B - tail, dtype=dt, device=dev))
            # One piece would come back as a view of that grad: the collective writes into
            # the bucket, so it is a copy.
            out = (torch._C._nn.flatten_dense_tensors(pieces) if len(pieces) > 1
                   else pieces[0].reshape(-1).clone())
        else:  # grads to cast (bf16 params, fp32 reduce): one copy with a cast per piece
            out = torch.empty(B, dtype=dt, device=dev)
            torch._foreach_copy_(torch._C._nn.unflatten_dense_tensors(out[:tail], pieces),
                                 pieces)
            out[tail:].zero_()
        b.grad = out
        return out

    def launch(self, b: Bucket, ctx: CommContext, inv_world: float) -> tuple[Handle, Finish | None]:
        buf = self._gather(b)
        if not (inv_world == 1.0 or self.fused(b) or divides_after(b, inv_world)):
            buf.mul_(inv_world)  # pre-divided ([Note: dividing after the reduction])
        lo, hi = b.own_piece()
        if self.fused(b):
            return self._launch_wire(b, ctx, inv_world)
        h = comm.reduce_scatter(buf[lo:hi], buf, ctx.group, ctx.world_size, ctx.counter)

        scale = inv_world if divides_after(b, inv_world) else 1.0

        def finish() -> None:
            S = b.buf.layout.shard_numel
            assert b.buf.grad_shard is not None and b.grad is not None
            dst, piece = b.buf.grad_shard[b.k * S:(b.k + 1) * S], b.grad[lo:hi]
            if b.status is BucketStatus.EMPTY:
                if scale == 1.0:
                    dst.copy_(piece)
                else:
                    torch.mul(piece, scale, out=dst)
                b.status = BucketStatus.REDUCED
            else:
                dst.add_(piece, alpha=scale)
            b.grad = None
        return h, finish

    def _launch_wire(self, b: Bucket, ctx: CommContext, inv_world: float
                     ) -> tuple[Handle, Finish | None]:
        """The bucket (raw grads) over the wire; the finish dequantizes, sums, scales by 1/W and
        writes or adds into the grad shard in one launch."""
        assert self.wire is not None and b.grad is not None
        red = wire.reduce_scatter_start(b.grad, self.wire, ctx)

        def finish() -> None:
            S = b.buf.layout.shard_numel
            assert b.buf.grad_shard is not None
            red.finish(b.buf.grad_shard[b.k * S:(b.k + 1) * S], inv_world,
                       accumulate=b.status is not BucketStatus.EMPTY)
            b.status = BucketStatus.REDUCED
            b.grad = None
        return red.handle, finish

    def before_step(self, buckets: Iterable[Bucket]) -> None:
        """Shard pieces no reduction reached since the last step hold stale grads: zero them."""
        for b in buckets:
            if b.status is BucketStatus.EMPTY and b.buf.grad_shard is not None:
                S = b.buf.layout.shard_numel
                b.buf.grad_shard[b.k * S:(b.k + 1) * S].zero_()
                b.status = BucketStatus.REDUCED


def reduction_for(stage: Stage, wire_format: WireFormat | None = None,
                  world_size: int = 1) -> Reduction:
    """The stage's strategy; `wire_format` (None: the reduce dtype's own collective) over a
    group of `world_size` ranks, see [Note: reductions over a wire format]."""
    if not stage.shards_state:
        return AllReduceFull(wire_format, world_size)
    if stage.keeps_full_grads:
        return ReduceScatterInPlace(wire_format, world_size)
    return ReduceIntoShard(wire_format, world_size)
