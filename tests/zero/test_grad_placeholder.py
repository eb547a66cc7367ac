"""See [Note: a grad onto a placeholder] (fusedzero/_grads.py): between backward passes `p.grad` may
be a NoLocalGrad placeholder; the next micro-batch's AccumulateGrad adds onto it, and that add
(and only that one) counts the placeholder as zero. Single process (W=1): what is checked is the
hook path, the same at every world size.

About an internal: fusedzero._grads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedzero import ZeroAdamW
from fusedzero._grads import NoLocalGrad

LR = 1e-2
# create_graph=True: torch warns of the param <-> grad cycle (zero_grad() breaks it here)
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=g) for _ in range(n)]


def _reference(
    batches: list[torch.Tensor], steps: int, create_graph: bool = False
) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(steps):
        for x in batches:
            model(x).square().sum().backward(create_graph=create_graph)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_micro_batches_onto_placeholders_match_torch_adamw(stage: int, create_graph: bool) -> None:
    """Three backwards per step, two steps: from the second backward on, each param's grad
    lands on the placeholder the first one left (in place, or with create_graph=True as a new
    `p.grad`). fp32 tolerance: the same sums in another order."""
    batches = _batches(3)
    model = _model()
    opt = ZeroAdamW(model.parameters(), lr=LR, stage=stage, module=model)
    for _ in range(2):
        for i, x in enumerate(batches):
            model(x).square().sum().backward(create_graph=create_graph)
            if i == 0:
                assert any(type(p.grad) is NoLocalGrad for p in model.parameters())
        opt.step()
        opt.zero_grad()
    opt.close()  # stage 3: the params are left full
    got = [p.detach().clone() for p in model.parameters()]
    for g, r in zip(got, _reference(batches, 2, create_graph)):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def test_any_other_op_on_a_placeholder_during_backward_still_raises() -> None:
    """Only the param's own AccumulateGrad may add onto its placeholder: a user's in-place add
    from a hook inside the next backward raises, naming max_grad_norm."""
    model = _model()
    opt = ZeroAdamW(model.parameters(), lr=LR, stage=2, module=model)
    x = _batches(1)[0]
    model(x).square().sum().backward()
    w = model[0].weight
    assert type(w.grad) is NoLocalGrad
    out = model(x)
    out.register_hook(lambda g: w.grad.add_(torch.ones_like(w)))
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        out.square().sum().backward()
    opt.zero_grad()
    opt.close()


def test_one_hook_per_param() -> None:
    """The grad path installs one hook per param (post-accumulate) and one on the model: a
    second per param (dropping the placeholder before each accumulation) cost ~2 us of host per
    param on every backward."""
    model = _model()
    opt = ZeroAdamW(model.parameters(), lr=LR, stage=2, module=model)
    assert len(opt.grads.hooks) == len(list(model.parameters())) + 1
    opt.close()
