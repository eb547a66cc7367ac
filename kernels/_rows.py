"""The per-step hyper-parameter rows of the grouped AdamW launch, one per param group.

Computed once per step on the device from the lr vector, the step count and the grad scale, in
fp64 rounded once to fp32, so no update kernel and no torch path has an fp64 operation per
element. With the Triton kernels that is part of the step's scalar launch (kernels/
_step_scalars.py; `_adamw_rows_kernel`, one program with a lane per group, where rows are asked
for alone); on the torch path a few vectorised torch ops (`adamw_rows`), each of which
would be a launch and ~15-25 us of host on CUDA (see [Note: one launch for the step's scalars],
kernels/_step_scalars.py). Both compute the same fp64 values up to a few fp64 ulps (the kernel's
expm1 is Kahan's, from exp and log), so the same fp32 rows. Nothing is read back to the host.
"""

from __future__ import annotations

import math
from enum import IntEnum

import torch
import triton
import triton.language as tl

from fusedzero.kernels._launch import (
    ENABLE_FP_FUSION,
    Hyper,
    copy_from_host,
    count_launch,
    device_guard,
    use_triton,
)


class RowCol(IntEnum):
    """The columns of a param group's per-step row, as the kernel reads them (fp32)."""

    STEP_SIZE = 0  # lr / (1 - beta1**step)
    BC2_SQRT = 1  # sqrt(1 - beta2**step)
    DECAY = 2  # 1 - lr * weight_decay
    BETA1 = 3
    ONE_MINUS_BETA1 = 4
    BETA2 = 5
    ONE_MINUS_BETA2 = 6
    EPS = 7
    GRAD_MULT = 8  # the grad scale, negated to maximize


NCOLS = len(RowCol)


class MuonRowCol(IntEnum):
    """The columns of a Muon row (kernels/_muon.py), one per (param group, lr ratio), as its
    kernels read them (fp32)."""

    BUF_WEIGHT = 0  # 1 - momentum: buf moves toward the grad
    NESTEROV_WEIGHT = 1  # momentum: the Nesterov blend moves from the grad toward buf
    NESTEROV = 2  # 1.0 or 0.0
    GRAD_MULT = 3  # the grad scale (per step)
    DECAY = 4  # 1 - lr * weight_decay (per step)
    NEG_LR = 5  # -(lr * lr_ratio), the adjusted lr negated (per step)


# The columns that change only with the hyper-parameters (written from the host, in this order).
_CONSTS = (RowCol.BETA1, RowCol.ONE_MINUS_BETA1, RowCol.BETA2, RowCol.ONE_MINUS_BETA2, RowCol.EPS)
assert _CONSTS == tuple(range(_CONSTS[0], _CONSTS[-1] + 1))  # one contiguous slice


class _C64(IntEnum):
    """The fp64 per-group constants a row is computed from each step."""

    WEIGHT_DECAY = 0
    SIGN = 1  # -1 to maximize
    LOG_BETA1 = 2
    LOG_BETA2 = 3


def check_consts(consts: tuple[tuple[float, float, float, float, bool], ...]) -> None:
    for beta1, beta2, *_ in consts:
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")


def _log(b: float) -> float:
    return math.log(b) if b > 0 else -math.inf


class Rows:
    """The device rows (`RowCol`), with the constant columns rewritten only when they change."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.rows = torch.zeros(n, NCOLS, dtype=torch.float32, device=device)
        # fp64 columns read per step (`_C64`).
        self.c64 = torch.zeros(n, len(_C64), dtype=torch.float64, device=device)
        self.consts: tuple | None = None

    def write_consts(self, hyper: Hyper) -> None:
        """The constant columns and the fp64 per-group constants, where they changed."""
        if hyper.consts != self.consts:
            check_consts(hyper.consts)
            copy_from_host(
                self.rows[:, _CONSTS[0] : _CONSTS[-1] + 1],
                [[b1, 1 - b1, b2, 1 - b2, eps] for b1, b2, eps, _, _ in hyper.consts],
            )
            copy_from_host(
                self.c64,
                [
                    [wd, -1.0 if mx else 1.0, _log(b1), _log(b2)]  # _C64
                    for b1, b2, _, wd, mx in hyper.consts
                ],
            )
            self.consts = hyper.consts

    def update(self, hyper: Hyper, step: torch.Tensor, grad_scale: torch.Tensor) -> torch.Tensor:
        """The rows for this step, by their own launch (`step_scalars` writes them in its
        launch instead, given this object)."""
        self.write_consts(hyper)
        if use_triton(self.rows.device):
            count_launch("rows")
            with device_guard(self.rows.device):
                _adamw_rows_kernel[(1,)](
                    hyper.lr,
                    self.c64,
                    step,
                    grad_scale,
                    self.rows,
                    self.rows.shape[0],
                    **self.constexprs(),
                    num_warps=1,
                    enable_fp_fusion=ENABLE_FP_FUSION,
                )
        else:
            adamw_rows(hyper.lr, self.c64, step, grad_scale, self.rows)
        return self.rows

    def constexprs(self) -> dict[str, int]:
        """What `_write_rows` is compiled for: the block of lanes and the column numbers."""
        return row_constexprs(max(16, triton.next_power_of_2(self.rows.shape[0])))


def row_constexprs(block: int) -> dict[str, int]:
    return dict(
        NCOLS=NCOLS,
        NC64=len(_C64),
        BLOCK=block,
        STEP_SIZE=int(RowCol.STEP_SIZE),
        BC2_SQRT=int(RowCol.BC2_SQRT),
        DECAY=int(RowCol.DECAY),
        GRAD_MULT=int(RowCol.GRAD_MULT),
        WD=int(_C64.WEIGHT_DECAY),
        SIGN=int(_C64.SIGN),
        LOG_BETA1=int(_C64.LOG_BETA1),
        LOG_BETA2=int(_C64.LOG_BETA2),
    )


def adamw_rows(
    lr: torch.Tensor,
    c64: torch.Tensor,
    step: torch.Tensor,
    grad_scale: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """The per-step columns of `rows` on the device, in fp64 rounded once to fp32: step_size =
    lr / (1 - beta1**step), bc2_sqrt = sqrt(1 - beta2**step), decay = 1 - lr * weight_decay,
    grad_mult = +-grad_scale. Bias corrections as -expm1(step * log(beta)): in fp32,
    1 - 0.999**1 would lose 4-5 digits to cancellation."""
    lr64 = lr.double()
    bc1, bc2 = torch.expm1(step.double() * c64[:, _C64.LOG_BETA1 : _C64.LOG_BETA2 + 1]).neg_().T
    rows[:, RowCol.STEP_SIZE].copy_(lr64 / bc1)
    rows[:, RowCol.BC2_SQRT].copy_(bc2.sqrt())
    rows[:, RowCol.DECAY].copy_(1.0 - lr64 * c64[:, _C64.WEIGHT_DECAY])
    rows[:, RowCol.GRAD_MULT].copy_(c64[:, _C64.SIGN] * grad_scale.double())


@triton.jit
def _expm1_f64(x):
    """expm1 in fp64 from exp and log (Kahan): exact where exp(x) rounds to 1, a few ulps
    elsewhere (no expm1 in the interpreter); nan and -inf as torch.expm1."""
    u = tl.exp(x)
    um1 = u - 1.0
    # Where u is 1 (x) or 0 (-1), the log is not taken: no 0/0 or log(0) even in a lane whose
    # value is not used (numpy warns in the interpreter).
    ok = (u != 1.0) & (u != 0.0)
    return tl.where(u == 1.0, x, tl.where(ok, um1 * x / tl.log(tl.where(ok, u, 2.0)), um1))


@triton.jit
def _adamw_rows_kernel(
    lr_ptr,
    c64_ptr,
    step_ptr,
    grad_scale_ptr,
    rows_ptr,
    n,
    NCOLS: tl.constexpr,
    NC64: tl.constexpr,
    BLOCK: tl.constexpr,
    STEP_SIZE: tl.constexpr,
    BC2_SQRT: tl.constexpr,
    DECAY: tl.constexpr,
    GRAD_MULT: tl.constexpr,
    WD: tl.constexpr,
    SIGN: tl.constexpr,
    LOG_BETA1: tl.constexpr,
    LOG_BETA2: tl.constexpr,
):
    """`adamw_rows` in one program, a lane per group."""
    _write_rows(
        lr_ptr,
        c64_ptr,
        tl.load(step_ptr),
        tl.load(grad_scale_ptr),
        rows_ptr,
        n,
        NCOLS,
        NC64,
        BLOCK,
        STEP_SIZE,
        BC2_SQRT,
        DECAY,
        GRAD_MULT,
        WD,
        SIGN,
        LOG_BETA1,
        LOG_BETA2,
    )


@triton.jit
def _write_rows(
    lr_ptr,
    c64_ptr,
    step32,
    grad_scale,
    rows_ptr,
    n,
    NCOLS: tl.constexpr,
    NC64: tl.constexpr,
    BLOCK: tl.constexpr,
    STEP_SIZE: tl.constexpr,
    BC2_SQRT: tl.constexpr,
    DECAY: tl.constexpr,
    GRAD_MULT: tl.constexpr,
    WD: tl.constexpr,
    SIGN: tl.constexpr,
    LOG_BETA1: tl.constexpr,
    LOG_BETA2: tl.constexpr,
):
    """The rows from this step's count and grad scale (fp32 values): the same fp64 operations
    as `adamw_rows` in the same order, each rounded once to fp32. Also called by the step's
    scalar kernel with the values it just computed (kernels/_step_scalars.py)."""
    r = tl.arange(0, BLOCK)
    m = r < n
    lr = tl.load(lr_ptr + r, mask=m, other=0.0).to(tl.float64)
    step = step32.to(tl.float64)
    c = c64_ptr + r * NC64
    # Lanes past the last group get log(beta) = -1: no 0/0 there (their rows are not stored).
    bc1 = -_expm1_f64(step * tl.load(c + LOG_BETA1, mask=m, other=-1.0))
    bc2 = -_expm1_f64(step * tl.load(c + LOG_BETA2, mask=m, other=-1.0))
    out = rows_ptr + r * NCOLS
    tl.store(out + STEP_SIZE, (lr / bc1).to(tl.float32), mask=m)
    tl.store(out + BC2_SQRT, tl.sqrt(bc2).to(tl.float32), mask=m)
    tl.store(out + DECAY, (1.0 - lr * tl.load(c + WD, mask=m, other=0.0)).to(tl.float32), mask=m)
    gs = grad_scale.to(tl.float64)
    tl.store(out + GRAD_MULT, (tl.load(c + SIGN, mask=m, other=0.0) * gs).to(tl.float32), mask=m)
