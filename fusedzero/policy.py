"""The options of `ZeroAdamW` beyond AdamW's own, as frozen policy records (as FSDP2's
`MixedPrecisionPolicy`): each groups the options of one concern, is validated when it is built,
and names its choices as `Literal` types checked at runtime.

    ZeroAdamW(model.parameters(), lr=3e-4, stage=2, module=model, max_grad_norm=1.0,
              precision=Precision(param_dtype=torch.bfloat16, master="bf16-kahan", states="int8"),
              wire=Wire(grads="int8", params="bf16"),
              groups=Groups(shard=dp_group, replicate=node_group))

- `Precision`: how numbers are held: param, grad and state dtypes, the master mode, the random
  stream of stochastic rounding, and what guards the step against fp16 overflow (loss scaling,
  skipping a step whose grads are not finite).
- `Wire`: what grads and gathered params cross the network as (docs/wire.md).
- `Groups`: the process groups: shard over, replicate over, all-gather on.
- `Sharding`: how the flat buffers are cut: bucket size (every stage) and stage-3 units (which
  modules, kept or freed after forward, how params on the meta device are initialised).

`fusedzero plan` (`PlanConfig`) takes the same `Precision`, `Wire` and `Sharding`. Strings are
kept as given (so a record prints as it was written); the optimizer parses them into enums.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args

import torch

from fusedzero._comm import Group
from fusedzero._dtypes import FLOAT_DTYPES
from fusedzero._units import (
    FullUnitInit,
    ParamInitFn,
    ShardInit,
    UnitPolicy,
    check_unit_policy,
)
from fusedzero.memory_modes import MemoryModes, check_param_dtype

__all__ = ["Groups", "MasterMode", "Precision", "Sharding", "StateMode", "Wire", "WireFormatName"]

MasterMode = Literal["fp32", "bf16-kahan", "bf16-sr", "bf16"]
StateMode = Literal["fp32", "bf16", "int8"]
WireFormatName = Literal["fp32", "bf16", "int8"]


# bf16-sr's seed is an int64 device tensor (fusedzero/_flat.py); negative seeds are refused so
# each stream has one name.
_SEED_MAX = (1 << 63) - 1
# The loss scale is an fp32 device tensor: a larger number is inf there.
_FP32_MAX = torch.finfo(torch.float32).max


def _check_bool(record: str, field: str, value: object) -> None:
    """A bool field: anything else is refused (a string such as "no" is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{record}({field}={value!r}): expected True or False")


def _check_choice(
    record: str, field: str, value: object, choices: Any, none_ok: bool = False
) -> None:
    """A `Literal` field checked at runtime: the message names the record, field and value."""
    allowed = get_args(choices)
    if value not in allowed and not (none_ok and value is None):
        raise ValueError(
            f"{record}({field}={value!r}): expected "
            f"{'None or ' if none_ok else ''}one of {list(allowed)}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """How numbers are held and how the step survives overflow. The default is fp32 everywhere:
    each param keeps its dtype (fp32 params are their own master), grads reduced in fp32."""

    param_dtype: torch.dtype | None = None
    """The model's params (e.g. torch.bfloat16, with an fp32 master); None keeps each param's
    dtype."""
    reduce_dtype: torch.dtype = torch.float32
    """Grads are accumulated in this and, without `Wire(grads=)`, reduced in it."""
    master: MasterMode = "fp32"
    """"fp32": an fp32 master (fp32 params are their own). With bf16 params only, no fp32
    master at all: "bf16-kahan" (the bf16 param plus a bf16 Kahan compensation), "bf16-sr"
    (updates stochastically rounded onto the param), "bf16" (round to nearest)."""
    states: StateMode = "fp32"
    """The update rule's state as "fp32", "bf16" or "int8" (one fp32 scale per 128 elements)."""
    seed: int = 0
    """The random stream of master="bf16-sr" (bits from (seed, step, element)): the same seed
    makes a run and its resume bit-exact."""
    loss_scale: Literal["dynamic"] | float | None = None
    """"dynamic" for fp16 dynamic loss scaling, a positive float for a static scale, None."""
    skip_nonfinite: bool = True
    """Skip the whole step (on the device, no host sync) when a grad is inf or nan."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            dt = getattr(self, name)
            if name == "reduce_dtype" and dt is None:
                raise ValueError("Precision(reduce_dtype=None): pass a dtype, e.g. torch.float32")
            if dt is not None and not (isinstance(dt, torch.dtype) and dt in FLOAT_DTYPES):
                raise ValueError(
                    f"Precision({name}={dt!r}): expected "
                    f"{'None or ' if name == 'param_dtype' else ''}one of {list(FLOAT_DTYPES)}"
                )
        _check_choice("Precision", "master", self.master, MasterMode)
        _check_choice("Precision", "states", self.states, StateMode)
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"Precision(seed={s!r}): expected an int in [0, 2**63 - 1]")
        if not 0 <= s <= _SEED_MAX:
            raise ValueError(
                f"Precision(seed={s}): expected an int in [0, 2**63 - 1] (bf16-sr's random "
                "stream is kept as an int64)"
            )
        ls = self.loss_scale
        if not (
            ls is None
            or ls == "dynamic"
            or (isinstance(ls, (int, float)) and not isinstance(ls, bool) and 0 < ls <= _FP32_MAX)
        ):
            raise ValueError(
                f"Precision(loss_scale={ls!r}): expected 'dynamic', a positive "
                f"number finite in fp32 (at most {_FP32_MAX:.4g}) or None"
            )
        _check_bool("Precision", "skip_nonfinite", self.skip_nonfinite)
        if self.param_dtype is not None:
            check_param_dtype(self.modes, self.param_dtype, "param_dtype")

    @property
    def modes(self) -> MemoryModes:
        """The (master, states) pair a flat buffer keeps."""
        return MemoryModes(self.master, self.states)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wire:
    """What crosses the network (docs/wire.md). None: each collective in its data's own dtype."""

    grads: WireFormatName | None = None
    """Grads' reductions (replica all-reduces too) as "fp32", "bf16" or "int8" (one fp32 scale
    per 128 elements), summed in fp32 on arrival; None: in `Precision.reduce_dtype`."""
    params: WireFormatName | None = None
    """Stages 1-3 param all-gathers as "bf16" or "int8"; a rank's own piece and the masters stay
    exact. None: in the param dtype."""

    def __post_init__(self) -> None:
        for name in ("grads", "params"):
            _check_choice("Wire", name, getattr(self, name), WireFormatName, none_ok=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Groups:
    """The process groups, each None by default, and None means something different for each:

    - `shard`: the ranks params, grads and state are sharded over. None: the default group
      (the world) when torch.distributed is initialised, else one rank and no communication.
      With tensor-parallel DTensor params, the dp group (docs/tensor_parallel.md).
    - `replicate`: for a 2-D mesh (shard within a node, replicate across nodes), the ranks that
      hold the same shard; each bucket's grad shard is all-reduced over it after its reduction
      in `shard` (fusedzero/_replicas.py). None: no replicas (a group of one, NOT the world).
    - `gather`: a second group over the ranks of `shard` (same order) for the param all-gathers
      of stages 1-3, so a prefetch is not queued behind a reduce-scatter on NCCL's one stream
      per communicator. None: the all-gathers run on `shard`. It costs a communicator's memory
      (`fusedzero train` makes one on GPUs).
    """

    shard: Group = None
    replicate: Group = None
    gather: Group = None

    def __post_init__(self) -> None:
        import torch.distributed as dist

        non_member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", -100)
        for name in ("shard", "replicate", "gather"):
            g = getattr(self, name)
            if g is None or isinstance(g, dist.ProcessGroup):
                continue
            if isinstance(g, int) and not isinstance(g, bool) and g == non_member:
                raise TypeError(
                    f"Groups({name}={g!r}): this rank is not a member of that group "
                    "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER on the "
                    "ranks outside it); build the optimizer on the group's ranks only, or pass "
                    "a group that holds this rank"
                )
            raise TypeError(
                f"Groups({name}={g!r}): expected a torch.distributed ProcessGroup or None"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sharding:
    """How the flat buffers are cut into buckets and, at stage 3, into units."""

    bucket_numel: int | None = None
    """Elements per bucket, all ranks' shards together (rounded so buckets are equal and divide
    by W*ALIGN); None: chosen per rank, at least 1 MiB of each rank's shard per bucket
    (`fusedzero._layout.default_bucket_numel`)."""
    units: UnitPolicy = None
    """Stage 3 units: None (each child of an nn.ModuleList), a module class or tuple of classes,
    a callable(module) -> bool, or a minimum element count. Stages 1-2: a module's forward
    waits for its subtree's params except those of units, which wait for their own."""
    reshard_after_forward: bool = True
    """Stage 3: free a unit after its forward and gather it again for backward (3 Psi of
    traffic per step, less the root unit's Psi); False keeps every unit until backward (2 Psi)."""
    param_init_fn: ParamInitFn | None = None
    """Stage 3 with params on the meta device: `fn(name, module)` initialises the params a
    module owns directly (default: `module.reset_parameters()`), run on this rank's elements
    only (fusedzero/_shard_init.py); `FullUnitInit(fn)` builds each unit in full instead (values
    of an eager build), `ShardInit` writes local segments (fusedzero/_units.py)."""

    def __post_init__(self) -> None:
        b = self.bucket_numel
        if b is not None and (isinstance(b, bool) or not isinstance(b, int)):
            raise TypeError(
                f"Sharding(bucket_numel={b!r}): expected an int >= 1 or None (chosen per rank)"
            )
        if b is not None and b < 1:
            raise ValueError(
                f"Sharding(bucket_numel={b!r}): expected an int >= 1 or None (chosen per rank)"
            )
        check_unit_policy(self.units, f"Sharding(units={self.units!r})")
        _check_bool("Sharding", "reshard_after_forward", self.reshard_after_forward)
        fn = self.param_init_fn
        if not (fn is None or isinstance(fn, (ShardInit, FullUnitInit)) or callable(fn)):
            raise TypeError(
                f"Sharding(param_init_fn={fn!r}): expected None (module.reset_parameters()), "
                "a callable fn(name, module), fusedzero.ShardInit(fn) or "
                "fusedzero.FullUnitInit(fn)"
            )


# A removed ZeroAdamW keyword -> where it lives now.
MOVED_KEYWORDS: dict[str, str] = {
    **{
        k: f"precision=Precision({k}=...)"
        for k in (
            "param_dtype",
            "reduce_dtype",
            "master",
            "states",
            "seed",
            "loss_scale",
            "skip_nonfinite",
        )
    },
    "process_group": "groups=Groups(shard=...)",
    "replicate_group": "groups=Groups(replicate=...)",
    "gather_group": "groups=Groups(gather=...)",
    "param_wire": "wire=Wire(params=...)",
    "unit_policy": "sharding=Sharding(units=...)",
    **{
        k: f"sharding=Sharding({k}=...)"
        for k in ("bucket_numel", "reshard_after_forward", "param_init_fn")
    },
}

_R = TypeVar("_R")


def check_record(name: str, value: object, cls: type[_R]) -> _R:
    """`value` if it is a `cls`, else a TypeError naming the record to pass."""
    if not isinstance(value, cls):
        hint = (
            f"{name}={cls.__name__}(grads={value!r})"
            if cls is Wire and isinstance(value, str)
            else f"{name}={cls.__name__}(...)"
        )
        raise TypeError(f"{name}={value!r}: expected a fusedzero.{cls.__name__} record; use {hint}")
    return value


def moved_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a constructor so a removed keyword raises a one-line TypeError naming its new place
    (`MOVED_KEYWORDS`) instead of Python's "unexpected keyword argument"."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        for k in kwargs:
            if k in MOVED_KEYWORDS:
                raise TypeError(f"{k}= moved: use {MOVED_KEYWORDS[k]}")
        init(self, *args, **kwargs)

    return wrapper
