"""Code that runs eagerly under `torch.compile`: the hooks and waits of a sharded optimizer read
process-group state and wait on other ranks, which Dynamo cannot trace. `eager(fn)` keeps such a
function out of a compiled caller's graph at no cost to an uncompiled one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["eager"]


def eager(fn: Callable[P, T], reason: str | None = None) -> Callable[P, T]:
    """`fn`, run eagerly under `torch.compile`: a compiled caller breaks its graph at the call
    (with `reason`, `torch.compiler.disable(fn, reason=reason)`, whose break names it).

    Under Dynamo `torch.compiler.is_compiling()` is True at trace time, and the call goes
    through `torch._disable_dynamo(fn)` (what torch's own optimizers use: Dynamo skips that
    wrapper, torch._compile being on its skip list). Uncompiled callers call `fn` directly: the
    disable wrapper swaps the frame-evaluation callback on every call, ~10 us, paid per grad
    and per unit on the hook path otherwise. torch._dynamo (about 2 s of imports) is imported
    at the first compiled call: a process that never compiles never pays for it."""
    disabled = (
        torch._disable_dynamo(fn)
        if reason is None  # type: ignore[attr-defined]
        else torch.compiler.disable(fn, reason=reason)
    )

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call
