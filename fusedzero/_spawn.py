"""Spawn W local ranks and collect their reports: the one process harness behind
`fusedzero.testing.run_ranks` (tests, benchmarks) and `fusedzero train`.

A rank sends one `Report` through a queue. The parent polls it, so a rank that dies without
reporting (segfault, abort, an OOM kill) fails the run within POLL_S, naming the rank and its
exit, instead of after the whole timeout; ranks still alive when the parent leaves are killed.

[Note: a port held for the ranks] A socket bound to a free local port, never listening, with
SO_REUSEADDR: while it is open no other bind takes the port (the kernel hands port 0 out only where
nothing is bound, and a plain bind to it fails), yet rank 0's store, which binds with SO_REUSEADDR
too, can listen on it. A port found free and released (`free_port`) could be taken by another
process before rank 0 bound it: a CI run's `fusedzero train` ended with EADDRINUSE while another
test's ranks started. Close it once the ranks are done (or their group is up).
"""

from __future__ import annotations

import contextlib
import enum
import os
import queue as queue_mod
import signal
import socket
import sys
import time
from collections.abc import Callable, Collection, Iterator
from multiprocessing.queues import Queue
from types import TracebackType
from typing import Any, NamedTuple, NoReturn

import torch.multiprocessing as mp

# How often the parent looks for ranks that died without a report while it waits: a dead rank
# is noticed within this, not after the whole timeout.
POLL_S = 0.2
# A rank's last report may still be in the pipe when its exit is seen: give it this long.
LAST_WORDS_S = 1.0
# A rank that reported an error leaves with this code (`leave`): it is no silent death.
REPORTED_ERROR_EXIT = 1


class ReportKind(enum.Enum):
    OK = "ok"
    ERROR = "error"  # the value is the rank's traceback
    USAGE = "usage"  # `fusedzero train`: a bad flag, path or checkpoint found on a rank
    STALLED = "stalled"  # `fusedzero train`: a wait on the others passed --timeout
    OUTPUT_CLOSED = "output closed"  # `fusedzero train | head`: stdout's reader left


class Report(NamedTuple):
    rank: int
    kind: ReportKind
    value: Any


def reserve_port() -> socket.socket:
    """A socket bound to a free local port, never listening, with SO_REUSEADDR (see
    [Note: a port held for the ranks]). Close it once the ranks are done (or their group is
    up)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port held (`reserve_port`) for the duration of the block."""
    s = reserve_port()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def free_port() -> int:
    """A port free now, released: only for a use that cannot race (see `reserve_port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_description(code: int | None) -> str:
    """'exit code 3' / 'killed by signal SIGSEGV (exit code -11)' for a Process.exitcode."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}"


def set_rank_env(rank: int, world_size: int, port: int) -> None:
    """In a spawned rank: the env:// rendezvous `init_process_group` reads, as torchrun sets it."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )


def leave(queue: Queue[Report], code: int) -> NoReturn:
    """End a spawned rank once its report is through the pipe. Skips interpreter teardown: it
    takes seconds with torch loaded, and after an error a gloo thread may still sit in a
    collective that never completes, which teardown would wait for."""
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def context(preload: list[str] | None) -> Any:
    """The multiprocessing context ranks start from: the fork server importing `preload`, or
    fresh spawned interpreters (None)."""
    return forkserver(preload) if preload is not None else mp.get_context("spawn")


def forkserver(preload: list[str]) -> Any:
    """The fork-server context: its server imports `preload` once, and each process it starts
    is a fork of it (milliseconds) instead of a fresh interpreter importing torch (seconds).
    The server starts with the first process of this Python process and serves all later ones;
    it holds no CUDA context and no threads. Its parent is the server, not the caller: not for
    ranks that watch their launcher (`fusedzero train` spawns)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


class _Stdio:
    """Pickled into a fork-server child: the caller's stdout and stderr of now (the server's
    are those of its start), passed as file descriptors and made the child's 1 and 2."""

    def __reduce__(self) -> tuple[Any, tuple]:
        from multiprocessing import reduction

        return _use_stdio, tuple(reduction.DupFd(fd) for fd in (1, 2) if _is_open(fd))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _use_stdio(*fds: Any) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), fds):
        os.dup2(fd.detach(), target)


def _in_env(
    rank: int,
    world_size: int,
    port: int,
    queue: Queue[Report],
    target: Callable[..., None],
    env: dict[str, str],
    stdio: None,
    *args: Any,
) -> None:
    """A fork-server child: the caller's environment of now, then `target`."""
    os.environ.clear()
    os.environ.update(env)
    target(rank, world_size, port, queue, *args)


class SpawnedRanks:
    """`world_size` processes running `target(rank, world_size, port, queue, *args)`.

    Use as a context manager: leaving the block normally gives the ranks `exit_grace_s` to end
    on their own (they tear down their process group after reporting); leaving it by an
    exception kills them at once, since the others may be stuck in a collective.
    """

    def __init__(
        self,
        target: Callable[..., None],
        world_size: int,
        args: tuple = (),
        *,
        daemon: bool = True,
        exit_grace_s: float = 10.0,
        preload: list[str] | None = None,
        name: str = "fusedzero",
    ) -> None:
        ctx = context(preload)
        self.world_size = world_size
        self.queue = ctx.Queue()
        self.exit_grace_s = exit_grace_s
        self._port = reserve_port()  # held until close(): see [Note: a port held for the ranks]
        port = self._port.getsockname()[1]
        if preload is not None:  # the server's environment and stdio are its start's
            args = (target, dict(os.environ), _Stdio(), *args)
            target = _in_env
        self.procs = [
            ctx.Process(
                target=target,
                args=(r, world_size, port, self.queue, *args),
                daemon=daemon,
                name=f"{name} rank {r}",
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def __enter__(self) -> SpawnedRanks:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(kill=exc_type is not None)

    def close(self, *, kill: bool) -> None:
        """Give the ranks `exit_grace_s` to end on their own, or (kill) 0.5 s; then kill."""
        for p in self.procs:
            p.join(timeout=0.5 if kill else self.exit_grace_s)
            if p.is_alive():
                p.kill()
                p.join()
        # Release the queue's semaphores now: left to interpreter exit, the resource tracker
        # warns about them as leaked.
        self.queue.close()
        self.queue.join_thread()
        self._port.close()

    def next_report(
        self,
        waiting_on: Collection[int],
        deadline: float = float("inf"),
        timeout: float | None = None,
    ) -> Report | None:
        """The next report, or None after POLL_S without one (the caller may check its own
        deadlines). Raises RuntimeError when a rank in `waiting_on` died without reporting, and
        TimeoutError (naming `timeout`, the caller's limit) once `time.monotonic()` passes
        `deadline`."""
        try:
            return self.queue.get(timeout=POLL_S)
        except queue_mod.Empty:
            pass
        dead = [r for r in waiting_on if not self.procs[r].is_alive()]
        if dead:
            try:  # its report may still be on the way through the pipe
                return self.queue.get(timeout=LAST_WORDS_S)
            except queue_mod.Empty:
                raise RuntimeError(
                    f"rank {dead[0]} died without reporting: "
                    f"{exit_description(self.procs[dead[0]].exitcode)}"
                ) from None
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{self.world_size} ranks did not finish within {timeout}s; still "
                f"running: {sorted(waiting_on)}"
            )
        return None

    def failure(self, report: Report, reported: Collection[int]) -> RuntimeError:
        """The error for a rank's ERROR report. A peer's death often surfaces first as this
        rank's connection error: the ranks that died silently are named too, as the likely
        cause."""
        time.sleep(LAST_WORDS_S)
        dead = [
            f"rank {r} died without reporting: {exit_description(p.exitcode)}\n"
            for r, p in enumerate(self.procs)
            if r != report.rank
            and r not in reported
            and not p.is_alive()
            and p.exitcode != REPORTED_ERROR_EXIT
        ]
        return RuntimeError("".join(dead) + f"rank {report.rank} failed:\n{report.value}")
