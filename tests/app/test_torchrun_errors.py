"""`fusedzero train` under torchrun (its ranks in a group of their own): a rank that raises
leaves at once with its own error (see [Note: a rank that raises in a group] in
fusedzero/app/launch.py). Before: its `finally` entered the end-of-run barrier while the other
rank was in a training collective, and the run ended, after the group's timeout, with a timeout
on both ranks instead of rank 0's error.

Two gloo processes with torchrun's environment; rank 0's training raises a usage error only it
sees (as `--log-jsonl` pointing at a file that is not a metrics log does), rank 1 is in an
all-reduce. The group's timeout is 30 s: rank 0 must be out with its error long before.

About an internal: fusedzero._spawn.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import pytest

from fusedzero._spawn import reserve_port

pytestmark = pytest.mark.slow  # two processes

TIMEOUT_S = 30


def _rank(rank: int, port: int, q: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # a fork of this process: libgomp's pool is not fork-safe

    import fusedzero.app.loop as loop
    from fusedzero.app import launch
    from fusedzero.app.config import UsageError, parse_args

    def train_rank(cfg: Any, device: Any, data: Any, progress: Any = None) -> dict:
        if dist.get_rank() == 0:
            raise UsageError("only rank 0 sees this")
        dist.all_reduce(torch.ones(3))  # rank 1: in a training collective
        return {}

    loop.train_rank = train_rank
    cfg = parse_args(["--device", "cpu", "--timeout", str(TIMEOUT_S), "--steps", "1"])
    t0 = time.monotonic()
    try:
        launch.run_config(cfg)
        q.put((rank, "ok", time.monotonic() - t0))
    except BaseException as e:  # noqa: BLE001 - the test reads it
        q.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - t0))


def test_a_rank_that_raises_leaves_with_its_own_error() -> None:
    import torch

    # Forks of this process (which imported torch already: no seconds of imports per rank),
    # but where torch sees a GPU, whose state a fork would share.
    ctx = mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    q = ctx.Queue()
    held = reserve_port()  # until the ranks are done: no other test's bind takes it
    port = held.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, what, took = q.get(timeout=TIMEOUT_S + 60)
        assert rank == 0, (rank, what)
        assert what == "UsageError: only rank 0 sees this", what
        assert took < TIMEOUT_S / 2, took  # before the group's timeout could end anything
    finally:
        for p in procs:
            p.kill()
            p.join(10)
        held.close()
