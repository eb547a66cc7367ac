"""A CUDA graph replays a step with the launch arguments it captured: whatever changes per step
(lr from a scheduler, the step count, the clip coefficient, the skip flag) must reach the
kernels through device memory, never as a Python number in the launch. Proven on CPU through
the Triton interpreter (FUSEDZERO_BACKEND=triton): every launch of the fused update, the sum of
squares and the step's scalars (with the AdamW rows) gets the same host arguments at every step
(equal integers and flags, no float at all, tensors of the same dtype and shape) while lr changes
each step. Tensor addresses may differ: a buffer allocated inside the step (the sum of squares'
total) comes from the graph's own pool under capture, at one address for every replay.

About internals: fusedzero.kernels._adamw, fusedzero.kernels._rows,
fusedzero.kernels._step_scalars, fusedzero.kernels._sum_of_squares."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fusedzero.kernels._adamw as adamw
import fusedzero.kernels._rows as rows
import fusedzero.kernels._step_scalars as step_scalars
import fusedzero.kernels._sum_of_squares as sumsq
from fusedzero.optim import ZeroAdamW


class Recorder:
    def __init__(self, kernel: Any, log: list[tuple[str, tuple, dict]], name: str) -> None:
        self.kernel, self.log, self.name = kernel, log, name

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.log.append((self.name, (grid, *args), kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _key(v: Any) -> Any:
    assert not isinstance(v, float), f"a Python float reaches a launch: {v}"
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape))
    if isinstance(v, tuple):
        return tuple(_key(x) for x in v)
    return v


@pytest.mark.interpreter  # FUSEDZERO_BACKEND=triton on CPU tensors
@pytest.mark.parametrize("stage", [1, 3])
def test_launch_arguments_do_not_change_between_steps(
    monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    monkeypatch.setenv("FUSEDZERO_BACKEND", "triton")
    log: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(
        adamw, "_grouped_adamw_kernel", Recorder(adamw._grouped_adamw_kernel, log, "adamw")
    )
    monkeypatch.setattr(
        sumsq, "_grouped_sumsq_kernel", Recorder(sumsq._grouped_sumsq_kernel, log, "sumsq")
    )
    monkeypatch.setattr(rows, "_adamw_rows_kernel", Recorder(rows._adamw_rows_kernel, log, "rows"))
    monkeypatch.setattr(
        step_scalars,
        "_step_scalars_kernel",
        Recorder(step_scalars._step_scalars_kernel, log, "step_scalars"),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, module=model, max_grad_norm=0.5)
    per_step = []
    for step in range(3):
        opt.param_groups[0]["lr"] = 1e-2 / (step + 1)  # what a scheduler writes
        model(torch.randn(4, 16)).square().mean().backward()
        log.clear()
        opt.step()
        opt.zero_grad()
        per_step.append([(n, _key(a), {k: _key(v) for k, v in kw.items()}) for n, a, kw in log])
    assert {n for n, _, _ in per_step[0]} == {"adamw", "sumsq", "step_scalars"}, per_step[0]
    assert per_step[1] == per_step[0] and per_step[2] == per_step[0]
    assert float(opt.step_count) == 3.0
