"""The AdamW rule: `torch.optim.AdamW`'s math on the engine's local shards.

Everything AdamW lives here and in its kernels (kernels/_adamw*.py, _rows.py, _memory_modes*.py):
the state names (exp_avg, exp_avg_sq and, in the int8 mode, their block scales), the
hyper-parameters (lr, betas, eps, weight_decay, maximize) and their validation, and the grouped
launch (`GroupedAdamW`: one launch per (grad dtype, out dtype) over every local shard, its
per-group rows written by the step's scalar launch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fusedzero._scalars import GroupLr
from fusedzero.kernels import AdamWBuffer, GroupedAdamW, Hyper
from fusedzero.memory_modes import QBLOCK, MemoryModes
from fusedzero.rules import LocalShard, StateField, StepTensors

__all__ = ["ADAMW", "AdamW"]

_F32 = torch.float32
_FP32 = torch.finfo(torch.float32)


def _number(v: Any) -> float:
    return float(v.reshape(-1)[0]) if isinstance(v, torch.Tensor) else float(v)


def check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """As torch.optim.AdamW, with its messages, and stricter on purpose: eps must be > 0 (a
    positive normal fp32 number: eps 0 divides by zero wherever the second moment is zero, e.g.
    a param whose grads are all zero, and writes inf or NaN into it), and lr, eps and
    weight_decay finite in fp32 (1e300 or inf is inf in the fp32 update). Used by the
    constructor and by `checkpoint.load` for the hyper-parameters a manifest holds."""
    lr_v = _number(lr)
    if not lr_v >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not lr_v <= _FP32.max:
        raise ValueError(
            f"Invalid learning rate: {lr} (must be finite in fp32, at most {_FP32.max:.4g})"
        )
    eps_v = _number(eps)
    if not eps_v >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not _FP32.tiny <= eps_v <= _FP32.max:
        raise ValueError(
            f"Invalid epsilon value: {eps} (must be > 0 and finite in fp32, in "
            f"[{_FP32.tiny:.4g}, {_FP32.max:.4g}]: eps 0 divides by zero where "
            "the second moment is zero; torch's default is 1e-8)"
        )
    if len(betas) != 2 or not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not _number(weight_decay) <= _FP32.max:
        raise ValueError(
            f"Invalid weight_decay value: {weight_decay} (must be finite in fp32, "
            f"at most {_FP32.max:.4g})"
        )


class AdamW:
    """The AdamW update rule (element-wise: any slice of a param is updated alone)."""

    name = "adamw"
    element_wise = True
    defaults: Mapping[str, Any] = dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, maximize=False
    )

    def check_group(self, group: Mapping[str, Any]) -> None:
        check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def state_fields(self, modes: MemoryModes) -> tuple[StateField, ...]:
        m_dt, v_dt = modes.state_dtypes
        fields = (
            StateField(name="exp_avg", dtype=m_dt, signed=True),
            StateField(name="exp_avg_sq", dtype=v_dt, signed=False),
        )
        if not modes.quantized:
            return fields
        # One fp32 scale per QBLOCK elements of each int8/uint8 state.
        return fields + tuple(
            StateField(name=f"{f.name}_scale", dtype=_F32, per=QBLOCK, scale_of=f.name)
            for f in fields
        )

    def build(
        self,
        shards: Sequence[LocalShard],
        *,
        device: torch.device,
        num_groups: int,
        modes: MemoryModes,
        seed: torch.Tensor | None,
    ) -> AdamWUpdate:
        return AdamWUpdate(shards, device=device, num_groups=num_groups, modes=modes, seed=seed)


ADAMW = AdamW()


def _consts(g: Mapping[str, Any]) -> tuple[float, float, float, float, bool]:
    beta1, beta2 = g["betas"]
    return (beta1, beta2, g["eps"], g["weight_decay"], g["maximize"])


class AdamWUpdate:
    """One grouped AdamW launch per (grad dtype, out dtype) over every local shard; the lr
    vector on the device (`GroupLr`)."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        *,
        device: torch.device,
        num_groups: int,
        modes: MemoryModes,
        seed: torch.Tensor | None,
    ) -> None:
        self.group_lr = GroupLr(num_groups, device, consts=_consts)
        self.launch = GroupedAdamW(
            [
                AdamWBuffer(
                    s.master,
                    s.grad,
                    s.state["exp_avg"],
                    s.state["exp_avg_sq"],
                    s.out,
                    s.num_buckets,
                    s.shard_numel,
                    s.group_index,
                    s.comp,
                    s.state.get("exp_avg_scale"),
                    s.state.get("exp_avg_sq_scale"),
                    s.sr_offset,
                )
                for s in shards
            ],
            device,
            num_groups,
            require_aligned=True,
            master_mode=modes.master,
            states=modes.states,
            seed=seed,
        )
        self.rows = self.launch.rows

    def read_groups(self, param_groups: list[dict[str, Any]]) -> Hyper:
        return self.group_lr.update(param_groups)

    def step(self, hyper: Hyper, scalars: StepTensors, *, rows_written: bool) -> None:
        self.launch.step(
            hyper, scalars.step, scalars.grad_scale, scalars.skip, rows_written=rows_written
        )
