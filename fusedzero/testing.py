"""Run a function on W local gloo ranks and collect what each returns (tests, benchmarks, CLI).

Every run has a timeout: a hung collective fails the caller instead of hanging it.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
           queue: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Tensors go through as bytes: torch's shared-memory handles die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
        # A gloo process can abort at exit after its work is done: barrier, destroy, then exit.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return results.

    `fn` must be importable (module level). Raises RuntimeError with the rank's traceback on
    failure and TimeoutError when the ranks do not finish in `timeout` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, env or {}),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, value = queue.get(timeout=timeout)
            except queue_mod.Empty:
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout}s") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
