"""Checks a run passes before any rank starts, so a bad flag or path fails at once, not after
the ranks spent minutes starting: the batch split, writable outputs, the checkpoint folder (and
its lock, held for the run's life), and the corpus.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from fusedzero import checkpoint
from fusedzero.app import watch
from fusedzero.app.config import VAL_FRACTION, TrainConfig, UsageError
from fusedzero.app.data import Split, load_corpus, split_corpus
from fusedzero.app.resume import latest_checkpoint
from fusedzero.app.runlock import RunFolderError, RunLock, check_ckpt_dir, check_writable
from fusedzero.checkpoint._placements import read as tp_record


def check_batch(cfg: TrainConfig, world: int) -> None:
    """The global batch splits over the data-parallel ranks (world / --tp: a replica's tp
    ranks share its rows) and the micro-batches."""
    dp = world // cfg.tp
    parts = dp * cfg.grad_accum
    if cfg.batch_size % parts:
        raise UsageError(
            f"--batch-size {cfg.batch_size} is not divisible by data-parallel "
            f"ranks*grad_accum = {dp}*{cfg.grad_accum} = {parts}; use a multiple "
            f"of {parts}"
        )


def load_data(cfg: TrainConfig) -> Split:
    """(train, val) uint8 tensors: the corpus's tail is validation, the same at every run."""
    try:
        return split_corpus(load_corpus(cfg.data, cfg.block_size), VAL_FRACTION, cfg.block_size)
    except (ValueError, OSError) as e:
        raise UsageError(f"--data: {e}") from None


def check_run_folder(cfg: TrainConfig) -> None:
    """--resume needs a checkpoint; a new run must not mix its steps into an old run's; every
    save rewrites `latest`, so it must be a file (or absent) now, not at the run's last save."""
    if cfg.ckpt_dir is None:
        return
    latest = checkpoint.save_root(cfg.ckpt_dir) / checkpoint.LATEST
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(latest).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise UsageError(
                f"--ckpt-dir: {str(latest)!r} is {kind}, but every checkpoint save "
                "replaces it with a file naming the newest step: remove it or "
                "pass another --ckpt-dir"
            )
    if cfg.resume:
        # A root or one step folder; sizes and headers only here, sha256 when the ranks load.
        try:
            latest_checkpoint(cfg, checksums=False)
        except checkpoint.CheckpointError as e:
            msg = " ".join(str(e).split())
            raise UsageError(
                f"--resume: no usable checkpoint in {cfg.ckpt_dir!r} ({msg}); "
                "drop --resume to start a new run"
            ) from None
        return
    if tp_record(Path(cfg.ckpt_dir)) is not None:  # its steps lie in tp folders
        raise UsageError(
            f"--ckpt-dir {cfg.ckpt_dir!r} holds a tensor-parallel run's "
            "checkpoints; pass --resume to continue it, or another --ckpt-dir "
            "(--overwrite does not apply to tensor-parallel roots)"
        )
    try:
        check_ckpt_dir(cfg.ckpt_dir, resume=False, overwrite=cfg.overwrite)
    except RunFolderError as e:
        raise UsageError(str(e)) from None


def checkpoint_bytes(cfg: TrainConfig, world: int, param_dtype: torch.dtype) -> int:
    """Bytes of one checkpoint of this run, as `fusedzero plan` computes the optimizer state
    (its flat buffers built from the model's shapes on the meta device), times the ranks that
    write it (stage 0: rank 0 alone). A lower bound: fp32 params, their own master in memory,
    are stored as the master too, and each shard adds its header."""
    from fusedzero.app.model import GPT, GPTConfig
    from fusedzero.plan import PLAN_PRECISION, PlanConfig, plan_model

    with torch.device("meta"):
        model = GPT(GPTConfig(**cfg.model_config()))
    precision = dataclasses.replace(
        PLAN_PRECISION, param_dtype=param_dtype, master=cfg.master, states=cfg.states
    )
    plan = plan_model(
        model, PlanConfig(world_size=world, precision=precision, sharding=cfg.sharding())
    )
    return plan.stages[cfg.stage].optimizer_bytes * (1 if cfg.stage == 0 else world)


def check_disk(cfg: TrainConfig, world: int, use_cuda: bool) -> None:
    """The checkpoint folder's disk holds one checkpoint, or the run fails now, not at its
    first save (a run that cannot save loses everything after its last checkpoint)."""
    if cfg.ckpt_dir is None:
        return
    param_dtype = cfg.params_dtype(use_cuda)
    try:
        need = checkpoint_bytes(cfg, world, param_dtype)
    except ValueError:
        return  # flags ZeroAdamW refuses: the ranks report them with their own message
    root = checkpoint.save_root(cfg.ckpt_dir)
    free = shutil.disk_usage(root).free
    if free < need:
        raise UsageError(
            f"--ckpt-dir: {str(root)!r} has {free} bytes free, but one checkpoint "
            f"of this run needs at least {need} (`fusedzero plan`'s optimizer "
            "state of every writing rank); free space or pass another --ckpt-dir"
        )


def check_outputs_writable(cfg: TrainConfig) -> None:
    """--ckpt-dir and --out-json must be writable before training starts (for a step folder
    given to --resume, the root that holds it: later saves go there)."""
    try:
        check_writable(
            None if cfg.ckpt_dir is None else checkpoint.save_root(cfg.ckpt_dir), cfg.out_json
        )
    except RunFolderError as e:
        raise UsageError(str(e)) from None
    try:
        for flag, path in (("--log-jsonl", cfg.log_jsonl), ("--plot", cfg.plot)):
            if path is not None:
                watch.check_writable(path, flag)
        if cfg.plot is not None:
            watch.require_matplotlib()
    except (ValueError, ImportError) as e:
        raise UsageError(str(e)) from None


@contextlib.contextmanager
def run_folder_lock(cfg: TrainConfig) -> Iterator[None]:
    """Hold --ckpt-dir's lock for the run's life: two runs in one folder would replace each
    other's checkpoints."""
    if cfg.ckpt_dir is None:
        yield
        return
    lock = RunLock(checkpoint.save_root(cfg.ckpt_dir))
    try:
        lock.acquire()
    except RunFolderError as e:
        raise UsageError(f"--ckpt-dir: {e}") from None
    try:
        if lock.took_over:
            print(
                f"fusedzero: note: took over the stale lock of {lock.took_over} (not running)",
                file=sys.stderr,
            )
        yield
    finally:
        lock.release()
