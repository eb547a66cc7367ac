"""What both integrations share: the framework import with the extra that installs it, the
ZeroAdamW keywords a user may pass through, and the full model state dict (a collective)."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

from torch import nn

from fusedzero._comm import group_rank
from fusedzero._model_state_dict import without_params
from fusedzero.optim import ZeroAdamW, ZeroOptimizer
from fusedzero.policy import MOVED_KEYWORDS


def import_framework(module: str, extra: str, what: str) -> ModuleType:
    """`importlib.import_module(module)`, or one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs {module.split('.')[0]} ({e}); install it with "
            f"pip install 'fusedzero[{extra}]'"
        ) from e


def zero_keywords() -> frozenset[str]:
    """The keywords ZeroAdamW's constructor takes, read from its signature (so a keyword it
    gains or loses is passed through without a change here)."""
    return frozenset(
        n
        for n, p in inspect.signature(ZeroAdamW.__init__).parameters.items()
        if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )


def check_zero_kwargs(zero_kwargs: dict[str, Any], taken: dict[str, str], where: str) -> None:
    """Refuse, in one line, a keyword ZeroAdamW does not take (naming its new place where it
    is one of the old flat signature's, `MOVED_KEYWORDS`), or one the integration sets itself
    from the framework's own settings (`taken`: keyword -> where it comes from)."""
    for k in zero_kwargs:
        if k in taken:
            raise TypeError(f"{where} got {k}=: it comes from {taken[k]}; set it there")
        if k in MOVED_KEYWORDS:
            raise TypeError(f"{where} got {k}=: it moved, use {MOVED_KEYWORDS[k]}")
        if k not in zero_keywords():
            raise TypeError(
                f"{where} got an unexpected keyword {k}=: it takes the framework's "
                f"own arguments plus stage= and ZeroAdamW's keywords "
                f"({', '.join(sorted(zero_keywords() - set(taken)))})"
            )


def full_state_dict(
    opt: ZeroOptimizer | None, module: nn.Module, *, rank0_only: bool = False
) -> dict[str, Any]:
    """`module.state_dict()` with every param at its full value: `opt.full_state_dict` (a
    collective at stages 1-3: call it on every rank), or the module's own without a live
    optimizer. `rank0_only`: the other ranks get the non-param entries alone (See [Note:
    rank-0-only full state dict] in fusedzero/_model_state_dict.py)."""
    if opt is not None:
        return opt.full_state_dict(module, rank0_only=rank0_only)
    state = module.state_dict()
    return state if not rank0_only or group_rank(None) == 0 else without_params(module, state)
