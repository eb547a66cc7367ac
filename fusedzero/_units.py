"""What a stage-3 unit is: the policy that picks the modules (`select_units`), and how params on the
meta device are initialised (`ShardInit`, `FullUnitInit`, `ParamInitFn`). Stages 1-2 use the same
units for their forward waits (fusedzero/_param_sync.py); fusedzero/_zero3.py gathers and frees
them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# How units are chosen (see `select_units`): None (every child of an nn.ModuleList), a module
# class or tuple of classes, a predicate on modules, or a minimum element count.
UnitPolicy = None | type | tuple[type, ...] | Callable[[nn.Module], bool] | int


class ShardInit:
    """A `param_init_fn` that initialises only this rank's elements of meta-device params:
    `fn(name, out, start)` fills the 1-D tensor `out` with elements `[start, start + out.numel())`
    of the flattened param `name`. No unit is ever gathered and nothing is broadcast, so the
    values must depend on (name, element) alone, which also makes them the same at every world
    size. Where a separate fp32 master exists it starts at the param dtype's cast of them."""

    def __init__(self, fn: Callable[[str, torch.Tensor, int], None]) -> None:
        if not callable(fn):
            raise TypeError(f"ShardInit(fn={fn!r}): expected a callable fn(name, out, start)")
        self.fn = fn


class FullUnitInit:
    """A `param_init_fn` that builds each unit in full on every rank: `fn(name, module)`
    (default: `module.reset_parameters()`) on real full tensors, unit by unit, then rank 0's
    values are broadcast and each rank keeps its shard. The values equal an eager build's with
    the same seed; the cost is every rank initialising the whole model and holding one unit
    (and the root) in full. The fallback for inits the local path refuses (See [Note:
    local-shard init] in fusedzero/_shard_init.py)."""

    def __init__(self, fn: Callable[[str, nn.Module], None] | None = None) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(
                f"FullUnitInit(fn={fn!r}): expected a callable fn(name, module) or None "
                "(module.reset_parameters())"
            )
        self.fn = fn


# `fn(name, module)` initialises the params a module owns directly, written against full
# tensors and run on this rank's elements only (fusedzero/_shard_init.py); or one of the above.
ParamInitFn = Callable[[str, nn.Module], None] | ShardInit | FullUnitInit


def check_unit_policy(policy: object, what: str) -> None:
    """One line naming `what` (e.g. "Sharding(units=...)") unless `policy` is a `UnitPolicy`:
    None, an nn.Module subclass or a non-empty tuple of them, a callable(module) -> bool, or an
    int >= 1 (a bool is refused: True would be a count of one element)."""
    takes = (
        "expected None, an nn.Module subclass (e.g. torch.nn.Linear) or a tuple of them, "
        "a callable(module) -> bool, or a minimum element count (an int >= 1)"
    )
    if policy is None or (isinstance(policy, type) and issubclass(policy, nn.Module)):
        return
    if isinstance(policy, tuple):
        if policy and all(isinstance(c, type) and issubclass(c, nn.Module) for c in policy):
            return
        raise TypeError(f"{what}: {takes}; a tuple must hold nn.Module subclasses only")
    if isinstance(policy, int) and not isinstance(policy, bool):
        if policy < 1:
            raise ValueError(f"{what}: a minimum element count must be an int >= 1")
        return
    if callable(policy) and not isinstance(policy, type):
        return
    hint = "; pass the class itself, not its name" if isinstance(policy, str) else ""
    raise TypeError(f"{what}: {takes}{hint}")


def default_policy(root: nn.Module) -> list[nn.Module]:
    """Every child of an nn.ModuleList (transformer blocks, in the usual model layout)."""
    return [m for mod in root.modules() if isinstance(mod, nn.ModuleList) for m in mod]


def select_units(root: nn.Module, policy: UnitPolicy) -> list[nn.Module]:
    """Units in forward (registration) order, from a policy: None (default), a module class or
    tuple of classes, a callable(module) -> bool, or an int (modules with at least that many
    param elements of their own subtree, innermost first)."""
    check_unit_policy(policy, f"Sharding(units={policy!r})")
    if policy is None:
        units = default_policy(root)
    elif isinstance(policy, type) or (
        isinstance(policy, tuple) and all(isinstance(c, type) for c in policy)
    ):
        units = [m for m in root.modules() if isinstance(m, policy) and m is not root]
    elif isinstance(policy, int):
        units = []
        claimed: set[int] = set()
        for m in reversed(list(root.modules())):
            if m is root:
                continue
            own = [p for p in m.parameters() if id(p) not in claimed]
            if sum(p.numel() for p in own) >= policy:
                units.append(m)
                claimed.update(id(p) for p in own)
        order = {id(m): i for i, m in enumerate(root.modules())}
        units.sort(key=lambda m: order[id(m)])
    else:
        if not callable(policy):  # check_unit_policy refuses it first
            raise TypeError(
                f"Sharding(units=...) must be None, a module class, a tuple of classes, a "
                f"callable or an int, got {policy!r}"
            )
        units = [m for m in root.modules() if m is not root and policy(m)]
    # Nested units: keep the outermost (a param belongs to one unit). One walk per unit, not
    # one per pair of units (80 blocks of 10 modules: 1.5 s of the pairwise walk).
    inner = {id(x) for o in units for x in o.modules() if x is not o}
    return [m for m in units if id(m) not in inner]
