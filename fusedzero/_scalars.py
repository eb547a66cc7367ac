"""Per-step device scalars: step count, grad norm, clip coefficient, skip flag, grad scale, and
the loss scaler. They live on the device and are written with device ops only, so a step needs no
host sync and a CUDA graph can capture it (nothing host-cached that a replay would bake in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fusedzero import _comm as comm
from fusedzero._comm import CommContext
from fusedzero.kernels import Hyper
from fusedzero.kernels._launch import copy_from_host
from fusedzero.kernels._rows import Rows
from fusedzero.kernels._step_scalars import step_scalars


class LossScaler:
    """Dynamic (or static) loss scale kept on the device; updated without a host sync."""

    def __init__(
        self,
        loss_scale: str | float,
        device: torch.device,
        init: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.dynamic = loss_scale == "dynamic"
        if not self.dynamic and not (isinstance(loss_scale, (int, float)) and loss_scale > 0):
            raise ValueError(
                f"loss_scale must be 'dynamic', a positive number or None, got {loss_scale!r}"
            )
        value = init if self.dynamic else float(loss_scale)
        self.scale = torch.full((1,), value, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval

    def update(self, found_inf: torch.Tensor) -> None:
        if self.dynamic:
            torch._amp_update_scale_(
                self.scale,
                self.growth_tracker,
                found_inf,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.scale.copy_(d["scale"])
        self.growth_tracker.copy_(d["growth_tracker"])

    def values(self) -> dict[str, float]:
        """Host values for a manifest (a host sync: checkpoints only)."""
        return {
            "scale": float(self.scale.reshape(-1)[0]),
            "growth_tracker": int(self.growth_tracker.reshape(-1)[0]),
        }

    def load_values(self, d: dict[str, float]) -> None:
        self.scale.fill_(d["scale"])
        self.growth_tracker.fill_(int(d["growth_tracker"]))


class StepScalars:
    """The scalars the fused kernel reads from the device, and their owner.

    `grad_scale` combines the inverse loss scale and the clip coefficient (grads were already
    divided by the world size before their reduction); `skip` is 1.0 when the step must not be
    taken (a non-finite grad with skip_nonfinite or loss scaling); `step` counts taken steps.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        max_grad_norm: float | None,
        skip_nonfinite: bool,
        scaler: LossScaler | None,
    ) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.device = device
        self.step = torch.zeros(1, **f32)
        self.skip = torch.zeros(1, **f32)
        self.grad_scale = torch.ones(1, **f32)
        self.norm = torch.zeros(1, **f32)
        self.max_grad_norm = max_grad_norm
        # On the device, as the kernel reads it (no Python number in a launch).
        self._max_norm = (
            None if max_grad_norm is None else torch.full((1,), float(max_grad_norm), **f32)
        )
        self.skip_nonfinite = skip_nonfinite
        self.scaler = scaler

    def prepare(
        self,
        sumsq: Callable[[], torch.Tensor],
        ctx: CommContext | None,
        tp_ctx: CommContext | None = None,
        rows: Rows | None = None,
        hyper: Hyper | None = None,
    ) -> None:
        """Norm, clip coefficient, skip flag and grad scale from this rank's reduced grad
        shards, and the step counted (only a step that is taken counts); `sumsq()` is their
        sum of squares (the grouped launch over all of them). `ctx` is the group whose ranks
        hold the other shards (None: the local grads are already global, stage 0); `tp_ctx`
        the tensor-parallel group whose ranks hold the other tp shards (`sumsq()` then counts
        each replicated param on one tp rank only). One all-reduce of one scalar per group,
        then one launch for every scalar and, where given, the update's `rows` of `hyper`
        (see [Note: one launch for the step's scalars] in kernels/_step_scalars.py); no host
        sync."""
        need_norm = self.max_grad_norm is not None or self.skip_nonfinite or self.scaler
        total = None
        if need_norm:
            total = sumsq()
            for c in (ctx, tp_ctx):
                if c is not None:
                    c.wait(
                        comm.all_reduce(total, c.group, c.world_size, c.counter),
                        what="grad-norm all-reduce",
                    )
        step_scalars(
            total,
            None if self.scaler is None else self.scaler.scale,
            self.norm,
            self.grad_scale,
            self.skip,
            self.step,
            max_grad_norm=self._max_norm,
            skip_nonfinite=self.skip_nonfinite or self.scaler is not None,
            rows=rows,
            hyper=hyper,
        )

    def finish(self) -> None:
        if self.scaler is not None:
            self.scaler.update(self.skip)


_FP32_MAX = torch.finfo(torch.float32).max


def group_numbers(g: Mapping[str, Any]) -> tuple[Any, ...]:
    """A group's hyper-parameters other than lr, in the group's order, tuples flattened."""
    out: list[Any] = []
    for k, v in g.items():
        if k not in ("params", "lr", "initial_lr"):
            out.extend(v if isinstance(v, (tuple, list)) else (v,))
    return tuple(out)


class GroupLr:
    """Per param group hyper-parameters as a rule's grouped launch reads them; owns the lr
    vector on the device (one entry per param group). `consts(group)` gives a group's other
    hyper-parameters as host values (the rule's; default: `group_numbers`).

    A float lr (what schedulers write) is compared on the host with the value last sent, and
    only when some group's float lr changed is the vector sent again: one small host-to-device
    copy, from a freshly allocated pinned tensor on CUDA (the caching host allocator keeps it
    alive until the copy has run), with no host sync and nothing a CUDA graph replay would bake
    in (no `fill_` of a host value). A CPU tensor lr is read on the host and goes the same way:
    copying it into a CUDA tensor would be a pageable host-to-device copy, which waits for the
    device (a host sync in every step). A tensor lr on the device is copied in with a device op
    every step (a CUDA graph replays that copy and sees the lr as it is then).
    """

    def __init__(
        self,
        num_groups: int,
        device: torch.device,
        consts: Callable[[Mapping[str, Any]], tuple[Any, ...]] = group_numbers,
    ) -> None:
        self.consts = consts
        self.lr = torch.zeros(num_groups, dtype=torch.float32, device=device)
        self._entries = list(self.lr.unbind())  # views: a tensor lr is copied into its entry
        self._sent: list[float | None] = [None] * num_groups

    def update(self, param_groups: list[dict[str, Any]]) -> Hyper:
        """This step's hyper-parameters from the groups as they are now. A float lr (or a CPU
        tensor lr of a CUDA optimizer) that is not finite in fp32 or is negative is refused
        here, where it is read on the host anyway (a NaN lr made every param NaN); a tensor lr
        on the optimizer's device is not read back (that would be a host sync per step)."""
        changed, tensors, consts = False, [], []
        sent = list(self._sent)  # committed once every group is checked
        for i, g in enumerate(param_groups):
            lr = g["lr"]
            if (
                isinstance(lr, torch.Tensor)
                and lr.device.type == "cpu"
                and self.lr.device.type != "cpu"
            ):
                lr = lr.item()  # host memory: no wait on the device
            if isinstance(lr, torch.Tensor):
                tensors.append((i, lr))
                sent[i] = None
            elif lr != sent[i]:
                if not 0.0 <= lr <= _FP32_MAX:  # (False for NaN)
                    raise ValueError(
                        f"param_groups[{i}]['lr'] is {lr}: lr must be a number in [0, "
                        f"{_FP32_MAX:.4g}] (finite in fp32); set a valid lr before step()"
                    )
                changed = True
                sent[i] = float(lr)
            consts.append(self.consts(g))
        self._sent = sent
        if changed:
            copy_from_host(self.lr, [x if x is not None else 0.0 for x in self._sent])
        if tensors:  # one op for every group's tensor lr
            torch._foreach_copy_(
                [self._entries[i] for i, _ in tensors], [lr.reshape(()) for _, lr in tensors]
            )
        return Hyper(self.lr, tuple(consts))
