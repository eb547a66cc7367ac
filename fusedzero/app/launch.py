"""`fusedzero train`: pretrain the small byte-level GPT with ZeroAdamW on local ranks.

    fusedzero train                          # 2 CPU ranks (gloo), or every local GPU (NCCL, bf16)
    fusedzero train --stage 3 --nproc 4 --steps 500 --out-json run.json
    torchrun --nproc-per-node 8 -m fusedzero.cli train --stage 2     # joins torchrun's group

The python API is `run(argv) -> summary dict` (what `--out-json` writes), used by the tests.

[Note: a rank that raises in a group] The end-of-run barrier and the group's destruction come after
a successful run only. A rank that raises (a usage error only rank 0 sees, an out-of-memory) leaves
at once with its own error: the other ranks are then in some other collective, which a barrier
would not match (on NCCL: a hang until the watchdog's abort, the real error never printed).
torchrun ends the other ranks when one exits with an error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import math
import os
import sys
import time
import traceback
from multiprocessing.queues import Queue
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fusedzero import _comm as comm
from fusedzero._comm import CollectiveTimeout
from fusedzero._spawn import (
    LAST_WORDS_S,
    REPORTED_ERROR_EXIT,
    Report,
    ReportKind,
    SpawnedRanks,
    context,
    exit_description,
    leave,
    set_rank_env,
)
from fusedzero.app import preflight
from fusedzero.app.config import (
    HelpFormatter,
    StalledError,
    TrainConfig,
    UsageError,
    add_arguments,
    config_from_args,
    parse_args,
)
from fusedzero.app.data import Split
from fusedzero.app.lifecycle import die_with_parent, sigterm_as_interrupt
from fusedzero.app.log import waiting_for
from fusedzero.app.preload import RANK_PRELOAD, under_torchrun

# After the first rank reports a stall, how long the launcher waits for the other ranks' own
# reports (they hit the same timeout at about the same moment) before it ends them.
_STALL_GRACE_S = 3.0


class RankFailed(RuntimeError):
    """A rank died (a signal, out of memory) or raised: one line naming the rank, the cause and
    the step, and the checkpoint a resume would use; `detail` keeps the rank's traceback (the
    CLI prints it with --debug)."""

    def __init__(self, msg: str, detail: str = "") -> None:
        super().__init__(msg)
        self.detail = detail


def add_train_subparser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="pretrain the small GPT with ZeroAdamW",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=_cli_train)
    return p


def _cli_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # A process torchrun started, whose group `_run_in_group` makes and destroys.
    torchrun_rank = under_torchrun() and not dist.is_initialized()
    run_config(cfg)
    if torchrun_rank:
        # Done, the group destroyed, every output written: skip interpreter teardown, as a
        # spawned rank does (`_spawn.leave`). A gloo process can abort in it after its work is
        # done ("terminate called without an active exception", SIGABRT after the summary:
        # seen once on 2 torchrun ranks in CI), which torchrun reports as a failed run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


# -- launching ------------------------------------------------------------------------------------
def run(argv: list[str]) -> dict[str, Any]:
    """Parse `fusedzero train` flags, train, and return the summary (what --out-json writes).

    Raises UsageError for bad flags, data paths or checkpoints.
    """
    return run_config(parse_args(list(argv)))


def run_config(cfg: TrainConfig) -> dict[str, Any]:
    """Train as `cfg` says: join torchrun's group if there is one, else spawn local ranks."""
    if under_torchrun() or dist.is_initialized():
        return _run_in_group(cfg)
    use_cuda, nproc = local_ranks(cfg)
    check_tp_world(cfg, nproc)
    preflight.check_batch(cfg, nproc)
    # Before anything slow: a bad path fails now, not after the run.
    preflight.check_outputs_writable(cfg)
    # Loaded once here; the tensors reach the ranks through shared memory, not a pipe.
    data = preflight.load_data(cfg)
    with preflight.run_folder_lock(cfg):
        preflight.check_run_folder(cfg)
        preflight.check_disk(cfg, nproc, use_cuda)
        with sigterm_as_interrupt():
            return _spawn(cfg, nproc, use_cuda, data)


def check_tp_world(cfg: TrainConfig, world: int) -> None:
    if world % cfg.tp:
        raise UsageError(
            f"--tp {cfg.tp} must divide the number of ranks ({world}): "
            f"use --nproc {cfg.tp * max(1, world // cfg.tp)}"
        )


def _use_cuda(cfg: TrainConfig) -> bool:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no GPU; use --device cpu")
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def local_ranks(cfg: TrainConfig) -> tuple[bool, int]:
    """(use CUDA, ranks to spawn): --device auto takes CUDA when torch sees a GPU, one rank per
    GPU; --device cpu runs --nproc gloo ranks (default 2) whatever GPUs are visible."""
    use_cuda = _use_cuda(cfg)
    gpus = torch.cuda.device_count() if use_cuda else 0
    nproc = cfg.nproc or (gpus if use_cuda else 2)
    if use_cuda and nproc > gpus:
        raise UsageError(
            f"--nproc {nproc} exceeds the {gpus} visible GPUs; use --nproc {gpus}, "
            "or --device cpu for gloo ranks on the CPU"
        )
    return use_cuda, nproc


# CPU ranks start from a fork server that imported RANK_PRELOAD once (fusedzero/_spawn.py; the
# `fusedzero` command starts it early: fusedzero/app/entry.py): each rank saves the seconds of
# imports a fresh interpreter pays. CUDA ranks are spawned fresh (a fork of a process that
# touched the CUDA driver is unsafe).
def _spawn(cfg: TrainConfig, nproc: int, use_cuda: bool, data: Split) -> dict[str, Any]:
    summary: dict[str, Any] | None = None
    reported: set[int] = set()
    stalls: dict[int, str] = {}
    stall_deadline = math.inf
    # Each rank's current step, written by the rank at the top of every step (shared memory,
    # no lock, no sync): what a rank that dies was doing.
    preload = None if use_cuda else RANK_PRELOAD
    progress = context(preload).Array("q", nproc, lock=False)
    # Not daemons: a daemon process may not start processes of its own; the ranks' end is tied
    # to the launcher by die_with_parent instead.
    with SpawnedRanks(
        _spawn_entry,
        nproc,
        (use_cuda, cfg, data, os.getpid(), progress),
        daemon=False,
        exit_grace_s=60.0,
        name="fusedzero train",
        preload=preload,
    ) as ranks:
        while len(reported) < nproc:
            if stalls and (time.monotonic() > stall_deadline or len(stalls) == nproc):
                silent = [r for r in range(nproc) if r not in stalls]
                raise StalledError(
                    "; ".join(stalls[r] for r in sorted(stalls))
                    + (f"; ranks {silent} did not report and were ended" if silent else "")
                )
            # A rank that exits without a report (killed, out of memory) would hang the rest.
            try:
                report = ranks.next_report(
                    [r for r in range(nproc) if r not in reported and r not in stalls]
                )
            except RuntimeError as e:
                raise _rank_failed(cfg, ranks, progress, None, str(e)) from None
            if report is None:
                continue
            if report.kind is ReportKind.USAGE:
                raise UsageError(report.value)
            if report.kind is ReportKind.STALLED:
                stalls[report.rank] = report.value
                stall_deadline = min(stall_deadline, time.monotonic() + _STALL_GRACE_S)
                continue
            if report.kind is ReportKind.OUTPUT_CLOSED:
                raise BrokenPipeError(errno.EPIPE, f"rank {report.rank}: stdout was closed")
            if report.kind is ReportKind.ERROR:
                raise _rank_failed(cfg, ranks, progress, report.rank, str(report.value))
            if report.rank == 0:
                summary = report.value
            reported.add(report.rank)
    assert summary is not None
    return summary


def _rank_failed(
    cfg: TrainConfig, ranks: SpawnedRanks, progress: Any, rank: int | None, detail: str
) -> RankFailed:
    """One line for a rank's end: a rank killed by a signal (often the cause of the others'
    connection errors) first, else the reporting rank's exception; with its step and the
    checkpoint a resume would pick."""
    time.sleep(LAST_WORDS_S)  # a killed peer's exit code arrives after the others' errors
    dead = [
        r
        for r, p in enumerate(ranks.procs)
        if not p.is_alive() and p.exitcode not in (0, REPORTED_ERROR_EXIT)
    ]
    if dead:
        r = dead[0]
        what = f"rank {r} {exit_description(ranks.procs[r].exitcode)}"
    else:
        r = rank if rank is not None else 0
        last = [ln for ln in detail.strip().splitlines() if ln.strip()]
        what = f"rank {r} failed: {' '.join(last[-1].split()) if last else 'no message'}"
    step = progress[r]
    what += f" at step {step}" if step > 0 else " before its first step"
    if cfg.ckpt_dir is not None:
        from fusedzero import checkpoint

        try:
            found = checkpoint.find_latest(cfg.ckpt_dir, checksums=False)
            what += (
                f"; the ranks were ended; the newest checkpoint, {found.path.name} in "
                f"{str(found.root)!r}, is intact: continue with --resume"
            )
        except checkpoint.CheckpointError:
            what += "; the ranks were ended; no checkpoint was saved yet"
    return RankFailed(what, detail)


def _spawn_entry(
    rank: int,
    world: int,
    port: int,
    q: Queue[Report],
    use_cuda: bool,
    cfg: TrainConfig,
    data: Split,
    parent_pid: int,
    progress: Any = None,
) -> None:
    die_with_parent(parent_pid)  # never train on as an orphan (see fusedzero.app.lifecycle)
    set_rank_env(rank, world, port)
    code = REPORTED_ERROR_EXIT
    try:
        device = _setup_device(use_cuda, rank, world)
        if use_cuda:  # a hung collective ends in a report (see [Note: a hung NCCL collective])
            comm.nccl_watchdog_env()
        # The group's timeout bounds every wait (fusedzero._comm.wait reads it back).
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg.timeout),
            **({"device_id": device} if use_cuda else {}),
        )
        from fusedzero.app.loop import train_rank  # the ranks', not the launcher's, import

        summary = train_rank(cfg, device, data, progress=progress)
        q.put(Report(rank, ReportKind.OK, summary if rank == 0 else None))
        # A gloo process can abort at exit after its work is done: barrier, destroy, then exit.
        with waiting_for("the end-of-run barrier"):
            dist.barrier()
        dist.destroy_process_group()
        code = 0
    except UsageError as e:
        # The parent kills the other ranks: no barrier with ranks that may never come.
        q.put(Report(rank, ReportKind.USAGE, str(e)))
    except CollectiveTimeout as e:
        q.put(Report(rank, ReportKind.STALLED, " ".join(str(e).split())))
    except BrokenPipeError:
        # Rank 0 prints into the launcher's stdout: its reader left (`fusedzero train | head`).
        # Later writes (the flush at exit included) go nowhere; the launcher ends quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        q.put(Report(rank, ReportKind.OUTPUT_CLOSED, None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put(Report(rank, ReportKind.ERROR, traceback.format_exc()))
    finally:
        leave(q, code)


def _run_in_group(cfg: TrainConfig) -> dict[str, Any]:
    """Under torchrun (or inside an initialised group): this process is one rank. A rank that
    raises leaves at once (see [Note: a rank that raises in a group])."""
    own_group = not dist.is_initialized()
    if own_group:
        env = torchrun_env()
        use_cuda = _use_cuda(cfg)
        device = _setup_device(use_cuda, env.local_rank, env.local_world)
        if use_cuda:  # a hung collective ends in a report (see [Note: a hung NCCL collective])
            comm.nccl_watchdog_env()
        # device_id: the communicator is made now, bound to this rank's GPU (barriers too).
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=cfg.timeout),
            **({"device_id": device} if use_cuda else {}),
        )
    else:
        use_cuda, device = _device_in_group(cfg)
    summary = _train_in_group(cfg, device, use_cuda)
    if own_group:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def _device_in_group(cfg: TrainConfig) -> tuple[bool, torch.device]:
    """A group the caller initialised: CUDA where the flags allow it and the group serves CUDA
    tensors with NCCL; its GPU is LOCAL_RANK's under torchrun, else the caller's current one
    (set_device before calling), never GPU 0 for every rank."""
    nccl = comm.serving_backend(None, "cuda") == "nccl"
    if cfg.device == "cuda" and not nccl:
        raise UsageError(
            f"--device cuda in a process group whose backend is "
            f"{dist.get_backend()!r}: its collectives cannot take CUDA tensors; "
            "initialise it with nccl (or 'cpu:gloo,cuda:nccl'), or use --device cpu"
        )
    use_cuda = _use_cuda(cfg) and nccl
    if not use_cuda:
        return False, _setup_device(False, 0, _env_int("LOCAL_WORLD_SIZE", 1, 1))
    local = _env_int("LOCAL_RANK", -1, 0)
    index = local if local >= 0 else torch.cuda.current_device()
    return True, _setup_device(True, index, 1)


class TorchrunEnv(NamedTuple):
    """This process's place in a torchrun job, from the variables torchrun sets."""

    rank: int
    world: int
    local_rank: int
    local_world: int


def _env_int(name: str, default: int, minimum: int) -> int:
    """The environment variable `name` as an int >= minimum (`default` when unset); a
    UsageError naming the variable otherwise (int("abc") names none)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UsageError(
            f"environment variable {name}={raw!r} is not an integer >= {minimum} "
            "(torchrun sets it; unset it to spawn local ranks)"
        )
    return value


def torchrun_env() -> TorchrunEnv:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, checked (one line naming a bad
    one, exit 2) before init_process_group parses them itself."""
    world = _env_int("WORLD_SIZE", 1, 1)
    rank = _env_int("RANK", 0, 0)
    if rank >= world:
        raise UsageError(f"environment variable RANK={rank} is not below WORLD_SIZE={world}")
    local_world = _env_int("LOCAL_WORLD_SIZE", world, 1)
    return TorchrunEnv(rank, world, _env_int("LOCAL_RANK", 0, 0), local_world)


def _train_in_group(cfg: TrainConfig, device: torch.device, use_cuda: bool) -> dict[str, Any]:
    check_tp_world(cfg, dist.get_world_size())
    preflight.check_batch(cfg, dist.get_world_size())
    # One rank checks the shared paths and holds the folder's lock; all learn the outcome.
    box: list[Any] = [None]
    lock = contextlib.ExitStack()
    if dist.get_rank() == 0:
        try:
            preflight.check_outputs_writable(cfg)
            lock.enter_context(preflight.run_folder_lock(cfg))
            preflight.check_run_folder(cfg)
            preflight.check_disk(cfg, dist.get_world_size(), use_cuda)
        except Exception as e:  # noqa: BLE001 - every rank must reach the broadcast
            lock.close()
            box[0] = str(e) if isinstance(e, UsageError) else f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise UsageError(box[0])
    with lock:
        from fusedzero.app.loop import train_rank

        return train_rank(cfg, device, preflight.load_data(cfg))


def _setup_device(use_cuda: bool, local_rank: int, local_world: int) -> torch.device:
    if use_cuda:
        # A scheduler that shows each process its own GPU only (CUDA_VISIBLE_DEVICES per task):
        # that one is device 0, whatever the local rank.
        visible = torch.cuda.device_count()
        index = 0 if visible == 1 else local_rank
        if index >= visible:
            raise UsageError(
                f"local rank {local_rank} has no GPU of its own: torch sees "
                f"{visible}; run one process per visible GPU"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    # Ranks share the cores: oversubscribing threads makes every rank slower.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // max(1, local_world)))
    return torch.device("cpu")
