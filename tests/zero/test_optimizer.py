"""The single-process optimizer contract (world size 1: the degenerate case of the same code)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fusedzero import Groups, Precision, Sharding, Wire, ZeroAdamW
from fusedzero.kernels import LAUNCHES

from _helpers import TwoLinear


class Net(TwoLinear):
    """Uneven shapes: 17x33 (561), 33, 5x33 (165), 5 elements."""

    def __init__(self) -> None:
        super().__init__(17, 33, 5)


def groups(m: Net, lr2: float = 3e-3) -> list[dict]:
    return [
        {"params": [m.a.weight, m.b.weight]},
        {
            "params": [m.a.bias, m.b.bias],
            "weight_decay": 0.0,
            "lr": lr2,
            "betas": (0.8, 0.99),
            "eps": 1e-6,
        },
    ]


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 17, generator=torch.Generator().manual_seed(step))


def make(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def assert_close(a: nn.Module, b: nn.Module, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_torch_adamw_25_steps_two_groups_with_scheduler(stage: int) -> None:
    ref_m, m = make(), make()
    ref = torch.optim.AdamW(groups(ref_m), lr=1e-3, weight_decay=0.05)
    opt = ZeroAdamW(
        groups(m),
        lr=1e-3,
        weight_decay=0.05,
        stage=stage,
        module=m,
        sharding=Sharding(bucket_numel=200, units=nn.Linear),
    )
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ref, opt)]
    for step in range(25):
        for model, o in ((ref_m, ref), (m, opt)):
            model(batch(step)).square().mean().backward()
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    assert opt.param_groups[1]["lr"] == ref.param_groups[1]["lr"]
    with opt.gathered_params():
        # fp32 rounding: torch's fused CPU kernel vs its single-tensor path, 25 steps.
        assert_close(m, ref_m, rtol=1e-6, atol=1e-7)


def test_bf16_params_equal_cast_of_master_after_every_step() -> None:
    m = make()
    opt = ZeroAdamW(
        m.parameters(),
        lr=1e-2,
        precision=Precision(param_dtype=torch.bfloat16),
        sharding=Sharding(bucket_numel=200),
    )
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    (fg,) = opt.flat_groups
    for step in range(5):
        m(batch(step).bfloat16()).float().square().mean().backward()
        opt.step()
        master = opt.shards.master(fg)
        for seg in fg.layout.segments(0):
            p = opt.params[seg.param].detach().reshape(-1)[seg.start : seg.start + seg.length]
            ref = master[seg.local : seg.local + seg.length].to(torch.bfloat16)
            assert torch.equal(p, ref)


def test_one_kernel_launch_per_dtype_combination_not_per_group_or_buffer() -> None:
    m = make()
    m.b.to(torch.bfloat16)  # two dtypes in each of the two groups
    opt = ZeroAdamW(groups(m), lr=1e-3, max_grad_norm=1.0, sharding=Sharding(bucket_numel=64))
    assert len(opt.flat_groups) == 4
    assert sum(fg.layout.num_buckets for fg in opt.flat_groups) > 4  # several buckets each
    x = batch(0)
    m.b(torch.tanh(m.a(x)).bfloat16()).float().square().mean().backward()
    before = dict(LAUNCHES)
    opt.step()
    # fp32 grads everywhere (reduce_dtype); fp32 params are their own master (no output), bf16
    # params get a bf16 copy: (fp32, None) and (fp32, bf16), whatever the groups and buckets.
    assert LAUNCHES["adamw"] - before.get("adamw", 0) == 2
    assert LAUNCHES["sumsq"] - before.get("sumsq", 0) == 1, "one grad dtype: one norm launch"


@pytest.mark.interpreter
def test_triton_interpreter_step_matches_torch_path_interpreter_only(monkeypatch) -> None:
    results = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("FUSEDZERO_BACKEND", backend)
        m = make()
        opt = ZeroAdamW(
            groups(m),
            lr=1e-3,
            max_grad_norm=0.5,
            precision=Precision(param_dtype=torch.bfloat16),
            sharding=Sharding(bucket_numel=200),
        )
        for step in range(3):
            m(batch(step).bfloat16()).float().square().mean().backward()
            opt.step()
        results.append([opt.shards.master(fg).clone() for fg in opt.flat_groups])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-8)


class _ScalarReads(TorchDispatchMode):
    """Records every read of a tensor's value by the host (.item(), bool(), float(), ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.interpreter
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_reads_no_tensor_value_on_host_triton_interpreter_only(monkeypatch, stage) -> None:
    """On CUDA every such read is a device sync. The Triton path must make none; the check is
    shown able to fail by the torch CPU path, which reads the skip flag (free on CPU)."""
    counts = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("FUSEDZERO_BACKEND", backend)
        m = make()
        opt = ZeroAdamW(
            m.parameters(),
            lr=1e-3,
            stage=stage,
            module=m,
            max_grad_norm=1.0,
            precision=Precision(loss_scale="dynamic"),
            sharding=Sharding(units=nn.Linear),
        )
        opt.scale_loss(m(batch(0)).square().mean()).backward()
        with _ScalarReads() as mode:
            opt.step()
        counts[backend] = mode.reads
    assert counts["triton"] == 0
    assert counts["torch"] > 0


def test_state_dict_round_trip_continues_identically() -> None:
    m1 = make()
    o1 = ZeroAdamW(
        groups(m1),
        lr=1e-3,
        precision=Precision(param_dtype=torch.bfloat16),
        sharding=Sharding(bucket_numel=200),
    )
    for step in range(3):
        m1(batch(step).bfloat16()).float().square().mean().backward()
        o1.step()
    sd = o1.state_dict()
    m2 = make(seed=1)
    o2 = ZeroAdamW(
        groups(m2),
        lr=5.0,
        precision=Precision(param_dtype=torch.bfloat16),
        sharding=Sharding(bucket_numel=200),
    )
    o2.load_state_dict(sd)
    assert o2.param_groups[1]["lr"] == 3e-3
    for step in range(3, 6):
        for m, o in ((m1, o1), (m2, o2)):
            m(batch(step).bfloat16()).float().square().mean().backward()
            o.step()
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    other = ZeroAdamW(make().parameters(), lr=1e-3, sharding=Sharding(bucket_numel=100))
    with pytest.raises(ValueError, match="layout"):
        other.load_state_dict(sd)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_maximize_and_zero_grad_drop_a_micro_batch(stage: int) -> None:
    ref_m, m = make(), make()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-3, maximize=True)
    opt = ZeroAdamW(
        m.parameters(),
        lr=1e-3,
        maximize=True,
        stage=stage,
        module=m,
        sharding=Sharding(bucket_numel=200, units=nn.Linear),
    )
    for step in range(3):
        m(batch(99)).square().mean().backward()
        opt.zero_grad()  # dropped: must not reach the update
        for model, o in ((ref_m, ref), (m, opt)):
            model(batch(step)).square().mean().backward()
            o.step()
            o.zero_grad()
    with opt.gathered_params():
        assert_close(m, ref_m)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_second_step_without_backward_is_refused_and_changes_nothing(stage: int) -> None:
    """See [Note: one step per backward] torch keeps `.grad` until zero_grad(),
    so its second step applies the same grads again; ours consumed them, and a second step
    applied zero grads (3.3e-3 away from torch's). It is refused in one line, after a step and
    after zero_grad(), leaving the params where torch's first step put them; the next
    backward and step match torch's zero_grad, backward, step."""
    ref_m, m = make(), make()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-3)
    opt = ZeroAdamW(
        m.parameters(),
        lr=1e-3,
        stage=stage,
        module=m,
        sharding=Sharding(bucket_numel=200, units=nn.Linear),
    )
    for model, o in ((ref_m, ref), (m, opt)):
        model(batch(0)).square().mean().backward()
        o.step()
    for again in (opt.step, lambda: (opt.zero_grad(), opt.step())):
        with pytest.raises(RuntimeError, match="^step\\(\\) without a backward since the last"):
            again()
        with opt.gathered_params():
            assert_close(m, ref_m)
    for model, o in ((ref_m, ref), (m, opt)):
        o.zero_grad()
        model(batch(1)).square().mean().backward()
        o.step()
    with opt.gathered_params():
        assert_close(m, ref_m)
    opt.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_nan_lr_set_after_construction_is_refused_at_step(stage: int) -> None:
    """`param_groups[i]["lr"] = nan` set after construction once made every param NaN. step()
    refuses it in one line naming the group, where the lr is read on the host anyway, before
    anything is written; a valid lr given to another group in the same step is not lost."""
    ref_m, m = make(), make()

    def groups(mod: nn.Module) -> list[dict]:
        return [
            {"params": [mod.a.weight, mod.b.weight]},
            {"params": [mod.a.bias, mod.b.bias], "weight_decay": 0.0},
        ]

    ref = torch.optim.AdamW(groups(ref_m), lr=1e-3)
    opt = ZeroAdamW(groups(m), lr=1e-3, stage=stage, module=m, sharding=Sharding(units=nn.Linear))
    for model, o in ((ref_m, ref), (m, opt)):
        model(batch(0)).square().mean().backward()
        o.param_groups[0]["lr"] = 2e-3
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"^param_groups\[1\]\['lr'\] is nan: lr must be"):
        opt.step()
    with opt.gathered_params():
        assert all(bool(p.isfinite().all()) for p in m.parameters())
    opt.param_groups[1]["lr"] = 1e-3
    opt.step()
    ref.step()
    with opt.gathered_params():
        assert_close(m, ref_m)
    opt.close()


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_grad_after_step_zeroes_once_and_still_clears_user_writes(stage: int) -> None:
    """See [Note: zeroing once]: `step()` consumes (zeroes) the full grad buffers; the usual
    `zero_grad()` right after must not make a second pass over them, yet a write into `.grad`
    in between is still cleared."""
    m = make()
    opt = ZeroAdamW(
        m.parameters(), lr=1e-3, stage=stage, module=m, sharding=Sharding(bucket_numel=200)
    )
    flats = [b.grad_flat for b in opt.flat_groups]
    m(batch(0)).square().mean().backward()
    assert any(bool(g.ne(0).any()) for g in flats)
    opt.step()
    assert all(bool(g.eq(0).all()) for g in flats)
    versions = [g._version for g in flats]
    opt.zero_grad()
    assert [g._version for g in flats] == versions, "zero_grad() zeroed consumed buffers again"
    p = next(m.parameters())
    p.grad.add_(1.0)  # a view of the grad buffer: the write must not survive zero_grad()
    opt.zero_grad()
    assert all(bool(g.eq(0).all()) for g in flats)


def test_dynamic_loss_scale_skips_inf_step_and_backs_off() -> None:
    m = make()
    opt = ZeroAdamW(m.parameters(), lr=1e-3, precision=Precision(loss_scale="dynamic"))
    before = [p.detach().clone() for p in m.parameters()]
    scale0 = opt.scaler.scale.item()
    (opt.scale_loss(m(batch(0)).square().mean()) * float("inf")).backward()
    opt.step()
    assert opt.skipped.item() == 1.0 and opt.step_count.item() == 0
    assert opt.scaler.scale.item() == scale0 / 2
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p, b)
    # A finite step with the scale applied equals an unscaled torch step.
    ref_m = make()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-3)
    ref_m(batch(1)).square().mean().backward()
    ref.step()
    opt.scale_loss(m(batch(1)).square().mean()).backward()
    opt.step()
    assert opt.step_count.item() == 1
    assert_close(m, ref_m)


def test_unused_frozen_and_zero_size_params() -> None:
    m = make()
    m.a.weight.requires_grad_(False)
    empty = nn.Parameter(torch.zeros(0, 3))
    opt = ZeroAdamW([*m.parameters(), empty], lr=1e-3)
    assert all(p is not m.a.weight for p in opt.params)
    w = m.a.weight.detach().clone()
    m(batch(0)).square().mean().backward()
    opt.step()
    assert torch.equal(m.a.weight, w)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "learning rate"),
        ({"eps": -1e-8}, "epsilon"),
        # Stricter than torch.optim.AdamW on purpose: eps 0 divides by zero at a zero second
        # moment; values outside fp32's range are inf (or 0) in the fp32 update.
        ({"eps": 0.0}, r"epsilon value: 0.0 \(must be > 0"),
        ({"eps": 1e-50}, r"epsilon value: 1e-50 \(must be > 0"),
        ({"eps": float("inf")}, "epsilon value: inf"),
        ({"lr": float("inf")}, r"learning rate: inf \(must be finite in fp32"),
        ({"lr": 1e300}, r"learning rate: 1e\+300 \(must be finite in fp32"),
        ({"lr": torch.tensor(float("inf"))}, "must be finite in fp32"),
        ({"lr": float("nan")}, "learning rate: nan"),
        ({"weight_decay": float("inf")}, r"weight_decay value: inf \(must be finite in fp32"),
        ({"betas": (1.0, 0.999)}, "beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "beta parameter at index 1"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"stage": 4}, r"ZeroAdamW\(stage=4\): expected 0, 1, 2 or 3"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"stage": 3}, "module=model"),
    ],
)
def test_bad_hyper_parameters_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroAdamW(make().parameters(), **kwargs)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Precision(reduce_dtype=torch.int32), r"Precision\(reduce_dtype=torch.int32\)"),
        (lambda: Precision(param_dtype=torch.float64), "param_dtype=torch.float64"),
        (lambda: Precision(master="kahan"), r"Precision\(master='kahan'\): expected one of"),
        (lambda: Precision(states="int4"), r"Precision\(states='int4'\)"),
        (lambda: Precision(loss_scale=-2.0), r"Precision\(loss_scale=-2.0\)"),
        (lambda: Precision(loss_scale="static"), "loss_scale='static'"),
        (
            lambda: Precision(master="bf16-sr", param_dtype=torch.float16),
            "param_dtype=torch.bfloat16",
        ),
        (lambda: Wire(grads="int4"), r"Wire\(grads='int4'\): expected None or one of \['fp32'"),
        (lambda: Wire(params="fp8"), r"Wire\(params='fp8'\)"),
        (lambda: Sharding(bucket_numel=0), r"Sharding\(bucket_numel=0\)"),
        (lambda: Sharding(units=0), r"Sharding\(units=0\)"),
    ],
)
def test_bad_policy_fields_raise_naming_the_value(build: Any, match: str) -> None:
    """The records validate themselves when built: the message names the field and value."""
    with pytest.raises(ValueError, match=match):
        build()


def test_the_literal_choices_are_the_kernels_and_wire_formats() -> None:
    """The records' Literal types and the tuples the kernels and wire formats accept agree: a
    mode added to one and not the other would be refused, or reach a kernel unchecked."""
    from typing import get_args

    from fusedzero import policy
    from fusedzero.kernels import MASTER_MODES, STATE_MODES
    from fusedzero.wire import WIRES

    assert get_args(policy.MasterMode) == MASTER_MODES
    assert get_args(policy.StateMode) == STATE_MODES
    assert get_args(policy.WireFormatName) == WIRES


def test_groups_refuse_what_is_not_a_process_group() -> None:
    with pytest.raises(TypeError, match=r"Groups\(shard=2\): expected a torch.distributed"):
        Groups(shard=2)  # type: ignore[arg-type]


def test_policy_records_are_frozen_and_keyword_only() -> None:
    p = Precision(master="bf16-kahan")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.master = "fp32"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Precision(torch.bfloat16)  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"param_dtype": torch.bfloat16},
            r"^param_dtype= moved: use precision=Precision\(param_dtype=...\)$",
        ),
        ({"process_group": None}, r"^process_group= moved: use groups=Groups\(shard=...\)$"),
        ({"replicate_group": None}, r"groups=Groups\(replicate=...\)"),
        ({"gather_group": None}, r"groups=Groups\(gather=...\)"),
        ({"param_wire": "int8"}, r"wire=Wire\(params=...\)"),
        ({"unit_policy": nn.Linear}, r"sharding=Sharding\(units=...\)"),
        ({"bucket_numel": 64}, r"sharding=Sharding\(bucket_numel=...\)"),
        ({"loss_scale": "dynamic"}, r"precision=Precision\(loss_scale=...\)"),
        (
            {"wire": "int8"},
            r"wire='int8': expected a fusedzero.Wire record; "
            r"use wire=Wire\(grads='int8'\)",
        ),
        ({"precision": torch.bfloat16}, r"use precision=Precision\(...\)"),
    ],
)
def test_a_removed_keyword_names_its_new_place(kwargs: dict, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        ZeroAdamW(make().parameters(), **kwargs)


def test_the_constructor_takes_at_most_15_parameters() -> None:
    """The options beyond AdamW's own live in the policy records (fusedzero/policy.py)."""
    params = inspect.signature(ZeroAdamW.__init__).parameters
    assert len(params) - 1 <= 15, list(params)
    for kept in (
        "params",
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "maximize",
        "stage",
        "module",
        "max_grad_norm",
        "precision",
        "wire",
        "groups",
        "sharding",
    ):
        assert kept in params


def test_eps_zero_refused_in_a_param_group() -> None:
    """Each group's hyper-parameters are checked, not only the defaults."""
    m = make()
    with pytest.raises(ValueError, match=r"epsilon value: 0 \(must be > 0"):
        ZeroAdamW([{"params": list(m.parameters()), "eps": 0}], lr=1e-3)


def test_bad_inputs_raise_clear_errors() -> None:
    m = make()
    with pytest.raises(ValueError, match="empty parameter list"):
        ZeroAdamW([])
    with pytest.raises(ValueError, match="more than one param"):
        ZeroAdamW([{"params": [m.a.weight]}, {"params": [m.a.weight]}])
    with pytest.raises(ValueError, match="one device"):
        ZeroAdamW([m.a.weight, nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match="dtype torch.float64"):
        ZeroAdamW([nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="not parameters of `module`"):
        ZeroAdamW([nn.Parameter(torch.zeros(3))], module=m)
    opt = ZeroAdamW([m.a.weight])
    with pytest.raises(NotImplementedError, match="after construction"):
        opt.add_param_group({"params": [m.b.weight]})
    emb = nn.Embedding(10, 4, sparse=True)
    with pytest.raises(ValueError, match="sparse"):
        ZeroAdamW(emb.parameters(), module=emb)
    opt = ZeroAdamW(emb.parameters(), stage=2)  # no module to inspect: caught at backward
    with pytest.raises(RuntimeError, match="sparse"):
        emb(torch.tensor([1, 2])).sum().backward()
    del opt


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_shard_state_round_trips_into_a_fresh_optimizer(stage: int) -> None:
    """The typed interface of fusedzero/state.py: what shard_state() gives, load_shard_state()
    puts back (params rewritten from master, moments, step count, loss scale); None fields are
    left as they are."""
    m, m2 = make(), make(seed=1)
    kw = dict(
        lr=1e-2,
        stage=stage,
        sharding=Sharding(bucket_numel=200, units=nn.Linear),
        precision=Precision(loss_scale="dynamic"),
    )
    opt, opt2 = ZeroAdamW(groups(m), module=m, **kw), ZeroAdamW(groups(m2), module=m2, **kw)
    for step in range(3):
        opt.scale_loss(m(batch(step)).square().mean()).backward()
        opt.step()
    infos = opt.param_infos()
    assert [i.name for i in infos] == ["a.weight", "b.weight", "a.bias", "b.bias"]
    assert [i.shape for i in infos] == [(33, 17), (5, 33), (33,), (5,)]
    assert [i.group_index for i in infos] == [0, 0, 1, 1]
    assert [s.layout.local_numel for s in opt.shard_infos()] == [
        s.local_numel for s in opt2.shard_infos()
    ]
    st = opt.shard_state()
    assert st.step_count == 3.0 and st.scaler is not None
    before = opt2.shard_state().exp_avg[0].clone()
    opt2.load_shard_state(type(st)(master=[t.clone() for t in st.master]))
    assert torch.equal(opt2.shard_state().exp_avg[0], before)  # None: left as it is
    assert opt2.step_count.item() == 0.0
    opt2.load_shard_state(st)
    assert opt2.step_count.item() == 3.0
    assert opt2.scaler.scale.item() == opt.scaler.scale.item()
    with opt.gathered_params(), opt2.gathered_params():
        assert_close(m2, m, rtol=0, atol=0)
    for a, b in zip(opt.shard_state().exp_avg, opt2.shard_state().exp_avg):
        assert torch.equal(a, b)
