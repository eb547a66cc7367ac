"""Where every element lives when some params need whole matrices on one rank (Muon): pure
arithmetic, no tensors, no torch.distributed.

Newton-Schulz needs each matrix whole. The layout puts every matrix of a per-matrix param whole
inside one rank's shard of one bucket, so the equal-size collectives the engine already runs
(reduce_scatter_tensor / all_gather_into_tensor per bucket) hand each owner its full grads and
bring the params back: no extra bytes on the wire, only the layout's padding.

The flat buffer is still a line of params, each contiguous and at a multiple of ALIGN (the
model's params stay views of it), cut into buckets; bucket k is `world_size` equal shards of
`shard_numel[k]` elements and rank r owns shard r of every bucket. Unlike `_layout.FlatLayout`,
buckets need not be equal: each is sized to what it holds (a bucket is its own collective, so
only its own shards must be equal). A rank's local shard is its shards of every bucket back to
back (`MuonBucket.local_offset`).

The plan, in four passes:

1. Expert stacks [E, M, N] whose matrices are multiples of ALIGN elements flow as a stream, one
   matrix per shard (shards of exactly one matrix), so a stack runs over consecutive ranks and
   every shard edge falls between two of its matrices. Equal matrices per shard: each full
   bucket is balanced by construction.
2. The other matrices (2-D params, stacks that cannot be cut at shard edges as one item) are
   packed bucket by bucket: the bucket's capacity is the largest matrix left, its W bins filled
   first-fit-decreasing by size (so a bin holds one gate projection, or 3 q/o and 2 k/v
   projections of a Llama). A bucket's shard size is its fullest bin. Bins go to ranks by NS
   cost, heaviest bin to the least-loaded rank (LPT), FLOPs counted 5 * (4 s*s*l + 2 s*s*s)
   for an s x l matrix (s <= l). In the last matrix bucket the used bins take the first ranks,
   so its empty shards are one run at its end.
3. Element-wise params (embeddings, head, norms, biases: any slice works for them) fill the room
   left in bins, largest first, each into the fullest bin it fits (best fit): whole params, since
   a matrix block on either side would cut them.
4. The rest of them run back to back from the end of the last matrix block, through the last
   matrix bucket's empty shards, into element-wise buckets of about `ew_bucket_numel` elements
   (they may straddle shard and bucket edges like any param of `_layout.FlatLayout`).

Padding is what is left: room in bins no element-wise param fits, alignment holes, and the last
bucket's tail. It cannot go below W * (largest matrix) - (all params) when that is positive (one
bucket of W shards, each at least a matrix: GPT-2 at W = 64). tests/zero/test_muon_layout.py
measures it on GPT-2 124M, Llama-3-8B/70B and a Mixtral-shaped MoE.

How the engine uses it: the buffer's params at `MuonLayout.offsets` (views as today), one
reduce-scatter and all-gather per `MuonBucket` of `numel` elements, each rank's pieces
(`RankShard.pieces`, the unit of resharding like `_layout.Segment`: `segments(rank)`), and the
matrices it owns (`RankShard.matrices`, grouped by shape into Newton-Schulz stacks; their local
offsets address the momentum buffers and the element-wise launches of kernels/_muon.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from fusedzero._layout import ALIGN, Segment, default_bucket_numel, round_up


def ns_cost(rows: int, cols: int, ns_steps: int = 5) -> int:
    """Newton-Schulz FLOPs of a rows x cols matrix: ns_steps * (4 s*s*l + 2 s*s*s), s <= l."""
    s, lg = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * s * s * lg + 2 * s * s * s)


@dataclass(frozen=True, slots=True)
class MuonParamSpec:
    """A param in model order: `per_matrix` needs whole matrices (2-D: one; 3-D [E, M, N]: E
    matrices of M x N); the others are element-wise."""

    name: str
    shape: tuple[int, ...]
    per_matrix: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrices(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1

    @property
    def matrix_shape(self) -> tuple[int, int]:
        return (self.shape[-2], self.shape[-1])


@dataclass(frozen=True, slots=True)
class MuonPiece:
    """A run of one param's elements in one rank's shard of one bucket: elements
    [start, start + length) of the flattened param at `local` in that rank's local shard."""

    param: int
    start: int
    length: int
    local: int


@dataclass(frozen=True, slots=True)
class MatrixRef:
    """A matrix a rank owns whole: matrix `index` of param `param` (0 for a 2-D param), rows x
    cols, starting at `local` in the rank's local shard."""

    param: int
    index: int
    rows: int
    cols: int
    local: int


@dataclass(slots=True)
class RankShard:
    """One rank's shard of one bucket."""

    rank: int
    pieces: list[MuonPiece] = field(default_factory=list)
    matrices: list[MatrixRef] = field(default_factory=list)
    padding: int = 0  # elements of the shard that belong to no param
    ns_flops: int = 0


@dataclass(slots=True)
class MuonBucket:
    """A bucket: `world_size` shards of `shard_numel` elements at `offset` in the full buffer;
    every rank's shard of it starts at `local_offset` in that rank's local shard."""

    index: int
    offset: int
    shard_numel: int
    local_offset: int
    ranks: list[RankShard]

    @property
    def numel(self) -> int:
        return self.shard_numel * len(self.ranks)


@dataclass(slots=True)
class MuonLayout:
    """The plan: each param's first element in the full buffer (`offsets`, multiples of ALIGN),
    and the buckets."""

    world_size: int
    params: list[MuonParamSpec]
    offsets: list[int]
    buckets: list[MuonBucket]

    @property
    def numel(self) -> int:
        """Elements of the full buffer (every bucket, padding included)."""
        return sum(b.numel for b in self.buckets)

    @property
    def local_numel(self) -> int:
        return sum(b.shard_numel for b in self.buckets)

    @property
    def param_numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def muon_numel(self) -> int:
        return sum(p.numel for p in self.params if p.per_matrix)

    @property
    def padding(self) -> int:
        return self.numel - self.param_numel

    def ns_flops(self) -> list[int]:
        """Newton-Schulz FLOPs per step of each rank."""
        out = [0] * self.world_size
        for b in self.buckets:
            for s in b.ranks:
                out[s.rank] += s.ns_flops
        return out

    def balance(self) -> float:
        """Max over mean of the ranks' NS FLOPs (1.0 with no matrix)."""
        f = self.ns_flops()
        mean = sum(f) / len(f)
        return max(f) / mean if mean else 1.0

    def segments(self, rank: int) -> list[Segment]:
        """`rank`'s pieces as `_layout.Segment`s (the unit checkpoints reshard by)."""
        return [
            Segment(p.param, p.start, p.length, rank, p.local)
            for b in self.buckets
            for p in b.ranks[rank].pieces
        ]


@dataclass(slots=True)
class _Item:
    """Something placed whole in one shard: a 2-D matrix, or a whole stack."""

    param: int
    size: int  # aligned
    flops: int


@dataclass(slots=True)
class _Bin:
    cap: int
    items: list[_Item] = field(default_factory=list)
    used: int = 0
    rank: int = -1
    stream: list[tuple[int, int]] = field(default_factory=list)  # (param, matrix) from pass 1
    fillers: list[int] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return sum(i.flops for i in self.items)


def plan_muon_layout(
    params: list[MuonParamSpec],
    world_size: int,
    *,
    ew_bucket_numel: int | None = None,
    ns_steps: int = 5,
) -> MuonLayout:
    """Plan the layout of `params` (model order) over `world_size` ranks (see the module
    docstring). `ew_bucket_numel`: the size of the element-wise buckets at the end (None:
    `_layout.default_bucket_numel` for bf16)."""
    W = world_size
    if W < 1:
        raise ValueError(f"world_size must be >= 1, got {W}")
    for p in params:
        if p.per_matrix and len(p.shape) not in (2, 3):
            raise ValueError(
                f"{p.name}: a per-matrix param must be 2-D or a 3-D stack [E, M, N], "
                f"got shape {p.shape}"
            )
    ew_bucket = ew_bucket_numel or default_bucket_numel(W, 2)
    cost = [ns_cost(*p.matrix_shape, ns_steps) if p.per_matrix else 0 for p in params]
    load = [0] * W
    buckets: list[list[_Bin]] = []

    # 1. Stacks that can be cut at shard edges: one matrix per shard, grouped by matrix size.
    streams: dict[int, list[int]] = {}
    items: list[_Item] = []
    for i, p in enumerate(params):
        if not p.per_matrix or p.numel == 0:
            continue
        m = math.prod(p.matrix_shape)
        if len(p.shape) == 3 and p.matrices > 1 and m % ALIGN == 0:
            streams.setdefault(m, []).append(i)
        else:
            items.append(_Item(i, round_up(p.numel, ALIGN), cost[i] * p.matrices))
    partial: list[_Bin] | None = None
    for m in sorted(streams, reverse=True):
        mats = [(i, e) for i in streams[m] for e in range(params[i].matrices)]
        for k in range(0, len(mats), W):
            bins = [_Bin(m) for _ in range(W)]
            for r, (i, e) in enumerate(mats[k : k + W]):
                bins[r].stream.append((i, e))
                bins[r].used, bins[r].rank = m, r
                load[r] += cost[i]
            buckets.append(bins)
        if len(mats) % W:
            partial = buckets[-1]  # its free shards (the last ranks) take matrices of pass 2

    # 2. The other matrices, bucket by bucket, first-fit decreasing into W bins.
    items.sort(key=lambda it: -it.size)  # stable: model order among equals
    while items:
        if partial is not None:
            bins, partial = partial, None
            free = [b for b in bins if b.rank < 0]
            cap = bins[0].cap
            if items[0].size > cap:  # no matrix left fits: the partial bucket stays as it is
                continue
            for b in free:
                b.cap = cap
        else:
            cap = items[0].size
            bins = [_Bin(cap) for _ in range(W)]
            buckets.append(bins)
            free = bins
        left = []
        for it in items:
            for b in free:
                if b.used + it.size <= b.cap:
                    b.items.append(it)
                    b.used += it.size
                    break
            else:
                left.append(it)
        items = left
        used = sorted((b for b in free if b.items), key=lambda b: -b.flops)
        taken = {b.rank for b in bins if b.rank >= 0}
        ranks = [r for r in range(W) if r not in taken]
        if not items:  # the last matrix bucket: used bins on its first free ranks
            ranks = ranks[: len(used)]
        ranks.sort(key=lambda r: load[r])
        for b, r in zip(used, ranks):
            b.rank = r
            load[r] += b.flops

    # Shard sizes and the rank order of every bucket's bins.
    shard: list[int] = []
    for k, bins in enumerate(buckets):
        if any(b.stream for b in bins):
            shard.append(bins[0].cap)  # stream shards are exactly one matrix
        else:
            shard.append(round_up(max(b.used for b in bins), ALIGN))
        by_rank: list[_Bin | None] = [None] * W
        for b in bins:
            if b.rank >= 0:
                by_rank[b.rank] = b
        buckets[k] = [b if b is not None else _Bin(shard[k], rank=r) for r, b in enumerate(by_rank)]
        for r, b in enumerate(buckets[k]):
            b.rank = r

    # 3. Element-wise params into the room of bins (not the last used one: the stream starts
    #    there), largest first, best fit.
    ew = [i for i, p in enumerate(params) if not p.per_matrix or p.numel == 0]
    last_used = None
    if buckets:
        last = buckets[-1]
        used_ranks = [b.rank for b in last if b.items or b.stream]
        last_used = (len(buckets) - 1, max(used_ranks) if used_ranks else -1)
    rooms: list[tuple[int, int, int]] = []  # (room, bucket, rank)
    for k, bins in enumerate(buckets):
        for b in bins:
            trailing = k == len(buckets) - 1 and not (b.items or b.stream)
            if not trailing and (k, b.rank) != last_used:
                room = shard[k] - b.used
                if room >= ALIGN:
                    rooms.append((room, k, b.rank))
    rooms.sort()
    streamed = []
    for i in sorted(ew, key=lambda i: -params[i].numel):
        need = round_up(params[i].numel, ALIGN)
        j = bisect.bisect_left(rooms, (need, -1, -1))
        if need == 0 or j == len(rooms):
            streamed.append(i)
            continue
        room, k, r = rooms.pop(j)
        b = buckets[k][r]
        b.fillers.append(i)
        b.used += need
        if room - need >= ALIGN:
            bisect.insort(rooms, (room - need, k, r))
    streamed.sort()  # model order

    # Absolute positions of every matrix block and filler.
    offsets = [0] * len(params)
    bucket_offset, local_offset, pos = [], [], 0
    loc = 0
    for k, bins in enumerate(buckets):
        bucket_offset.append(pos)
        local_offset.append(loc)
        for b in bins:
            cur = pos + b.rank * shard[k]
            for i, e in b.stream:
                if e == 0:
                    offsets[i] = cur
                cur += shard[k]  # one matrix fills the shard
            for it in b.items:
                offsets[it.param] = cur
                cur += it.size
            for i in b.fillers:
                offsets[i] = cur
                cur += round_up(params[i].numel, ALIGN)
        pos += W * shard[k]
        loc += shard[k]

    # 4. The rest of the element-wise params from the end of the last matrix block.
    if last_used is not None:
        k, r = last_used
        start = bucket_offset[k] + max(r, 0) * shard[k] + (buckets[k][r].used if r >= 0 else 0)
    else:
        start = 0
    cur = start
    for i in streamed:
        offsets[i] = cur
        cur = round_up(cur + params[i].numel, ALIGN)
    if cur > pos:
        rest = cur - pos
        n = -(-rest // ew_bucket)
        s = round_up(-(-rest // (n * W)), ALIGN)
        for _ in range(n):
            bucket_offset.append(pos)
            local_offset.append(loc)
            shard.append(s)
            buckets.append([_Bin(s, rank=r) for r in range(W)])
            pos += W * s
            loc += s

    return _records(params, W, offsets, buckets, shard, bucket_offset, local_offset, cost)


def _records(
    params: list[MuonParamSpec],
    W: int,
    offsets: list[int],
    buckets: list[list[_Bin]],
    shard: list[int],
    bucket_offset: list[int],
    local_offset: list[int],
    cost: list[int],
) -> MuonLayout:
    """Cut the placed params into each rank's pieces and matrices."""
    order = sorted((offsets[i], i) for i, p in enumerate(params) if p.numel)
    starts = [o for o, _ in order]
    out = []
    for k in range(len(buckets)):
        S, ranks = shard[k], []
        for r in range(W):
            lo = bucket_offset[k] + r * S
            hi = lo + S
            rs = RankShard(r)
            j = max(0, bisect.bisect_right(starts, lo) - 1)
            while j < len(order) and order[j][0] < hi:
                o, i = order[j]
                p = params[i]
                a, b = max(lo, o), min(hi, o + p.numel)
                if a < b:
                    rs.pieces.append(MuonPiece(i, a - o, b - a, local_offset[k] + a - lo))
                    if p.per_matrix:
                        m = math.prod(p.matrix_shape)
                        for e in range((a - o) // m, -(-(b - o) // m)):
                            rs.matrices.append(
                                MatrixRef(i, e, *p.matrix_shape, local_offset[k] + o + e * m - lo)
                            )
                            rs.ns_flops += cost[i]
                j += 1
            rs.padding = S - sum(pc.length for pc in rs.pieces)
            ranks.append(rs)
        out.append(MuonBucket(k, bucket_offset[k], S, local_offset[k], ranks))
    return MuonLayout(W, list(params), offsets, out)
