"""A single buffer's AdamW update through the grouped launch (adamw.py), and its float64
reference: the API tests and `fusedzero doctor` use for one shard, in any memory mode."""
from __future__ import annotations

import math

import torch

from fusedzero.kernels._launch import (Hyper, Strided, as_strided, check_scalar,
                                       shard_numel_of)
from fusedzero.kernels.adamw import AdamWBuffer, GroupedAdamW
from fusedzero.kernels.rows import check_consts


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

    Memory modes (kernels/modes.py): with `master_mode` "bf16-kahan", "bf16-sr" or "bf16",
    `master` is the bf16 param (no fp32 master) and `out` must be None; `kahan` is the bf16
    compensation buffer (local layout, bf16-kahan only); `seed` a one-element int32/int64 tensor
    and `sr_offset` this buffer's offset in the random stream (bf16-sr). `states` "bf16" stores
    exp_avg/exp_avg_sq as bf16, "int8" as int8/uint8 codes with fp32 `exp_avg_scale` /
    `exp_avg_sq_scale` of one per QBLOCK elements (shard_numel a multiple of QBLOCK).
    """
    shard_numel = shard_numel_of(exp_avg, num_buckets, shard_numel)
    device = as_strided(master, shard_numel).tensor.device
    for name, t in (("lr", lr), ("step", step), ("grad_scale", grad_scale), ("skip", skip)):
        check_scalar(name, t, device)
    hyper = Hyper(lr.reshape(1).float(), ((beta1, beta2, eps, weight_decay, maximize),))
    buf = AdamWBuffer(master, grad, exp_avg, exp_avg_sq, out, num_buckets, shard_numel, 0,
                      kahan, exp_avg_scale, exp_avg_sq_scale, sr_offset)
    plan = GroupedAdamW([buf], device, 1, master_mode=master_mode, states=states, seed=seed)
    check_consts(hyper.consts)
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
