"""A backward that raises (an OOM, an error in a custom Function) runs no end-of-backward
callback: the optimizer must not stay "in backward" (see [Note: a backward that raised] in
fusedzero/_grads.py). Before the fix every later step() raised "step() called during backward"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedzero import ZeroAdamW


class _Boom(torch.autograd.Function):
    """Identity forward; its backward raises while `armed`."""

    armed = False

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        if _Boom.armed:
            raise RuntimeError("boom")
        return g


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_c: bool = True) -> torch.Tensor:
        h = self.a(x)
        h = _Boom.apply(h)  # grads of b (and c) are computed before this raises
        h = self.b(h)
        return self.c(h) if use_c else h


def _raise_in_backward(model: Net, x: torch.Tensor) -> None:
    """One backward of `model` that raises inside _Boom, after b's and c's grads."""
    _Boom.armed = True
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(x).square().sum().backward()
    finally:
        _Boom.armed = False


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_after_a_backward_that_raised_gives_the_clean_run(stage: int) -> None:
    """The raise comes after b's and c's grads (and, at stages 2-3, possibly a launched
    bucket); zero_grad() then discards everything: the next step equals a run that never
    raised, bit for bit."""
    torch.manual_seed(0)
    m1, m2 = Net(), Net()
    m2.load_state_dict(m1.state_dict())
    o1 = ZeroAdamW(m1.parameters(), lr=1e-2, stage=stage, module=m1)
    o2 = ZeroAdamW(m2.parameters(), lr=1e-2, stage=stage, module=m2)
    x = torch.randn(3, 4)
    _raise_in_backward(m1, x)
    o1.zero_grad()
    for m, o in ((m1, o1), (m2, o2)):  # c gets no grad this time
        m(x, use_c=False).square().sum().backward()
        o.step()
        o.zero_grad()
    with o1.gathered_params(), o2.gathered_params():
        for p, q in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_next_forward_recovers_without_zero_grad(stage: int) -> None:
    torch.manual_seed(0)
    m = Net()
    opt = ZeroAdamW(m.parameters(), lr=1e-2, stage=stage, module=m)
    x = torch.randn(3, 4)
    _raise_in_backward(m, x)
    before = [p.detach().clone() for p in m.parameters()] if stage < 3 else None
    m(x).square().sum().backward()  # the forward's hook ends the raised backward
    opt.step()
    assert not opt.grads.in_backward
    if before is not None:
        assert all(not torch.equal(p, q) for p, q in zip(m.parameters(), before))
    opt.close()
