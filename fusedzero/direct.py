"""Reduce-scatter and all-gather as direct point-to-point exchanges, for gloo.

[Note: gloo has no reduce-scatter] torch's gloo backend emulates `reduce_scatter_tensor` with a
clone of the whole input on the calling thread and an all-reduce of the whole buffer, after which
each rank keeps its slice: 2(W-1)/W * n elements on the wire instead of a reduce-scatter's
(W-1)/W * n, plus two copies. Its `all_gather_into_tensor` gathers into a temporary and copies
out. Every ZeRO stage from 1 up reduces and gathers this way every step, so on CPU ranks the
ZeRO collectives would cost twice their formula. Here each rank instead sends every peer the
slice that peer owns and receives from each peer its contribution to its own slice (gloo's
send/recv are native and copy nothing on the calling thread), then adds them up: exactly
(W-1)/W * n elements sent and received per rank, the ring formulas `CommCounter` counts, for
both collectives. The all-gather sends this rank's slice to every peer and receives theirs
straight into place.

Costs and lifetimes:
- A reduce-scatter holds a transient receive buffer of (W-1)/W * n elements until its wait (gloo's
  emulation held a full clone, n); the sum runs on the waiting thread, 1/W of the elements.
- The input must not be rewritten before the wait (the sends read it in place; gloo's clone made
  it free at once). Every caller already waits before touching a reduced or gathered buffer.
- Sums run in a fixed order per rank (own slice, then peers from rank+1 on), so a run repeats bit
  for bit; W = 2 is a single add, identical to any order.
- Messages carry a tag in a reserved range made from the collective's place in a per-group
  sequence and what it is (kind and size), identical on every rank because every rank issues the
  same collectives in the same order (as any collective needs); the user's own sends on the same
  group (tag 0 by default) never match ours, and ranks that diverged (rank-dependent control
  flow) wait on different tags and time out naming their own wait.

NCCL keeps its native collectives (`fusedzero.comm` only routes CPU tensors on gloo here).
"""
from __future__ import annotations

import datetime
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

# Tags of direct collectives: a range far from torch's default p2p tag 0.
TAG_BASE = 1 << 30
TAG_SPAN = 1 << 29

_tag_seqs: weakref.WeakKeyDictionary[dist.ProcessGroup, Iterator[int]] = (
    weakref.WeakKeyDictionary())


def _next_tag(group: dist.ProcessGroup | None, kind: int, t: torch.Tensor) -> int:
    """The tag of the group's next direct collective: its place in the group's sequence mixed
    with what it is (kind, elements, element size). Ranks whose control flow diverged (one
    skipped a unit) then post different tags, match nothing, and each times out naming its own
    wait, instead of pairing up unrelated messages."""
    pg = group if group is not None else dist.group.WORLD
    seq = _tag_seqs.get(pg)
    if seq is None:
        seq = _tag_seqs[pg] = itertools.count()
    what = (kind * 1_000_003 + t.numel()) * 31 + t.element_size()
    return TAG_BASE + (next(seq) * 2_654_435_761 + what) % TAG_SPAN


class DirectWork:
    """The handle of a direct collective: `wait` completes its sends and receives, then runs the
    step that finishes it on this thread (the reduce-scatter's sum). Same `wait` contract as
    `torch.distributed.Work` (an optional timedelta; RuntimeError on timeout)."""

    def __init__(self, works: list[dist.Work], then: Callable[[], None] | None = None) -> None:
        self._works = works
        self._then = then

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while self._works:
            w = self._works[0]
            if deadline is None:
                w.wait()
            else:
                left = max(deadline - time.monotonic(), 0.001)
                w.wait(datetime.timedelta(seconds=left))
            self._works.pop(0)
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self._then is None and not self._works

    def __del__(self) -> None:
        # Dropped before its wait (an optimizer discarded with its params' all-gather in flight,
        # an exception mid-backward): a gloo send or receive destroyed while pending leaves its
        # pair waiting for it, which stalls every later message between the two ranks. A daemon
        # thread waits for them instead, as gloo's own queue would for a collective.
        if self._works:
            threading.Thread(target=_drain, args=(self._works,), daemon=True,
                             name="fusedzero-direct-drain").start()


def _drain(works: list[dist.Work]) -> None:
    for w in works:
        try:
            w.wait()
        except RuntimeError:
            return  # the group is gone or timed out: nothing is waiting on it any more


def _peers(rank: int, world_size: int) -> list[int]:
    """Every other group rank, starting after this one: ranks do not all send to rank 0 first."""
    return [(rank + i) % world_size for i in range(1, world_size)]


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                   world_size: int, rank: int) -> DirectWork:
    """Sum `inp` (1-D, W equal slices) over the group; slice `rank` of the sum lands in `out`
    (which may alias that slice of `inp`) when the returned handle is waited."""
    S = out.numel()
    tag = _next_tag(group, 1, inp)
    peers = _peers(rank, world_size)
    recv = torch.empty((world_size - 1, S), dtype=inp.dtype, device=inp.device)
    works = [dist.irecv(recv[i], group=group, group_src=p, tag=tag) for i, p in enumerate(peers)]
    works += [dist.isend(inp[p * S:(p + 1) * S], group=group, group_dst=p, tag=tag)
              for p in peers]
    own = inp[rank * S:(rank + 1) * S]

    def add() -> None:
        torch.add(own, recv[0] if world_size == 2 else recv.sum(0), out=out)
    return DirectWork([w for w in works if w is not None], add)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
               world_size: int, rank: int) -> DirectWork:
    """Every rank's `inp` into its slice of `out` (1-D); `inp` may be this rank's slice."""
    S = inp.numel()
    tag = _next_tag(group, 2, out)
    peers = _peers(rank, world_size)
    works = [dist.irecv(out[p * S:(p + 1) * S], group=group, group_src=p, tag=tag)
             for p in peers]
    works += [dist.isend(inp, group=group, group_dst=p, tag=tag) for p in peers]
    mine = out[rank * S:(rank + 1) * S]
    if mine.data_ptr() != inp.data_ptr():
        mine.copy_(inp)
    return DirectWork([w for w in works if w is not None])
