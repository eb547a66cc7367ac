"""Fused AdamW over a rank's flat shards: one pass, 28 bytes per param with bf16 grads and output.

Reads fp32 master, grad (fp32/bf16/fp16), exp_avg, exp_avg_sq; writes master, exp_avg, exp_avg_sq
and optionally a bf16/fp16/fp32 copy of the new params.

Grouped launch. `GroupedAdamW` is built once over every flat buffer of a rank (all param groups,
all stage-3 units, all buckets) and updates them all with one launch per (grad dtype, output
dtype): a piece table (kernels/table.py) tells each program which piece it updates and which
hyper-parameter row it reads. The rows (one per param group, `ROW` below) are computed once per
step on the device from the lr vector, the step count and the grad scale by a few vectorised
torch ops (`adamw_rows`, in fp64 there), so the kernel itself has no fp64 instruction. Nothing is
read back to the host: a step has no host sync and can be captured in a CUDA graph.

Layout. A buffer's streams each cover `num_buckets` pieces of `shard_numel` elements described by
`Strided(tensor, stride, base)`: piece k at `tensor[k * stride + base:][:shard_numel]`. The local
shard is `stride=shard_numel, base=0`; a rank's pieces of a full bucketed buffer (the model's
param buffer, an in-place reduce-scattered grad buffer) are `stride=bucket_numel,
base=rank*shard_numel`. exp_avg and exp_avg_sq are always local.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fusedzero.kernels import adamw_torch
from fusedzero.kernels._launch import (ENABLE_FP_FUSION, GRAD_DTYPES, Hyper, Strided,
                                       as_strided, check_scalar, check_stream, copy_from_host,
                                       count_launch, device_guard, shard_numel_of, use_triton)
from fusedzero.kernels.adamw_modes import adamw_step_modes
from fusedzero.kernels.table import Buffer, Table, build_table, pieces_of

# 1024 elements per program with 8 warps: 4 elements per thread, one 128-bit access per fp32
# stream. With 4 warps (8 per thread) Triton gives 16-bit streams an 8-element layout and fp32
# ones a 4-element layout, and converts between them through shared memory; at 4 per thread
# every stream has the same layout (16-bit accesses are 64-bit) and no conversion is needed
# (tests/test_compile.py checks the PTX for st.shared).
BLOCK = 1024
NUM_WARPS = 8
# [Note: GPU vs interpreter numerics] Compiled with FMA contraction off (_launch.ENABLE_FP_FUSION,
# free in a memory-bound kernel) and sqrt_rn/div_rn, every fp32 operation of the update is one IEEE
# round-to-nearest op, as numpy does it in the interpreter: the two agree bitwise. The per-step
# row (step size, bias correction) is computed by torch ops in fp64 and rounded once to fp32, the
# same on every path. Not measured on a GPU here; the PTX is checked for the exact forms
# (tests/test_compile.py). The torch path (torch._fused_adamw_) orders the math differently:
# within 2 * 8 ulps of the interpreter (tests/test_kernels.py).
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The per-step row of a param group, as the kernel reads it (fp32).
ROW = ("step_size", "bc2_sqrt", "decay", "beta1", "one_minus_beta1", "beta2",
       "one_minus_beta2", "eps", "grad_mult")
NCOLS = len(ROW)
_STREAMS = ("master", "grad", "exp_avg", "exp_avg_sq", "out")


@triton.jit
def _round_to_bf16(x):
    # Round-to-nearest-even fp32 -> bf16 in integer ops. The GPU's cvt.rn does the same, but the
    # Triton interpreter truncates; spelling it out gives the same rounding on both (integer ops
    # are exact, so the bf16 copy is bitwise the rounded master on both).
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    # A NaN stays a (quiet) NaN: the carry could otherwise wrap its payload to +-0 or inf.
    bits = tl.where(x != x, bits | 0x400000, rounded)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


# Loads and stores of master and the moments live in these helpers: a memory mode (a bf16 master,
# blockwise-quantised moments) is a constexpr variant of them, local to them.
@triton.jit
def _load_master(ptr, idx, mask):
    return tl.load(ptr + idx, mask=mask).to(tl.float32)


@triton.jit
def _store_master(ptr, idx, p, mask):
    tl.store(ptr + idx, p, mask=mask)


@triton.jit
def _load_moments(m_ptr, v_ptr, idx, mask):
    return tl.load(m_ptr + idx, mask=mask), tl.load(v_ptr + idx, mask=mask)


@triton.jit
def _store_moments(m_ptr, v_ptr, idx, m, v, mask):
    tl.store(m_ptr + idx, m, mask=mask)
    tl.store(v_ptr + idx, v, mask=mask)


@triton.jit
def _store_out(ptr, idx, p, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        o = _round_to_bf16(p)
    else:
        o = p.to(ptr.dtype.element_ty)
    tl.store(ptr + idx, o, mask=mask)


@triton.jit
def _offset(row_ptr, col, ALIGNED: tl.constexpr):
    off = tl.load(row_ptr + col)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    return off


@triton.jit
def _grouped_adamw_kernel(
    # pointers: one base per stream kind, the piece table, the rows, the skip flag
    master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr,
    piece_ptr, prog_piece_ptr, row_ptr, skip_ptr,
    # flags
    HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One grid axis over every program of every piece (CUDA caps axes 1-2 at 65535); int64
    # element offsets: a stream may pass 2**31 elements.
    prog = tl.program_id(0).to(tl.int64)
    piece = tl.load(prog_piece_ptr + prog).to(tl.int64)
    entry = piece_ptr + piece * 8  # master, grad, exp_avg, exp_avg_sq, out, numel, first, row
    numel = _offset(entry, 5, ALIGNED)
    idx = (prog - tl.load(entry + 6)) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    m_base = master_ptr + _offset(entry, 0, ALIGNED)
    g_base = grad_ptr + _offset(entry, 1, ALIGNED)
    a_base = exp_avg_ptr + _offset(entry, 2, ALIGNED)
    s_base = exp_avg_sq_ptr + _offset(entry, 3, ALIGNED)
    hp = row_ptr + tl.load(entry + 7) * 9  # the ROW of this piece's param group
    step_size = tl.load(hp + 0)
    bc2_sqrt = tl.load(hp + 1)
    decay = tl.load(hp + 2)
    beta1 = tl.load(hp + 3)
    one_minus_beta1 = tl.load(hp + 4)
    beta2 = tl.load(hp + 5)
    one_minus_beta2 = tl.load(hp + 6)
    eps = tl.load(hp + 7)
    grad_mult = tl.load(hp + 8)  # grad scale, negated to maximize

    p = _load_master(m_base, idx, mask)
    g = tl.load(g_base + idx, mask=mask).to(tl.float32) * grad_mult
    m, v = _load_moments(a_base, s_base, idx, mask)

    # The order of operations follows torch.optim.AdamW's single-tensor path. sqrt_rn / div_rn:
    # IEEE round-to-nearest, where tl.sqrt compiles to sqrt.approx.ftz and `/` to div.full.
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)

    # A skipped step (non-finite grads) masks the stores only: the loads need not wait for it.
    keep = idx < tl.where(tl.load(skip_ptr) == 0, numel, 0)
    _store_master(m_base, idx, p, keep)
    _store_moments(a_base, s_base, idx, m, v, keep)
    if HAS_OUT:
        _store_out(out_ptr + _offset(entry, 4, ALIGNED), idx, p, keep, OUT_BF16)


class AdamWBuffer(NamedTuple):
    """One buffer for `GroupedAdamW`: its streams, layout and hyper-parameter row (param group)."""

    master: torch.Tensor | Strided
    grad: torch.Tensor | Strided
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: torch.Tensor | Strided | None
    num_buckets: int
    shard_numel: int
    row: int


def _check_consts(consts: tuple[tuple[float, float, float, float, bool], ...]) -> None:
    for beta1, beta2, *_ in consts:
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")


def _log(b: float) -> float:
    return math.log(b) if b > 0 else -math.inf


class _Rows:
    """The device rows of `ROW`, with the constant columns rewritten only when they change."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.rows = torch.zeros(n, NCOLS, dtype=torch.float32, device=device)
        # fp64 columns read per step: weight decay, sign, log beta1, log beta2.
        self.c64 = torch.zeros(n, 4, dtype=torch.float64, device=device)
        self.consts: tuple | None = None

    def update(self, hyper: Hyper, step: torch.Tensor, grad_scale: torch.Tensor) -> torch.Tensor:
        if hyper.consts != self.consts:
            _check_consts(hyper.consts)
            copy_from_host(self.rows[:, 3:8], [[b1, 1 - b1, b2, 1 - b2, eps]
                                               for b1, b2, eps, _, _ in hyper.consts])
            copy_from_host(self.c64, [[wd, -1.0 if mx else 1.0, _log(b1), _log(b2)]
                                      for b1, b2, _, wd, mx in hyper.consts])
            self.consts = hyper.consts
        adamw_rows(hyper.lr, self.c64, step, grad_scale, self.rows)
        return self.rows


def adamw_rows(lr: torch.Tensor, c64: torch.Tensor, step: torch.Tensor,
               grad_scale: torch.Tensor, rows: torch.Tensor) -> None:
    """The per-step columns of `rows` on the device, in fp64 rounded once to fp32: step_size =
    lr / (1 - beta1**step), bc2_sqrt = sqrt(1 - beta2**step), decay = 1 - lr * weight_decay,
    grad_mult = +-grad_scale. Bias corrections as -expm1(step * log(beta)): in fp32,
    1 - 0.999**1 would lose 4-5 digits to cancellation."""
    lr64 = lr.double()
    bc = torch.expm1(step.double() * c64[:, 2:4]).neg_()
    rows[:, 0].copy_(lr64 / bc[:, 0])
    rows[:, 1].copy_(bc[:, 1].sqrt_())
    rows[:, 2].copy_(1.0 - lr64 * c64[:, 0])
    rows[:, 8].copy_(c64[:, 1] * grad_scale.double())


class GroupedAdamW:
    """Every buffer of a rank updated by one launch per (grad dtype, out dtype), tables built once.

    A "launch" is one `_grouped_adamw_kernel` launch on CUDA (and in the interpreter); on the
    torch path (CPU) it is one grouped call that runs one `torch._fused_adamw_` per row with
    tensor lists over all its buffers and pieces. `LAUNCHES["adamw"]` counts them. Every check of
    the streams is done here, once; `require_aligned` refuses tables the kernel could not access
    with 128-bit vectors (what the optimizer's layout guarantees).
    """

    def __init__(self, buffers: list[AdamWBuffer], device: torch.device, num_rows: int, *,
                 require_aligned: bool = False) -> None:
        self.device = device
        self.triton = use_triton(device)
        by_combo: dict[tuple[torch.dtype, torch.dtype | None], list[Buffer]] = {}
        for b in buffers:
            _check(b, device, num_rows)
            ms, gs = as_strided(b.master, b.shard_numel), as_strided(b.grad, b.shard_numel)
            m_ = Strided(b.exp_avg, b.shard_numel, 0)
            v_ = Strided(b.exp_avg_sq, b.shard_numel, 0)
            os_ = None if b.out is None else as_strided(b.out, b.shard_numel)
            streams = (ms, gs, m_, v_) + ((os_,) if os_ is not None else ())
            key = (gs.tensor.dtype, None if os_ is None else os_.tensor.dtype)
            by_combo.setdefault(key, []).append(Buffer(streams, b.num_buckets, b.shard_numel,
                                                       b.row))
        self.launches: list[tuple[tuple, Table | adamw_torch.Combo]] = []
        for key, bufs in by_combo.items():
            pieces = [p for b in bufs for p in pieces_of(b)]
            if not pieces:
                continue
            if self.triton:
                t = build_table(pieces, BLOCK, device, streams=len(_STREAMS))
                if require_aligned and not t.aligned:
                    raise ValueError("a piece offset or length is not a multiple of 16 elements: "
                                     "the layout must keep shards, strides and bases aligned")
                self.launches.append((key, t))
            else:
                self.launches.append((key, adamw_torch.Combo(pieces, num_rows)))
        self.rows = _Rows(num_rows, device) if self.triton else None

    def step(self, hyper: Hyper, step: torch.Tensor, grad_scale: torch.Tensor,
             skip: torch.Tensor) -> None:
        """One update of every buffer: `step` (already counted), `grad_scale` (multiplies the
        grad) and `skip` (non-zero: leave everything untouched) are one-element device tensors."""
        if not self.launches:
            return
        if self.rows is None:
            _check_consts(hyper.consts)
            for _, combo in self.launches:
                count_launch("adamw")
                combo.run(hyper, step, grad_scale, skip)
            return
        rows = self.rows.update(hyper, step, grad_scale)
        with device_guard(self.device):
            for (_, out_dtype), t in self.launches:
                count_launch("adamw")
                has_out = out_dtype is not None
                bases = t.bases if has_out else t.bases + (t.bases[0],)  # out never written
                _grouped_adamw_kernel[(t.programs,)](
                    *bases, t.pieces, t.prog_piece, rows, skip,
                    HAS_OUT=has_out, OUT_BF16=out_dtype == torch.bfloat16, ALIGNED=t.aligned,
                    BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=ENABLE_FP_FUSION)


def _check(b: AdamWBuffer, device: torch.device, num_rows: int) -> None:
    nb, S = b.num_buckets, b.shard_numel
    check_stream("master", as_strided(b.master, S), (torch.float32,), nb, S, device)
    check_stream("grad", as_strided(b.grad, S), GRAD_DTYPES, nb, S, device)
    for name, t in (("exp_avg", b.exp_avg), ("exp_avg_sq", b.exp_avg_sq)):
        check_stream(name, Strided(t, S, 0), (torch.float32,), nb, S, device)
    if b.out is not None:
        check_stream("out", as_strided(b.out, S), OUT_DTYPES, nb, S, device)
    if not 0 <= b.row < num_rows:
        raise ValueError(f"row {b.row} out of range for {num_rows} hyper-parameter rows")


def adamw_step(
    master: torch.Tensor | Strided,
    grad: torch.Tensor | Strided,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | Strided | None = None,
    *,
    lr: torch.Tensor,
    step: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    num_buckets: int = 1,
    shard_numel: int | None = None,
    master_mode: str = "fp32",
    states: str = "fp32",
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    kahan: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    sr_offset: int = 0,
) -> None:
    """One AdamW update of a single shard, in place, through the grouped launch.

    `lr`, `step` (the step number of this update, already counted), `grad_scale` (multiplies the
    grad: 1/(world*accum*loss_scale) * clip_coef) and `skip` (non-zero: leave everything untouched)
    are one-element tensors on the same device. Every stream covers `num_buckets` pieces of
    `shard_numel` elements (see the module docstring); plain tensors are the local layout.

    A memory mode (`master_mode`, `states` and their buffers: see `adamw_modes.adamw_step_modes`)
    runs the per-buffer kernel of adamw_modes.py ([Note: memory modes are not grouped yet]).
    """
    if master_mode != "fp32" or states != "fp32":
        adamw_step_modes(master, grad, exp_avg, exp_avg_sq, out, lr=lr, step=step,
                         grad_scale=grad_scale, skip=skip, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, maximize=maximize, num_buckets=num_buckets,
                         shard_numel=shard_numel, master_mode=master_mode, states=states,
                         exp_avg_scale=exp_avg_scale, exp_avg_sq_scale=exp_avg_sq_scale,
                         kahan=kahan, seed=seed, sr_offset=sr_offset)
        return
    shard_numel = shard_numel_of(exp_avg, num_buckets, shard_numel)
    device = as_strided(master, shard_numel).tensor.device
    for name, t in (("lr", lr), ("step", step), ("grad_scale", grad_scale), ("skip", skip)):
        check_scalar(name, t, device)
    plan = GroupedAdamW([AdamWBuffer(master, grad, exp_avg, exp_avg_sq, out, num_buckets,
                                     shard_numel, 0)], device, 1)
    hyper = Hyper(lr.reshape(1).float(), ((beta1, beta2, eps, weight_decay, maximize),))
    _check_consts(hyper.consts)
    plan.step(hyper, step, grad_scale, skip)


def adamw_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, *, lr: float, step: int, grad_scale: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float,
                    maximize: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 reference of one update on local (contiguous) tensors; returns new (p, m, v)."""
    p, g = master.double(), grad.double() * grad_scale
    m, v = exp_avg.double(), exp_avg_sq.double()
    if maximize:
        g = -g
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
    p = p - lr / (1 - beta1**step) * m / denom
    return p, m, v
