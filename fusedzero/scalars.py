"""Per-step device scalars: step count, grad norm, clip coefficient, skip flag, grad scale, and
the loss scaler. They live on the device and are written with device ops only, so a step needs no
host sync and a CUDA graph can capture it (nothing host-cached that a replay would bake in).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from fusedzero import comm
from fusedzero.comm import CommContext
from fusedzero.kernels import Strided, sumsq
from fusedzero.layout import FlatLayout


class LossScaler:
    """Dynamic (or static) loss scale kept on the device; updated without a host sync."""

    def __init__(self, loss_scale: str | float, device: torch.device, init: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.dynamic = loss_scale == "dynamic"
        if not self.dynamic and not (isinstance(loss_scale, (int, float)) and loss_scale > 0):
            raise ValueError(f"loss_scale must be 'dynamic', a positive number or None, "
                             f"got {loss_scale!r}")
        value = init if self.dynamic else float(loss_scale)
        self.scale = torch.full((1,), value, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval

    def update(self, found_inf: torch.Tensor) -> None:
        if self.dynamic:
            torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf,
                                     self.growth_factor, self.backoff_factor,
                                     self.growth_interval)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.scale.copy_(d["scale"])
        self.growth_tracker.copy_(d["growth_tracker"])

    def values(self) -> dict[str, float]:
        """Host values for a manifest (a host sync: checkpoints only)."""
        return {"scale": float(self.scale.reshape(-1)[0]),
                "growth_tracker": int(self.growth_tracker.reshape(-1)[0])}

    def load_values(self, d: dict[str, float]) -> None:
        self.scale.fill_(d["scale"])
        self.growth_tracker.fill_(int(d["growth_tracker"]))


class StepScalars:
    """The scalars the fused kernel reads from the device, and their owner.

    `grad_scale` combines the inverse loss scale and the clip coefficient (grads were already
    divided by the world size before their reduction); `skip` is 1.0 when the step must not be
    taken (a non-finite grad with skip_nonfinite or loss scaling); `step` counts taken steps.
    """

    def __init__(self, device: torch.device, *, max_grad_norm: float | None,
                 skip_nonfinite: bool, scaler: LossScaler | None) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.device = device
        self.step = torch.zeros(1, **f32)
        self.skip = torch.zeros(1, **f32)
        self.grad_scale = torch.ones(1, **f32)
        self.norm = torch.zeros(1, **f32)
        self._one = torch.ones(1, **f32)
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.scaler = scaler

    def prepare(self, grads: Iterable[tuple[Strided | torch.Tensor, FlatLayout]],
                ctx: CommContext | None) -> None:
        """Norm, clip coefficient, skip flag and grad scale from this rank's reduced grad
        shards. `ctx` is the group whose ranks hold the other shards (None: the local grads are
        already global, stage 0). One all-reduce of one scalar; no host sync."""
        need_norm = self.max_grad_norm is not None or self.skip_nonfinite or self.scaler
        inv = self._one if self.scaler is None else self._one / self.scaler.scale
        if not need_norm:
            self.grad_scale.copy_(inv)
            self.skip.zero_()
            return
        total = torch.zeros(1, dtype=torch.float32, device=self.device)
        for grad, layout in grads:
            total += sumsq(grad, num_buckets=layout.num_buckets, shard_numel=layout.shard_numel)
        if ctx is not None:
            ctx.wait(comm.all_reduce(total, ctx.group, ctx.world_size, ctx.counter),
                     what="grad-norm all-reduce")
        finite = torch.isfinite(total)
        torch.mul(total.sqrt(), inv, out=self.norm)
        scale = inv
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1.
            coef = (self.max_grad_norm / (self.norm + 1e-6)).clamp_(max=1.0)
            scale = inv * torch.where(finite, coef, torch.ones_like(coef))
        self.grad_scale.copy_(scale)
        if self.skip_nonfinite or self.scaler is not None:
            self.skip.copy_(~finite)
        else:
            self.skip.zero_()

    def advance(self) -> None:
        """The step counter advances only for steps that are taken."""
        self.step.add_(1.0 - self.skip)

    def finish(self) -> None:
        if self.scaler is not None:
            self.scaler.update(self.skip)
