"""The flat buffers `fusedzero plan` counts, as the optimizer builds them: which params each
buffer holds (`buffers_from_groups`, in `fusedzero._flat.build_buffers`' order), the stage-3
unit of each param (`units_of`, as `Zero3.assign`) and each buffer's layout (`layout_of`, as
`FlatBuffer` lays it out). Pure arithmetic over shapes: nothing allocated."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from fusedzero._layout import FlatLayout, build_layout, default_bucket_numel
from fusedzero._owner_layout import build_owner_layout
from fusedzero._units import select_units
from fusedzero.rules import Rule


class Sizing(Protocol):
    """What of a `fusedzero.plan.PlanConfig` the buffers depend on."""

    @property
    def world_size(self) -> int: ...

    @property
    def param_dtype(self) -> torch.dtype | None: ...

    @property
    def bucket_numel(self) -> int | None: ...


Item = tuple[int, str, tuple[int, ...]]  # (index in the optimizer's param list, name, shape)


class Buffer(NamedTuple):
    """One flat buffer as planned: its dtype, params, stage-3 unit (0, the root, elsewhere)
    and param group."""

    dtype: torch.dtype
    items: list[Item]
    unit: int
    group: int


def buffers_from_groups(
    groups: list[list[tuple[str, nn.Parameter]]],
    stage: int,
    cfg: Sizing,
    units: list[int] | None,
) -> list[Buffer]:
    """Every flat buffer, in ZeroAdamW's order: stages 0-2 group by (param group, dtype), stage
    3 by (unit, group, dtype) (`fusedzero._flat.build_buffers`, the units from
    `Zero3.assign`)."""
    keyed: dict[tuple[int, int, torch.dtype], list[Item]] = {}
    index = 0
    for gi, group in enumerate(groups):
        for name, p in group:
            dt = cfg.param_dtype or p.dtype
            u = units[index] if stage == 3 and units is not None else 0
            keyed.setdefault((u, gi, dt), []).append((index, name, tuple(p.shape)))
            index += 1
    order = sorted(keyed, key=lambda k: (k[0], k[1])) if stage == 3 else list(keyed)
    return [Buffer(k[2], keyed[k], k[0], k[1]) for k in order]


def units_of(model: nn.Module, params: list[nn.Parameter], policy: Any) -> list[int]:
    """Stage-3 unit of each param, as `fusedzero._zero3.Zero3.assign` decides."""
    owner: dict[int, int] = {}
    for u, m in enumerate(select_units(model, policy), start=1):
        for p in m.parameters():
            if id(p) in owner and owner[id(p)] != u:
                owner[id(p)] = 0  # shared by two units (tied weights): the root holds it
            else:
                owner.setdefault(id(p), u)
    return [owner.get(id(p), 0) for p in params]


def layout_of(
    items: list[Item],
    dt: torch.dtype,
    stage: int,
    cfg: Sizing,
    rule: Rule | None = None,
    owner_load: list[int] | None = None,
) -> FlatLayout:
    """One flat buffer's layout, as FlatBuffer builds it. Stage 0 replicates everything: its
    layout is the world-size-1 layout. A per-matrix rule's buffer takes the owner layout
    (fusedzero/_owner_layout.py) where it is sharded, `owner_load` carried over the buffers in
    their order as `build_buffers` carries it."""
    bucket = (
        cfg.bucket_numel
        if cfg.bucket_numel is not None
        else default_bucket_numel(cfg.world_size, dt.itemsize)
    )  # as FlatBuffer chooses it
    shards = 1 if stage == 0 else cfg.world_size
    if rule is not None and not rule.element_wise and shards > 1:
        blocks = [rule.blocks(it[2]) for it in items]
        return build_owner_layout(items, blocks, shards, owner_load, bucket)
    return build_layout(items, shards, bucket)
