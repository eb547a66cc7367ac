"""The engine runs any update rule: a rule written here, in a test, with no change to the
engine (buffers, hooks, buckets, state records, plan, state dicts), trains like its torch.optim
counterpart, and its state fields are allocated, counted and carried by name.

About internals: fusedzero.checkpoint._catalog, fusedzero.checkpoint._manifest (the manifest's
rule) and fusedzero.rules._adamw (the AdamW rule a manifest names)."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from fusedzero import checkpoint
from fusedzero.memory_modes import MemoryModes
from fusedzero.optim import ZeroOptimizer
from fusedzero.plan import PlanConfig, plan_groups
from fusedzero.policy import Precision, Sharding
from fusedzero.rules import Block, ByGroup, LocalShard, StateField, StepTensors
from fusedzero.rules._adamw import ADAMW
from fusedzero.testing import fake_group

from _helpers import Stack, TwoLinear


class SGDMomentum:
    """`torch.optim.SGD(momentum=, weight_decay=)` (no dampening, no Nesterov) as a rule: one
    state field, a torch path of foreach ops over each shard's pieces."""

    name = "sgd-momentum"
    element_wise = True
    defaults: Mapping[str, Any] = dict(lr=1e-2, momentum=0.9, weight_decay=0.0)

    def check_group(self, group: Mapping[str, Any]) -> None:
        for k in ("lr", "momentum", "weight_decay"):
            if not group[k] >= 0.0:
                raise ValueError(f"Invalid {k} value: {group[k]}")

    def state_fields(self, modes: MemoryModes) -> tuple[StateField, ...]:
        if modes.quantized:
            raise ValueError("sgd-momentum keeps no int8 state: use states='fp32' or 'bf16'")
        return (StateField(name="momentum_buffer", dtype=modes.state_dtypes[0]),)

    def build(
        self,
        shards: Sequence[LocalShard],
        *,
        device: torch.device,
        num_groups: int,
        modes: MemoryModes,
        seed: torch.Tensor | None,
    ) -> _SGDUpdate:
        if not modes.fp32_master:
            raise ValueError("sgd-momentum writes an fp32 master only")
        return _SGDUpdate(shards)


class _SGDUpdate:
    rows = None  # no per-group rows for the step's scalar launch

    def __init__(self, shards: Sequence[LocalShard]) -> None:
        self.shards = shards

    def read_groups(self, param_groups: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
        return [(float(g["lr"]), g["momentum"], g["weight_decay"]) for g in param_groups]

    def step(self, hyper: Any, scalars: StepTensors, *, rows_written: bool) -> None:
        if scalars.skip.item():  # a host sync: fine for a test rule
            return
        for s in self.shards:
            lr, momentum, wd = hyper[s.group_index]
            params = s.pieces(s.master)
            bufs = s.pieces(s.state["momentum_buffer"])
            grads = torch._foreach_mul(s.pieces(s.grad), scalars.grad_scale.reshape(()))
            if wd:
                torch._foreach_add_(grads, params, alpha=wd)
            # The buffer starts at zero: momentum * 0 + g is torch's first-step clone of g.
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads)
            torch._foreach_add_(params, bufs, alpha=-lr)
            if s.out is not None:
                torch._foreach_copy_(s.pieces(s.out), params)


SGD = SGDMomentum()


class PerMatrix(SGDMomentum):
    """The same math, declared per-matrix (needs whole tensors on one rank): it checks that
    every param of its shards is there whole, as a Newton-Schulz rule would need."""

    name = "per-matrix"
    element_wise = False

    def blocks(self, shape: tuple[int, ...]) -> Block:
        n = math.prod(shape)
        return Block(n, n)  # every param one block, its size its cost

    def build(self, shards: Sequence[LocalShard], **kw: Any) -> _SGDUpdate:
        held = [t.param for s in shards for t in s.whole_tensors()]  # raises if one is cut
        assert sorted(held) == sorted({seg.param for s in shards for seg in s.segments})
        return super().build(shards, **kw)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _groups(m: Stack) -> list[dict[str, Any]]:
    decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 0.05}]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_rule_the_engine_never_saw_trains_bitwise_like_torch_sgd(stage: int) -> None:
    """SGD with momentum and weight decay, two param groups, 4 steps at every stage on one
    rank: the params equal `torch.optim.SGD`'s bit for bit (the same fp32 ops in the same
    order; grads are reduced in fp32 and divided by W = 1), and the momentum buffers sit in
    the rule's field, read by name from the state records."""
    torch.manual_seed(0)
    model = Stack()
    ref = copy.deepcopy(model)
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    opt = ZeroOptimizer(_groups(model), SGD, hyper, stage=stage, module=model)
    _train(model, opt)
    ref_opt = torch.optim.SGD(_groups(ref), **hyper)
    _train(ref, ref_opt)
    with opt.gathered_params():
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), f"{n}: max diff {(p - q).abs().max().item()}"
    st = opt.shard_state()
    assert st.names() == ("master", "momentum_buffer")
    want = {id(p): ref_opt.state[p]["momentum_buffer"] for p in ref.parameters()}
    refs = dict(zip(map(id, model.parameters()), ref.parameters(), strict=True))
    for info, buf in zip(opt.shard_infos(), st.momentum_buffer, strict=True):
        for seg in info.segments():
            p = opt.params[seg.param]
            got = buf[seg.local : seg.local + seg.length]
            exp = want[id(refs[id(p)])].reshape(-1)[seg.start : seg.start + seg.length]
            assert torch.equal(got, exp), f"momentum of {opt.param_names[seg.param]}"
    opt.close()


MIXED = ByGroup("rule", {"sgd": SGD, "adamw": ADAMW}, {"sgd": dict(lr=0.1, weight_decay=0.01)})


def _mixed_groups(m: Stack) -> list[dict[str, Any]]:
    """The blocks' weights to SGD, their biases and the head to AdamW (two groups)."""
    named = dict(m.named_parameters())
    w = [p for n, p in named.items() if n.startswith("blocks") and n.endswith("weight")]
    b = [p for n, p in named.items() if n.startswith("blocks") and n.endswith("bias")]
    head = [named["head.weight"], named["head.bias"]]
    return [
        {"params": w, "rule": "sgd"},
        {"params": b, "rule": "adamw", "lr": 0.01},
        {"params": head, "rule": "adamw", "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_groups_running_different_rules_train_like_their_torch_optimizers(stage: int) -> None:
    """One optimizer (one set of hooks) whose groups run SGD and AdamW, 4 steps at every stage
    on one rank: the params match `torch.optim.SGD` on the SGD group plus `torch.optim.AdamW`
    on the others (each group filled from its own rule's defaults) to an ulp: the AdamW kernel
    orders its fp32 ops otherwise than torch (ZeroAdamW alone differs from torch.optim.AdamW by
    as much, test_optimizer.py), and through the forward that reaches the SGD params too. Each
    buffer
    holds its own rule's fields (None for the other's in the state record), and a state dict
    carries both into a fresh optimizer that then steps identically."""
    torch.manual_seed(0)
    model = Stack()
    ref = copy.deepcopy(model)
    twin = copy.deepcopy(model)
    opt = ZeroOptimizer(_mixed_groups(model), MIXED, stage=stage, module=model)
    assert [r.name for r in opt.group_rules] == ["sgd-momentum", "adamw", "adamw"]
    assert opt.rule is None
    assert opt.param_groups[0]["momentum"] == 0.9 and "betas" not in opt.param_groups[0]
    assert opt.param_groups[2]["betas"] == (0.9, 0.999) and "momentum" not in opt.param_groups[2]
    _train(model, opt)
    groups = _mixed_groups(ref)
    sgd = torch.optim.SGD(groups[0]["params"], lr=0.1, momentum=0.9, weight_decay=0.01)
    adamw = torch.optim.AdamW([{k: v for k, v in g.items() if k != "rule"} for g in groups[1:]])
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ref(torch.randn(8, 16, generator=g)).square().mean().backward()
        sgd.step()
        adamw.step()
        sgd.zero_grad()
        adamw.zero_grad()
    with opt.gathered_params():
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
    st = opt.shard_state()
    assert st.names() == ("master", "momentum_buffer", "exp_avg", "exp_avg_sq")
    for info, mom, m in zip(opt.shard_infos(), st.momentum_buffer, st.exp_avg, strict=True):
        assert (mom is None) == (info.group_index != 0) and (m is None) == (mom is not None)
    assert opt.memory().optimizer == sum(
        (4 if i.group_index == 0 else 8) * i.local_numel for i in opt.shard_infos()
    )

    opt2 = ZeroOptimizer(_mixed_groups(twin), MIXED, stage=stage, module=twin)
    opt2.load_state_dict(opt.state_dict())
    x = torch.randn(8, 16)
    for m, o in ((model, opt), (twin, opt2)):
        m(x).square().mean().backward()
        o.step()
        with o.gathered_params():
            pass
    with opt.gathered_params(), opt2.gathered_params():
        for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), n
    opt.close()
    opt2.close()


def test_a_group_without_its_rule_key_is_refused_and_checked_by_its_own_rule() -> None:
    """With rules by group, a group that names no rule (or an unknown one) is refused naming
    the key; each group's hyper-parameters are checked by its own rule."""
    model = Stack()
    with pytest.raises(ValueError, match="has no 'rule'"):
        ZeroOptimizer(model.parameters(), MIXED)
    with pytest.raises(ValueError, match="rule='lion', expected one of"):
        ZeroOptimizer([{"params": list(model.parameters()), "rule": "lion"}], MIXED)
    with pytest.raises(ValueError, match="Invalid momentum value: -1"):
        ZeroOptimizer(
            [{"params": list(model.parameters()), "rule": "sgd", "momentum": -1.0}], MIXED
        )


def test_a_checkpoint_of_groups_running_a_rule_it_cannot_name_is_refused(tmp_path) -> None:
    """Where groups run different rules the manifest names each group's; one of them unknown
    to the format (the test's SGD) is refused when saving, naming it, and nothing is
    written."""
    model = Stack()
    opt = ZeroOptimizer(_mixed_groups(model), MIXED, stage=1, module=model)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="not 'sgd-momentum'"):
        checkpoint.save(opt, tmp_path / "ck", step=1).wait()
    assert not any((tmp_path / "ck").glob("step-*"))
    opt.close()


def test_the_rule_s_fields_are_what_memory_plan_and_state_dicts_hold() -> None:
    """One fp32 field per element: `opt.memory()` counts it (fp32 params are their own master),
    `plan` predicts the same bytes from the rule, bf16 states halve it, and a state dict
    carries it by name into a fresh optimizer that then steps identically."""
    torch.manual_seed(0)
    model = TwoLinear(16, 33, 5)
    opt = ZeroOptimizer(model.parameters(), SGD, stage=1, module=model)
    n_local = sum(i.local_numel for i in opt.shard_infos())
    assert opt.memory().optimizer == 4 * n_local
    cfg = PlanConfig(world_size=1, precision=Precision(param_dtype=torch.float32), rule=SGD)
    plan = plan_groups([list(model.named_parameters())], cfg, model=model)
    assert plan.stages[1].optimizer_bytes == opt.memory().optimizer
    half = ZeroOptimizer(
        copy.deepcopy(model).parameters(), SGD, stage=1, precision=Precision(states="bf16")
    )
    assert half.memory().optimizer == 2 * n_local
    half.close()

    x = torch.randn(4, 16)
    twin = copy.deepcopy(model)  # other values after the step below, until the load
    model(x).sum().backward()
    opt.step()
    opt2 = ZeroOptimizer(twin.parameters(), SGD, stage=1, module=twin)
    sd = opt.state_dict()
    assert set(sd["state"]["flat"][0]) == {"master", "momentum_buffer"}
    opt2.load_state_dict(sd)
    for m, o in ((model, opt), (twin, opt2)):
        m(x).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    opt.close()
    opt2.close()


def test_rule_checks_its_hyper_parameters_and_refuses_what_it_cannot_hold() -> None:
    """The rule's own validation runs on the defaults and on every group, and a memory mode
    the rule has no field for is refused by the rule, naming it."""
    model = TwoLinear(4, 4, 2)
    with pytest.raises(ValueError, match="Invalid momentum value: -0.5"):
        ZeroOptimizer(model.parameters(), SGD, dict(lr=0.1, momentum=-0.5, weight_decay=0.0))
    with pytest.raises(ValueError, match="Invalid lr value: -1"):
        ZeroOptimizer([{"params": list(model.parameters()), "lr": -1}], SGD)
    with pytest.raises(ValueError, match="no int8 state"):
        ZeroOptimizer(model.parameters(), SGD, precision=Precision(states="int8"))


def test_a_checkpoint_refuses_a_rule_it_cannot_name_before_writing(tmp_path) -> None:
    """Checkpoints name the rule whose state their shards hold; a rule the format does not list
    is refused when saving, naming the rules it holds, and nothing is written."""
    model = TwoLinear(4, 4, 2)
    opt = ZeroOptimizer(model.parameters(), SGD, stage=1, module=model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"update rules \['adamw', 'muon'\], not 'sgd-momentum'"):
        checkpoint.save(opt, tmp_path / "ck", step=1).wait()
    assert not any((tmp_path / "ck").glob("step-*"))
    opt.close()


def test_a_per_matrix_rule_gets_whole_tensors_at_every_stage_and_world_size() -> None:
    """`element_wise = False` with its `blocks`: on one rank (whole tensors in the local shard)
    it trains as the element-wise rule; sharded over 2 ranks (rank r of a fake group) at stages
    1-3 the owner layout hands each rank whole tensors only, and each tensor to one rank: no
    engine code knows the rule."""
    torch.manual_seed(0)
    a = TwoLinear(16, 33, 5)
    b = copy.deepcopy(a)
    opts = [
        ZeroOptimizer(m.parameters(), r, stage=2, module=m) for m, r in ((a, PerMatrix()), (b, SGD))
    ]
    for m, o in zip((a, b), opts):
        m(torch.ones(2, 16)).sum().backward()
        o.step()
        o.close()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    # One rank, buckets of 512 elements: a.weight (528) straddles two and is still whole.
    d = copy.deepcopy(a)
    ZeroOptimizer(
        d.parameters(), PerMatrix(), stage=1, module=d, sharding=Sharding(bucket_numel=512)
    ).close()
    for stage in (1, 2, 3):
        owners: dict[int, int] = {}
        for r in range(2):
            with fake_group(r, 2):
                c = TwoLinear(16, 33, 5)
                o = ZeroOptimizer(c.parameters(), PerMatrix(), stage=stage, module=c, device="cpu")
                for buf in o.flat_groups:
                    for t in buf.local_shard().whole_tensors():
                        assert t.param not in owners, (stage, t.param)
                        owners[t.param] = r
                o.close()
        assert sorted(owners) == list(range(4)) and set(owners.values()) == {0, 1}, stage


def test_a_manifest_names_its_rule_and_one_without_holds_adamw(tmp_path) -> None:
    """A ZeroAdamW checkpoint's manifest says "adamw"; a manifest without the key (every one
    written before it existed) reads as AdamW; an unknown rule is refused by the schema."""
    from fusedzero import ZeroAdamW
    from fusedzero.checkpoint._catalog import read_manifest
    from fusedzero.checkpoint._manifest import CheckpointError, manifest_rule, validate
    from fusedzero.rules._adamw import ADAMW

    model = TwoLinear(4, 4, 2)
    opt = ZeroAdamW(model.parameters(), stage=1, module=model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    m = read_manifest(checkpoint.save(opt, tmp_path, step=1).wait())
    opt.close()
    assert m["rule"] == "adamw" and manifest_rule(m) is ADAMW
    del m["rule"]
    assert manifest_rule(m) is ADAMW
    with pytest.raises(CheckpointError, match="rule.*expected one of \\['adamw', 'muon'\\]"):
        validate({**m, "rule": "sgd-momentum"}, tmp_path / "manifest.json")


def test_a_shard_state_field_the_rule_does_not_keep_is_refused() -> None:
    """A ShardState carries fields by name, so a misspelt or foreign field would otherwise be
    dropped silently on load: it is refused, naming the rule's fields."""
    from fusedzero.state import ShardState

    model = TwoLinear(4, 4, 2)
    opt = ZeroOptimizer(model.parameters(), SGD, stage=1, module=model)
    bad = [torch.zeros(i.local_numel) for i in opt.shard_infos()]
    with pytest.raises(ValueError, match=r"\['exp_avg'\].*keeps \['master', 'momentum_buffer'\]"):
        opt.load_shard_state(ShardState(exp_avg=bad))
    opt.close()
