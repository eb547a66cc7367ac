"""The flat-shard layout (a contract: docs/design.md, "Flat buffers"): where every parameter
element lives.

A *flat buffer* holds the params of one (param group, dtype[, ZeRO-3 unit]) back to back, each
starting at a multiple of ALIGN elements. The buffer is cut into `num_buckets` buckets of equal
size `bucket_numel`, a multiple of `world_size * ALIGN`; a param may straddle two buckets. Every
bucket is split into `world_size` equal shards of `shard_numel` elements, and rank r owns
`[r*S, (r+1)*S)` of every bucket. A rank's *local shard* is the concatenation of its pieces:

    full element  k*B + r*S + j   <->   rank r, local element  k*S + j      (0 <= j < S)

Equal buckets keep the map a two-term formula, which lets the fused kernel read and write a
rank's pieces of full buffers in place (see `fusedzero.kernels._adamw`), and bound the padding to
`num_buckets * world_size * ALIGN` elements per buffer plus each param's alignment hole.

Everything that must survive a change of world size or stage goes through `Segment`s, never raw
buffer offsets.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import NamedTuple

# 128 elements = 256 B of bf16 / 512 B of fp32: every param view and every shard edge is 16-byte
# aligned (128-bit vector accesses) for any element size up to 4 bytes.
ALIGN = 128
# Bucket size, when the user gives none, is chosen per rank. A bucket's collective moves one
# shard of it per rank, so what keeps it bandwidth-bound and what bounds its padding (a bucket is
# padded by < W * ALIGN elements: < ALIGN / shard_numel of it) is the size of one rank's shard,
# not the bucket's total; the total sets the transient memory of stages 2-3 (a bucket in flight
# is a full-size buffer). So the default is
#     bucket_numel = max(DEFAULT_BUCKET_NUMEL, W * MIN_SHARD_BYTES // itemsize)
# 2**25 elements (32M: 64 MiB of bf16): large enough that a collective is bandwidth-bound on NCCL
# at W <= 64, small enough that reduce-scatter of early buckets overlaps the rest of backward.
DEFAULT_BUCKET_NUMEL = 1 << 25
# 1 MiB per rank per bucket: each rank's chunk of a ring step stays above NCCL's latency-bound
# regime at any W, and padding stays under ALIGN / (MIN_SHARD_BYTES / itemsize) = 0.025% (bf16)
# of a bucket. It takes over from DEFAULT_BUCKET_NUMEL above W = 64 (bf16) / 128 (fp32).
MIN_SHARD_BYTES = 1 << 20


def default_bucket_numel(world_size: int, itemsize: int) -> int:
    """Elements per bucket when the user gives no `bucket_numel` (see MIN_SHARD_BYTES)."""
    return max(DEFAULT_BUCKET_NUMEL, world_size * (MIN_SHARD_BYTES // itemsize))


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class ParamSlot(NamedTuple):
    """One param in a flat buffer."""

    index: int  # position in the optimizer's flat list of params (all groups)
    name: str
    shape: tuple[int, ...]
    numel: int
    offset: int  # first element in the full flat buffer, a multiple of ALIGN


class Segment(NamedTuple):
    """A run of one param's elements held by one rank: the unit of resharding."""

    param: int  # ParamSlot.index
    start: int  # first element within the flattened param
    length: int
    rank: int
    local: int  # offset in that rank's local shard of this buffer


@dataclass
class FlatLayout:
    """Geometry of one flat buffer at one world size. Pure arithmetic, no tensors."""

    params: list[ParamSlot]
    world_size: int
    numel: int  # end of the last param (alignment holes included, no tail padding)
    num_buckets: int
    bucket_numel: int
    _segments: dict[int, list[Segment]] = field(default_factory=dict, repr=False)
    _starts: list[int] | None = field(default=None, repr=False)

    @property
    def shard_numel(self) -> int:
        return self.bucket_numel // self.world_size if self.world_size else 0

    @property
    def padded_numel(self) -> int:
        return self.num_buckets * self.bucket_numel

    @property
    def local_numel(self) -> int:
        return self.num_buckets * self.shard_numel

    @property
    def param_numel(self) -> int:
        return sum(p.numel for p in self.params)

    def bucket_range(self, k: int) -> tuple[int, int]:
        return k * self.bucket_numel, (k + 1) * self.bucket_numel

    def piece(self, k: int, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard of bucket k in the full buffer."""
        s = k * self.bucket_numel + rank * self.shard_numel
        return s, s + self.shard_numel

    def buckets_of(self, slot: ParamSlot) -> range:
        if slot.numel == 0 or self.bucket_numel == 0:
            return range(0)
        first = slot.offset // self.bucket_numel
        last = (slot.offset + slot.numel - 1) // self.bucket_numel
        return range(first, last + 1)

    def overlap(self, pos: int, k: int) -> tuple[int, int, int]:
        """(start in bucket k, end in bucket k, start in the param) of params[pos] in bucket k."""
        slot, B = self.params[pos], self.bucket_numel
        a, b = max(slot.offset, k * B), min(slot.offset + slot.numel, (k + 1) * B)
        return a - k * B, b - k * B, a - slot.offset

    def _first_from(self, pos: int) -> int:
        """Index of the first param that may hold element `pos` or lie after it (params are in
        offset order): a bisection, so walking a bucket costs its own params, not all of them."""
        if self._starts is None:
            self._starts = [p.offset for p in self.params]
        return max(0, bisect.bisect_right(self._starts, pos) - 1)

    def _overlapping(self, lo: int, hi: int) -> range:
        """Positions of the params that may overlap [lo, hi) (check each; most do)."""
        return range(self._first_from(lo), bisect.bisect_left(self._starts or [], hi))

    def slots_in(self, k: int) -> list[int]:
        """Positions in `params` of the params overlapping bucket k."""
        return [
            i
            for i in self._overlapping(*self.bucket_range(k))
            if k in self.buckets_of(self.params[i])
        ]

    def holes(self, k: int) -> list[tuple[int, int]]:
        """Ranges of bucket k that belong to no param (alignment gaps, tail padding)."""
        spans = sorted(self.overlap(pos, k)[:2] for pos in self.slots_in(k))
        out, cur = [], 0
        for a, b in spans:
            if a > cur:
                out.append((cur, a))
            cur = max(cur, b)
        if cur < self.bucket_numel:
            out.append((cur, self.bucket_numel))
        return out

    def segments(self, rank: int) -> list[Segment]:
        """Every run of param elements that `rank` owns, in local-shard order."""
        if rank not in self._segments:
            out: list[Segment] = []
            for k in range(self.num_buckets):
                lo, hi = self.piece(k, rank)
                for i in self._overlapping(lo, hi):
                    p = self.params[i]
                    a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
                    if a < b:
                        out.append(
                            Segment(
                                p.index, a - p.offset, b - a, rank, k * self.shard_numel + a - lo
                            )
                        )
            self._segments[rank] = out
        return self._segments[rank]


def build_layout(
    params: list[ParamSlot] | list[tuple[int, str, tuple[int, ...]]],
    world_size: int,
    bucket_numel: int | None = None,
    *,
    itemsize: int = 2,
) -> FlatLayout:
    """Place params (index, name, shape) back to back at ALIGN offsets and cut equal buckets of
    about `bucket_numel` elements in total (None: `default_bucket_numel(world_size, itemsize)`,
    `itemsize` being the buffer's element size). Offsets are Python ints: exact past 2**31."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel is None:
        bucket_numel = default_bucket_numel(world_size, itemsize)
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    slots: list[ParamSlot] = []
    cur = 0
    for item in params:
        index, name, shape = item[0], item[1], tuple(item[2])
        numel = math.prod(shape)
        offset = round_up(cur, ALIGN)
        slots.append(ParamSlot(index, name, shape, numel, offset))
        cur = offset + numel
    if cur == 0:
        return FlatLayout(slots, world_size, 0, 0, 0)
    # Round the requested bucket up to a whole number of aligned shards *before* counting
    # buckets: counting with the raw size first (bucket_numel < world_size * ALIGN) made one
    # bucket per `bucket_numel` elements, each then padded to world_size * ALIGN, e.g. 9x a 1M
    # param's size at W=8, bucket 100. Then spread the elements evenly over that many buckets,
    # so the tail padding is under world_size * ALIGN per bucket.
    unit = world_size * ALIGN
    num_buckets = math.ceil(cur / round_up(bucket_numel, unit))
    b = round_up(math.ceil(cur / num_buckets), unit)
    return FlatLayout(slots, world_size, cur, num_buckets, b)


def intersect(a: list[Segment], b: list[Segment]) -> list[tuple[Segment, Segment, int, int]]:
    """Overlaps of two segment lists: (seg_a, seg_b, start within the param, length).

    Used to move state between layouts of different world sizes or stages (checkpoint load).
    """
    by_param: dict[int, list[Segment]] = {}
    for s in b:
        by_param.setdefault(s.param, []).append(s)
    out = []
    for sa in a:
        for sb in by_param.get(sa.param, ()):
            lo = max(sa.start, sb.start)
            hi = min(sa.start + sa.length, sb.start + sb.length)
            if lo < hi:
                out.append((sa, sb, lo, hi - lo))
    return out
