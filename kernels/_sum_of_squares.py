"""Sum of squares of a rank's grad shards, the reduction behind global-norm clipping.

A non-finite element makes the sum inf or nan, so `~isfinite(sumsq)` is also the non-finite-grad
flag: one pass gives both. `GroupedSumsq` is built once over every grad view of a rank and runs
one launch per grad dtype (a piece table as in the AdamW kernel, kernels/_table.py); every launch
writes the fp32 partial sum of each of its programs into one partials buffer, then one `sum`
over it. Deterministic: the same partials in the same order every step.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from fusedzero.kernels import _table as table
from fusedzero.kernels._launch import (
    ENABLE_FP_FUSION,
    GRAD_DTYPES,
    Strided,
    as_strided,
    check_stream,
    count_launch,
    device_guard,
    shard_numel_of,
    use_triton,
)
from fusedzero.kernels._table import SUMSQ_WIDTH, Buffer, Piece, Table, build_table, pieces_of

# 4096 elements per program keeps the partials buffer small (1/4096 of the shard) while every
# thread still issues several 128-bit loads.
BLOCK = 4096
NUM_WARPS = 8
_WIDTH = tl.constexpr(SUMSQ_WIDTH)
# Elements squared at a time on the torch path: 1 MiB of fp32 scratch, within a core's L2 on
# server CPUs, so the cast-in, the square and the sum touch memory once (the grads) instead of
# writing and re-reading a scratch as large as the shard.
_CHUNK = 1 << 18


@triton.jit
def _grouped_sumsq_kernel(
    x_ptr,
    piece_ptr,
    prog_piece_ptr,
    partial_ptr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program `prog` squares BLOCK elements of its piece and writes partial `prog`; one grid
    # axis (CUDA caps axes 1-2 at 65535), int64 offsets.
    prog = tl.program_id(0).to(tl.int64)
    # The piece's table row (kernels/_table.py `SumsqCol`).
    entry = piece_ptr + tl.load(prog_piece_ptr + prog).to(tl.int64) * _WIDTH
    off = tl.load(entry + table.SumsqCol.X)
    numel = tl.load(entry + table.SumsqCol.NUMEL)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
        numel = tl.multiple_of(numel, 16)
    idx = (prog - tl.load(entry + table.SumsqCol.FIRST)) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + off + idx, mask=idx < numel, other=0.0).to(tl.float32)
    tl.store(partial_ptr + prog, tl.sum(x * x, axis=0))


class SumsqView:
    """One grad view for `GroupedSumsq`: `num_buckets` pieces of `shard_numel` elements."""

    def __init__(
        self, x: torch.Tensor | Strided, num_buckets: int = 1, shard_numel: int | None = None
    ) -> None:
        self.shard_numel = shard_numel_of(x, num_buckets, shard_numel)
        self.stream = as_strided(x, self.shard_numel)
        self.num_buckets = num_buckets


class GroupedSumsq:
    """fp32 sum of squares over many grad views: one launch per grad dtype, tables built once.

    On the torch path (CPU) a "launch" is one grouped pass per dtype: the pieces are packed into
    chunks of at most `_CHUNK` elements, each chunk squared in one scratch buffer and summed.
    """

    def __init__(
        self, views: list[SumsqView], device: torch.device, *, require_aligned: bool = False
    ) -> None:
        self.device = device
        self.triton = use_triton(device)
        by_dtype: dict[torch.dtype, list[Piece]] = {}
        for v in views:
            check_stream("x", v.stream, GRAD_DTYPES, v.num_buckets, v.shard_numel, device)
            buf = Buffer((v.stream,), v.num_buckets, v.shard_numel, 0)
            by_dtype.setdefault(v.stream.tensor.dtype, []).extend(pieces_of(buf))
        self.tables: list[Table] = []
        self.chunks: list[list[torch.Tensor]] = []
        for pieces in by_dtype.values():
            if not pieces:
                continue
            if self.triton:
                t = build_table(pieces, BLOCK, device)
                assert t.pieces.shape[1] == SUMSQ_WIDTH
                if require_aligned and not t.aligned:
                    raise ValueError("a grad piece is not 16-element aligned")
                self.tables.append(t)
            else:
                self.chunks += _pack(
                    [p.tensors[0][p.starts[0] : p.starts[0] + p.numel] for p in pieces]
                )
        self.programs = sum(t.programs for t in self.tables)
        self.launches = len(self.tables) if self.triton else len({c[0].dtype for c in self.chunks})
        self._scratch: torch.Tensor | None = None
        self._partial: torch.Tensor | None = None  # the Triton path's per-program partial sums
        self._outs: list[torch.Tensor] = []  # each table's slice of them

    def __call__(self) -> torch.Tensor:
        """One-element fp32 tensor: the sum of squares (inf/nan if any element is)."""
        if self.triton:
            return self._triton()
        for _ in range(self.launches):
            count_launch("sumsq")
        if not self.chunks:
            return torch.zeros(1, dtype=torch.float32, device=self.device)
        # torch.sum, not torch.dot: MKL's sdot accumulates each SIMD lane sequentially over the
        # thread's share, an error growing with n / (lanes * threads) (5e-6 relative at 1e5
        # elements with 2 threads), where torch's CPU sum is a cascade (tree) summation within
        # ~log2(n) ulps for any thread count, as the kernel's in-block tree then sum over
        # partials. Chunk sums are summed as a tree too.
        if self._scratch is None:
            self._scratch = torch.empty(
                max(sum(t.numel() for t in c) for c in self.chunks),
                dtype=torch.float32,
                device=self.device,
            )
        sums = []
        for c in self.chunks:
            n = sum(t.numel() for t in c)
            s = self._scratch[:n]
            torch.cat(c, out=s)  # bf16/fp16 views are cast on the way in
            sums.append(s.square_().sum())
        return torch.stack(sums).sum().reshape(1)

    def _triton(self) -> torch.Tensor:
        if self._partial is None:  # made once, with each table's slice: no op per step
            self._partial = torch.empty(
                max(self.programs, 1), dtype=torch.float32, device=self.device
            )
            starts = itertools.accumulate((t.programs for t in self.tables), initial=0)
            self._outs = [self._partial[s:] for s in starts][: len(self.tables)]
        partial = self._partial
        if not self.tables:
            return partial.zero_()[:1]
        with device_guard(self.device):
            for t, out in zip(self.tables, self._outs):
                count_launch("sumsq")
                _grouped_sumsq_kernel[(t.programs,)](
                    t.bases[0],
                    t.pieces,
                    t.prog_piece,
                    out,
                    ALIGNED=t.aligned,
                    BLOCK=BLOCK,
                    num_warps=NUM_WARPS,
                    enable_fp_fusion=ENABLE_FP_FUSION,
                )
        return partial.sum().reshape(1)


def _pack(views: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Views cut into chunks of at most `_CHUNK` elements, in order (big views are split)."""
    chunks: list[list[torch.Tensor]] = [[]]
    room = _CHUNK
    for v in views:
        while v.numel():
            if room == 0:
                chunks.append([])
                room = _CHUNK
            part, v = v[:room], v[room:]
            chunks[-1].append(part)
            room -= part.numel()
    return [c for c in chunks if c]


def sumsq(
    x: torch.Tensor | Strided, *, num_buckets: int = 1, shard_numel: int | None = None
) -> torch.Tensor:
    """fp32 one-element tensor: sum of squares over one shard (inf/nan if any is non-finite)."""
    v = SumsqView(x, num_buckets, shard_numel)
    return GroupedSumsq([v], v.stream.tensor.device)()
