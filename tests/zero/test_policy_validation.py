"""Every field of the policy records, and ZeroAdamW's own keywords, is checked when built: a value
of the wrong kind raises a one-line TypeError, one of the right kind out of range a ValueError,
each naming the record, the field, the value given and what it takes. Messages name today's API
(the records), never a keyword of the old flat signature. Fast: one process, no group.

About an internal: fusedzero._units (its select_units, called by plan and emulate with a policy
that no record checked)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedzero import FullUnitInit, Groups, Precision, Sharding, ShardInit, Wire, ZeroAdamW
from fusedzero._units import select_units


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def fn(name: str, module: nn.Module) -> None:
    pass


BAD = [
    # Precision
    (lambda: Precision(param_dtype="bf16"), ValueError, r"^Precision\(param_dtype='bf16'\): "),
    (lambda: Precision(param_dtype=torch.int8), ValueError, r"expected None or one of"),
    (lambda: Precision(reduce_dtype="fp32"), ValueError, r"^Precision\(reduce_dtype='fp32'\)"),
    (lambda: Precision(master=None), ValueError, r"^Precision\(master=None\): expected one"),
    (lambda: Precision(states=8), ValueError, r"^Precision\(states=8\): expected one of"),
    (lambda: Precision(seed=-1), ValueError, r"^Precision\(seed=-1\): expected an int in \[0, "),
    (lambda: Precision(seed=1 << 63), ValueError, r"^Precision\(seed=9223372036854775808\)"),
    (lambda: Precision(seed=1.5), TypeError, r"^Precision\(seed=1.5\): expected an int in"),
    (lambda: Precision(seed="x"), TypeError, r"^Precision\(seed='x'\): expected an int in"),
    (lambda: Precision(seed=True), TypeError, r"^Precision\(seed=True\)"),
    (lambda: Precision(loss_scale=1e39), ValueError, r"^Precision\(loss_scale=1e\+39\): .*fp32"),
    (lambda: Precision(loss_scale=True), ValueError, r"^Precision\(loss_scale=True\)"),
    (
        lambda: Precision(skip_nonfinite="no"),
        TypeError,
        r"^Precision\(skip_nonfinite='no'\): expected True or False$",
    ),
    (lambda: Precision(skip_nonfinite=0), TypeError, r"^Precision\(skip_nonfinite=0\)"),
    (lambda: Precision(skip_nonfinite=None), TypeError, r"^Precision\(skip_nonfinite=None\)"),
    # Wire
    (lambda: Wire(grads=torch.bfloat16), ValueError, r"^Wire\(grads=torch.bfloat16\)"),
    (lambda: Wire(params=16), ValueError, r"^Wire\(params=16\): expected None or one of"),
    # Groups
    (lambda: Groups(replicate="node"), TypeError, r"^Groups\(replicate='node'\): expected a"),
    (lambda: Groups(gather=[0, 1]), TypeError, r"^Groups\(gather=\[0, 1\]\): expected a"),
    # Sharding
    (lambda: Sharding(bucket_numel=1.5), TypeError, r"^Sharding\(bucket_numel=1.5\): expected"),
    (lambda: Sharding(bucket_numel="1M"), TypeError, r"^Sharding\(bucket_numel='1M'\)"),
    (lambda: Sharding(bucket_numel=-8), ValueError, r"^Sharding\(bucket_numel=-8\): expected"),
    (
        lambda: Sharding(units="Linear"),
        TypeError,
        r"^Sharding\(units='Linear'\): expected None, an nn.Module subclass .*"
        r"pass the class itself, not its name$",
    ),
    (lambda: Sharding(units=3.5), TypeError, r"^Sharding\(units=3.5\): expected None, an nn"),
    (lambda: Sharding(units=True), TypeError, r"^Sharding\(units=True\): expected None"),
    (lambda: Sharding(units=-3), ValueError, r"^Sharding\(units=-3\): a minimum element count"),
    (lambda: Sharding(units=int), TypeError, r"^Sharding\(units=<class 'int'>\)"),
    (lambda: Sharding(units=()), TypeError, r"^Sharding\(units=\(\)\): .*nn.Module subclasses"),
    (lambda: Sharding(units=(nn.Linear, "Conv")), TypeError, r"^Sharding\(units=\(<class"),
    (
        lambda: Sharding(reshard_after_forward=None),
        TypeError,
        r"^Sharding\(reshard_after_forward=None\): expected True or False$",
    ),
    (lambda: Sharding(reshard_after_forward="yes"), TypeError, r"reshard_after_forward='yes'"),
    (
        lambda: Sharding(param_init_fn=42),
        TypeError,
        r"^Sharding\(param_init_fn=42\): expected None \(module.reset_parameters\(\)\), a "
        r"callable fn\(name, module\), fusedzero.ShardInit\(fn\) or fusedzero.FullUnitInit\(fn\)$",
    ),
    (lambda: ShardInit(42), TypeError, r"^ShardInit\(fn=42\): expected a callable"),
    (lambda: FullUnitInit("normal"), TypeError, r"^FullUnitInit\(fn='normal'\): expected a"),
]


@pytest.mark.parametrize("build, exc, match", BAD)
def test_every_record_field_is_checked_when_built(build: Any, exc: type, match: str) -> None:
    """Each bad value raises when the record is built, naming record, field and value, in one
    line (before, most of these were accepted: "no" kept skipping on, seed=-1 a second name
    for a stream, units="Linear" no unit at all)."""
    with pytest.raises(exc, match=match) as info:
        build()
    assert "\n" not in str(info.value)


GOOD = [
    lambda: Precision(seed=0),
    lambda: Precision(seed=(1 << 63) - 1),
    lambda: Precision(skip_nonfinite=False, loss_scale=1024),
    lambda: Precision(loss_scale="dynamic", param_dtype=torch.float16),
    lambda: Sharding(units=nn.Linear, reshard_after_forward=False, bucket_numel=1),
    lambda: Sharding(units=(nn.Linear, nn.Conv1d), param_init_fn=fn),
    lambda: Sharding(units=lambda m: isinstance(m, nn.Linear), param_init_fn=FullUnitInit()),
    lambda: Sharding(units=1000, param_init_fn=ShardInit(lambda name, out, start: None)),
    lambda: Sharding(param_init_fn=FullUnitInit(fn)),
]


@pytest.mark.parametrize("build", GOOD)
def test_every_documented_kind_of_value_is_taken(build: Any) -> None:
    build()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"stage": True}, TypeError, r"^ZeroAdamW\(stage=True\): expected an int 0, 1, 2 or 3"),
        ({"stage": 2.0}, TypeError, r"^ZeroAdamW\(stage=2.0\): expected an int 0, 1, 2 or 3"),
        ({"stage": "2"}, TypeError, r"^ZeroAdamW\(stage='2'\)"),
        ({"stage": -1}, ValueError, r"^ZeroAdamW\(stage=-1\): expected 0, 1, 2 or 3$"),
        (
            {"max_grad_norm": "1"},
            TypeError,
            r"^ZeroAdamW\(max_grad_norm='1'\): expected a positive number or None",
        ),
        ({"max_grad_norm": True}, TypeError, r"^ZeroAdamW\(max_grad_norm=True\)"),
        ({"max_grad_norm": -1.0}, ValueError, r"^ZeroAdamW\(max_grad_norm=-1.0\): expected a"),
        ({"max_grad_norm": float("nan")}, ValueError, r"^ZeroAdamW\(max_grad_norm=nan\)"),
        ({"max_grad_norm": float("inf")}, ValueError, r"max_grad_norm=inf\): .*finite in fp32"),
        ({"module": [nn.Linear(2, 2)]}, TypeError, r"^ZeroAdamW\(module=list object\): expected"),
    ],
)
def test_zero_adamw_keywords_are_checked(kwargs: dict, exc: type, match: str) -> None:
    """stage=True and stage=2.0 were taken as stages 1 and 2 (bool and a float equal to an int
    pass Stage(...)); max_grad_norm="1" failed with "'>' not supported"."""
    with pytest.raises(exc, match=match):
        ZeroAdamW(make().parameters(), **kwargs)


def test_a_stage_enum_and_an_int_are_taken() -> None:
    from fusedzero.stage import Stage

    assert ZeroAdamW(make().parameters(), stage=Stage.GRADIENTS).stage is Stage.GRADIENTS
    assert ZeroAdamW(make().parameters(), stage=0, max_grad_norm=1).stage is Stage.DP


def test_a_group_this_rank_is_not_in_is_named() -> None:
    """torch.distributed.new_group returns the NON_GROUP_MEMBER sentinel (-100) on the ranks
    outside the group: the message says so instead of "expected a ProcessGroup"."""
    sentinel = dist.GroupMember.NON_GROUP_MEMBER
    for field in ("shard", "replicate", "gather"):
        with pytest.raises(
            TypeError,
            match=rf"^Groups\({field}={sentinel}\): this rank is not a member of that group",
        ):
            Groups(**{field: sentinel})


def test_the_bf16_master_message_names_the_records() -> None:
    """No-fp32-master modes with non-bf16 params point at Precision's fields, not at the old
    flat keywords (param_dtype=, master=)."""
    want = (
        r"^Precision\(master='bf16-kahan'\) keeps no fp32 master: .* pass "
        r"Precision\(param_dtype=torch.bfloat16\) \(or bf16 params\), or "
        r"Precision\(master='fp32'\)$"
    )
    with pytest.raises(ValueError, match=want):
        Precision(master="bf16-kahan", param_dtype=torch.float32)
    with pytest.raises(ValueError, match=want):
        ZeroAdamW(make().parameters(), precision=Precision(master="bf16-kahan"))


def test_select_units_names_the_sharding_field() -> None:
    """A caller that hands select_units a policy directly (plan, emulate) meets the record's
    name, not the old unit_policy keyword."""
    with pytest.raises(TypeError, match=r"^Sharding\(units='Linear'\): expected None") as info:
        select_units(make(), "Linear")  # type: ignore[arg-type]
    assert "unit_policy" not in str(info.value)
