"""What `step()` issues on the Triton path (CUDA's): three kernel launches (sum of squares, the
step's scalars with the AdamW rows, the update) and one torch op (the sum of the sum of squares'
partials), plus at stages 0-1 one op that empties every full grad buffer, where the scalars and
rows were ~35 torch ops, each a launch and host time on CUDA (see [Note: one launch for the step's
scalars] in kernels/_step_scalars.py). No op per param group or per buffer
(before: four launches, the partials' allocation and a zero_ per full grad buffer).

The kernels are stubbed out (nothing runs: what is counted is what the host issues), so the
count is exact and the same on any machine; their arithmetic is tested against the torch path
in tests/kernels/test_step_scalars.py.

About internals: fusedzero.kernels._adamw, fusedzero.kernels._rows,
fusedzero.kernels._step_scalars, fusedzero.kernels._sum_of_squares."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fusedzero import ZeroAdamW
from fusedzero.kernels import (
    LAUNCHES,
    _adamw as adamw,
    _rows as rows,
    _step_scalars as step_scalars,
    _sum_of_squares as sum_of_squares,
)
from fusedzero.testing import fake_group

pytestmark = pytest.mark.interpreter  # FUSEDZERO_BACKEND=triton on CPU tensors


class _Ops(TorchDispatchMode):
    """aten ops but views (`views`: every op, views and collectives included; never the
    profiler's ranges)."""

    def __init__(self, views: bool = False) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.views = views

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace != "profiler" and (
            self.views or (not func.is_view and func.namespace == "aten")
        ):
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


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_step_issues_three_launches_and_one_torch_op_triton_path(
    stubbed, stage: int, clip: float | None
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    groups = [
        {"params": [model[0].weight, model[1].weight]},
        {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
    ]
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
    assert got == {"sumsq": 1, "step_scalars": 1, "adamw": 1}
    # The sum of the sum of squares' partials; stages 0-1 then empty their two full grad
    # buffers (one per group) by one op for the next step's grads.
    want = ["aten.sum.default"] + ["aten._foreach_zero_.default"] * (stage <= 1)
    assert collections.Counter(c.ops) == collections.Counter(want), c.ops
    opt.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_at_two_ranks_adds_only_the_collectives_triton_path(stubbed, stage: int) -> None:
    """At W=2 (a fake group: collectives return at once) step() adds the norm's all-reduce of
    one scalar (stages 1-3: the grads are sharded) and at stages 1-2 one all-gather per bucket
    of updated params, from views made once (no view op per step)."""
    with fake_group(0, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        opt = ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, module=model, max_grad_norm=1.0)
        x = torch.randn(4, 16)
        for _ in range(2):
            model(x).square().sum().backward()
            before = dict(LAUNCHES)
            with _Ops(views=True) as c:
                opt.step()
            opt.zero_grad()
        got = {k: LAUNCHES[k] - before.get(k, 0) for k in LAUNCHES if LAUNCHES[k] != before.get(k)}
        assert got == {"sumsq": 1, "step_scalars": 1, "adamw": 1}
        gathers = sum(b.layout.num_buckets for b in opt.flat_groups) if stage in (1, 2) else 0
        want = (
            ["aten.sum.default", "aten.view.default"]  # the partials' sum, as (1,)
            + ["c10d.allreduce_.default"] * (stage > 0)
            + ["aten._foreach_zero_.default"] * (stage <= 1)
            + ["c10d._allgather_base_.default"] * gathers
        )
        assert collections.Counter(c.ops) == collections.Counter(want), c.ops
        opt.close()
