"""Piece tables: many buffers of one rank as one kernel launch, built once.

A *piece* is a run of elements every stream of a buffer holds contiguously: one bucket's piece of
a bucketed buffer, or a whole buffer when every stream is the rank's contiguous local shard. A
grouped launch covers every piece of every buffer it was given; each program handles `BLOCK`
elements of one piece and finds it with one load (`prog_piece[program id]`).

Columns. A table row (int64) is the piece's `Col` (numel, first program, hyper-parameter row),
then one element offset per stream, then the piece's ints. The kernels' layouts are named here,
in one place (`AdamWCol`, `SumsqCol`, `MuonMomentumCol`, `MuonUpdateCol`), and read by name by
the builders, the torch paths and the `@triton.jit` kernels (`table.AdamWCol.NUMEL`: Triton
resolves a module's attributes while it compiles, so the names cost nothing at run time).

Addresses. Each stream kind (master, grad, ...) of a launch has one *base tensor* passed as a
kernel argument, the one of that kind at the lowest address, and the table holds each piece's
int64 element offset from it. Every tensor of one kind has the same dtype, so an offset is exact
(the address difference is a multiple of the element size). The runtime specialises a base
pointer as 16-byte aligned (CUDA caching-allocator blocks are 512-byte aligned); the optimizer's
layout (fusedzero/_layout.py) makes every shard, stride and base a multiple of 128 elements, so
every offset and piece length is a multiple of 16 elements and the launcher compiles with
`ALIGNED` (the kernel then declares them `tl.multiple_of(_, 16)`, which keeps 128-bit accesses).
A table that is not aligned (a user's odd views through `adamw_step`) runs the same kernel
without the hints. A plan that needs it (`require_aligned`) refuses an unaligned table.

The tables hold addresses: a tensor a plan was built over must never be replaced (only written
in place) while the plan lives; the optimizer's buffers are built once and loaded with `copy_`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import torch

from fusedzero.kernels._launch import MAX_GRID_X, Strided

ALIGN = 16  # elements: what `tl.multiple_of` may claim for every offset and piece length
# Table entries are int64 element offsets and counts: a flat buffer passes 2**31 elements at
# 70B params (never int32); `prog_piece` is int32, a piece index (pieces < 2**31).
INT64_MAX = 2**63 - 1


def check_entry(name: str, value: int) -> None:
    """An offset or count the kernels read from the table: exact in int64, never negative."""
    if not 0 <= value <= INT64_MAX:
        raise ValueError(
            f"table {name} {value} does not fit the table's int64 (0 <= value <= 2**63 - 1)"
        )


class Col(IntEnum):
    """The columns every table row starts with; stream j's offset is column `STREAMS + j`."""

    NUMEL = 0  # elements in the piece
    FIRST = 1  # its first program: program p does block p - FIRST of piece prog_piece[p]
    ROW = 2  # its hyper-parameter row (the param group)
    STREAMS = 3


class AdamWCol(IntEnum):
    """A row of a grouped AdamW launch's table: `Col`, then the streams in the order of a
    Piece's tensors, then bf16-sr's index offset (the piece's one int). The default mode's rows
    end after OUT (`ADAMW_WIDTH`; OUT is 0 without an output); a memory mode's have every column
    (`ADAMW_MODE_WIDTH`): the Kahan comp at the local offset, each int8 state's scales at
    local offset / QBLOCK, and the offset of the piece's first element in bf16-sr's stream."""

    NUMEL = Col.NUMEL
    FIRST = Col.FIRST
    ROW = Col.ROW
    MASTER = 3
    GRAD = 4
    EXP_AVG = 5
    EXP_AVG_SQ = 6
    OUT = 7
    COMP = 8
    EXP_AVG_SCALE = 9
    EXP_AVG_SQ_SCALE = 10
    SR_OFFSET = 11

    @property
    def stream(self) -> int:
        """A stream column's index in a Piece's tensors and starts."""
        return self - Col.STREAMS


ADAMW_WIDTH = AdamWCol.OUT + 1
ADAMW_MODE_WIDTH = len(AdamWCol)


class SumsqCol(IntEnum):
    """A row of a sum-of-squares launch's table: `Col`, then the grad stream."""

    NUMEL = Col.NUMEL
    FIRST = Col.FIRST
    ROW = Col.ROW
    X = 3


SUMSQ_WIDTH = len(SumsqCol)


class MuonMomentumCol(IntEnum):
    """A row of a Muon momentum launch's table (kernels/_muon.py): `Col`, then the grad, the
    momentum buffer and the Newton-Schulz input streams."""

    NUMEL = Col.NUMEL
    FIRST = Col.FIRST
    ROW = Col.ROW
    GRAD = 3
    BUF = 4
    NS_IN = 5


class MuonUpdateCol(IntEnum):
    """A row of a Muon update launch's table (kernels/_muon.py): `Col`, then the fp32 master,
    the orthogonalised update and the low-precision param copy (0 without one)."""

    NUMEL = Col.NUMEL
    FIRST = Col.FIRST
    ROW = Col.ROW
    MASTER = 3
    UPDATE = 4
    OUT = 5


MUON_MOMENTUM_WIDTH = len(MuonMomentumCol)
MUON_UPDATE_WIDTH = len(MuonUpdateCol)
assert AdamWCol.MASTER == SumsqCol.X == Col.STREAMS


class Buffer(NamedTuple):
    """One buffer's streams (each covering `num_buckets` pieces of `shard_numel`) and its row."""

    streams: tuple[Strided, ...]
    num_buckets: int
    shard_numel: int
    row: int


class Piece(NamedTuple):
    """A run of `numel` elements at `starts[j]` of stream j's tensor, for hyper-parameter `row`.
    A None tensor is a stream this launch does not have (offset 0, no base); `ints` are extra
    integer columns written after every offset (e.g. bf16-sr's random-stream offset)."""

    tensors: tuple[torch.Tensor | None, ...]
    starts: tuple[int, ...]
    numel: int
    row: int
    ints: tuple[int, ...] = ()


def pieces_of(buf: Buffer) -> list[Piece]:
    """The buffer's pieces: one when every stream is local and contiguous, else one per bucket."""
    nb, S = buf.num_buckets, buf.shard_numel
    if nb == 0 or S == 0:
        return []
    tensors = tuple(s.tensor for s in buf.streams)
    if all(s.stride == S and s.base == 0 for s in buf.streams):
        return [Piece(tensors, (0,) * len(tensors), nb * S, buf.row)]
    return [
        Piece(tensors, tuple(k * s.stride + s.base for s in buf.streams), S, buf.row)
        for k in range(nb)
    ]


class Table(NamedTuple):
    """A launch's device-side table. `pieces` rows (int64): `Col`, one offset per stream, the
    ints; `prog_piece`: the piece of each program (int32). `bases[j]` is None for a stream the
    launch does not have."""

    bases: tuple[torch.Tensor | None, ...]
    pieces: torch.Tensor
    prog_piece: torch.Tensor
    programs: int
    aligned: bool


def _base(pieces: list[Piece], j: int) -> torch.Tensor | None:
    ts = [p.tensors[j] for p in pieces]
    if all(t is None for t in ts):
        return None
    if any(t is None for t in ts):
        raise ValueError(f"stream {j}: present in some pieces of a launch and absent in others")
    return min(ts, key=lambda t: t.data_ptr())


def build_table(
    pieces: list[Piece],
    block: int,
    device: torch.device,
    streams: int | None = None,
    loose: tuple[int, ...] = (),
) -> Table:
    """The table of `pieces` (non-empty, all with the same number of streams). Rows have at
    least `streams` stream columns (missing ones padded with 0 before the ints: a kernel with a
    fixed row shape). Streams in `loose` (indices) need not be 16-element aligned (e.g. int8
    scales, one per 128 elements)."""
    k = len(pieces[0].tensors)
    bases = tuple(_base(pieces, j) for j in range(k))
    rows, counts, first, aligned = [], [], 0, True
    for p in pieces:
        offs = []
        for j, (t, start) in enumerate(zip(p.tensors, p.starts)):
            b = bases[j]
            if t is None or b is None:
                offs.append(0)
                continue
            diff = t.data_ptr() - b.data_ptr()
            size = t.element_size()
            if diff % size or t.dtype != b.dtype:
                raise ValueError(
                    f"stream {j}: tensors of one launch must share a dtype "
                    f"({t.dtype} vs {b.dtype}) and element grid"
                )
            offs.append(diff // size + start)
            check_entry(f"stream {j} offset", offs[-1])
            aligned = aligned and (j in loose or offs[-1] % ALIGN == 0)
        check_entry("numel", p.numel)
        nprog = -(-p.numel // block)
        aligned = aligned and p.numel % ALIGN == 0
        pad = [0] * max(0, (streams or k) - k)
        row = [0] * Col.STREAMS
        row[Col.NUMEL], row[Col.FIRST], row[Col.ROW] = p.numel, first, p.row
        rows.append(row + offs + pad + list(p.ints))
        counts.append(nprog)
        first += nprog
    if first > MAX_GRID_X:
        raise ValueError(
            f"{first} programs of {block} elements exceed CUDA's grid limit "
            f"{MAX_GRID_X}; use larger buckets"
        )
    aligned = aligned and all(
        b.data_ptr() % 16 == 0 for j, b in enumerate(bases) if b is not None and j not in loose
    )
    table = torch.tensor(rows, dtype=torch.int64)
    prog_piece = torch.repeat_interleave(
        torch.arange(len(pieces), dtype=torch.int32), torch.tensor(counts)
    )
    return Table(bases, table.to(device), prog_piece.to(device), first, aligned)
