"""The per-step scalars in one launch: grad norm, clip coefficient, skip flag, grad scale and
the step count, from the (reduced) sum of squares of the grads and the loss scale.

[Note: one launch for the step's scalars] The torch path is about a dozen tiny ops (isfinite,
sqrt, the clip's add, reciprocal, multiply, clamp and where, copies, the step's add): on CUDA
each is a launch and ~15-25 us of host time (dispatch, launch) on the path that issues the
update, so a step spent a few hundred us of host before its update could start. The kernel does
the same arithmetic in one program, in the same fp32 operations in the same order (IEEE
division and square root, no FMA contraction), so both paths give the same bits: `1 / scale`,
`sqrt(total) * inv`, the clip as torch's `max_norm / x` computes it (`reciprocal(x) *
max_norm`), clamped to 1 and ignored for a non-finite norm, and `step + (1 - skip)`. Given the
update's rows (`rows.Rows`), the same program then writes them from the step count and grad
scale it just computed (kernels/_rows.py, the same fp64 operations as their own launch): the
step's scalars, bias corrections and lr rows are one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedzero.kernels._launch import (
    ENABLE_FP_FUSION,
    Hyper,
    check_scalar,
    count_launch,
    device_guard,
    use_triton,
)
from fusedzero.kernels._rows import Rows, _write_rows, adamw_rows, row_constexprs


@triton.jit
def _step_scalars_kernel(
    total_ptr,
    loss_scale_ptr,
    norm_ptr,
    grad_scale_ptr,
    skip_ptr,
    step_ptr,
    max_norm_ptr,
    lr_ptr,
    c64_ptr,
    rows_ptr,
    n_rows,
    NORM: tl.constexpr,
    SCALED: tl.constexpr,
    CLIP: tl.constexpr,
    SKIP_NONFINITE: tl.constexpr,
    ROWS: tl.constexpr,
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
    inv = tl.full((), 1.0, tl.float32)
    if SCALED:
        inv = tl.div_rn(inv, tl.load(loss_scale_ptr))
    scale = inv
    skip = tl.full((), 0.0, tl.float32)
    if NORM:
        total = tl.load(total_ptr)
        finite = tl.abs(total) < float("inf")  # False for inf and nan
        norm = tl.sqrt_rn(total) * inv
        tl.store(norm_ptr, norm)
        if CLIP:
            coef = tl.div_rn(1.0, norm + 1e-6) * tl.load(max_norm_ptr)
            coef = tl.where(coef > 1.0, 1.0, coef)  # clamp(max=1): nan stays nan
            scale = inv * tl.where(finite, coef, 1.0)
        if SKIP_NONFINITE:
            skip = tl.where(finite, 0.0, 1.0)
    tl.store(grad_scale_ptr, scale)
    tl.store(skip_ptr, skip)
    step = tl.load(step_ptr) + (1.0 - skip)
    tl.store(step_ptr, step)
    if ROWS:
        _write_rows(
            lr_ptr,
            c64_ptr,
            step,
            scale,
            rows_ptr,
            n_rows,
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


def step_scalars(
    total: torch.Tensor | None,
    loss_scale: torch.Tensor | None,
    norm: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    step: torch.Tensor,
    *,
    max_grad_norm: torch.Tensor | None,
    skip_nonfinite: bool,
    rows: Rows | None = None,
    hyper: Hyper | None = None,
) -> None:
    """Write `norm` (the grad norm over the loss scale), `grad_scale` (1 / loss scale, times
    the clip coefficient with `max_grad_norm`) and `skip` (1.0 for a non-finite norm with
    `skip_nonfinite`), and count the step in `step` unless it is skipped. `total`: the sum of
    squares of the grads (None: no norm is needed, `norm` is left alone). Every tensor is a
    one-element fp32 tensor on one device, `max_grad_norm` too (no Python number reaches the
    launch: a CUDA graph replays the arguments it captured); nothing is read back to the
    host. With `rows` (and this step's `hyper`), the update's rows too, in the same launch."""
    dev = step.device
    for name, t in (
        ("total", total),
        ("loss_scale", loss_scale),
        ("norm", norm),
        ("grad_scale", grad_scale),
        ("skip", skip),
        ("step", step),
        ("max_grad_norm", max_grad_norm),
    ):
        if t is not None:
            check_scalar(name, t, dev)
    if max_grad_norm is not None and total is None:
        raise ValueError("max_grad_norm needs the sum of squares (total)")
    if rows is not None:
        if hyper is None:
            raise ValueError("rows need this step's hyper-parameters (hyper)")
        rows.write_consts(hyper)  # host values, copied only when they changed
    count_launch("step_scalars")
    if not use_triton(dev):
        _step_scalars_torch(
            total,
            loss_scale,
            norm,
            grad_scale,
            skip,
            step,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=skip_nonfinite,
        )
        if rows is not None and hyper is not None:
            adamw_rows(hyper.lr, rows.c64, step, grad_scale, rows.rows)
        return
    with device_guard(dev):
        _step_scalars_kernel[(1,)](
            step if total is None else total,
            step if loss_scale is None else loss_scale,
            norm,
            grad_scale,
            skip,
            step,
            step if max_grad_norm is None else max_grad_norm,
            step if hyper is None else hyper.lr,
            step if rows is None else rows.c64,
            step if rows is None else rows.rows,
            0 if rows is None else rows.rows.shape[0],
            NORM=total is not None,
            SCALED=loss_scale is not None,
            CLIP=max_grad_norm is not None,
            SKIP_NONFINITE=skip_nonfinite and total is not None,
            ROWS=rows is not None,
            **(row_constexprs(16) if rows is None else rows.constexprs()),
            num_warps=1,
            enable_fp_fusion=ENABLE_FP_FUSION,
        )


def _step_scalars_torch(
    total: torch.Tensor | None,
    loss_scale: torch.Tensor | None,
    norm: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    step: torch.Tensor,
    *,
    max_grad_norm: torch.Tensor | None,
    skip_nonfinite: bool,
) -> None:
    """The same arithmetic as torch ops (CPU tensors, and the reference the kernel is tested
    against)."""
    one = torch.ones(1, dtype=torch.float32, device=step.device)
    inv = one if loss_scale is None else one / loss_scale
    if total is None:
        grad_scale.copy_(inv)
        skip.zero_()
    else:
        finite = torch.isfinite(total)
        torch.mul(total.sqrt(), inv, out=norm)
        scale = inv
        if max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1
            # (as torch computes a number over a tensor: the reciprocal, times the number).
            coef = ((norm + 1e-6).reciprocal() * max_grad_norm).clamp_(max=1.0)
            scale = inv * torch.where(finite, coef, torch.ones_like(coef))
        grad_scale.copy_(scale)
        if skip_nonfinite:
            skip.copy_(~finite)
        else:
            skip.zero_()
    step.add_(1.0 - skip)
