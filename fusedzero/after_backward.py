"""Stage 3's late units ([Note: a unit with a param that got no grad]): an identity on a unit's
inputs whose backward runs once their grads are complete, and frees the unit there."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


# Note: a unit with a param that got no grad
# A unit is freed in backward when its last param's grad arrives. A param that gets no grad
# (an unused branch, a conditional layer) kept its unit gathered to the end of backward, each
# such unit one more gathered at once. A unit a backward left gathered to its end is marked
# `late`; from then on its forward passes its tensor inputs through `_AfterBackward`, whose
# backward runs when the grads of those inputs are complete: the unit's own backward is done,
# so it is freed there (FSDP2 frees every unit that way). Autograd runs the ready nodes of a
# graph latest-created first, so the unit's param-only nodes (created after its inputs) have
# run by then. Grads that arrive later need no gathered params. Only late units pay for the
# extra node, and a unit whose inputs need no grad keeps the end-of-backward free.


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; `done()` when their grads are complete."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *xs: torch.Tensor) -> Any:
        ctx.done = done
        return xs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.done()
        return (None, *grads)


def free_when_inputs_have_grads(args: Any, done: Callable[[], None]) -> Any:
    """`args` with its tensors that need a grad passed through `_AfterBackward` (None: none)."""
    flat, spec = tree_flatten(args)
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None
    for i, t in zip(idx, _AfterBackward.apply(done, *(flat[i] for i in idx))):
        flat[i] = t
    return tree_unflatten(flat, spec)
