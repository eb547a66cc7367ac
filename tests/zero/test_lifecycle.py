"""Runs that end instead of hanging: collective timeouts naming the wait, ranks that die
without reporting, and (through `fusedzero train`) signals, locks and pre-flight checks.

Every multi-rank case here has a short process-group timeout and a test timeout: a regression
shows up as a failure, never as a hung suite.

About internals: fusedzero._comm, fusedzero._spawn, fusedzero.checkpoint._saving.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fusedzero._comm import CollectiveTimeout
from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks or the CLI

# The process group's timeout in the stall tests: long enough for two ranks of a tiny model to
# meet at each collective on 2 cores shared with other jobs (load 6x: a few seconds apart),
# short enough to keep the test quick.
STALL_TIMEOUT_S = 8.0


class Units(nn.Module):
    """Three stage-3 units of different sizes (a rank that skips one cannot be matched up by
    accident with the other rank's gather of the same size)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor, again: bool = False) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        if again:  # the first block once more, after the last
            x = torch.tanh(self.blocks[0](x))
        return x


def _diverge(rank: int, world: int) -> str:
    """Rank 1 calls unit 1 a second time, behind the unit order (rank-dependent control flow
    that a skipped unit's gathers do not make up for): each rank must raise a timeout naming
    what it waited for."""
    torch.manual_seed(0)
    model = Units()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=3, module=model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    try:
        for _ in range(3):
            model(x, again=rank == 1).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except CollectiveTimeout as e:
        return str(e)
    except RuntimeError as e:
        # The other rank timed out first and left: this rank's wait fails at once, with the
        # connection error, still naming the rank and its wait.
        return str(e)
    return "no error"


@pytest.mark.timeout(300)
def test_stage3_divergent_ranks_fail_naming_the_wait() -> None:
    msgs = run_ranks(_diverge, 2, timeout=240, pg_timeout=STALL_TIMEOUT_S)
    for rank, msg in enumerate(msgs):
        assert msg.startswith(f"rank {rank}: "), msg
        assert "all-gather of unit" in msg or "reduction" in msg or "broadcast" in msg, msg
    # At least the rank that waited longest says it timed out (the other may see its peer go).
    assert any("timed out" in m and "waiting for" in m for m in msgs), msgs


def _die(rank: int, world: int, victim: int, how: str) -> None:
    """`victim` dies the hard way while the other rank is busy (and would never report)."""
    if rank == victim:
        if how == "segfault":
            ctypes.string_at(0)  # a real SIGSEGV: reads address 0
        os.abort()
    time.sleep(600)


@pytest.mark.timeout(180)  # far below run_ranks' own: the death must be noticed at once
@pytest.mark.parametrize("victim, how, sig", [(1, "segfault", "SIGSEGV"), (0, "abort", "SIGABRT")])
def test_run_ranks_reports_a_dead_rank_at_once(victim: int, how: str, sig: str) -> None:
    with pytest.raises(RuntimeError) as e:
        run_ranks(_die, 2, victim, how, timeout=600)
    code = -getattr(signal, sig)
    assert f"rank {victim} died without reporting: killed by {sig} (exit code {code})" in str(
        e.value
    )


# -- `fusedzero train` as a real process: signals, stalls ------------------------------------
# A tiny model and more steps than any test waits for: the run is always ended from outside.
LONG_RUN = [
    "train",
    "--n-layer",
    "1",
    "--n-embd",
    "16",
    "--n-head",
    "2",
    "--block-size",
    "16",
    "--batch-size",
    "4",
    "--steps",
    "100000",
    "--eval-seqs",
    "2",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--nproc",
    "2",
    "--no-progress",
    "--device",
    "cpu",
]
# How long a test waits for something that takes a few seconds on an idle machine (a busy
# 2-core machine can be ten times slower); a pytest timeout above it bounds every test.
PATIENCE_S = 180.0
# --timeout of the stalled run: as STALL_TIMEOUT_S, it must not fire on a merely slow rank.
TRAIN_TIMEOUT_S = "8"


def _state(pid: int) -> str | None:
    """The process state letter, or None when there is no such process. A zombie ('Z') has
    exited: it only waits for its new parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d))
    return sorted(out)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ranks(pid: int) -> list[int]:
    """The rank processes of a `fusedzero train` launcher (not its resource tracker): spawned
    children (CUDA) or the children of its fork server (CPU, fusedzero/_spawn.py)."""
    ranks = []
    for c in _children(pid):
        cmd = _cmdline(c)
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            ranks.append(c)
        elif b"forkserver" in cmd:
            ranks += _children(c)
    return sorted(ranks)


def _start_training(corpus: Path, *extra: str) -> tuple[subprocess.Popen, list[int]]:
    """Start `fusedzero train`; return it and its 2 rank pids once the ranks are training."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.Popen(
        [sys.executable, "-m", "fusedzero.cli", *LONG_RUN, "--data", str(corpus), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + PATIENCE_S
    seen = ""
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while "val loss" not in seen:  # the first eval: every rank is set up and training
            if time.monotonic() > deadline or p.poll() is not None:
                p.kill()
                raise AssertionError(f"the run did not start: {seen!r} {p.stderr.read()!r}")
            if sel.select(timeout=1.0):
                seen += p.stdout.readline()
    ranks = _ranks(p.pid)
    assert len(ranks) == 2, ranks
    return p, ranks


def _wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + PATIENCE_S
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [q for q in pids if _alive(q)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "argparse.py"
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py", path)
    return path


@pytest.mark.timeout(900)
def test_killed_launcher_takes_its_ranks_and_sigterm_stops_like_ctrl_c(corpus: Path) -> None:
    """SIGKILL to the launcher: its ranks die too (before: they trained on with PPID 1).
    SIGTERM: the launcher ends its ranks and exits 128+15 with one line."""
    p, ranks = _start_training(corpus)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=PATIENCE_S)
    assert _wait_gone(ranks) == [], "ranks outlived their SIGKILLed launcher"
    p.stdout.close()
    p.stderr.close()

    p, ranks = _start_training(corpus)
    os.kill(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=PATIENCE_S)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "fusedzero: terminated by SIGTERM", err
    assert _wait_gone(ranks) == [], "ranks outlived their SIGTERMed launcher"


@pytest.mark.timeout(500)
def test_stalled_rank_ends_the_run_naming_rank_and_wait(corpus: Path) -> None:
    """A rank that stops (SIGSTOP: it holds its sockets, so no peer sees a closed connection)
    stalls the others; after --timeout the run ends with one line naming what the live rank
    waited for and the silent rank, exit code 1, and no rank is left behind."""
    p, ranks = _start_training(corpus, "--timeout", TRAIN_TIMEOUT_S)
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        _, err = p.communicate(timeout=PATIENCE_S)
    finally:
        if _alive(ranks[1]):
            os.kill(ranks[1], signal.SIGCONT)
    assert p.returncode == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("fusedzero: error: rank "), err
    assert "timed out" in line and "waiting for" in line, line
    assert f"limit {TRAIN_TIMEOUT_S}s" in line, line
    assert "did not report and were ended" in line, line
    assert _wait_gone(ranks) == []


# -- async checkpoint save with a dead peer -----------------------------------------------------
def _async_save_with_dead_peer(rank: int, port: int, ckpt: str, result: str) -> None:
    """Rank 1 dies (SIGKILL) while writing its shard; rank 0's save thread must give up after
    the group's timeout, so its handle reports the dead rank and the process can exit."""
    import datetime

    import torch.distributed as dist

    from fusedzero import checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S)
    )
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    if rank == 1:
        checkpoint._saving._write_shard = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    h = checkpoint.save(opt, ckpt, step=1, async_=True)
    try:
        h.wait()
        msg = "saved"
    except checkpoint.CheckpointError as e:
        msg = str(e)
    Path(result).write_text(msg)
    os._exit(0)  # gloo's teardown with a dead peer is not what this test is about


@pytest.mark.timeout(300)
def test_async_save_with_a_dead_peer_ends(tmp_path: Path) -> None:
    """Before: rank 0's (non-daemon) save thread waited 1800 s for the dead rank's shard."""
    import multiprocessing

    from fusedzero._spawn import reserve_port

    ctx = multiprocessing.get_context("spawn")
    held = reserve_port()  # until the ranks are done: no other test's bind takes it
    port, result = held.getsockname()[1], tmp_path / "rank0.txt"
    procs = [
        ctx.Process(
            target=_async_save_with_dead_peer, args=(r, port, str(tmp_path / "ckpt"), str(result))
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=PATIENCE_S)
        assert procs[0].exitcode == 0, "rank 0 did not finish its save"
        msg = result.read_text()
        assert "ranks [1] did not finish their shards" in msg, msg
        assert f"{STALL_TIMEOUT_S}s" in msg, msg
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        held.close()
