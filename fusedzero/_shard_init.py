"""Stage 3 from the meta device: a model's own init, run on this rank's elements only; and
`model.load_state_dict` written straight into the shards: the params swapped for `LocalParam`s
(fusedzero/_local_param.py: the tensor and how its ops land on this rank's runs) in the modules
for the duration, and `nn.init.trunc_normal_` patched.

[Note: local-shard init]
An init written against full tensors (`reset_parameters`, `nn.init.*`, a transformers
`_init_weights`, a user's `fn(name, module)`) runs with every sharded param of the model
replaced, in its module's `_parameters`, by a `LocalParam`: a tensor of the param's full shape
and dtype that owns no storage. Its in-place ops are applied to the runs of the param this rank
holds (`Piece`s: views of the param shard), nothing else:
- views (`w[i]`, `w.data`, `w[:, :k]`, `w.t()`, `w.detach()`) are new `LocalParam`s over the
  same pieces; their geometry is computed on a meta tensor. A write to a view goes run by run
  (its contiguous innermost dims; up to `_local_param.MAX_RUNS` runs), in the view's element order;
- fills (`fill_`, `zero_`) and every pointwise in-place op (`mul_`, `add_`, `clamp_`,
  `erfinv_`: what `trunc_normal_` is made of) with scalars or tensors that broadcast to it;
- `copy_` from a plain tensor that broadcasts to it: each run takes its own elements of it;
- random fills (`uniform_`, `normal_`, `bernoulli_`, `exponential_`, `log_normal_`, `cauchy_`,
  `geometric_`): see [Note: init random stream] in fusedzero/_local_param.py.
Fan-in and fan-out (`kaiming_*`, `xavier_*`) come from the shape, which is the full one. Any
other op raises one line naming it and the fallback, `FullUnitInit` (fusedzero/_units.py: every
rank builds each unit in full, rank 0's values are broadcast). Memory beyond the shard: one
random block (`BLOCK` fp32 elements) at a time, and nothing is gathered or broadcast but the
seed. (Tensor-parallel params on the meta device are refused before this: docs/
tensor_parallel.md; `applies` keeps DTensor params off the LocalParam paths all the same.)

[Note: loading into LocalParams]
`model.load_state_dict(sd)` at stage 3 runs torch's own load (its name and shape checks, its
error messages) against `LocalParam`s in load mode: torch's `param.copy_(value)` writes this
rank's runs of `value` into the fp32 master and the param shard as its cast (the bf16-kahan
compensation of those runs is zeroed), as `import_weights` does. A tensor-parallel (DTensor)
param keeps its place and global shape; its local tensor is the LocalParam (torch's DTensor
`copy_` copies local into local). Nothing is gathered: memory beyond the shard is what torch's
copy reads of the given tensors. A unit that was gathered when the load began is gathered
again from the new shards after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from fusedzero._dtensor import local, set_local
from fusedzero._flat import FlatBuffer
from fusedzero._local_param import (
    InitContext,
    LocalInitStats,
    LocalParam,
    ParamTarget,
    local_trunc_normal,
    targets_of,
)

# Initialise the params a module owns directly (`param_init_fn`'s plain form).
ModuleInit = Callable[[str, nn.Module], None]


class _Swap(NamedTuple):
    """One module's entry for a sharded param, while a LocalParam stands in for it."""

    module: nn.Module
    name: str  # the param's qualified name in the root
    param: nn.Parameter
    local: LocalParam


def _swap_in(
    root: nn.Module,
    targets: dict[int, ParamTarget],
    ctx: InitContext,
    drop: dict[int, list[str]] | None = None,
) -> list[_Swap]:
    """Every sharded param of `root`, in every module that holds it, replaced by a LocalParam
    (one per param: tied modules see the same one); where `drop` (id(module) -> param names)
    says so, by one over no elements, whose writes are dropped (See [Note: a tied param is
    initialised once] in fusedzero/_zero3.py)."""
    made: dict[int, LocalParam] = {}
    swapped = []
    for mname, m in root.named_modules():
        dropped = (drop or {}).get(id(m), ())
        for pname, p in list(m._parameters.items()):
            if p is None or id(p) not in targets:
                continue
            t = targets[id(p)]
            if pname in dropped:
                lp = LocalParam.of(ParamTarget(t.name, t.shape, t.dtype, t.device), ctx)
            else:
                lp = made.get(id(p))
                if lp is None:
                    lp = made[id(p)] = LocalParam.of(t, ctx)
            m._parameters[pname] = lp  # type: ignore[assignment]
            swapped.append(_Swap(m, f"{mname}.{pname}" if mname else pname, p, lp))
    return swapped


def _swap_out(swapped: list[_Swap]) -> None:
    replaced = []
    for s in swapped:
        attr = s.name.rsplit(".", 1)[-1]
        if s.module._parameters.get(attr) is not s.local:
            replaced.append(s.name)
        s.module._parameters[attr] = s.param
    if replaced:
        raise RuntimeError(
            f"the init assigned new tensors to {replaced[:4]} instead of writing into them: "
            "at stage 3 on the meta device a param is written in place (w.copy_(t), "
            "nn.init.*_); or pass "
            "sharding=Sharding(param_init_fn=fusedzero.FullUnitInit(fn))"
        )


def applies(buffers: list[FlatBuffer]) -> bool:
    """Whether the local init can run: plain (not DTensor) params (tp params on the meta
    device are refused before, docs/tensor_parallel.md: this keeps it so)."""
    return all(local(p) is p for b in buffers for p in b.params)


def init_local(
    root: nn.Module,
    buffers: list[FlatBuffer],
    fn: ModuleInit | None,
    broadcast: Callable[[torch.Tensor], None],
    also: set[int] | None = None,
    drop: dict[int, list[str]] | None = None,
) -> LocalInitStats:
    """Run `fn(name, module)` (default: `module.reset_parameters()`) for every module that owns
    sharded params or whose id is in `also` (modules with buffers to fill), in
    `named_modules()` order, on this rank's elements only (See [Note: local-shard init]); a
    separate fp32 master is what the init writes, the param shard its cast (See [Note: init
    writes the fp32 master] in fusedzero/_local_param.py). A param that `drop` (id(module) ->
    param names) names for a module is not written by that module's init (a tied param's later
    holder)."""
    stats = LocalInitStats()
    if not buffers or any(b.device.type == "meta" for b in buffers):
        return stats  # nothing real to write (a meta-device emulation)
    seed = torch.tensor(
        [torch.initial_seed() % (1 << 63)], dtype=torch.int64, device=buffers[0].device
    )
    broadcast(seed)  # every rank and replica keys its stream alike (a collective)
    stats.seed = int(seed.item())  # a host sync, once
    targets = targets_of(buffers)
    ctx = InitContext(load=False, stats=stats)
    if fn is None:

        def fn(name: str, m: nn.Module) -> None:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()

    swapped = _swap_in(root, targets, ctx, drop)
    owners = {id(s.module) for s in swapped} | (also or set())
    try:
        with torch.no_grad(), local_trunc_normal():
            for name, m in root.named_modules():
                if id(m) in owners:
                    fn(name, m)
    finally:
        ctx.last_block = None
        _swap_out(swapped)
    with torch.no_grad():
        for b in buffers:
            if b.master is not None and b.param_shard is not None:
                b.param_shard.copy_(b.master)
    return stats


class ShardLoad:
    """The LocalParams of one `load_state_dict` (See [Note: loading into LocalParams]): in the
    modules for plain params; as the local tensor of a DTensor param (torch's DTensor `copy_`
    copies local into local), whose global shape torch's checks keep seeing."""

    def __init__(self, root: nn.Module, buffers: list[FlatBuffer]) -> None:
        self.stats = LocalInitStats()
        targets = targets_of(buffers)
        ctx = InitContext(load=True, stats=self.stats)
        self._locals = [(p, local(p)) for b in buffers for p in b.params if local(p) is not p]
        for p, _ in self._locals:
            set_local(p, LocalParam.of(targets[id(p)], ctx))
        tp = {id(p) for p, _ in self._locals}
        self._swapped = _swap_in(root, {k: t for k, t in targets.items() if k not in tp}, ctx)

    def close(self) -> None:
        for p, t in self._locals:
            set_local(p, t)
        _swap_out(self._swapped)
