"""The per-step hyper-parameter rows of the grouped AdamW launch, one per param group.

Computed once per step on the device from the lr vector, the step count and the grad scale by a
few vectorised torch ops (fp64 there, rounded once to fp32), so no kernel and no torch path has an
fp64 operation per element, and every path (kernel, interpreter, the memory modes' torch path)
reads the same fp32 values. Nothing is read back to the host.
"""
from __future__ import annotations

import math
from enum import IntEnum

import torch

from fusedzero.kernels._launch import Hyper, copy_from_host



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

    def update(self, hyper: Hyper, step: torch.Tensor, grad_scale: torch.Tensor) -> torch.Tensor:
        if hyper.consts != self.consts:
            check_consts(hyper.consts)
            copy_from_host(self.rows[:, _CONSTS[0]:_CONSTS[-1] + 1],
                           [[b1, 1 - b1, b2, 1 - b2, eps] for b1, b2, eps, _, _ in hyper.consts])
            copy_from_host(self.c64, [[wd, -1.0 if mx else 1.0, _log(b1), _log(b2)]  # _C64
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
    bc1, bc2 = torch.expm1(step.double() * c64[:, _C64.LOG_BETA1:_C64.LOG_BETA2 + 1]).neg_().T
    rows[:, RowCol.STEP_SIZE].copy_(lr64 / bc1)
    rows[:, RowCol.BC2_SQRT].copy_(bc2.sqrt())
    rows[:, RowCol.DECAY].copy_(1.0 - lr64 * c64[:, _C64.WEIGHT_DECAY])
    rows[:, RowCol.GRAD_MULT].copy_(c64[:, _C64.SIGN] * grad_scale.double())
