"""`fusedzero train`: pretrain the small byte-level GPT with ZeroAdamW on local ranks.

    fusedzero train                          # 2 CPU ranks (gloo), or every local GPU (NCCL, bf16)
    fusedzero train --stage 3 --nproc 4 --steps 500 --out-json run.json
    torchrun --nproc-per-node 8 -m fusedzero.cli train --stage 2     # joins torchrun's group

The python API is `run(argv) -> summary dict` (what `--out-json` writes), used by the tests.

Reproducibility: the model is initialised from `--seed` on every rank; the global batch of step s
is drawn from (seed, s) alone (`fusedzero.data.BatchSampler`), so the same seed and global batch
train on the same data at any world size and grad accumulation. Nothing else consumes randomness
(no dropout), so a checkpoint needs no RNG state: the step number is the data position.

[Note: host syncs] The step itself has none on CUDA. Losses and grad norms of each step are kept
as device tensors and read, all-reduced over ranks with `torch.distributed` directly (not counted in
`opt.comm`), only at log points (`--log-every`), evals and checkpoints.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import queue as queue_mod
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fusedzero.comm import DEFAULT_TIMEOUT_S, CollectiveTimeout

# Defaults for the 2-rank CPU run: measured 77 s wall on an idle 2-core machine including
# start-up (~30k tokens/s; 104 s with other jobs on the cores), validation loss 5.33 -> 1.90.
DEFAULT_STEPS = 500
DEFAULT_BATCH = 32
DEFAULT_LR = 3e-3
DEFAULT_N_LAYER = 2
DEFAULT_N_HEAD = 4
DEFAULT_N_EMBD = 128
DEFAULT_BLOCK = 128
# Validation sequences evaluated at every eval; fixed windows spread over the val split.
DEFAULT_EVAL_SEQS = 64
# Log points read device values back to the host (a sync on CUDA): not every step.
DEFAULT_LOG_EVERY = 10
# Fraction of the corpus (its tail) held out for validation.
VAL_FRACTION = 0.05
# The cosine decays to this fraction of --lr (as in nanoGPT / Chinchilla-style schedules).
MIN_LR_RATIO = 0.1

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

Split = tuple[torch.Tensor, torch.Tensor]  # (train, val) uint8 byte tensors


class UsageError(Exception):
    """A bad flag, path or checkpoint: reported as one line, `fusedzero: error: ...`, exit 2."""


class StalledError(RuntimeError):
    """A rank waited on the others past --timeout: one line naming each rank and its wait
    (`fusedzero: error: ...`, exit 1)."""

# After the first rank reports a stall, how long the launcher waits for the other ranks' own
# reports (they hit the same timeout at about the same moment) before it ends them.
_STALL_GRACE_S = 3.0


class ArgParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage and exiting (the CLI prints it
    as one line; the python API lets the caller catch it)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # "fusedzero train: argument --stage: ..." -> "train: argument --stage: ..."
        where = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        raise UsageError(f"{where}{message}")


# -- configuration --------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """One training run. Built from the command line by `parse_args`, validated here."""

    stage: int = 2
    """ZeRO stage: 0 DP, 1 optimizer state, 2 + grads, 3 + params."""
    nproc: int | None = None
    """Local ranks to spawn (None: every GPU, or 2 on CPU). Ignored under torchrun."""
    steps: int = DEFAULT_STEPS
    """Optimizer steps of the whole run; the lr schedule spans them (also with --stop-at)."""
    batch_size: int = DEFAULT_BATCH
    """Global batch in sequences per step, over all ranks and micro-batches."""
    grad_accum: int = 1
    """Micro-batches per step on each rank."""
    lr: float = DEFAULT_LR
    """Peak learning rate (after warmup)."""
    warmup: int | None = None
    """Linear warmup steps (None: 5% of --steps, at least 1)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices and embeddings (1-D params get none)."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.95
    """Adam's second-moment decay (0.95, as is usual for transformer pretraining)."""
    clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""
    seed: int = 0
    """Model init and data order."""
    n_layer: int = DEFAULT_N_LAYER
    """Transformer blocks."""
    n_head: int = DEFAULT_N_HEAD
    """Attention heads; must divide n_embd."""
    n_embd: int = DEFAULT_N_EMBD
    """Width of the residual stream."""
    block_size: int = DEFAULT_BLOCK
    """Sequence length in bytes."""
    data: str | None = None
    """Text file or folder; None: the Python standard library's sources."""
    eval_every: int = 100
    """Steps between validation evals (0: only at the start and the end)."""
    eval_seqs: int = DEFAULT_EVAL_SEQS
    """Validation sequences per eval."""
    log_every: int = DEFAULT_LOG_EVERY
    """Steps between log points (host reads of loss / grad norm)."""
    ckpt_dir: str | None = None
    """Checkpoint root (one folder per saved step, written by fusedzero.checkpoint)."""
    save_every: int = 0
    """Steps between checkpoints (0: only at --stop-at and the end)."""
    keep_last: int | None = None
    """Checkpoints to keep in --ckpt-dir (None: all)."""
    resume: bool = False
    """Resume from the latest complete checkpoint in --ckpt-dir (any world size or stage)."""
    overwrite: bool = False
    """Start a new run in a --ckpt-dir that holds checkpoints; they are removed after this
    run's first complete save (without it, such a folder is refused)."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any rank may wait on the others (a collective, a checkpoint write) before the run
    ends with an error naming the rank and what it waited for."""
    stop_at: int | None = None
    """Stop cleanly after this step and save, as a preempted job would."""
    out_json: str | None = None
    """Write the summary (per-step losses, bytes, dtypes) here as JSON, from rank 0."""
    bucket_numel: int | None = None
    """Elements per bucket (None: the library default)."""
    reduce_dtype: str = "fp32"
    """fp32 / bf16 / fp16: dtype grads are reduced and accumulated in."""
    param_dtype: str | None = None
    """fp32 / bf16 / fp16 (None: bf16 on CUDA, fp32 on CPU)."""
    device: str = "auto"
    """auto (CUDA if available), cpu or cuda."""
    progress: bool = True
    """A tqdm bar on rank 0."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise UsageError(msg)

        need(self.stage in (0, 1, 2, 3), f"--stage must be 0, 1, 2 or 3, got {self.stage}")
        for name in ("steps", "batch_size", "grad_accum", "n_layer", "n_head", "n_embd",
                     "block_size", "eval_seqs", "log_every"):
            v = getattr(self, name)
            need(v >= 1, f"--{name.replace('_', '-')} must be >= 1, got {v}")
        need(self.nproc is None or self.nproc >= 1, f"--nproc must be >= 1, got {self.nproc}")
        need(self.n_embd % self.n_head == 0,
             f"--n-embd {self.n_embd} is not divisible by --n-head {self.n_head}")
        need(math.isfinite(self.lr) and self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(self.clip >= 0, f"--clip must be >= 0 (0 disables), got {self.clip}")
        need(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
             f"--beta1/--beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        need(self.warmup is None or 0 <= self.warmup <= self.steps,
             f"--warmup must be in [0, --steps={self.steps}], got {self.warmup}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.save_every >= 0, f"--save-every must be >= 0, got {self.save_every}")
        need(self.keep_last is None or self.keep_last >= 1,
             f"--keep-last must be >= 1, got {self.keep_last}")
        need(self.bucket_numel is None or self.bucket_numel >= 1,
             f"--bucket-numel must be >= 1, got {self.bucket_numel}")
        need(self.reduce_dtype in _DTYPES,
             f"--reduce-dtype must be one of {sorted(_DTYPES)}, got {self.reduce_dtype!r}")
        need(self.param_dtype is None or self.param_dtype in _DTYPES,
             f"--param-dtype must be one of {sorted(_DTYPES)}, got {self.param_dtype!r}")
        need(math.isfinite(self.timeout) and self.timeout > 0,
             f"--timeout must be > 0 seconds, got {self.timeout}")
        need(not (self.resume and self.overwrite),
             "--resume and --overwrite exclude each other: continue the run in --ckpt-dir, or "
             "start over in it")
        need(self.device in ("auto", "cpu", "cuda"),
             f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.stop_at is not None:
            need(1 <= self.stop_at <= self.steps,
                 f"--stop-at must be in [1, --steps={self.steps}], got {self.stop_at}")
        for flag, used in (("--resume", self.resume), ("--overwrite", self.overwrite),
                           ("--save-every", self.save_every > 0),
                           ("--stop-at", self.stop_at is not None),
                           ("--keep-last", self.keep_last is not None)):
            need(not used or self.ckpt_dir is not None,
                 f"{flag} needs --ckpt-dir DIR (where checkpoints are written and read)")

    @property
    def warmup_steps(self) -> int:
        return max(1, self.steps // 20) if self.warmup is None else self.warmup

    def model_config(self) -> dict[str, int]:
        return {"n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                    "block_size": self.block_size}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig  # defaults live on the dataclass
    a = p.add_argument
    a("--stage", type=int, choices=(0, 1, 2, 3), default=d.stage,
      help="ZeRO stage: 0 DP, 1 optimizer state, 2 +grads, 3 +params (default %(default)s)")
    a("--nproc", type=int, default=None,
      help="local ranks to spawn (default: every GPU, or 2 on CPU); ignored under torchrun")
    a("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    a("--batch-size", type=int, default=d.batch_size,
      help="global batch in sequences per step (default %(default)s)")
    a("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step per rank")
    a("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    a("--warmup", type=int, default=None, help="linear warmup steps (default 5%% of --steps)")
    a("--weight-decay", type=float, default=d.weight_decay,
      help="AdamW decoupled weight decay of matrices")
    a("--beta1", type=float, default=d.beta1, help="AdamW beta1")
    a("--beta2", type=float, default=d.beta2, help="AdamW beta2")
    a("--clip", type=float, default=d.clip, help="max grad norm, 0 disables (default %(default)s)")
    a("--seed", type=int, default=d.seed, help="model init and data order")
    a("--n-layer", type=int, default=d.n_layer, help="transformer blocks")
    a("--n-head", type=int, default=d.n_head, help="attention heads")
    a("--n-embd", type=int, default=d.n_embd, help="model width")
    a("--block-size", type=int, default=d.block_size, help="sequence length in bytes")
    a("--data", default=None, metavar="PATH",
      help="text file or folder (default: the Python standard library's sources)")
    a("--eval-every", type=int, default=d.eval_every,
      help="steps between validation evals, 0: start and end only (default %(default)s)")
    a("--eval-seqs", type=int, default=d.eval_seqs, help="validation sequences per eval")
    a("--log-every", type=int, default=d.log_every, help="steps between log points")
    a("--ckpt-dir", default=None, metavar="DIR", help="checkpoint folder")
    a("--save-every", type=int, default=d.save_every,
      help="steps between checkpoints (0: at --stop-at and the end only)")
    a("--keep-last", type=int, default=None, help="checkpoints to keep (default all)")
    a("--resume", action="store_true",
      help="resume from the latest complete checkpoint in --ckpt-dir (any world size/stage); "
           "hyper-parameter flags given now (--lr, --beta1, --beta2, --weight-decay, --clip, "
           "--warmup) override the checkpoint's")
    a("--overwrite", action="store_true",
      help="start a new run in a --ckpt-dir that holds checkpoints (removed after this run's "
           "first save); without it or --resume such a folder is refused")
    a("--stop-at", type=int, default=None, metavar="STEP",
      help="stop after STEP and save, as if preempted (the schedule still spans --steps)")
    a("--out-json", default=None, metavar="FILE", help="write the run summary as JSON")
    a("--timeout", type=float, default=d.timeout, metavar="SECONDS",
      help="end the run with an error naming the rank and the operation when any rank waits "
           "on the others longer than this (default %(default)g = 10 minutes)")
    a("--bucket-numel", type=int, default=None, help="elements per bucket")
    a("--reduce-dtype", choices=sorted(_DTYPES), default="fp32",
      help="dtype grads are reduced in (default %(default)s)")
    a("--param-dtype", choices=sorted(_DTYPES), default=None,
      help="model param dtype (default bf16 on CUDA, fp32 on CPU)")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto",
      help="auto: CUDA with NCCL when a GPU is visible, else CPU with gloo")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action) or ""


def add_train_subparser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="pretrain the small GPT with ZeroAdamW",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=_HelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cli_train)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def parse_args(argv: list[str]) -> TrainConfig:
    p = ArgParser(prog="fusedzero train")
    add_arguments(p)
    return config_from_args(p.parse_args(argv))


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
    _check_optional_modules(cfg)
    if all(k in os.environ for k in _TORCHRUN_ENV) or dist.is_initialized():
        return _run_in_group(cfg)
    use_cuda = _use_cuda(cfg)
    nproc = cfg.nproc or (torch.cuda.device_count() if use_cuda else 2)
    if use_cuda and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc} exceeds the {torch.cuda.device_count()} visible GPUs")
    _check_batch(cfg, nproc)
    _check_writable(cfg)  # before anything slow: a bad path fails now, not after the run
    # Loaded once here; the tensors reach the ranks through shared memory, not a pipe.
    data = _load_data(cfg)
    with _run_folder_lock(cfg):
        _check_ckpt_dir(cfg)
        from fusedzero.lifecycle import sigterm_as_interrupt

        with sigterm_as_interrupt():
            return _spawn(cfg, nproc, use_cuda, data)


def _use_cuda(cfg: TrainConfig) -> bool:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no GPU; use --device cpu")
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _check_optional_modules(cfg: TrainConfig) -> None:
    if (cfg.ckpt_dir is not None) and importlib.util.find_spec("fusedzero.checkpoint") is None:
        raise UsageError("--ckpt-dir/--resume need fusedzero.checkpoint, which this build of "
                         "fusedzero does not have yet")
    if cfg.stage == 3 and importlib.util.find_spec("fusedzero.zero3") is None:
        raise UsageError("--stage 3 needs fusedzero.zero3, which this build of fusedzero does "
                         "not have yet; use --stage 0, 1 or 2")


def _check_batch(cfg: TrainConfig, world: int) -> None:
    parts = world * cfg.grad_accum
    if cfg.batch_size % parts:
        raise UsageError(f"--batch-size {cfg.batch_size} is not divisible by ranks*grad_accum = "
                         f"{world}*{cfg.grad_accum} = {parts}; use a multiple of {parts}")


def _load_data(cfg: TrainConfig) -> Split:
    """(train, val) uint8 tensors: the corpus's tail is validation, the same at every run."""
    from fusedzero.data import load_corpus, split_corpus

    try:
        return split_corpus(load_corpus(cfg.data, cfg.block_size), VAL_FRACTION, cfg.block_size)
    except (ValueError, OSError) as e:
        raise UsageError(f"--data: {e}") from None


def _check_ckpt_dir(cfg: TrainConfig) -> None:
    """--resume needs a checkpoint; a new run must not mix its steps into an old run's."""
    from fusedzero.runlock import RunFolderError, check_ckpt_dir

    if cfg.ckpt_dir is None:
        return
    if cfg.resume:
        from fusedzero import checkpoint

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


def _check_writable(cfg: TrainConfig) -> None:
    """--ckpt-dir and --out-json must be writable before training starts."""
    from fusedzero.runlock import RunFolderError, check_writable

    try:
        check_writable(cfg.ckpt_dir, cfg.out_json)
    except RunFolderError as e:
        raise UsageError(str(e)) from None


@contextlib.contextmanager
def _run_folder_lock(cfg: TrainConfig) -> Any:
    """Hold --ckpt-dir's lock for the run's life: two runs in one folder would replace each
    other's checkpoints."""
    if cfg.ckpt_dir is None:
        yield
        return
    from fusedzero.runlock import RunFolderError, RunLock

    from fusedzero.checkpoint import save_root

    lock = RunLock(save_root(cfg.ckpt_dir))
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


def _spawn(cfg: TrainConfig, nproc: int, use_cuda: bool,
           data: Split) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from fusedzero.testing import exit_description, free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawn_entry,
                         args=(r, nproc, port, use_cuda, cfg, data, q, os.getpid()),
                         daemon=False) for r in range(nproc)]
    for p in procs:
        p.start()
    summary: dict[str, Any] | None = None
    reported: set[int] = set()
    stalls: dict[int, str] = {}
    stall_deadline = math.inf
    try:
        while len(reported) < nproc:
            if stalls and (time.monotonic() > stall_deadline or len(stalls) == nproc):
                silent = [r for r in range(nproc) if r not in stalls]
                raise StalledError(
                    "; ".join(stalls[r] for r in sorted(stalls))
                    + (f"; ranks {silent} did not report and were ended" if silent else ""))
            try:
                rank, status, value = q.get(timeout=0.2 if stalls else 1.0)
            except queue_mod.Empty:
                # A rank that exits without a report (killed, out of memory) would hang the rest.
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in reported and r not in stalls]
                if dead and q.empty():
                    time.sleep(0.5)  # a report written just before exit may still be in flight
                    if q.empty():
                        raise RuntimeError(f"rank {dead[0][0]} died without reporting: "
                                           f"{exit_description(dead[0][1])}") from None
                continue
            if status == "usage":
                raise UsageError(value)
            if status == "stalled":
                stalls[rank] = value
                stall_deadline = min(stall_deadline, time.monotonic() + _STALL_GRACE_S)
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            if rank == 0:
                summary = value
            reported.add(rank)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:  # after an error: the other ranks may be stuck in a collective
            if p.is_alive():
                p.kill()
                p.join()
        # Release the queue's semaphores now: left to interpreter exit, the resource tracker
        # warns about them as leaked.
        q.close()
        q.join_thread()
        del q
    assert summary is not None
    return summary


def _spawn_entry(rank: int, world: int, port: int, use_cuda: bool, cfg: TrainConfig,
                 data: Split, q: Any, parent_pid: int) -> None:
    from fusedzero.lifecycle import die_with_parent

    die_with_parent(parent_pid)  # never train on as an orphan (see fusedzero.lifecycle)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    code = 1
    try:
        device = _setup_device(use_cuda, rank, world)
        # The group's timeout bounds every wait (fusedzero.comm.wait reads it back).
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.timeout),
                                **({"device_id": device} if use_cuda else {}))
        summary = train_rank(cfg, device, data)
        q.put((rank, "ok", summary if rank == 0 else None))
        # A gloo process can abort at exit after its work is done: barrier, destroy, then exit.
        with _waiting_for("the end-of-run barrier"):
            dist.barrier()
        dist.destroy_process_group()
        code = 0
    except UsageError as e:
        # The parent kills the other ranks: no barrier with ranks that may never come.
        q.put((rank, "usage", str(e)))
    except CollectiveTimeout as e:
        q.put((rank, "stalled", " ".join(str(e).split())))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        # Skip interpreter teardown (2+ s with torch loaded) once the report is through the pipe.
        q.close()
        q.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_in_group(cfg: TrainConfig) -> dict[str, Any]:
    """Under torchrun (or inside an initialised group): this process is one rank."""
    use_cuda = _use_cuda(cfg)
    own_group = not dist.is_initialized()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"]) if own_group else dist.get_world_size()
    device = _setup_device(use_cuda, local, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if own_group:
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        _check_batch(cfg, dist.get_world_size())
        # One rank checks the shared paths and holds the folder's lock; all learn the outcome.
        box: list[Any] = [None]
        lock = contextlib.ExitStack()
        if dist.get_rank() == 0:
            try:
                _check_writable(cfg)
                lock.enter_context(_run_folder_lock(cfg))
                _check_ckpt_dir(cfg)
            except UsageError as e:
                lock.close()
                box[0] = str(e)
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise UsageError(box[0])
        with lock:
            summary = train_rank(cfg, device, _load_data(cfg))
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


# -- one rank -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _waiting_for(what: str) -> Any:
    """Blocking `torch.distributed` calls outside the optimizer (logging, evals, the end
    barrier) time out after the group's timeout with gloo's own words: name the wait instead."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CollectiveTimeout) or "timed out" not in str(e).lower():
            raise
        raise CollectiveTimeout(f"rank {dist.get_rank()}: timed out waiting for {what} "
                                f"({' '.join(str(e).split())}); another rank stalled or "
                                "crashed (raise --timeout if it is just slow)") from None


def lr_lambda_for(cfg: TrainConfig) -> Callable[[int], float]:
    """The schedule as a plain closure: LambdaLR.state_dict() then stores nothing for it (the
    position is `last_epoch`), so its state is JSON-able and independent of the world size."""
    steps, warmup = cfg.steps, cfg.warmup_steps

    def lr_lambda(i: int) -> float:
        """Multiplier of --lr for update i (0-based): linear warmup, then cosine to 10%."""
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, steps - warmup))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return lr_lambda


def train_rank(cfg: TrainConfig, device: torch.device, data: Split) -> dict[str, Any]:
    """The training loop of one rank in an initialised process group. Returns the summary
    (identical on every rank); rank 0 also prints the closing table and writes --out-json."""
    from fusedzero.data import BatchSampler, eval_batches
    from fusedzero.model import GPT, GPTConfig, gpt_param_groups
    from fusedzero.optim import ZeroAdamW

    rank, world = dist.get_rank(), dist.get_world_size()
    train_data, val_data = data
    param_dtype = _DTYPES[cfg.param_dtype] if cfg.param_dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    reduce_dtype = _DTYPES[cfg.reduce_dtype]

    # Initialised on the CPU and moved: the same weights on every device (the CPU generator),
    # and .to() keeps the tied weight tied.
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**cfg.model_config())).to(device)
    extra: dict[str, Any] = {}
    if cfg.bucket_numel is not None:
        extra["bucket_numel"] = cfg.bucket_numel
    opt = ZeroAdamW(gpt_param_groups(model, cfg.weight_decay), lr=cfg.lr,
                    betas=(cfg.beta1, cfg.beta2), stage=cfg.stage, module=model,
                    param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                    max_grad_norm=cfg.clip or None, **extra)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_for(cfg))
    sampler = BatchSampler(train_data, cfg.block_size, cfg.batch_size, cfg.seed)
    val = eval_batches(val_data, cfg.block_size, cfg.eval_seqs, 1)[0]
    log = _Log(rank, world, device)

    start = 0
    if cfg.resume:
        start = _resume(cfg, opt, sched, log)
    replace_old = cfg.overwrite  # until the first save of this run
    stop = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    A = cfg.grad_accum
    tokens_per_step = cfg.batch_size * cfg.block_size

    bar = None
    if rank == 0 and cfg.progress:
        import threading

        from tqdm.auto import tqdm

        # tqdm's default lock includes a multiprocessing semaphore, which a spawned rank's
        # os._exit would leave behind (resource_tracker warns): one process, one thread lock.
        tqdm.set_lock(threading.RLock())
        # Redrawn at most every 0.2 s on a terminal, every 10 s into a log file.
        bar = tqdm(total=cfg.steps, initial=start, desc=f"ZeRO-{cfg.stage} x{world}",
                   unit="step", dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.2 if sys.stderr.isatty() else 10.0)

    def say(msg: str) -> None:
        if rank == 0:
            (bar.write if bar is not None else print)(msg)

    if start == 0 or not log.val:
        log.val.append({"step": start, "val_loss": evaluate(model, val, rank, world)})
        say(f"step {start:5d}: val loss {log.val[-1]['val_loss']:.4f}")

    comm_total = dict.fromkeys(opt.comm.bytes, 0)
    train_time, timed_steps = 0.0, 0
    seg_start, seg_steps = time.perf_counter(), 0

    def close_segment() -> None:
        """Add the steps since the last boundary to the throughput clock (after a host sync)."""
        nonlocal train_time, timed_steps, seg_start, seg_steps
        if seg_steps:
            train_time += time.perf_counter() - seg_start
            timed_steps += seg_steps
        seg_start, seg_steps = time.perf_counter(), 0

    for step in range(start + 1, stop + 1):
        before = dict(opt.comm.bytes)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for m in range(A):
            x, y = sampler.batch(step - 1, rank, world, m, A)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with opt.no_sync() if m < A - 1 else contextlib.nullcontext():
                _, loss = model(x, y)
                (loss / A).backward()
            loss_sum += loss.detach().float()
        opt.step()
        lr = opt.param_groups[0]["lr"]
        sched.step()
        opt.zero_grad()
        for k, v in opt.comm.bytes.items():
            comm_total[k] += v - before[k]
        log.pending.append((step, loss_sum / A, opt.grad_norm.detach().clone().reshape(()), lr))
        seg_steps += 1

        is_eval = cfg.eval_every > 0 and step % cfg.eval_every == 0 and step != stop
        is_save = cfg.ckpt_dir is not None and (
            step == stop or (cfg.save_every > 0 and step % cfg.save_every == 0))
        if step % cfg.log_every == 0 or step == stop or step == start + 1 or is_eval or is_save:
            log.flush()  # host sync: all-reduce of the pending losses
            if step == start + 1 and stop > start + 1:
                seg_start, seg_steps = time.perf_counter(), 0  # first step: warm-up, untimed
            else:
                close_segment()
            if bar is not None:
                s = log.steps[-1]
                post = {"loss": f"{s['loss']:.3f}", "gnorm": f"{s['grad_norm']:.2f}",
                        "lr": f"{s['lr']:.2e}"}
                if timed_steps:
                    post["tok/s"] = f"{tokens_per_step * timed_steps / train_time:,.0f}"
                bar.set_postfix(post, refresh=False)
        if bar is not None:
            bar.update(1)
        if is_eval:
            log.val.append({"step": step, "val_loss": evaluate(model, val, rank, world)})
            say(f"step {step:5d}: val loss {log.val[-1]['val_loss']:.4f}  "
                f"train loss {log.steps[-1]['loss']:.4f}")
            seg_start = time.perf_counter()
        if is_save:
            _save(cfg, opt, sched, log, step, replace_old=replace_old)
            replace_old = False
            say(f"step {step:5d}: checkpoint saved in {cfg.ckpt_dir}")
            seg_start = time.perf_counter()
    close_segment()
    if bar is not None:
        bar.close()

    final_step = max(stop, start)
    if not log.val or log.val[-1]["step"] != final_step:
        log.val.append({"step": final_step, "val_loss": evaluate(model, val, rank, world)})
    run_steps = max(0, stop - start)
    summary = _summary(cfg, opt, world, device, param_dtype, reduce_dtype, log,
                       {k: v / run_steps if run_steps else 0.0 for k, v in comm_total.items()},
                       tokens_per_step * timed_steps / train_time if train_time > 0 else 0.0)
    if rank == 0:
        print(format_table(summary, stopped=cfg.stop_at is not None and stop < cfg.steps))
        if cfg.out_json:
            Path(cfg.out_json).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.out_json).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


class _Log:
    """Per-step records. Device values wait in `pending` until `flush` (a host sync)."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []
        self.steps: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []

    def flush(self) -> None:
        if not self.pending:
            return
        losses = torch.stack([p[1] for p in self.pending])
        norms = torch.stack([p[2] for p in self.pending]).float()
        # The global mean loss: logging only, so through dist directly, not counted in opt.comm.
        with _waiting_for("the all-reduce of logged losses"):
            dist.all_reduce(losses)
        losses = (losses / self.world).tolist()  # host sync
        for (step, _, _, lr), loss, norm in zip(self.pending, losses, norms.tolist(), strict=True):
            self.steps.append({"step": step, "loss": loss, "grad_norm": norm, "lr": lr})
        self.pending.clear()


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: Split, rank: int,
             world: int) -> float:
    """Mean next-byte cross-entropy over the fixed validation windows, split over ranks.

    Every rank runs the same number of forwards (ZeRO-3 gathers params collectively), possibly on
    an empty slice.
    """
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    device = next(iter(model.parameters())).device
    x, y = val[0][rank::world], val[1][rank::world]
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    if x.shape[0]:
        logits, _ = model(x.to(device))
        totals[0] += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                     y.to(device).reshape(-1), reduction="sum").double()
        totals[1] += y.numel()
    else:
        model(val[0][:1].to(device))  # keep collective forwards in step across ranks
    with _waiting_for("the all-reduce of the validation loss"):
        dist.all_reduce(totals)
    model.train(was_training)
    return float(totals[0] / totals[1])  # host sync


# -- checkpoints ----------------------------------------------------------------------------------
# Hyper-parameter flags a resume may change (the others must match the checkpoint's run).
_HPARAMS = ("lr", "beta1", "beta2", "weight_decay", "clip", "warmup")


def _hparams(cfg: TrainConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in _HPARAMS}


def _caller_state(cfg: TrainConfig, sched: Any, log: _Log, step: int) -> dict[str, Any]:
    """Everything besides the optimizer a resume needs, identical on every rank, JSON-able."""
    return {"step": step, "scheduler": sched.state_dict(), "steps": list(log.steps),
            "val": list(log.val), "model": cfg.model_config(), "seed": cfg.seed,
            "batch_size": cfg.batch_size, "total_steps": cfg.steps, "hparams": _hparams(cfg)}


def _save(cfg: TrainConfig, opt: Any, sched: Any, log: _Log, step: int,
          replace_old: bool = False) -> None:
    """Save step `step`; with `replace_old` (--overwrite, first save of the run) then remove
    every other checkpoint in the folder: the old run's stay until this one has a complete
    save (keep_last waits too: it would keep the old run's higher steps instead)."""
    from fusedzero import checkpoint

    log.flush()
    root = checkpoint.save_root(cfg.ckpt_dir or "")
    with _waiting_for(f"the checkpoint save of step {step}"):
        checkpoint.save(opt, root, step=step,
                        caller_state=_caller_state(cfg, sched, log, step),
                        keep_last=None if replace_old else cfg.keep_last)
    if replace_old and dist.get_rank() == 0:
        new = root / checkpoint.step_dir_name(step)
        for old in checkpoint.list_checkpoints(root):
            if old.resolve() != new.resolve():
                shutil.rmtree(old)


def _resume(cfg: TrainConfig, opt: Any, sched: Any, log: _Log) -> int:
    from fusedzero import checkpoint

    # This run's flags are what runs (and what --out-json records): the groups keep their
    # betas and decay, and the scheduler's lr base is put back after load_state_dict.
    base_lrs = list(sched.base_lrs)
    try:
        # The newest checkpoint that verifies (a corrupt newest one or a lost `latest` falls
        # back, with a warning); rank 0 decides so every rank loads the same one.
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = checkpoint.find_latest(cfg.ckpt_dir)
            except checkpoint.CheckpointError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        found = box[0]
        for why in found.skipped if dist.get_rank() == 0 else ():
            print(f"fusedzero: warning: --resume: skipped {why}", file=sys.stderr, flush=True)
        # find_latest just hashed every shard on rank 0: load checks sizes and headers only.
        loaded = checkpoint.load(opt, found.path, verify=False,
                                 load_hyperparams=False)
    except CollectiveTimeout:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        msg = " ".join(str(e).split())
        raise UsageError(f"--resume: cannot load a checkpoint from {cfg.ckpt_dir!r}: "
                         f"{type(e).__name__}: {msg}") from None
    # Every saving rank stored the same caller state, but a run with more ranks than the saving
    # one gets None on the new ranks: rank 0's (always there) goes to all.
    box = [loaded.caller_state]
    with _waiting_for("the broadcast of the resumed run's state"):
        dist.broadcast_object_list(box, src=0)
    state = box[0]
    if not isinstance(state, dict) or "step" not in state:
        raise UsageError(f"--resume: the checkpoint in {cfg.ckpt_dir!r} was not written by "
                         "`fusedzero train` (no step in its caller state)")
    for key, mine in (("model", cfg.model_config()), ("seed", cfg.seed),
                      ("batch_size", cfg.batch_size), ("total_steps", cfg.steps)):
        if state.get(key) != mine:
            raise UsageError(f"--resume: the checkpoint was trained with {key}={state.get(key)}, "
                             f"this run has {key}={mine}; pass the same flags to resume")
    step = int(state["step"])
    saved = _saved_hparams(state)
    sched.load_state_dict(state["scheduler"])
    sched.base_lrs = base_lrs
    changed = [f"--{k.replace('_', '-')} {v} (checkpoint: {saved[k]})"
               for k, v in _hparams(cfg).items() if k in saved and saved[k] != v]
    if changed and dist.get_rank() == 0:
        print(f"fusedzero: resume: flags override the checkpoint: {', '.join(changed)}",
              flush=True)
    # LambdaLR.load_state_dict restores the schedule position only: set the groups' lr to the
    # exact value the uninterrupted run would use for the next update (LambdaLR's own formula).
    lrs = [base * lam(sched.last_epoch) for base, lam in zip(base_lrs, sched.lr_lambdas,
                                                              strict=True)]
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    log.steps[:] = state.get("steps", [])
    log.val[:] = state.get("val", [])
    return step


def _saved_hparams(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint run's hyper-parameter flags (recorded in the caller state since they can
    change on resume; older checkpoints have only the lr, in the scheduler's state)."""
    if isinstance(state.get("hparams"), dict):
        return dict(state["hparams"])
    base = (state.get("scheduler") or {}).get("base_lrs") or [None]
    return {} if base[0] is None else {"lr": base[0]}


# -- summary --------------------------------------------------------------------------------------
def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _summary(cfg: TrainConfig, opt: Any, world: int, device: torch.device,
             param_dtype: torch.dtype, reduce_dtype: torch.dtype, log: _Log,
             comm_per_step: dict[str, float], tokens_per_s: float) -> dict[str, Any]:
    mem = opt.memory()
    # Max over ranks: shards can differ by padding. Logging, so dist directly.
    res = torch.tensor([mem.params, mem.grads, mem.optimizer], dtype=torch.int64, device=device)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)
    params_b, grads_b, opt_b = res.tolist()
    psi = int(mem.param_elements)
    pb, gb = param_dtype.itemsize, reduce_dtype.itemsize
    master = 4 if param_dtype != torch.float32 else 0
    ddp = {"params": psi * pb, "grads": psi * gb, "optimizer": psi * (8 + master)}
    ddp_comm = 2 * (world - 1) * psi * gb // world
    return {
        "stage": cfg.stage,
        "world_size": world,
        "params": psi,
        "padded_params": sum(fg.layout.padded_numel for fg in opt.flat_groups),
        "steps": list(log.steps),
        "train_loss": log.steps[-1]["loss"] if log.steps else None,
        "val_loss": log.val[-1]["val_loss"] if log.val else None,
        "val": list(log.val),
        "tokens_per_s": tokens_per_s,
        "resident_bytes": {"params": params_b, "grads": grads_b, "optimizer": opt_b},
        "ddp_resident_bytes": ddp,
        "comm_bytes_per_step": comm_per_step,
        "ddp_comm_bytes_per_step": {"all_reduce": ddp_comm},
        "dtypes": {"param": _dtype_name(param_dtype), "master": "float32",
                   "grad_reduce": _dtype_name(reduce_dtype)},
        "device": device.type,
        "config": dataclasses.asdict(cfg),
    }


def format_table(s: dict[str, Any], stopped: bool = False) -> str:
    MB = 1e6
    r, d = s["resident_bytes"], s["ddp_resident_bytes"]
    c = s["comm_bytes_per_step"]
    first_val = s["val"][0]["val_loss"] if s["val"] else float("nan")
    last = s["steps"][-1]["step"] if s["steps"] else 0
    def fmt(v):
        return "-" if v is None else f"{v:.4f}"
    rows = [
        ("stage", f"ZeRO-{s['stage']}"),
        ("world size", f"{s['world_size']} ({s['device']})"),
        ("params", f"{s['params']:,} ({s['padded_params']:,} padded)"),
        ("dtypes", (f"params {s['dtypes']['param']}, master {s['dtypes']['master']}, "
                   f"grad reduce {s['dtypes']['grad_reduce']}")),
        ("steps", f"{last}" + ("  (stopped early: resume with --resume)" if stopped else "")),
        ("train loss", fmt(s["train_loss"])),
        ("val loss", f"{fmt(s['val_loss'])}  (at start {first_val:.4f})"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}"),
    ]
    w = max(len(k) for k, _ in rows)
    out = ["", "fusedzero train: done"] + [f"  {k:<{w}}  {v}" for k, v in rows]
    out.append("")
    out.append(f"  {'MB per rank':<22}{'ZeRO-' + str(s['stage']):>12}{'plain DDP':>12}")
    for k in ("params", "grads", "optimizer"):
        out.append(f"  {k:<22}{r[k] / MB:>12.3f}{d[k] / MB:>12.3f}")
    out.append(f"  {'total':<22}{sum(r.values()) / MB:>12.3f}{sum(d.values()) / MB:>12.3f}")
    out.append("  comm MB per step per rank")
    out.append(f"  {'  all_reduce':<22}{c['all_reduce'] / MB:>12.3f}"
               f"{s['ddp_comm_bytes_per_step']['all_reduce'] / MB:>12.3f}")
    for k in ("reduce_scatter", "all_gather"):
        out.append(f"  {'  ' + k:<22}{c[k] / MB:>12.3f}{0.0:>12.3f}")
    return "\n".join(out)
