"""The per-step hyper-parameter rows of the grouped AdamW launch, one per param group.

Computed once per step on the device from the lr vector, the step count and the grad scale by a
few vectorised torch ops (fp64 there, rounded once to fp32), so no kernel and no torch path has an
fp64 operation per element, and every path (kernel, interpreter, the memory modes' torch path)
reads the same fp32 values. Nothing is read back to the host.
"""
from __future__ import annotations

import math

import torch

from fusedzero.kernels._launch import Hyper, copy_from_host

# The per-step row of a param group, as the kernel reads it (fp32).
ROW = ("step_size", "bc2_sqrt", "decay", "beta1", "one_minus_beta1", "beta2",
       "one_minus_beta2", "eps", "grad_mult")
NCOLS = len(ROW)


def check_consts(consts: tuple[tuple[float, float, float, float, bool], ...]) -> None:
    for beta1, beta2, *_ in consts:
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")


def _log(b: float) -> float:
    return math.log(b) if b > 0 else -math.inf


class Rows:
    """The device rows of `ROW`, with the constant columns rewritten only when they change."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.rows = torch.zeros(n, NCOLS, dtype=torch.float32, device=device)
        # fp64 columns read per step: weight decay, sign, log beta1, log beta2.
        self.c64 = torch.zeros(n, 4, dtype=torch.float64, device=device)
        self.consts: tuple | None = None

    def update(self, hyper: Hyper, step: torch.Tensor, grad_scale: torch.Tensor) -> torch.Tensor:
        if hyper.consts != self.consts:
            check_consts(hyper.consts)
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
