"""Reused ranks (`fusedzero.testing.reuse_ranks`, on for this suite): the same processes run
consecutive runs of one world size, their group intact; a failing run leaves no broken pool
behind for the next test."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fusedzero import testing
from fusedzero.testing import run_ranks


def _pid_and_sum(rank: int, world: int) -> tuple[int, float]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return os.getpid(), t.item()


def _fail_on_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 says no")
    dist.barrier()  # rank 0 waits here for a peer that never comes


_HELD: list = []


def _leave_the_group(rank: int, world: int, hold: bool) -> int:
    if rank == 0:
        if hold:  # its sockets stay open: rank 1's barrier never hears that rank 0 left
            _HELD.append(dist.group.WORLD)
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return rank


@pytest.mark.slow  # spawns ranks
def test_ranks_are_reused_and_a_failure_starts_fresh_ones() -> None:
    assert testing._REUSE  # tests/conftest.py turned it on
    first = run_ranks(_pid_and_sum, 3)
    again = run_ranks(_pid_and_sum, 3)
    assert [s for _, s in first] == [s for _, s in again] == [6.0] * 3
    assert [p for p, _ in first] == [p for p, _ in again]  # the same processes
    assert run_ranks(_pid_and_sum, 3, fresh=True)[0][0] not in {p for p, _ in first}
    with pytest.raises(RuntimeError, match="rank 1 says no"):
        run_ranks(_fail_on_1, 3)
    after = run_ranks(_pid_and_sum, 3)
    assert [s for _, s in after] == [6.0] * 3
    assert not {p for p, _ in after} & {p for p, _ in first}  # the failed pool was replaced


@pytest.mark.slow  # spawns ranks
@pytest.mark.parametrize("hold", [False, True], ids=["closed", "sockets_open"])
def test_a_body_that_breaks_the_group_returns_and_is_not_reused(hold: bool) -> None:
    """Whether or not the peers' gloo notices that rank 0 left, every rank's result comes back
    and the pool is replaced (see [Note: a body that leaves the group])."""
    before = {p for p, _ in run_ranks(_pid_and_sum, 2)}
    assert run_ranks(_leave_the_group, 2, hold, timeout=60) == [0, 1]
    after = {p for p, _ in run_ranks(_pid_and_sum, 2)}
    assert not before & after


@pytest.mark.slow  # spawns ranks
def test_a_pool_with_a_rank_killed_from_outside_is_replaced() -> None:
    first = [p for p, _ in run_ranks(_pid_and_sum, 2)]
    os.kill(first[1], signal.SIGKILL)
    for _ in range(100):  # until the parent sees it dead
        if not any(p.pid == first[1] and p.is_alive() for p in mp.active_children()):
            break
        time.sleep(0.05)
    after = run_ranks(_pid_and_sum, 2)
    assert [s for _, s in after] == [3.0, 3.0] and not set(first) & {p for p, _ in after}


def _pools_in_a_fork() -> None:
    assert not testing._POOLS and not testing._REUSE, (testing._POOLS, testing._REUSE)


def test_a_fork_does_not_inherit_the_pools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A fork of the test process (a forked docs block that calls run_ranks) must not use the
    parent's pools (their ranks take the parent's tasks) nor keep its own: it leaves through
    os._exit, without atexit, and its pool's ranks outlived the session."""
    from _helpers import run_forked

    monkeypatch.setitem(testing._POOLS, ("parent", ()), object())
    p = run_forked(_pools_in_a_fork, tmp_path)
    assert p.returncode == 0, p.stderr
    assert ("parent", ()) in testing._POOLS and testing._REUSE
