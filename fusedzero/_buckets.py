"""Bucket scheduling: which bucket is reduced when, and how many reductions are in flight.

Grads are counted into their buckets as backward produces them; a complete bucket is launched
at once if every bucket before it in the launch order was (collectives must match across ranks,
so the order is fixed), and everything left is launched at the end of backward. How a bucket is
reduced is the stage's `Reduction` (`fusedzero._reduce`).

[Note: buckets with unused params] A param that gets no grad (an unused branch) would leave
its bucket incomplete until the end of backward and, the order being fixed, every bucket after
it too. At the end of the first backward that reduces, the ranks agree (one all-reduce of a
flag per bucket over the group, and over the replicas on a 2-D mesh, whose all-reduces follow
the same order; a host sync once) on which buckets were incomplete on any rank; those move to
the end of the launch order, for good: the others launch as they complete, the moved ones at
the end of backward (earlier if their grads do come). The order stays identical on every rank,
and a param that is used after all only costs time, never a result.
At stage 3 a unit this rank's forward did not run (an expert no token was routed to) gets
zero grads for its params at its place in the unit order, where a rank that ran it completes
it, so its buckets are complete on every rank and never moved (see [Note: one gather order on
every rank] in fusedzero/_zero3.py: the reduce-scatters share the group with the gathers).

[Note: host cost per grad] `BucketSchedule.add_grad` runs once per param per backward, on the
host path that feeds the device: each torch call or context manager there costs ~1 us (and on
CUDA a kernel launch), so it runs none; a bucket's grads go in by one op when it is complete
(see [Note: grads into a bucket, per bucket] in fusedzero/_reduce.py), and the launch scan runs only
then.

[Note: a param's grad twice in one backward] A reentrant checkpoint
(`torch.utils.checkpoint(..., use_reentrant=True)`) runs a nested backward per checkpointed
region, and each runs the AccumulateGrad of the params it reaches: a param used in two such
regions (or inside and outside one) gets its post-accumulate hook twice in one backward. Only
its first grad counts toward its buckets' `pending` (and its stage-3 unit's): `GradHooks` marks
each param's record with the backward it last came in, a Python compare per grad and no torch
op. A later grad (`add_grad_again`) for a bucket not launched yet is summed with the first, as
torch sums them in `.grad`: kept in `got` (stages 0-1 flush it at once where the bucket was
already flushed: its launch puts nothing in), or already summed by autograd into the bucket
view. One for a bucket already launched in this backward raises: a collective (on NCCL, in
flight) is reading the bucket, the grad cannot go in without racing it, nor be dropped, and
the launch order is fixed on every rank (DDP raises here too). Where autograd accumulates
into a bucket view (stages 0-1) it wrote the grad before the hook could see it: the error
says this backward's grads are to be discarded.

[Note: one order across communicators] The replica all-reduces start at fixed points of
the launch order, the same on every rank, never when a reduction happens to be complete
(an `is_completed()` poll): NCCL requires the collectives of two communicators to be
issued in the same order on every rank, or a rank whose kernels cannot run at once (one
hardware queue, e.g. CUDA_DEVICE_MAX_CONNECTIONS=1) waits on the other forever.

[Note: zeroing once] `step()` then `zero_grad()`, the usual loop, would zero each full
grad buffer twice. A buffer is skipped when its version counter (shared by every view:
`.grad`, bucket slices) has not moved since it was last zeroed here and no reduction
was launched on it since. Every torch op that puts grads in bumps the counter
(autograd's accumulation into `.grad` views, `add_`/`mul_`/`copy_` by the reductions,
a user's in-place op on `.grad`); a collective writing in place does not, nor does a
Triton kernel (the wire formats), and on NCCL no `mul_` runs before or after one (the
1/W is the collective's premul_sum): a buffer that got no local grad but the other
ranks' average (a param group this rank's batch did not use) would keep that average
into the next step. So every launch marks its buffer (`_reduced_into`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from fusedzero import _comm as comm
from fusedzero._comm import CommContext, Handle
from fusedzero._flat import FlatBuffer
from fusedzero._profiling import phase
from fusedzero._reduce import MAX_INFLIGHT_BUCKETS, Bucket, BucketStatus, Finish, reduction_for
from fusedzero._replicas import ReplicaReduction
from fusedzero.stage import Stage
from fusedzero.wire import WireFormat

_SAME: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def _no_grad() -> contextlib.AbstractContextManager[None]:
    """no_grad where grad mode is on (create_graph=True, zero_grad(), a raised backward's
    recovery). Backward runs with it off: entering no_grad there cost ~1 us per bucket and
    per finished reduction for nothing."""
    return torch.no_grad() if torch.is_grad_enabled() else _SAME


@dataclasses.dataclass(slots=True, eq=False)
class PendingReduction:
    """A launched reduction of one bucket: its handle, and what to run once it is complete
    (None: nothing, or already run)."""

    bucket: Bucket
    handle: Handle
    finish: Finish | None


def launch_order(
    buffers: list[FlatBuffer], order: list[torch.Tensor], by_unit: bool
) -> list[Bucket]:
    """Launch order, identical on every rank: the bucket expected to be complete first goes
    first. Backward produces grads in about reverse forward order, and a bucket is complete when
    its earliest-used param's grad arrives, so buckets go in descending order of their earliest
    param's place in `order` (`module.parameters()`, or the optimizer's order). A bucket that
    mixes early and late layers (a small no-decay group of biases and norms) thus waits at the
    end instead of holding up every other bucket. Stage 3 (`by_unit`): units finish backward in
    reverse forward order; the root (unit 0) finishes last."""
    buckets = [
        Bucket(buf, k, buf.layout.slots_in(k), buf.layout.holes(k))
        for buf in buffers
        for k in range(buf.layout.num_buckets)
    ]
    if by_unit:
        buckets.sort(key=lambda b: (b.buf.unit == 0, -b.buf.unit, -b.k))
        return buckets
    place = {id(p): i for i, p in enumerate(order)}
    first = {
        id(b): min((place.get(id(b.buf.params[i]), -1) for i in b.slots), default=-1)
        for b in buckets
    }
    buckets.sort(key=lambda b: (-first[id(b)], -b.k))
    return buckets


class BucketSchedule:
    """The grad buckets of every flat buffer, their launch order and their reductions."""

    def __init__(
        self,
        buffers: list[FlatBuffer],
        stage: Stage,
        ctx: CommContext,
        order: list[torch.Tensor],
        replicas: CommContext | None = None,
        wire_format: WireFormat | None = None,
    ) -> None:
        self.buffers = buffers
        self.ctx = ctx
        # 2-D mesh: each bucket's shard is averaged over the replicas once its reduction is
        # complete (see [Note: replicas and accumulation] in fusedzero/_replicas.py), wire too.
        self.replicas = (
            ReplicaReduction(replicas, wire_format)
            if replicas is not None and replicas.world_size > 1
            else None
        )
        self.reduction = reduction_for(stage, wire_format, ctx.world_size)
        self.buckets = launch_order(buffers, order, by_unit=stage.shards_params)
        bucket_of = {(id(b.buf), b.k): b for b in self.buckets}
        # Per param, its buckets: looked up once here, not on every grad of every backward.
        self._buckets_at: dict[tuple[int, int], tuple[Bucket, ...]] = {
            (id(buf), pos): tuple(bucket_of[(id(buf), k)] for k in buf.layout.buckets_of(slot))
            for buf in buffers
            for pos, slot in enumerate(buf.layout.params)
        }
        # Grads are pre-divided before every reduction (see fusedzero._reduce): the reduced
        # buffers hold the average.
        self.inv_world = 1.0 / ctx.world_size
        # Stages 2-3 keep no full grad buffer to accumulate in: they reduce every micro-batch.
        self._always_reduces = not stage.keeps_full_grads
        # Stages 0-1: kept grads go into the full buffer when their bucket is complete, inside
        # no_sync too; stages 2-3 put them into the bucket at its launch.
        self._flushes = not self.reduction.gathers_at_launch
        self.sync = True
        self._pending: list[PendingReduction] = []  # launched since the last wait_all, in order
        # Those with a finish still to run, oldest first. The scans per launch walk these (at
        # most MAX_INFLIGHT_BUCKETS + 1), never every bucket.
        self._unfinished: collections.deque[PendingReduction] = collections.deque()
        self.max_live_buckets = 0  # most transient bucket buffers alive at once (stages 2-3)
        self._next = 0
        self._zeroed_at: dict[int, int] = {}  # id(buf) -> grad_flat._version after its zero_
        self._reduced_into: set[int] = set()  # id(buf) of buffers a reduction wrote since
        self._order_agreed = False  # see [Note: buckets with unused params]
        self.reset_pending()

    # -- backward -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev

    def reduces_now(self) -> bool:
        return self.sync or self._always_reduces

    def buckets_of(self, buf: FlatBuffer, pos: int) -> tuple[Bucket, ...]:
        return self._buckets_at[(id(buf), pos)]

    def was_reduced(self, buf: FlatBuffer, pos: int) -> bool:
        """A bucket holding param `pos` was reduced since the last step."""
        return any(b.status is not BucketStatus.EMPTY for b in self.buckets_of(buf, pos))

    def add_grad(self, buckets: tuple[Bucket, ...], pos: int, grad: torch.Tensor | None) -> None:
        """Param `pos` of a flat buffer, whose buckets are `buckets` (`buckets_of`), has its
        grad for this backward: keep it for them (None: autograd already accumulated it into
        the bucket view), and put in and launch what is complete. See [Note: host cost per
        grad]: no torch op here, only on a bucket's completion. Once per param per backward:
        a second grad goes to `add_grad_again`."""
        if grad is not None:
            for b in buckets:
                b.got[pos] = grad
        complete = False
        for b in buckets:
            b.pending -= 1
            if b.pending <= 0:
                complete = True
                if b.got and self._flushes:
                    self._flush(b)
        if complete:
            self._launch_ready(force=False)

    def add_grad_again(
        self, buckets: tuple[Bucket, ...], pos: int, grad: torch.Tensor | None
    ) -> None:
        """Param `pos` has another grad in this backward (None: autograd summed it into the
        bucket view): summed with the first, or, after its bucket was launched, an error. See
        [Note: a param's grad twice in one backward]."""
        for b in buckets:
            if b.launched:
                name = b.buf.layout.params[pos].name
                raise RuntimeError(
                    f"ZeroAdamW: param {name} got a second grad in one backward after its "
                    f"bucket (bucket {b.k} of param group {b.buf.group_index}) was launched "
                    "for reduction. A reentrant activation checkpoint (torch.utils.checkpoint("
                    "..., use_reentrant=True)) runs a nested backward per checkpointed region, "
                    "so a param used in two such regions, or inside and outside one, gets a "
                    "grad from each, and this one cannot go into a bucket a collective is "
                    "already reducing. Use use_reentrant=False, or do not share "
                    f"{name} across reentrant-checkpointed regions. This backward's grads "
                    "are not valid: call opt.zero_grad() before the next backward"
                )
        for b in buckets:
            if grad is not None:
                prev = b.got.get(pos)
                b.got[pos] = grad if prev is None else prev + grad
            if b.pending <= 0 and b.got and self._flushes:
                self._flush(b)  # b was flushed at its completion: its launch adds nothing

    def _flush(self, b: Bucket) -> None:
        """Stages 0-1: b's kept grads into the full grad buffer (one foreach op)."""
        with _no_grad():  # create_graph=True: no history on the grad buffer
            self.reduction.flush(b, self.inv_world)

    def _launch_ready(self, force: bool) -> None:
        if not self.reduces_now():
            return
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.pending > 0 and not force:
                return
            self.ctx.record("reduce", (b.buf.unit, b.buf.group_index, b.k))
            self._reduced_into.add(id(b.buf))  # See [Note: zeroing once]
            b.launched = True
            with _no_grad(), phase(self.reduction.range_name):
                h, finish = self.reduction.launch(b, self.ctx, self.inv_world)
            if self.replicas is not None:
                finish = self._then_replicas(b, finish)
            r = PendingReduction(b, h, finish)
            if finish is not None:
                self._unfinished.append(r)
            self._pending.append(r)
            self._next += 1
            if self.reduction.transient:
                # Only an unfinished reduction holds a transient bucket buffer (`b.grad`).
                live = sum(x.bucket.grad is not None for x in self._unfinished)
                self.max_live_buckets = max(self.max_live_buckets, live)
            if self.reduction.transient or self.replicas is not None:
                self._bound_inflight()

    def _then_replicas(self, b: Bucket, finish: Finish | None) -> Finish:
        """`finish`, then b's replica average (or, inside no_sync, a note that it is due)."""
        assert self.replicas is not None
        replicas, now = self.replicas, self.sync

        def then() -> None:
            if finish is not None:
                finish()
            if now:
                replicas.start(b)
            else:
                b.replica_stale = True

        return then

    def _bound_inflight(self) -> None:
        """Finish the oldest reductions beyond MAX_INFLIGHT_BUCKETS: transient buffers are
        freed as backward goes on, and a replica all-reduce (HSDP) starts when the bucket
        MAX_INFLIGHT_BUCKETS launches later is launched. (On NCCL the wait orders streams; it
        does not block the host.)

        See [Note: one order across communicators]."""
        while len(self._unfinished) > MAX_INFLIGHT_BUCKETS:
            r = self._unfinished.popleft()
            with _no_grad(), phase("fusedzero::reduce_wait"):
                self.ctx.wait(r.handle, what="grad reduction of a backward bucket")
                finish, r.handle, r.finish = r.finish, None, None
                assert finish is not None
                finish()

    def end_backward(self, grads_arrived: bool) -> bool:
        """Launch what is left and wait for every reduction: the grads are final when backward
        returns (what the user does next may read them), the next micro-batch never writes into
        a buffer a collective is reading, and stages 2-3 free their bucket buffers. On NCCL the
        wait orders the streams. Returns whether this backward reduced."""
        # A backward that reached the model's output but no param (torch.autograd.grad w.r.t.
        # inputs) has nothing to reduce.
        reduced = self.reduces_now() and grads_arrived
        incomplete = []
        for b in self.buckets:  # (one walk: it runs once per bucket per backward)
            incomplete.append(b.pending > 0)
            if b.got and self._flushes:
                self._flush(b)
        if reduced:
            self.ctx.record("flush", self._next)  # what is launched from here waited for the end
            self._launch_ready(force=True)
        self.wait_all()
        if reduced and not self._order_agreed:
            self._defer_incomplete(incomplete)
        self.reset_pending()
        return reduced

    def _defer_incomplete(self, incomplete: list[bool]) -> None:
        """See [Note: buckets with unused params]: once, the same on every rank."""
        self._order_agreed = True
        # Over the replicas too (2-D mesh): they issue the replica all-reduces in this order.
        groups = [self.ctx] + ([self.replicas.ctx] if self.replicas is not None else [])
        if any(g.world_size > 1 for g in groups):
            flags = torch.tensor(incomplete, dtype=torch.int32, device=self.buffers[0].device)
            for g in groups:
                g.wait(
                    comm.all_reduce_uncounted(flags, g.group, g.world_size),
                    what="all-reduce of the buckets some rank got no grad for",
                )
            incomplete = [bool(f) for f in flags.tolist()]  # a host sync, once per optimizer
        late = [b for b, f in zip(self.buckets, incomplete) if f]
        self.buckets = [b for b, f in zip(self.buckets, incomplete) if not f] + late
        for b in late:
            self.ctx.record("deferred", (b.buf.unit, b.buf.group_index, b.k))

    def abandon(self) -> None:
        """After a backward that raised (GradHooks.recover): complete what was launched, drop
        the grads kept for buckets that never launched (stages 2-3; stages 0-1 keep every grad
        that arrived, as torch's `.grad` does), reset the counts."""
        self.wait_all()
        for b in self.buckets:
            if b.got and self._flushes:
                self._flush(b)
            b.got.clear()
            b.release()
        self.reset_pending()

    def wait_all(self) -> None:
        if not self._pending and self.replicas is None:
            return
        with _no_grad(), phase("fusedzero::reduce_wait"):
            for r in self._pending:
                self.ctx.wait(r.handle, what="grad reduction of a backward bucket")
                if r.finish is not None:
                    r.finish()
            self._pending.clear()
            self._unfinished.clear()
            if self.replicas is not None:
                self.replicas.wait()

    def finish_replicas(self) -> None:
        """Before the update: average over the replicas what no backward averaged (stages 2-3
        inside no_sync)."""
        if self.replicas is not None:
            with _no_grad():
                self.replicas.leftovers(self.buckets)

    def reset_pending(self) -> None:
        for b in self.buckets:
            b.pending = len(b.slots)
            b.launched = False
        self._next = 0

    # -- step ---------------------------------------------------------------------------------
    def before_step(self) -> None:
        self.reduction.before_step(self.buckets)

    def reset_step(self) -> None:
        """The grads are consumed: empty the full grad buffers; the next reduction of every
        bucket is the first of its step.

        See [Note: zeroing once]."""
        todo = [
            buf
            for buf in self.buffers
            if buf.grad_flat is not None
            and (
                self._zeroed_at.get(id(buf)) != buf.grad_flat._version
                or id(buf) in self._reduced_into
            )
        ]
        if todo:  # one op for every buffer
            torch._foreach_zero_([buf.grad_flat for buf in todo])
            for buf in todo:
                self._zeroed_at[id(buf)] = buf.grad_flat._version
        self._reduced_into.clear()
        for b in self.buckets:  # every full grad buffer is all zeros now
            # Nothing kept survives a step (a grad that came after its bucket launched: see
            # [Note: a param's grad twice in one backward]).
            b.got.clear()
            b.status = BucketStatus.EMPTY
            b.replica_stale = False
            b.fresh = True
