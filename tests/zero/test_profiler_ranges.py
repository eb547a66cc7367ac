"""Each phase of a step is a named range in a user's torch.profiler trace (see
[Note: profiler ranges] in fusedzero/_profiling.py), and without a profiler running none is
entered: a range costs ~12 us of host even then, per bucket and per unit."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from fusedzero import Sharding, ZeroAdamW
from fusedzero.testing import fake_group

COMMON = {
    "fusedzero::step",
    "fusedzero::grad_norm",
    "fusedzero::update",
    "fusedzero::end_backward",
    "fusedzero::zero_grad",
    "fusedzero::reduce_wait",
}
BY_STAGE = {
    0: {"fusedzero::all_reduce"},
    1: {"fusedzero::reduce_scatter", "fusedzero::all_gather", "fusedzero::param_wait"},
    3: {
        "fusedzero::reduce_scatter",
        "fusedzero::unit_gather",
        "fusedzero::unit_wait",
        "fusedzero::unit_free",
    },
}


class _ProfilerOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "profiler":
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _model_and_opt(stage: int) -> tuple[nn.Module, ZeroAdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    return model, ZeroAdamW(
        model.parameters(),
        lr=1e-3,
        stage=stage,
        module=model,
        max_grad_norm=1.0,
        sharding=Sharding(units=nn.Linear),
    )


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_every_phase_is_a_named_range_in_the_trace_fake_2_ranks(stage: int) -> None:
    x = torch.randn(4, 8)
    with fake_group(0, 2):
        model, opt = _model_and_opt(stage)
        model(x).square().sum().backward()  # the first step records the gather order
        opt.step()
        opt.zero_grad()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        opt.close()
    names = {e.key for e in prof.key_averages() if e.key.startswith("fusedzero::")}
    assert COMMON | BY_STAGE[stage] <= names, sorted(COMMON | BY_STAGE[stage] - names)


def test_no_range_is_entered_without_a_profiler() -> None:
    x = torch.randn(4, 8)
    with fake_group(0, 2):
        model, opt = _model_and_opt(3)
        for _ in range(2):
            with _ProfilerOps() as c:
                model(x).square().sum().backward()
                opt.zero_grad()
        opt.close()
    assert not c.ops, c.ops
