"""Checks a run passes before any rank starts, so a bad flag or path fails at once, not after
the ranks spent minutes starting: the batch split, writable outputs, the checkpoint folder (and
its lock, held for the run's life), and the corpus.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from fusedzero import checkpoint
from fusedzero.app.config import VAL_FRACTION, TrainConfig, UsageError
from fusedzero.app.data import Split, load_corpus, split_corpus
from fusedzero.app import watch
from fusedzero.app.runlock import RunFolderError, RunLock, check_ckpt_dir, check_writable


def check_batch(cfg: TrainConfig, world: int) -> None:
    parts = world * cfg.grad_accum
    if cfg.batch_size % parts:
        raise UsageError(f"--batch-size {cfg.batch_size} is not divisible by ranks*grad_accum = "
                         f"{world}*{cfg.grad_accum} = {parts}; use a multiple of {parts}")


def load_data(cfg: TrainConfig) -> Split:
    """(train, val) uint8 tensors: the corpus's tail is validation, the same at every run."""
    try:
        return split_corpus(load_corpus(cfg.data, cfg.block_size), VAL_FRACTION, cfg.block_size)
    except (ValueError, OSError) as e:
        raise UsageError(f"--data: {e}") from None


def check_run_folder(cfg: TrainConfig) -> None:
    """--resume needs a checkpoint; a new run must not mix its steps into an old run's."""
    if cfg.ckpt_dir is None:
        return
    if cfg.resume:
        # A root or one step folder; sizes and headers only here, sha256 when the ranks load.
        try:
            checkpoint.find_latest(cfg.ckpt_dir, checksums=False)
        except checkpoint.CheckpointError as e:
            msg = " ".join(str(e).split())
            raise UsageError(f"--resume: no usable checkpoint in {cfg.ckpt_dir!r} ({msg}); "
                             "drop --resume to start a new run") from None
        return
    try:
        check_ckpt_dir(cfg.ckpt_dir, resume=False, overwrite=cfg.overwrite)
    except RunFolderError as e:
        raise UsageError(str(e)) from None


def check_outputs_writable(cfg: TrainConfig) -> None:
    """--ckpt-dir and --out-json must be writable before training starts."""
    try:
        check_writable(cfg.ckpt_dir, cfg.out_json)
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
            print(f"fusedzero: note: took over the stale lock of {lock.took_over} (not running)",
                  file=sys.stderr)
        yield
    finally:
        lock.release()
