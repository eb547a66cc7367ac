"""The owner layout: a flat buffer whose every block (a matrix Muon orthogonalises) lies whole in
one rank's shard of one bucket. Pure arithmetic, no tensors.

A per-matrix rule (`Rule.element_wise = False`, fusedzero/rules) needs each block whole on the
rank that updates it. The engine's collectives cut every bucket into W equal shards and hand
rank r shard r (`fusedzero._layout`), so the layout, not a new collective, keeps blocks whole:
the reduce-scatter the engine already runs hands each owner its full grads, the update runs once
on the owner, and the all-gather brings the params back. Zero bytes on the wire beyond the
padding.

The result is an ordinary `FlatLayout` (equal buckets, params at ALIGN multiples in offset
order, holes between them): the kernels, reductions, gathers, stage-3 units and checkpoints run
it unchanged. Only the placement differs:

1. Shard size S: the largest thing that must sit whole in a shard (a 2-D matrix, or a 3-D stack
   that cannot be cut at shard edges), rounded up to ALIGN. A stack [E, M, N] whose matrices are
   ALIGN multiples dividing S *streams*: S / (M*N) matrices per shard over consecutive shards,
   every shard edge between two of its matrices (a Mixtral expert stack: one matrix a shard).
2. Bins of S elements, first-fit decreasing: a bin holds one Llama MLP matrix, or three q/o
   projections and two k/v ones; a GPT-2 c_attn with an attention c_proj.
   Where the buffer's `bucket_numel` allows bins larger than S and no stack streams, fewer,
   larger bins are tried (m per rank, about 1/(W*m) of the matrices each, worst-fit
   decreasing) and the packing of least padding kept (`_fewer_larger_bins`).
3. Bins to slots: each rank gets m = ceil(bins / W) slots of S, c of them back to back in its
   shard of each of m / c buckets (c the largest divisor of m whose bucket, W * c * S, fits the
   buffer's `bucket_numel`: each bucket is a collective and ~4 ops in backward, so more bins a
   bucket means fewer ops per param, at the same padding). Stream bins first, in slot order
   (they must be consecutive in the buffer); then the rest by longest-processing-time, the
   costliest bin to the least-loaded rank with a free slot, the cost being the rule's
   (Newton-Schulz FLOPs for Muon). The m * W - bins slots left over are padding.

Padding is the empty slots (< W bins' worth) plus each bin's unfilled room. It is small where a
buffer holds many more matrices than W * (matrices per bin) (Llama-8B at W = 8: 0.96%) and
large where it does not (GPT-2 124M at W = 8: 4 of 40 slots empty, 11%; a stage-3 unit of one
block at W = 8), with bins of S; with a bucket of the whole buffer (2., larger bins) GPT-2
and Llama-8B/70B at W = 8 pad nothing. An element-wise param could fill the room (docs/muon.md,
"Padding"), which needs buckets of more than one size or a buffer of two rules: not done.

`bucket_numel` bounds a bucket only down to W * S: a bucket holds at least one bin per rank.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from fusedzero._layout import ALIGN, FlatLayout, ParamSlot, round_up


class Block(NamedTuple):
    """What must sit whole on one rank: a param of `shape` is `prod(shape) // numel` blocks of
    `numel` elements back to back (a 2-D matrix: one; a stack [E, M, N]: E of M*N), each
    costing `cost` (the rule's work per block: what the layout balances over ranks)."""

    numel: int
    cost: int


@dataclass(slots=True)
class _Bin:
    used: int = 0
    cost: int = 0
    # (param position, elements) placed back to back from the bin's start.
    items: list[tuple[int, int]] = field(default_factory=list)
    stream: bool = False


def _streams(numel: int, block: Block, S: int) -> bool:
    """A param of several blocks that may cross shard edges between its blocks."""
    m = block.numel
    return numel > m and m % ALIGN == 0 and S % m == 0


def shard_size(sizes: list[int], blocks: list[Block]) -> int:
    """S: the largest thing that must sit whole in one shard (see the module docstring, 1)."""
    S = max([ALIGN] + [round_up(b.numel, ALIGN) for n, b in zip(sizes, blocks) if n])
    while True:  # a stack that cannot stream is whole: it may raise S, which may stop another
        need = max(
            [S] + [round_up(n, ALIGN) for n, b in zip(sizes, blocks) if n and not _streams(n, b, S)]
        )
        if need == S:
            return S
        S = need


def build_owner_layout(
    params: list[tuple[int, str, tuple[int, ...]]],
    blocks: list[Block],
    world_size: int,
    load: list[int] | None = None,
    bucket_numel: int = 0,
) -> FlatLayout:
    """The owner layout of `params` (index, name, shape), `blocks[i]` the block of params[i],
    over `world_size` ranks (see the module docstring). Params come back in offset order.

    `load`: each rank's cost in the buffers laid out before this one, updated in place, so that
    the balance holds over all of them (stage 3 lays out a buffer per unit: balanced one by one,
    each unit's costliest bin would land on rank 0). None: this buffer alone.
    `bucket_numel`: how large a bucket may grow by holding several bins per rank (0: one bin
    per rank per bucket)."""
    W = world_size
    if W < 1:
        raise ValueError(f"world_size must be >= 1, got {W}")
    if len(blocks) != len(params):
        raise ValueError(f"{len(blocks)} blocks for {len(params)} params")
    sizes = [math.prod(shape) for _, _, shape in params]
    for (_, name, shape), n, b in zip(params, sizes, blocks):
        if b.numel < 1 or n % b.numel:
            raise ValueError(f"{name} of shape {shape} is not whole blocks of {b.numel} elements")
    if not any(sizes):
        slots = [ParamSlot(i, name, tuple(shape), 0, 0) for i, name, shape in params]
        return FlatLayout(slots, W, 0, 0, 0)
    S = shard_size(sizes, blocks)
    # Decided once, at this S: larger bins (below) are tried only where nothing streams.
    streams = [bool(n) and _streams(n, b, S) for n, b in zip(sizes, blocks)]
    costs = [n // b.numel * b.cost for n, b in zip(sizes, blocks)]

    # 2. Streams first (consecutive bins), then first-fit decreasing.
    bins: list[_Bin] = []
    offsets = [0] * len(params)
    for pos, (n, b) in enumerate(zip(sizes, blocks)):
        if streams[pos]:
            per = S // b.numel  # blocks per shard
            count = n // b.numel
            offsets[pos] = len(bins)  # its first bin; the slot's offset below
            for first in range(0, count, per):
                k = min(per, count - first)
                bins.append(_Bin(k * b.numel, k * b.cost, [(pos, k * b.numel)], True))
    whole = [pos for pos, n in enumerate(sizes) if n and not streams[pos]]
    whole.sort(key=lambda pos: -round_up(sizes[pos], ALIGN))  # stable: model order among equals
    n_stream = len(bins)
    for pos in whole:
        size = round_up(sizes[pos], ALIGN)
        # A stream's bins take whole params only after its last block: only its last bin may
        # have room, and what follows it there is fine.
        for b in bins:
            if b.used + size <= S:
                break
        else:
            b = _Bin()
            bins.append(b)
        # The stream's own elements are not aligned up: place after the aligned end.
        b.used = round_up(b.used, ALIGN) + size
        b.cost += costs[pos]
        b.items.append((pos, size))
    if not n_stream:
        S, bins = _fewer_larger_bins(S, bins, W, bucket_numel, costs)

    # 3. Bins to slots. Each rank gets m = ceil(bins / W) slots, c of them in each of m / c
    #    buckets (c the largest divisor of m whose bucket fits `bucket_numel`: fewer, larger
    #    collectives, the same padding). Slot (bucket k, rank r, place j) starts at linear index
    #    (k*W + r)*c + j, times S. Streams go first, from the least-loaded rank that keeps them
    #    in the slots there are; the rest by LPT over ranks with a free slot.
    m = -(-len(bins) // W)
    c = max(d for d in range(1, m + 1) if m % d == 0 and (d == 1 or d * W * S <= bucket_numel))
    if load is None:
        load = [0] * W
    if len(load) != W:
        raise ValueError(f"load has {len(load)} ranks, expected {W}")
    r0 = min(range(min(W, (m * W - n_stream) // c + 1)), key=lambda r: (load[r], r))
    free: list[list[int]] = [list(range(m)) for _ in range(W)]  # each rank's free slots
    placed: list[tuple[int, int, _Bin]] = []  # (linear index, rank, bin)
    for j, b in enumerate(bins[:n_stream]):
        lin = r0 * c + j
        k, r, jj = lin // (W * c), lin // c % W, lin % c
        free[r].remove(k * c + jj)
        load[r] += b.cost
        placed.append((lin, r, b))
    for b in sorted(bins[n_stream:], key=lambda b: -b.cost):
        r = min((r for r in range(W) if free[r]), key=lambda r: (load[r], r))
        slot = free[r].pop(0)
        placed.append(((slot // c * W + r) * c + slot % c, r, b))
        load[r] += b.cost

    # Offsets: a bin's items back to back at ALIGN from its slot's start (a stream bin's first
    # item is its stream's piece, whose offset is the stream's first bin's: stream bin j went to
    # linear index r0*c + j).
    for pos in range(len(params)):
        if streams[pos]:
            offsets[pos] = (r0 * c + offsets[pos]) * S
    for lin, _, b in placed:
        cur = lin * S
        for i, (pos, length) in enumerate(b.items):
            cur = round_up(cur, ALIGN)
            if not (b.stream and i == 0):
                offsets[pos] = cur
            cur += length
    order = sorted(range(len(params)), key=lambda pos: (offsets[pos], pos))
    slots = [
        ParamSlot(params[pos][0], params[pos][1], tuple(params[pos][2]), sizes[pos], offsets[pos])
        for pos in order
    ]
    end = max(s.offset + s.numel for s in slots)
    return FlatLayout(slots, W, end, m // c, W * c * S)


def _fewer_larger_bins(
    S: int, bins: list[_Bin], W: int, bucket_numel: int, costs: list[int]
) -> tuple[int, list[_Bin]]:
    """Bins larger than the largest matrix, where the bucket size allows, when they pad less:
    for m bins per rank, capacity C = max(S, total / (W*m)) rounded up to ALIGN (and a few
    ALIGN-rounded percent more where the items do not fit), the items worst-fit decreasing into
    exactly W*m bins (each into the emptiest: the fills even out, where first fit leaves the
    last bins light). GPT-2 124M at W = 8: its 48 matrices make 8 bins of exactly an eighth (no
    padding) where bins of the largest matrix leave 4 of 40 slots empty (11%). Kept: the layout
    of least padding, the smaller bins on a tie (more buckets: more overlap with backward)."""
    cap = bucket_numel // W
    if cap <= S:
        return S, bins
    items = [(pos, size, costs[pos]) for b in bins for pos, size in b.items]
    items.sort(key=lambda t: (-t[1], t[0]))  # largest first, model order among equals
    total = sum(size for _, size, _ in items)
    best = (-(-len(bins) // W) * W * S, S, bins)
    m = 1
    while True:
        C = round_up(max(S, -(-total // (W * m))), ALIGN)
        if C <= S:
            break
        for grow in (0, 1, 2, 5):
            Cg = round_up(C + C * grow // 100, ALIGN)
            if Cg > cap:
                break
            packed = _worst_fit(items, W * m, Cg)
            if packed is not None:
                if W * m * Cg < best[0]:
                    best = (W * m * Cg, Cg, packed)
                break
        m += 1
    return best[1], best[2]


def _worst_fit(items: list[tuple[int, int, int]], n: int, C: int) -> list[_Bin] | None:
    """`items` (position, aligned size, cost; largest first) worst-fit into `n` bins of `C`, or
    None where one does not fit."""
    bins = [_Bin() for _ in range(n)]
    heap = [(0, i) for i in range(n)]
    for pos, size, cost in items:
        used, i = heapq.heappop(heap)
        if used + size > C:
            return None
        b = bins[i]
        b.used = used + size
        b.cost += cost
        b.items.append((pos, size))
        heapq.heappush(heap, (b.used, i))
    return bins


def rank_costs(layout: FlatLayout, blocks: dict[int, Block]) -> list[int]:
    """Each rank's work in `layout`: the cost of every block its shards hold (`blocks` by param
    index)."""
    out = [0] * layout.world_size
    for r in range(layout.world_size):
        for seg in layout.segments(r):
            b = blocks[seg.param]
            out[r] += seg.length // b.numel * b.cost
    return out
