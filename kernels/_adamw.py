"""Fused AdamW over a rank's flat shards: one pass, 28 bytes per param with bf16 grads and output.

Reads fp32 master, grad (fp32/bf16/fp16), exp_avg, exp_avg_sq; writes master, exp_avg, exp_avg_sq
and optionally a bf16/fp16/fp32 copy of the new params.

Grouped launch. `GroupedAdamW` is built once over every flat buffer of a rank (all param groups,
all stage-3 units, all buckets) and updates them all with one launch per (grad dtype, output
dtype): a piece table (kernels/_table.py) tells each program which piece it updates and which
hyper-parameter row it reads. The rows (one per param group, `rows.RowCol`) are computed once per
step on the device from the lr vector, the step count and the grad scale, in fp64 (by one small
launch with the Triton kernels, by torch ops on the torch path: kernels/_rows.py), so the update
kernel itself has no fp64 instruction.
Nothing is read back to the host: a step has no host sync and can be captured in a CUDA graph.

Memory modes (kernels/_memory_modes.py: bf16 masters with Kahan comp or stochastic rounding, bf16 or
blockwise-int8 states) are constexpr variants (MASTER_MODE, STATE_MODE) of the same kernel and
the same launch: the mode is the optimizer's, so a step is still one launch per (grad dtype, out
dtype). Their extra streams (comp, the int8 scales) and bf16-sr's index offset are extra columns
of the piece table (`table.AdamWCol`); the default variant's table and code are unchanged.

Layout. A buffer's streams each cover `num_buckets` pieces of `shard_numel` elements described by
`Strided(tensor, stride, base)`: piece k at `tensor[k * stride + base:][:shard_numel]`. The local
shard is `stride=shard_numel, base=0`; a rank's pieces of a full bucketed buffer (the model's
param buffer, an in-place reduce-scattered grad buffer) are `stride=bucket_numel,
base=rank*shard_numel`. exp_avg and exp_avg_sq are always local.

[Note: GPU vs interpreter numerics] Compiled with FMA contraction off (_launch.ENABLE_FP_FUSION,
free in a memory-bound kernel) and sqrt_rn/div_rn, every fp32 operation of the update is one IEEE
round-to-nearest op, as numpy does it in the interpreter: the two agree bitwise. The per-step row
(step size, bias correction) is computed by torch ops in fp64 and rounded once to fp32, the same on
every path. Not measured on a GPU here; the PTX is checked for the exact forms
(tests/kernels/test_compile.py). The torch path (torch._fused_adamw_) orders the math differently:
within 2 * 8 ulps of the interpreter (tests/kernels/test_kernels.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fusedzero.kernels import _adamw_torch as adamw_torch, _rows as hp_rows, _table as table
from fusedzero.kernels._launch import (
    ENABLE_FP_FUSION,
    GRAD_DTYPES,
    Hyper,
    Strided,
    as_strided,
    check_stream,
    count_launch,
    device_guard,
    use_triton,
)
from fusedzero.kernels._memory_modes import (
    MASTER_CODE,
    QBLOCK,
    STATE_CODE,
    STATE_DTYPES,
    check_mode_buffers,
    check_modes,
    load_master,
    load_state,
    round_to_bf16 as _round_to_bf16,
    store_master,
    store_state,
)
from fusedzero.kernels._memory_modes_torch import ModeCombo
from fusedzero.kernels._rows import Rows, check_consts
from fusedzero.kernels._table import (
    ADAMW_MODE_WIDTH,
    ADAMW_WIDTH,
    AdamWCol,
    Buffer,
    Piece,
    Table,
    build_table,
    pieces_of,
)

# 1024 elements per program with 8 warps: 4 elements per thread, one 128-bit access per fp32
# stream. With 4 warps (8 per thread) Triton gives 16-bit streams an 8-element layout and fp32
# ones a 4-element layout, and converts between them through shared memory; at 4 per thread
# every stream has the same layout (16-bit accesses are 64-bit) and no conversion is needed
# (tests/kernels/test_compile.py checks the PTX for st.shared).
BLOCK = 1024
NUM_WARPS = 8
# The kernel and the interpreter agree bitwise: see [Note: GPU vs interpreter numerics].
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The default mode's streams (a launch without an output has OUT's column, at 0) and a memory
# mode's; the int8 scales (one per QBLOCK elements) need not be 16-element aligned.
_DEFAULT_STREAMS = AdamWCol.OUT.stream + 1
_MODE_STREAMS = tuple(c for c in AdamWCol if AdamWCol.MASTER <= c < AdamWCol.SR_OFFSET)
_LOOSE = (AdamWCol.EXP_AVG_SCALE.stream, AdamWCol.EXP_AVG_SQ_SCALE.stream)
_WIDTH = tl.constexpr(ADAMW_WIDTH)
_MODE_WIDTH = tl.constexpr(ADAMW_MODE_WIDTH)
_NCOLS = tl.constexpr(hp_rows.NCOLS)
_QBLOCK = tl.constexpr(QBLOCK)
assert BLOCK % QBLOCK == 0  # a program's scales are whole quantization blocks


# Loads and stores of master and the moments are the memory modes' helpers
# (kernels/_memory_modes.py): a mode (a bf16 master, bf16 or blockwise-int8 moments) is a constexpr
# variant of them, local to them. In the default mode (0, 0) they are one plain load/store per
# stream.
@triton.jit
def _store_out(ptr, idx, p, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        o = _round_to_bf16(p)
    else:
        o = p.to(ptr.dtype.element_ty)
    tl.store(ptr + idx, o, mask=mask)


@triton.jit
def _offset(col_ptr, ALIGNED: tl.constexpr):
    off = tl.load(col_ptr)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    return off


@triton.jit
def _grouped_adamw_kernel(
    # pointers: one base per stream kind, the piece table, the rows, the skip flag
    master_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    out_ptr,
    piece_ptr,
    prog_piece_ptr,
    row_ptr,
    skip_ptr,
    # memory modes: Kahan comp and int8 scale bases, the SR seed and step (unused in mode 0, 0)
    comp_ptr,
    exp_avg_scale_ptr,
    exp_avg_sq_scale_ptr,
    seed_ptr,
    step_ptr,
    # flags
    HAS_OUT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    MASTER_MODE: tl.constexpr = 0,
    STATE_MODE: tl.constexpr = 0,
):
    # One grid axis over every program of every piece (CUDA caps axes 1-2 at 65535); int64
    # element offsets: a stream may pass 2**31 elements.
    prog = tl.program_id(0).to(tl.int64)
    piece = tl.load(prog_piece_ptr + prog).to(tl.int64)
    # The piece's table row (kernels/_table.py `AdamWCol`): the default mode's or a memory mode's.
    if MASTER_MODE == 0 and STATE_MODE == 0:
        entry = piece_ptr + piece * _WIDTH
    else:
        entry = piece_ptr + piece * _MODE_WIDTH
    numel = _offset(entry + table.AdamWCol.NUMEL, ALIGNED)
    blk = prog - tl.load(entry + table.AdamWCol.FIRST)
    idx = blk * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    m_base = master_ptr + _offset(entry + table.AdamWCol.MASTER, ALIGNED)
    g_base = grad_ptr + _offset(entry + table.AdamWCol.GRAD, ALIGNED)
    a_base = exp_avg_ptr + _offset(entry + table.AdamWCol.EXP_AVG, ALIGNED)
    s_base = exp_avg_sq_ptr + _offset(entry + table.AdamWCol.EXP_AVG_SQ, ALIGNED)
    # This piece's param group's row of per-step hyper-parameters (kernels/_rows.py `RowCol`).
    hp = row_ptr + tl.load(entry + table.AdamWCol.ROW) * _NCOLS
    step_size = tl.load(hp + hp_rows.RowCol.STEP_SIZE)
    bc2_sqrt = tl.load(hp + hp_rows.RowCol.BC2_SQRT)
    decay = tl.load(hp + hp_rows.RowCol.DECAY)
    # (BETA1 is not read: m moves by (1 - beta1) * (g - m), as torch's lerp.)
    one_minus_beta1 = tl.load(hp + hp_rows.RowCol.ONE_MINUS_BETA1)
    beta2 = tl.load(hp + hp_rows.RowCol.BETA2)
    one_minus_beta2 = tl.load(hp + hp_rows.RowCol.ONE_MINUS_BETA2)
    eps = tl.load(hp + hp_rows.RowCol.EPS)
    grad_mult = tl.load(hp + hp_rows.RowCol.GRAD_MULT)  # grad scale, negated to maximize
    # Mode streams: the comp at the local offset, each state's scales at local offset / QBLOCK
    # (a program's BLOCK is whole quantization blocks), bf16-sr's index offset.
    c_base = comp_ptr
    sr_base = 0
    if MASTER_MODE == 1:
        c_base = comp_ptr + _offset(entry + table.AdamWCol.COMP, ALIGNED)
    if MASTER_MODE == 2:
        sr_base = tl.load(entry + table.AdamWCol.SR_OFFSET)
    qa = exp_avg_scale_ptr
    qs = exp_avg_sq_scale_ptr
    if STATE_MODE == 2:
        qa = exp_avg_scale_ptr + tl.load(entry + table.AdamWCol.EXP_AVG_SCALE)
        qs = exp_avg_sq_scale_ptr + tl.load(entry + table.AdamWCol.EXP_AVG_SQ_SCALE)
    qidx, qfirst = _qblocks(blk, BLOCK)

    p = load_master(m_base, idx, c_base, idx, mask, MASTER_MODE)
    g = tl.load(g_base + idx, mask=mask).to(tl.float32) * grad_mult
    m = load_state(a_base, qa, idx, mask, qidx, qfirst < numel, STATE_MODE, True, BLOCK)
    v = load_state(s_base, qs, idx, mask, qidx, qfirst < numel, STATE_MODE, False, BLOCK)

    # The order of operations follows torch.optim.AdamW's single-tensor path. sqrt_rn / div_rn:
    # IEEE round-to-nearest, where tl.sqrt compiles to sqrt.approx.ftz and `/` to div.full.
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)

    # A skipped step (non-finite grads) masks the stores only: the loads need not wait for it.
    limit = tl.where(tl.load(skip_ptr) == 0, numel, 0)
    keep = idx < limit
    qkeep = qfirst < limit
    # The update used this step's fresh fp32 m and v; only what is stored is rounded/quantized.
    store_master(m_base, idx, c_base, idx, keep, p, seed_ptr, step_ptr, sr_base, MASTER_MODE)
    store_state(a_base, qa, idx, keep, qidx, qkeep, m, STATE_MODE, True, BLOCK)
    store_state(s_base, qs, idx, keep, qidx, qkeep, v, STATE_MODE, False, BLOCK)
    if HAS_OUT:  # fp32 master only
        _store_out(out_ptr + _offset(entry + table.AdamWCol.OUT, ALIGNED), idx, p, keep, OUT_BF16)


@triton.jit
def _qblocks(blk, BLOCK: tl.constexpr):
    """This program's quantization blocks: their scale indices from the piece's scale base and
    their first elements (a piece is whole blocks, so a block is wholly in or out)."""
    j = tl.arange(0, BLOCK // _QBLOCK)
    return blk * (BLOCK // _QBLOCK) + j, blk * BLOCK + j * _QBLOCK


class AdamWBuffer(NamedTuple):
    """One buffer for `GroupedAdamW`: its streams, layout and hyper-parameter row (param group),
    and a memory mode's own buffers (kernels/_memory_modes.py): the Kahan comp (local layout), the
    int8 scales (one fp32 per QBLOCK local elements) and the buffer's offset in bf16-sr's
    stream."""

    master: torch.Tensor | Strided
    grad: torch.Tensor | Strided
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: torch.Tensor | Strided | None
    num_buckets: int
    shard_numel: int
    row: int
    comp: torch.Tensor | None = None
    exp_avg_scale: torch.Tensor | None = None
    exp_avg_sq_scale: torch.Tensor | None = None
    sr_offset: int = 0


def _pieces(
    b: AdamWBuffer, ms: Strided, gs: Strided, os_: Strided | None, default: bool
) -> list[Piece]:
    """The buffer's pieces, their streams in `AdamWCol` order (master, grad, exp_avg, exp_avg_sq
    and out if any); with a memory mode every piece has every stream (None when absent: the
    comp and the two scales, at the local offset and local offset / QBLOCK), then the SR offset
    of its first local element."""
    S = b.shard_numel
    local = [Strided(t, S, 0) for t in (b.exp_avg, b.exp_avg_sq)]
    streams = (ms, gs, *local) + ((os_,) if os_ is not None else ())
    if default:
        return pieces_of(Buffer(streams, b.num_buckets, S, b.row))
    out = []
    for p in pieces_of(Buffer(streams, b.num_buckets, S, b.row)):
        lo = p.starts[AdamWCol.EXP_AVG.stream]  # exp_avg is local: the piece's first element
        q = lo // QBLOCK
        mode = {
            AdamWCol.COMP: (b.comp, lo),
            AdamWCol.EXP_AVG_SCALE: (b.exp_avg_scale, q),
            AdamWCol.EXP_AVG_SQ_SCALE: (b.exp_avg_sq_scale, q),
        }
        cols = [
            mode.get(c)
            or (
                (p.tensors[c.stream], p.starts[c.stream])
                if c.stream < len(p.tensors)
                else (None, 0)
            )
            for c in _MODE_STREAMS
        ]
        out.append(
            Piece(
                tuple(t for t, _ in cols),
                tuple(st for _, st in cols),
                p.numel,
                p.row,
                (b.sr_offset + lo,),
            )
        )
    return out


class GroupedAdamW:
    """Every buffer of a rank updated by one launch per (grad dtype, out dtype), tables built once.

    A "launch" is one `_grouped_adamw_kernel` launch on CUDA (and in the interpreter); on the
    torch path (CPU) it is one grouped call: in the default mode one `torch._fused_adamw_` per
    row with tensor lists over all its buffers and pieces, in a memory mode one vectorised pass
    per row over all its pieces (_memory_modes_torch.py). `LAUNCHES["adamw"]` counts them. The
    memory mode (`master_mode`, `states`, bf16-sr's `seed`) is the optimizer's: one for every
    buffer.
    Every check of the streams is done here, once; `require_aligned` refuses tables the kernel
    could not access with 128-bit vectors (what the optimizer's layout guarantees).
    """

    def __init__(
        self,
        buffers: list[AdamWBuffer],
        device: torch.device,
        num_rows: int,
        *,
        require_aligned: bool = False,
        master_mode: str = "fp32",
        states: str = "fp32",
        seed: torch.Tensor | None = None,
    ) -> None:
        check_modes(master_mode, states)
        self.device = device
        self.triton = use_triton(device)
        self.modes = (MASTER_CODE[master_mode], STATE_CODE[states])
        default = self.modes == (0, 0)
        self.seed = seed
        by_combo: dict[tuple[torch.dtype, torch.dtype | None], list[Piece]] = {}
        for b in buffers:
            _check(b, device, num_rows, master_mode, states, seed)
            ms, gs = as_strided(b.master, b.shard_numel), as_strided(b.grad, b.shard_numel)
            os_ = None if b.out is None else as_strided(b.out, b.shard_numel)
            key = (gs.tensor.dtype, None if os_ is None else os_.tensor.dtype)
            by_combo.setdefault(key, []).extend(_pieces(b, ms, gs, os_, default))
        self.launches: list[tuple[tuple, Table | adamw_torch.Combo | ModeCombo]] = []
        for key, pieces in by_combo.items():
            if not pieces:
                continue
            if self.triton:
                t = build_table(pieces, BLOCK, device, streams=_DEFAULT_STREAMS, loose=_LOOSE)
                assert t.pieces.shape[1] == (ADAMW_WIDTH if default else ADAMW_MODE_WIDTH)
                if require_aligned and not t.aligned:
                    raise ValueError(
                        "a piece offset or length is not a multiple of 16 elements: "
                        "the layout must keep shards, strides and bases aligned"
                    )
                self.launches.append((key, t))
            elif default:
                self.launches.append((key, adamw_torch.Combo(pieces, num_rows)))
            else:
                self.launches.append((key, ModeCombo(pieces, master_mode, states, seed)))
        self.rows = Rows(num_rows, device) if self.triton or not default else None

    def step(
        self,
        hyper: Hyper,
        step: torch.Tensor,
        grad_scale: torch.Tensor,
        skip: torch.Tensor,
        rows_written: bool = False,
    ) -> None:
        """One update of every buffer: `step` (already counted), `grad_scale` (multiplies the
        grad) and `skip` (non-zero: leave everything untouched) are one-element device tensors.
        `rows_written`: `self.rows` already holds this step's rows (the step's scalar launch
        wrote them, kernels/_step_scalars.py)."""
        if not self.launches:
            return
        if self.rows is None:
            check_consts(hyper.consts)
            for _, combo in self.launches:
                count_launch("adamw")
                combo.run(hyper, step, grad_scale, skip)
            return
        rows = self.rows.rows if rows_written else self.rows.update(hyper, step, grad_scale)
        if not self.triton:
            for _, combo in self.launches:
                count_launch("adamw")
                combo.run(rows, step, skip)
            return
        mm, sm = self.modes
        with device_guard(self.device):
            for (_, out_dtype), t in self.launches:
                count_launch("adamw")
                has_out = out_dtype is not None
                # Streams a launch does not have get a never-accessed stand-in pointer.
                b = [x if x is not None else t.bases[0] for x in t.bases]
                b += [t.bases[0]] * (len(_MODE_STREAMS) - len(b))
                _grouped_adamw_kernel[(t.programs,)](
                    *b[:_DEFAULT_STREAMS],
                    t.pieces,
                    t.prog_piece,
                    rows,
                    skip,
                    *b[_DEFAULT_STREAMS:],
                    skip if self.seed is None else self.seed,
                    step,
                    HAS_OUT=has_out,
                    OUT_BF16=out_dtype == torch.bfloat16,
                    ALIGNED=t.aligned,
                    BLOCK=BLOCK,
                    MASTER_MODE=mm,
                    STATE_MODE=sm,
                    num_warps=NUM_WARPS,
                    enable_fp_fusion=ENABLE_FP_FUSION,
                )


def _check(
    b: AdamWBuffer,
    device: torch.device,
    num_rows: int,
    master_mode: str,
    states: str,
    seed: torch.Tensor | None,
) -> None:
    nb, S = b.num_buckets, b.shard_numel
    m_dtype = torch.float32 if master_mode == "fp32" else torch.bfloat16
    check_stream("master", as_strided(b.master, S), (m_dtype,), nb, S, device)
    check_stream("grad", as_strided(b.grad, S), GRAD_DTYPES, nb, S, device)
    for name, t, dt in zip(
        ("exp_avg", "exp_avg_sq"), (b.exp_avg, b.exp_avg_sq), STATE_DTYPES[states]
    ):
        check_stream(name, Strided(t, S, 0), (dt,), nb, S, device)
    check_mode_buffers(
        master_mode,
        states,
        out=b.out,
        exp_avg_scale=b.exp_avg_scale,
        exp_avg_sq_scale=b.exp_avg_sq_scale,
        kahan=b.comp,
        seed=seed,
        num_buckets=nb,
        shard_numel=S,
        device=device,
    )
    if b.out is not None:
        check_stream("out", as_strided(b.out, S), OUT_DTYPES, nb, S, device)
    if not 0 <= b.row < num_rows:
        raise ValueError(f"row {b.row} out of range for {num_rows} hyper-parameter rows")
