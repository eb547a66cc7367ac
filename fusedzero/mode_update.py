"""A memory mode's update, one per-buffer launch per flat buffer ([Note: memory modes are not
grouped yet] in kernels/adamw_modes.py); the default mode runs the grouped launch (optim.py)."""
from __future__ import annotations

from typing import Any

import torch

from fusedzero.flat import FlatBuffer
from fusedzero.kernels import adamw_step
from fusedzero.scalars import StepScalars


def step_per_buffer(buffers: list[FlatBuffer], param_groups: list[dict[str, Any]],
                    lrs: torch.Tensor, scalars: StepScalars) -> None:
    """A memory mode's update: one per-buffer launch each (kernels/adamw_modes.py, [Note: memory
    modes are not grouped yet]). `lrs` is the (groups,) device lr vector of `GroupLr`."""
    s = scalars
    for buf in buffers:
        g = param_groups[buf.group_index]
        beta1, beta2 = g["betas"]
        adamw_step(buf.master_view(), buf.grad_view(), buf.exp_avg, buf.exp_avg_sq,
                   buf.out_view(), lr=lrs[buf.group_index:buf.group_index + 1],
                   step=s.step, grad_scale=s.grad_scale, skip=s.skip, beta1=beta1,
                   beta2=beta2, eps=g["eps"], weight_decay=g["weight_decay"],
                   maximize=g["maximize"], num_buckets=buf.layout.num_buckets,
                   shard_numel=buf.layout.shard_numel, **buf.kernel_modes())
