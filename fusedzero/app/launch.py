"""`fusedzero train`: pretrain the small byte-level GPT with ZeroAdamW on local ranks.

    fusedzero train                          # 2 CPU ranks (gloo), or every local GPU (NCCL, bf16)
    fusedzero train --stage 3 --nproc 4 --steps 500 --out-json run.json
    torchrun --nproc-per-node 8 -m fusedzero.cli train --stage 2     # joins torchrun's group

The python API is `run(argv) -> summary dict` (what `--out-json` writes), used by the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import time
import traceback
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist

from fusedzero.app import preflight
from fusedzero.app.config import (HelpFormatter, StalledError, TrainConfig, UsageError,
                                  add_arguments, config_from_args, parse_args)
from fusedzero.app.data import Split
from fusedzero.app.lifecycle import die_with_parent, sigterm_as_interrupt
from fusedzero.app.log import waiting_for
from fusedzero.app.loop import train_rank
from fusedzero import comm
from fusedzero.comm import CollectiveTimeout
from fusedzero.spawn import (REPORTED_ERROR_EXIT, Report, ReportKind, SpawnedRanks, leave,
                             set_rank_env)

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# After the first rank reports a stall, how long the launcher waits for the other ranks' own
# reports (they hit the same timeout at about the same moment) before it ends them.
_STALL_GRACE_S = 3.0


def add_train_subparser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="pretrain the small GPT with ZeroAdamW",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=HelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cli_train)
    return p



def _cli_train(args: argparse.Namespace) -> int:
    run_config(config_from_args(args))
    return 0


# -- launching ------------------------------------------------------------------------------------
def run(argv: list[str]) -> dict[str, Any]:
    """Parse `fusedzero train` flags, train, and return the summary (what --out-json writes).

    Raises UsageError for bad flags, data paths or checkpoints.
    """
    return run_config(parse_args(list(argv)))


def run_config(cfg: TrainConfig) -> dict[str, Any]:
    """Train as `cfg` says: join torchrun's group if there is one, else spawn local ranks."""
    if all(k in os.environ for k in _TORCHRUN_ENV) or dist.is_initialized():
        return _run_in_group(cfg)
    use_cuda = _use_cuda(cfg)
    nproc = cfg.nproc or (torch.cuda.device_count() if use_cuda else 2)
    if use_cuda and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc} exceeds the {torch.cuda.device_count()} visible GPUs")
    preflight.check_batch(cfg, nproc)
    # Before anything slow: a bad path fails now, not after the run.
    preflight.check_outputs_writable(cfg)
    # Loaded once here; the tensors reach the ranks through shared memory, not a pipe.
    data = preflight.load_data(cfg)
    with preflight.run_folder_lock(cfg):
        preflight.check_run_folder(cfg)
        with sigterm_as_interrupt():
            return _spawn(cfg, nproc, use_cuda, data)




def _use_cuda(cfg: TrainConfig) -> bool:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no GPU; use --device cpu")
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())




def _spawn(cfg: TrainConfig, nproc: int, use_cuda: bool, data: Split) -> dict[str, Any]:
    summary: dict[str, Any] | None = None
    reported: set[int] = set()
    stalls: dict[int, str] = {}
    stall_deadline = math.inf
    # Not daemons: a daemon process may not start processes of its own; the ranks' end is tied
    # to the launcher by die_with_parent instead.
    with SpawnedRanks(_spawn_entry, nproc, (use_cuda, cfg, data, os.getpid()), daemon=False,
                      exit_grace_s=60.0) as ranks:
        while len(reported) < nproc:
            if stalls and (time.monotonic() > stall_deadline or len(stalls) == nproc):
                silent = [r for r in range(nproc) if r not in stalls]
                raise StalledError(
                    "; ".join(stalls[r] for r in sorted(stalls))
                    + (f"; ranks {silent} did not report and were ended" if silent else ""))
            # A rank that exits without a report (killed, out of memory) would hang the rest.
            report = ranks.next_report([r for r in range(nproc)
                                        if r not in reported and r not in stalls])
            if report is None:
                continue
            if report.kind is ReportKind.USAGE:
                raise UsageError(report.value)
            if report.kind is ReportKind.STALLED:
                stalls[report.rank] = report.value
                stall_deadline = min(stall_deadline, time.monotonic() + _STALL_GRACE_S)
                continue
            if report.kind is ReportKind.ERROR:
                raise ranks.failure(report, reported)
            if report.rank == 0:
                summary = report.value
            reported.add(report.rank)
    assert summary is not None
    return summary


def _spawn_entry(rank: int, world: int, port: int, q: Queue[Report], use_cuda: bool,
                 cfg: TrainConfig, data: Split, parent_pid: int) -> None:
    die_with_parent(parent_pid)  # never train on as an orphan (see fusedzero.app.lifecycle)
    set_rank_env(rank, world, port)
    code = REPORTED_ERROR_EXIT
    try:
        device = _setup_device(use_cuda, rank, world)
        if use_cuda:  # a hung collective ends in a report ([Note: a hung NCCL collective])
            comm.nccl_watchdog_env()
        # The group's timeout bounds every wait (fusedzero.comm.wait reads it back).
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.timeout),
                                **({"device_id": device} if use_cuda else {}))
        summary = train_rank(cfg, device, data)
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
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put(Report(rank, ReportKind.ERROR, traceback.format_exc()))
    finally:
        leave(q, code)


def _run_in_group(cfg: TrainConfig) -> dict[str, Any]:
    """Under torchrun (or inside an initialised group): this process is one rank."""
    use_cuda = _use_cuda(cfg)
    own_group = not dist.is_initialized()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"]) if own_group else dist.get_world_size()
    device = _setup_device(use_cuda, local, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if own_group:
        if use_cuda:  # a hung collective ends in a report ([Note: a hung NCCL collective])
            comm.nccl_watchdog_env()
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        preflight.check_batch(cfg, dist.get_world_size())
        # One rank checks the shared paths and holds the folder's lock; all learn the outcome.
        box: list[Any] = [None]
        lock = contextlib.ExitStack()
        if dist.get_rank() == 0:
            try:
                preflight.check_outputs_writable(cfg)
                lock.enter_context(preflight.run_folder_lock(cfg))
                preflight.check_run_folder(cfg)
            except UsageError as e:
                lock.close()
                box[0] = str(e)
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise UsageError(box[0])
        with lock:
            summary = train_rank(cfg, device, preflight.load_data(cfg))
    finally:
        if own_group:
            dist.barrier()
            dist.destroy_process_group()
    return summary


def _setup_device(use_cuda: bool, local_rank: int, local_world: int) -> torch.device:
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # Ranks share the cores: oversubscribing threads makes every rank slower.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // max(1, local_world)))
    return torch.device("cpu")
