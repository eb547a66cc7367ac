"""What `step()` issues on the Triton path (CUDA's): four kernel launches (sum of squares, the
step's scalars, the AdamW rows, the update) and two torch ops (the partial sums' buffer and their
sum), where the scalars and rows were ~35 torch ops, each a launch and host time on CUDA
(see [Note: one launch for the step's scalars] in kernels/step_scalars.py).

The kernels are stubbed out (nothing runs: what is counted is what the host issues), so the
count is exact and the same on any machine; their arithmetic is tested against the torch path
in tests/kernels/test_step_scalars.py."""
from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fusedzero import ZeroAdamW
from fusedzero.kernels import LAUNCHES, adamw, rows, step_scalars, sum_of_squares

pytestmark = pytest.mark.interpreter  # FUSEDZERO_BACKEND=triton on CPU tensors


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view and func.namespace == "aten":
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _NoKernel:
    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: None


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEDZERO_BACKEND", "triton")
    monkeypatch.setattr(adamw, "_grouped_adamw_kernel", _NoKernel())
    monkeypatch.setattr(sum_of_squares, "_grouped_sumsq_kernel", _NoKernel())
    monkeypatch.setattr(rows, "_adamw_rows_kernel", _NoKernel())
    monkeypatch.setattr(step_scalars, "_step_scalars_kernel", _NoKernel())


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_step_issues_four_launches_and_two_torch_ops_triton_path(stubbed, stage: int,
                                                                 clip: float | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    groups = [{"params": [model[0].weight, model[1].weight]},
              {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0}]
    opt = ZeroAdamW(groups, lr=1e-3, stage=stage, module=model, max_grad_norm=clip)
    x = torch.randn(4, 16)
    for _ in range(2):
        model(x).square().sum().backward()
        before = dict(LAUNCHES)
        with _Ops() as c:
            opt.step()
        opt.zero_grad()
    got = {k: LAUNCHES[k] - before.get(k, 0) for k in LAUNCHES if LAUNCHES[k] != before.get(k)}
    # The norm is computed with or without a clip (skip_nonfinite is on by default).
    assert got == {"sumsq": 1, "step_scalars": 1, "rows": 1, "adamw": 1}
    # The sum of squares' partials (empty) and their sum; stage 0 then empties its two full
    # grad buffers (one per group) for the next step's grads.
    want = ["aten.empty.memory_format", "aten.sum.default"] + ["aten.zero_.default"] * 2 * (
        stage == 0)
    assert collections.Counter(c.ops) == collections.Counter(want), c.ops
    opt.close()
