"""Run a function on W local gloo ranks and collect what each returns (tests, benchmarks, CLI).

Every run has a timeout: a hung collective fails the caller instead of hanging it, and a rank
that dies without reporting (segfault, abort, out of memory) fails it at once, naming the rank
and its exit code.
"""
from __future__ import annotations

import datetime
import io
import os
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# How often the parent looks for ranks that died without a report while it waits: a dead rank
# is noticed within this, not after the whole timeout.
_POLL_S = 0.2
# A rank's last report may still be in the pipe when its exit is seen: give it this long.
_LAST_WORDS_S = 1.0


def free_port() -> int:
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


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
           queue: Any, env: dict[str, str], pg_timeout: float | None) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    code = 0
    try:
        extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", rank=rank, world_size=world_size, **extra)
        result = fn(rank, world_size, *args)
        # Tensors go through as bytes: torch's shared-memory handles die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
        code = 1
    if not code:
        try:
            # A gloo process can abort at exit after its work is done: barrier, destroy, exit.
            dist.barrier()
            dist.destroy_process_group()
        except RuntimeError:
            # The result is in; a failing teardown (a peer that already left after a test's
            # deliberate stall) is no second report, just a reason to leave at once.
            code = 1
    if code:
        # After an error a gloo thread may still sit in a collective that never completes, and
        # interpreter teardown would wait for it: leave once the report is through the pipe.
        queue.close()
        queue.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              env: dict[str, str] | None = None, pg_timeout: float | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return results.

    `fn` must be importable (module level). Raises RuntimeError with the rank's traceback on
    failure, RuntimeError naming the rank and its exit code when a rank dies without reporting
    (segfault, abort), and TimeoutError when the ranks do not finish in `timeout` seconds.
    `pg_timeout` is the process group's timeout in seconds (None: torch's default), which
    `fusedzero.comm.wait` uses as its limit.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry,
                         args=(r, world_size, port, fn, args, queue, env or {}, pg_timeout),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=_POLL_S)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
                if dead:
                    try:  # its report may still be on the way through the pipe
                        rank, status, value = queue.get(timeout=_LAST_WORDS_S)
                    except queue_mod.Empty:
                        r = dead[0]
                        raise RuntimeError(
                            f"rank {r} died without reporting: "
                            f"{exit_description(procs[r].exitcode)}") from None
                elif time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{world_size} ranks did not finish within {timeout}s; still running: "
                        f"{[r for r in range(world_size) if r not in results]}") from None
                else:
                    continue
            if status == "error":
                # A peer's death often surfaces first as this rank's connection error: name the
                # dead rank too, as the likely cause.
                time.sleep(_LAST_WORDS_S)
                dead = [f"rank {r} died without reporting: {exit_description(p.exitcode)}\n"
                        for r, p in enumerate(procs)
                        if r != rank and r not in results and not p.is_alive()
                        and p.exitcode != 1]  # exit code 1: a rank that reported its error
                raise RuntimeError("".join(dead) + f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        queue.close()
        queue.join_thread()
    return [results[r] for r in range(world_size)]
