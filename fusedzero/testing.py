"""Run a function on W local gloo ranks and collect what each returns (tests, benchmarks);
`fake_group` stands in for W ranks in this one process where nothing is communicated.

The processes are `fusedzero.spawn`'s, as `fusedzero train`'s.

Every run has a timeout: a hung collective fails the caller instead of hanging it, and a rank
that dies without reporting (segfault, abort, out of memory) fails it at once, naming the rank
and its exit code.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist

from fusedzero.spawn import (REPORTED_ERROR_EXIT, Report, ReportKind, SpawnedRanks, leave,
                             set_rank_env)


def _entry(rank: int, world_size: int, port: int, queue: Queue[Report], fn: Callable[..., Any],
           args: tuple, env: dict[str, str], pg_timeout: float | None) -> None:
    os.environ.update(env)
    set_rank_env(rank, world_size, port)
    torch.set_num_threads(1)
    try:
        extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", rank=rank, world_size=world_size, **extra)
        result = fn(rank, world_size, *args)
        # Tensors go through as bytes: torch's shared-memory handles die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put(Report(rank, ReportKind.OK, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put(Report(rank, ReportKind.ERROR, traceback.format_exc()))
        leave(queue, REPORTED_ERROR_EXIT)
    try:
        # A gloo process can abort at exit after its work is done: barrier, destroy, exit.
        dist.barrier()
        dist.destroy_process_group()
    except RuntimeError:
        # The result is in; a failing teardown (a peer that already left after a test's
        # deliberate stall) is no second report, just a reason to leave at once.
        leave(queue, REPORTED_ERROR_EXIT)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              env: dict[str, str] | None = None, pg_timeout: float | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return results.

    `fn` must be importable (module level). Raises RuntimeError with the rank's traceback on
    failure, RuntimeError naming the rank and its exit code when a rank dies without reporting
    (segfault, abort), and TimeoutError when the ranks do not finish in `timeout` seconds.
    `pg_timeout` is the process group's timeout in seconds (None: torch's default), which
    `fusedzero.comm.wait` uses as its limit.
    """
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    with SpawnedRanks(_entry, world_size, (fn, args, env or {}, pg_timeout), daemon=True,
                      exit_grace_s=10.0) as ranks:
        while len(results) < world_size:
            report = ranks.next_report([r for r in range(world_size) if r not in results],
                                       deadline, timeout)
            if report is None:
                continue
            if report.kind is ReportKind.ERROR:
                raise ranks.failure(report, results)
            results[report.rank] = torch.load(io.BytesIO(report.value), weights_only=False)
    return [results[r] for r in range(world_size)]


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[None]:
    """This process as `rank` of `world_size` in torch's "fake" process group: collectives
    return at once and move nothing, so layouts, plans and byte counts of a W-rank run can be
    built and checked in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
