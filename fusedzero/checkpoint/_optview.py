"""The optimizer as a checkpoint sees it: tables built from fusedzero/state.py's records and the
optimizer's public attributes (`params`, `param_names`, `param_groups`, `module`), never from its
private ones."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fusedzero.optim import ZeroAdamW


def param_table(opt: ZeroAdamW) -> dict[int, tuple[str, tuple[int, ...]]]:
    """param index -> (name, shape): what checkpoints and weight files are matched by."""
    return {p.index: (p.name, tuple(p.shape)) for p in opt.param_infos()}


def aliases(opt: ZeroAdamW) -> dict[int, list[str]]:
    """id(param) -> every name `opt.module` gives it (a tied weight has several)."""
    out: dict[int, list[str]] = {}
    if opt.module is not None:
        for n, p in opt.module.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), []).append(n)
    return out


def group_names(opt: ZeroAdamW) -> list[list[str]]:
    """The names of each param group's params: whether saved hyper-parameters fit this run."""
    index = {id(p): i for i, p in enumerate(opt.params)}
    return [[opt.param_names[index[id(p)]] for p in g["params"]] for g in opt.param_groups]


def hyperparams(opt: ZeroAdamW) -> list[dict[str, Any]]:
    """Each param group's JSON-able hyper-parameters (a one-element tensor as its float), plus
    `param_names`; values JSON cannot hold are left out."""
    groups = []
    for g, names in zip(opt.param_groups, group_names(opt)):
        d = {k: _jsonable(v) for k, v in g.items() if k != "params"}
        d = {k: v for k, v in d.items() if v is not _SKIP}
        d["param_names"] = names
        groups.append(d)
    return groups


_SKIP = object()


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v.reshape(-1)[0])
    if isinstance(v, tuple):
        v = list(v)
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return _SKIP
    return v
