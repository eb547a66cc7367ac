"""A single buffer's AdamW update through the grouped launch (_adamw.py), and its float64
reference: the API tests and `fusedzero doctor` use for one shard, in any memory mode."""

from __future__ import annotations

import math
from typing import Any

import torch

from fusedzero.kernels._adamw import AdamWBuffer, GroupedAdamW
from fusedzero.kernels._launch import Hyper, Strided, as_strided, check_scalar, shard_numel_of
from fusedzero.kernels._rows import check_consts


class AdamWPlan:
    """A single buffer's update planned once: the piece table is built and copied to the device
    here, so each call is only the row update and the launch, as in the optimizer. Building the
    table per call (what `adamw_step` does) copies it from host memory every time; on a GPU that
    copy waits for the work queued before it, so a loop of `adamw_step` calls is timed with
    host gaps in it (bench and doctor time a plan).

    Arguments as `adamw_step`'s, less the per-step tensors, which each call takes:
    `plan(lr=..., step=..., grad_scale=..., skip=...)`. The tensors must not be replaced while
    the plan lives (it holds their addresses), only written in place.
    """

    def __init__(
        self,
        master: torch.Tensor | Strided,
        grad: torch.Tensor | Strided,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        out: torch.Tensor | Strided | None = None,
        *,
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
        shard_numel = shard_numel_of(exp_avg, num_buckets, shard_numel)
        self.device = as_strided(master, shard_numel).tensor.device
        self.consts = ((beta1, beta2, eps, weight_decay, maximize),)
        check_consts(self.consts)
        buf = AdamWBuffer(
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            out,
            num_buckets,
            shard_numel,
            0,
            kahan,
            exp_avg_scale,
            exp_avg_sq_scale,
            sr_offset,
        )
        self.plan = GroupedAdamW(
            [buf], self.device, 1, master_mode=master_mode, states=states, seed=seed
        )

    def __call__(
        self, *, lr: torch.Tensor, step: torch.Tensor, grad_scale: torch.Tensor, skip: torch.Tensor
    ) -> None:
        for name, t in (("lr", lr), ("step", step), ("grad_scale", grad_scale), ("skip", skip)):
            check_scalar(name, t, self.device)
        self.plan.step(Hyper(lr.reshape(1).float(), self.consts), step, grad_scale, skip)


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
    **kwargs: Any,
) -> None:
    """One AdamW update of a single shard, in place, through the grouped launch (a one-off
    `AdamWPlan`: for repeated updates of the same buffers, build the plan once).

    `lr`, `step` (the step number of this update, already counted), `grad_scale` (multiplies the
    grad: 1/(world*accum*loss_scale) * clip_coef) and `skip` (non-zero: leave everything untouched)
    are one-element tensors on the same device. Keyword arguments: beta1, beta2, eps,
    weight_decay (required), maximize, and the layout and memory mode below.

    Every stream covers `num_buckets` pieces of `shard_numel` elements (see kernels/_adamw.py);
    plain tensors are the local layout. Memory modes (kernels/_memory_modes.py): with `master_mode`
    "bf16-kahan", "bf16-sr" or "bf16", `master` is the bf16 param (no fp32 master) and `out` must
    be None; `kahan` is the bf16 compensation buffer (local layout, bf16-kahan only); `seed` a
    one-element int32/int64 tensor and `sr_offset` this buffer's offset in the random stream
    (bf16-sr). `states` "bf16" stores exp_avg/exp_avg_sq as bf16, "int8" as int8/uint8 codes with
    fp32 `exp_avg_scale` / `exp_avg_sq_scale` of one per QBLOCK elements (shard_numel a multiple
    of QBLOCK).
    """
    AdamWPlan(master, grad, exp_avg, exp_avg_sq, out, **kwargs)(
        lr=lr, step=step, grad_scale=grad_scale, skip=skip
    )


def adamw_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    step: int,
    grad_scale: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
