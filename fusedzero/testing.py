"""Run a function on W local gloo ranks and collect what each returns (tests, benchmarks);
`fake_group` stands in for W ranks in this one process where nothing is communicated.

The processes are `fusedzero._spawn`'s, as `fusedzero train`'s.

Every run has a timeout: a hung collective fails the caller instead of hanging it, and a rank
that dies without reporting (segfault, abort, out of memory) fails it at once, naming the rank
and its exit code.

Reused ranks (`reuse_ranks(True)`, what tests/conftest.py sets for the test suite): starting a
rank costs seconds (a fresh interpreter imports torch and joins a gloo group) while most test
bodies take milliseconds, so the W processes of a run stay up, their group joined, and run the
next run of the same (world size, env, group timeout) too. Between runs they pass a barrier, so
a run that leaves the ranks out of step fails there. Any failure (an error report, a death, a
timeout) kills the pool; the next run starts fresh ones. A body that needs a process of its own
(process-lifetime peaks such as ru_maxrss, import side effects) passes `fresh=True`.

[Note: a body that leaves the group] A body may destroy the group and join another (a test of init
and teardown). Its peers learn that only when gloo notices the closed connection in their next
collective, and that notice has not always come: on a loaded CI machine a peer waited in the
barrier until the run's timeout. So each rank reports its result, and whether its group is still
the one it joined, before the barrier; the parent kills a pool where any rank's is not, and no
rank's result waits on a peer's socket.
"""

from __future__ import annotations

import atexit
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

from fusedzero._spawn import (
    REPORTED_ERROR_EXIT,
    Report,
    ReportKind,
    SpawnedRanks,
    context,
    leave,
    set_rank_env,
)

__all__ = ["fake_group", "reuse_ranks", "run_ranks"]

# What the fork server imports once for every rank it starts (fusedzero/_spawn.py `forkserver`).
PRELOAD = ["fusedzero.testing", "fusedzero.optim", "torch._dynamo"]


def _preload() -> list[str] | None:
    """PRELOAD where ranks run on the CPU; None (fresh spawned ranks) where torch sees a GPU:
    whether importing these touches the CUDA driver in the server (which would break CUDA in
    every forked rank) has not been checked on a GPU machine."""
    return None if torch.cuda.is_available() else PRELOAD


def _join(
    rank: int, world_size: int, port: int, env: dict[str, str], pg_timeout: float | None
) -> None:
    os.environ.update(env)
    set_rank_env(rank, world_size, port)
    torch.set_num_threads(1)
    extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
    dist.init_process_group("gloo", rank=rank, world_size=world_size, **extra)


def _dumps(result: Any) -> bytes:
    # Tensors go through as bytes: torch's shared-memory handles die with this process.
    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def _leave_group(queue: Queue[Report]) -> None:
    try:
        # A gloo process can abort at exit after its work is done: barrier, destroy, exit.
        dist.barrier()
        dist.destroy_process_group()
    except RuntimeError:
        # The result is in; a failing teardown (a peer that already left after a test's
        # deliberate stall) is no second report, just a reason to leave at once.
        leave(queue, REPORTED_ERROR_EXIT)


def _entry(
    rank: int,
    world_size: int,
    port: int,
    queue: Queue[Report],
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
    pg_timeout: float | None,
) -> None:
    try:
        _join(rank, world_size, port, env, pg_timeout)
        queue.put(Report(rank, ReportKind.OK, _dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put(Report(rank, ReportKind.ERROR, traceback.format_exc()))
        leave(queue, REPORTED_ERROR_EXIT)
    _leave_group(queue)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    pg_timeout: float | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return results.

    `fn` must be importable (module level). Raises RuntimeError with the rank's traceback on
    failure, RuntimeError naming the rank and its exit code when a rank dies without reporting
    (segfault, abort), and TimeoutError when the ranks do not finish in `timeout` seconds.
    `pg_timeout` is the process group's timeout in seconds (None: torch's default), which
    `fusedzero._comm.wait` uses as its limit. Ranks are reused between runs where
    `reuse_ranks(True)` was called, unless `fresh`.
    """
    deadline = time.monotonic() + timeout
    # A run with its own group timeout tests stalls and timeouts: it leaves its group broken.
    if _REUSE and not fresh and pg_timeout is None:
        key = (world_size, tuple(sorted((env or {}).items())))
        pool = _POOLS.pop(key, None)
        if pool is not None and not pool.alive():  # a rank was killed from outside since
            pool.close(kill=True)
            pool = None
        pool = pool or _Pool(world_size, env or {})
        try:
            out, healthy = pool.run(fn, args, deadline, timeout)
        except BaseException:
            pool.close(kill=True)
            raise
        if not healthy:  # the body broke the group (a rank left it, a collective failed)
            pool.close(kill=True)
            return out
        _POOLS[key] = pool
        while len(_POOLS) > _MAX_POOLS:  # the least recently used goes
            _POOLS.pop(next(iter(_POOLS))).close(kill=False)
        return out
    with SpawnedRanks(
        _entry,
        world_size,
        (fn, args, env or {}, pg_timeout),
        daemon=True,
        exit_grace_s=10.0,
        preload=_preload(),
        name="fusedzero test",
    ) as ranks:
        return [_load(v) for v in _collect(ranks, world_size, deadline, timeout)]


def _load(value: bytes) -> Any:
    return torch.load(io.BytesIO(value), weights_only=False)


def _collect(ranks: SpawnedRanks, world_size: int, deadline: float, timeout: float) -> list[Any]:
    """Each rank's OK report value, in rank order; the first ERROR report raises."""
    results: dict[int, Any] = {}
    while len(results) < world_size:
        report = ranks.next_report(
            [r for r in range(world_size) if r not in results], deadline, timeout
        )
        if report is None:
            continue
        if report.kind is ReportKind.ERROR:
            raise ranks.failure(report, results)
        results[report.rank] = report.value
    return [results[r] for r in range(world_size)]


_REUSE = False
_MAX_POOLS = 3  # idle ranks hold memory (~250 MB each with torch loaded), no CPU
_POOLS: dict[tuple, _Pool] = {}


def reuse_ranks(on: bool) -> None:
    """Keep ranks up between `run_ranks` calls (on) or start fresh ones for each (off, the
    default); turning it off closes the pools."""
    global _REUSE
    _REUSE = on
    if not on:
        while _POOLS:
            _POOLS.popitem()[1].close(kill=False)


def _pool_entry(
    rank: int,
    world_size: int,
    port: int,
    queue: Queue[Report],
    tasks: list[Queue[Any]],
    env: dict[str, str],
) -> None:
    """A reused rank: join the group, then run each task until a None. Each OK report's value
    is (result bytes, whether this rank still has the group it joined), sent before the barrier
    between runs (see [Note: a body that leaves the group])."""
    try:
        _join(rank, world_size, port, env, None)
        joined = dist.group.WORLD
        while (task := tasks[rank].get()) is not None:
            fn, args = task
            result = _dumps(fn(rank, world_size, *args))
            intact = dist.is_initialized() and dist.group.WORLD is joined
            queue.put(Report(rank, ReportKind.OK, (result, intact)))
            if not intact:
                leave(queue, 0)
            try:  # drain what the body left in flight before the next run's collectives
                dist.barrier()
            except RuntimeError:
                leave(queue, 0)  # the next run finds this rank dead and starts fresh ones
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put(Report(rank, ReportKind.ERROR, traceback.format_exc()))
        leave(queue, REPORTED_ERROR_EXIT)
    _leave_group(queue)
    leave(queue, 0)


# See [Note: a body that leaves the group].


class _Pool:
    """`world_size` ranks with their group joined, each taking runs from its own task queue."""

    def __init__(self, world_size: int, env: dict[str, str]) -> None:
        preload = _preload()
        self.world_size = world_size
        self.tasks: list[Queue[Any]] = [context(preload).Queue() for _ in range(world_size)]
        self.ranks = SpawnedRanks(
            _pool_entry,
            world_size,
            (self.tasks, env),
            daemon=True,
            exit_grace_s=10.0,
            preload=preload,
            name="fusedzero test",
        )

    def run(
        self, fn: Callable[..., Any], args: tuple, deadline: float, timeout: float
    ) -> tuple[list[Any], bool]:
        """Each rank's result, and whether every rank still has the group it joined."""
        for q in self.tasks:
            q.put((fn, args))
        values = _collect(self.ranks, self.world_size, deadline, timeout)
        return [_load(b) for b, _ in values], all(ok for _, ok in values)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.ranks.procs)

    def close(self, *, kill: bool) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
        self.ranks.close(kill=kill)
        for q in self.tasks:
            q.close()
            q.join_thread()


atexit.register(reuse_ranks, False)


def _forget_pools() -> None:
    """In a fork of this process: the pools are the parent's (their ranks take the parent's
    tasks), and a fork that leaves through os._exit never runs atexit, so pools it started
    would outlive it. A fork starts fresh ranks for each run instead."""
    global _REUSE
    _REUSE = False
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_pools)


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
