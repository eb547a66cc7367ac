"""Single-process semantics: detaching an optimizer (close, abandon), params frozen after
construction, reentrant checkpointing without a module. (Multi-rank items: test_parity.py.)"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedzero import Sharding, ZeroAdamW

from _helpers import TwoLinear

LR = 1e-3


class Net(TwoLinear):
    def __init__(self) -> None:
        super().__init__(6, 13, 4)


def make() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def loss(m: nn.Module, step: int) -> torch.Tensor:
    return m(batch(step)).square().mean()


def build(m: Net, stage: int, **kw) -> ZeroAdamW:
    return ZeroAdamW(
        m.parameters(),
        lr=LR,
        stage=stage,
        module=m,
        sharding=Sharding(bucket_numel=128, units=nn.Linear),
        **kw,
    )


def hooks_left(m: nn.Module) -> int:
    n = 0
    for mod in m.modules():
        n += len(mod._forward_hooks) + len(mod._forward_pre_hooks)
    for p in m.parameters():
        n += len(p._backward_hooks or {}) + len(
            getattr(p, "_post_accumulate_grad_hooks", None) or {}
        )
    return n


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_close_removes_every_hook_and_a_live_optimizer_refuses_a_second(stage: int) -> None:
    """A second optimizer on a model with a live one is refused; after
    close() no hook of ours is left, the params keep their values, and a new optimizer trains
    exactly like a fresh torch.optim.AdamW from there."""
    m, ref_m = make(), make()
    assert hooks_left(m) == 0
    opt = build(m, stage)
    with pytest.raises(ValueError, match=r"a\.weight already belongs to a live ZeroAdamW.*close"):
        build(m, stage)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=LR)
    for model, o in ((m, opt), (ref_m, ref)):
        loss(model, 0).backward()
        o.step()
        o.zero_grad()
    opt.close()
    opt.close()  # idempotent
    assert hooks_left(m) == 0
    assert all(p.grad is None for p in m.parameters())
    for p, q in zip(m.parameters(), ref_m.parameters()):  # stage 3: full values, own storage
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    opt2 = build(m, stage)  # no longer refused; one set of hooks
    ref2 = torch.optim.AdamW(ref_m.parameters(), lr=LR)
    for step in (1, 2):
        for model, o in ((m, opt2), (ref_m, ref2)):
            loss(model, step).backward()
            o.step()
            o.zero_grad()
    with opt2.gathered_params():
        for p, q in zip(m.parameters(), ref_m.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [0, 3])
def test_abandon_removes_every_hook_and_leaves_full_shaped_params(stage: int) -> None:
    """abandon() (after a failed run: no collective, no wait) detaches like close(); the params
    keep their full shapes: at stages 0-2 their values too, at stage 3 (where this rank had only
    its shard) storage of their own filled with NaN, for a checkpoint load to fill."""
    m = make()
    opt = build(m, stage)
    loss(m, 0).backward()
    opt.step()
    with opt.gathered_params():
        before = [p.detach().clone() for p in m.parameters()]
    opt.abandon()
    opt.abandon()  # a no-op once closed
    assert hooks_left(m) == 0 and not m._state_dict_pre_hooks
    assert all(p.grad is None for p in m.parameters())
    for p, b in zip(m.parameters(), before):
        assert p.shape == b.shape and p.dtype == b.dtype
        assert torch.equal(p.detach(), b) if stage < 3 else p.isnan().all()
    if stage == 3:  # each its own storage, off the unit buffers
        assert len({p.untyped_storage().data_ptr() for p in m.parameters()}) == 4
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    build(m, 0).close()  # released: a new optimizer is no longer refused


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_param_frozen_after_build_is_refused_at_step_naming_it(stage: int) -> None:
    """The fused update would keep moving a param frozen after construction
    (momentum, weight decay); step() refuses before touching anything, naming it."""
    m = make()
    opt = build(m, stage)
    loss(m, 0).backward()
    opt.step()
    m.a.weight.requires_grad_(False)
    loss(m, 1).backward()
    with opt.gathered_params():
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(RuntimeError, match=r"\['a\.weight'\].*requires_grad=False after"):
        opt.step()
    with opt.gathered_params():
        for n, p in m.named_parameters():
            assert torch.equal(p, before[n]), n
    m.a.weight.requires_grad_(True)  # unfrozen again: the step goes through
    opt.step()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_reentrant_checkpointing_without_module_is_refused_clearly(stage: int) -> None:
    """The case the fix cannot cover: without `module` the end-of-backward
    callback can only be queued from the first grad, which a reentrant checkpoint delivers
    from its nested graph task. It is detected and refused, naming the two ways out. (With
    `module=` it works: test_parity.py::test_reentrant_activation_checkpointing_at_every_stage.)"""
    m = make()
    m.b.forward = functools.partial(checkpoint, m.b.forward, use_reentrant=True)
    ZeroAdamW(m.parameters(), lr=LR, stage=stage, sharding=Sharding(bucket_numel=128))
    with pytest.raises(
        RuntimeError, match="use_reentrant.*module=model|module=model.*use_reentrant"
    ):
        loss(m, 0).backward()
