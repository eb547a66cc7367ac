"""Runs that end instead of hanging: collective timeouts naming the wait, ranks that die
without reporting, and (through `fusedzero train`) signals, locks and pre-flight checks.

Every multi-rank case here has a short process-group timeout and a test timeout: a regression
shows up as a failure, never as a hung suite.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest
import torch
from torch import nn

from fusedzero.comm import CollectiveTimeout
from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

# The process group's timeout in the stall tests: long enough for gloo to set up and run a
# first all-gather of a tiny model on 2 busy cores, short enough to keep the test quick.
STALL_TIMEOUT_S = 4.0


class Units(nn.Module):
    """Three stage-3 units of different sizes (a rank that skips one cannot be matched up by
    accident with the other rank's gather of the same size)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8, bias=False),
                                     nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(b(x))
        return x


def _diverge(rank: int, world: int) -> str:
    """Rank 1 skips unit 1 (rank-dependent control flow): each rank must raise a timeout
    naming what it waited for."""
    torch.manual_seed(0)
    model = Units()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=3, module=model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    try:
        for _ in range(3):
            model(x, skip=1 if rank == 1 else None).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except CollectiveTimeout as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_stage3_divergent_ranks_time_out_naming_the_wait() -> None:
    msgs = run_ranks(_diverge, 2, timeout=90, pg_timeout=STALL_TIMEOUT_S)
    for rank, msg in enumerate(msgs):
        assert msg.startswith(f"rank {rank}: timed out"), msg
        assert "waiting for" in msg and ("all-gather" in msg or "reduction" in msg), msg


def _die(rank: int, world: int, victim: int, how: str) -> None:
    """`victim` dies the hard way while the other rank is busy (and would never report)."""
    if rank == victim:
        if how == "segfault":
            ctypes.string_at(0)  # a real SIGSEGV: reads address 0
        os.abort()
    time.sleep(600)


@pytest.mark.timeout(60)  # far below run_ranks' own timeout: the death must be noticed at once
@pytest.mark.parametrize("victim, how, sig", [(1, "segfault", "SIGSEGV"), (0, "abort", "SIGABRT")])
def test_run_ranks_reports_a_dead_rank_at_once(victim: int, how: str, sig: str) -> None:
    with pytest.raises(RuntimeError) as e:
        run_ranks(_die, 2, victim, how, timeout=600)
    code = -getattr(signal, sig)
    assert f"rank {victim} died without reporting: killed by {sig} (exit code {code})" \
        in str(e.value)
