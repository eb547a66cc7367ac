"""Models and data shared by test modules: `from _helpers import ...` (tests/ is on sys.path, the
folder of the root conftest.py, in the test process and in the ranks it spawns).

Library-side helpers (ranks on gloo, a fake process group) are `fusedzero.testing`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

from fusedzero.app.model import GPT, GPTConfig


class TwoLinear(nn.Module):
    """`b(tanh(a(x)))`: two linear layers, sizes chosen by the test (uneven ones exercise
    padding and params cut at shard edges)."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def make_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The GPT of `cfg`, initialised from `seed` (the global RNG, as the ranks seed it)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def gpt_batch(cfg: GPTConfig, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch of `batch` random token sequences: (inputs, next tokens)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def fast_only(cases: Iterable[Any], fast: Callable[[Any], bool]) -> list[Any]:
    """`cases` for `pytest.mark.parametrize`, those `fast` rejects marked slow: the fast tier
    runs a few that together still reach every branch, the slow tier the rest. A tuple case is
    the values of several argnames."""
    return [c if fast(c) else pytest.param(*(c if isinstance(c, tuple) else (c,)),
                                           marks=pytest.mark.slow)
            for c in cases]
