"""Checkpoints of a training run: save a step with the caller state a resume needs, and resume
from the newest checkpoint that verifies (at any world size or stage).

Nothing besides the optimizer consumes randomness (no dropout, data drawn from (seed, step)), so
a checkpoint needs no RNG state: the step number is the data position.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from fusedzero import checkpoint
from fusedzero._comm import CollectiveTimeout
from fusedzero.app.config import TrainConfig, UsageError
from fusedzero.app.log import RunLog, waiting_for
from fusedzero.checkpoint._format import remove
from fusedzero.checkpoint._placements import read as tp_record

if TYPE_CHECKING:  # the launcher imports this module; only ranks build an optimizer
    from fusedzero.optim import ZeroAdamW

# What loading a checkpoint may raise besides CheckpointError: a usage error for the user.
_LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError)
# Hyper-parameter flags a resume may change (the others must match the checkpoint's run).
_HPARAMS = ("lr", "beta1", "beta2", "weight_decay", "clip", "warmup")


def _hparams(cfg: TrainConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in _HPARAMS}


def caller_state(
    cfg: TrainConfig, sched: LambdaLR, log: RunLog, step: int, rank: int
) -> dict[str, Any]:
    """Everything besides the optimizer a resume needs, JSON-able, from rank `rank` of the
    saving group. The run's history (`steps`, `val`: ~61 bytes a step packed) goes into rank 0's
    state only, the one `resume` broadcasts to every rank; the other ranks' states stay the
    same size at any step. (Stored by every rank, the history grew the manifest by W x 61
    bytes a step, past the reader's cap, MAX_MANIFEST, within 40k steps at 64 ranks. Rank 0's
    alone fits ~2M steps at small world sizes, ~700k at 1024 ranks x 70B, where the other
    ranks leave it their ~44 KiB each: checkpoint/_manifest.py.)"""
    full = rank == 0
    return {
        "step": step,
        "scheduler": sched.state_dict(),
        "steps": list(log.steps) if full else [],
        "val": list(log.val) if full else [],
        "model": cfg.model_config(),
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "total_steps": cfg.steps,
        "hparams": _hparams(cfg),
        "modes": {"master": cfg.master, "states": cfg.states},
        "run_id": log.run_id,
    }


def save(
    cfg: TrainConfig,
    opt: ZeroAdamW,
    sched: LambdaLR,
    log: RunLog,
    step: int,
    replace_old: bool = False,
) -> None:
    """Save step `step`; with `replace_old` (--overwrite, first save of the run) then remove
    every other checkpoint in the folder: the old run's stay until this one has a complete
    save (keep_last waits too: it would keep the old run's higher steps instead)."""
    log.flush()
    root = checkpoint.save_root(cfg.ckpt_dir or "")
    try:
        with waiting_for(f"the checkpoint save of step {step}"):
            checkpoint.save(
                opt,
                root,
                step=step,
                caller_state=caller_state(cfg, sched, log, step, opt.rank),
                keep_last=None if replace_old else cfg.keep_last,
            )
    except (OSError, checkpoint.CheckpointError, ValueError) as e:
        # The same error on every rank (save agrees on it); the staging folder is gone.
        msg = " ".join(str(e).split())
        full = any(
            f"[Errno {n}]" in msg or "No space left" in msg for n in (errno.ENOSPC, errno.EDQUOT)
        )
        try:
            prev = f"step {_step_of(checkpoint.find_latest(root, checksums=False).path)}"
        except checkpoint.CheckpointError:
            prev = None
        kept = (
            f"the previous checkpoint ({prev} in {str(root)!r}) is intact and --resume "
            "continues from it"
            if prev
            else "no earlier checkpoint of this run exists"
        )
        raise UsageError(
            f"checkpoint save of step {step} failed{' (disk full)' if full else ''}: {msg}; {kept}"
        ) from None
    if replace_old and dist.get_rank() == 0:
        new = root / checkpoint.step_dir_name(step)
        for old in checkpoint.list_checkpoints(root):
            if old.name != new.name:
                remove(old)  # a symlinked step folder: the link goes, never its target


def _step_of(d: Any) -> int:
    return int(d.name.removeprefix("step-"))


def check_caller_state(cfg: TrainConfig, sched: LambdaLR, rank: int, state: Any) -> None:
    """A saved caller state this run can resume from, or ValueError naming what is wrong.
    Checked inside `checkpoint.load`, before the optimizer or scheduler is touched, on every
    rank (a rank the saving run did not have gets None: rank 0's state goes to it)."""
    if state is None and rank != 0:
        return
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(
            "the checkpoint was not written by `fusedzero train` (no step in its caller state)"
        )
    for key, mine in (
        ("model", cfg.model_config()),
        ("seed", cfg.seed),
        ("batch_size", cfg.batch_size),
        ("total_steps", cfg.steps),
    ):
        if state.get(key) != mine:
            raise ValueError(
                f"the checkpoint was trained with {key}={state.get(key)}, this "
                f"run has {key}={mine}; pass the same flags to resume"
            )
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= cfg.steps:
        raise ValueError(
            f"its caller state's step is {step!r}, expected a whole number in "
            f"[0, {cfg.steps}] (--steps)"
        )
    _same_form(state.get("scheduler"), sched.state_dict(), "scheduler state")
    if state["scheduler"]["last_epoch"] != step:
        raise ValueError(
            f"its scheduler is at step {state['scheduler']['last_epoch']}, its "
            f"caller state at step {step}"
        )
    for key in ("steps", "val"):
        _check_records(state.get(key, []), key, step)
    for key in ("hparams", "modes"):
        if not isinstance(state.get(key, {}), dict):
            raise ValueError(
                f"its caller state's {key} is {type(state[key]).__name__}, expected a dict"
            )
    rid = state.get("run_id")  # older checkpoints have none
    if rid is not None and not (
        isinstance(rid, str) and len(rid) <= 64 and rid.isascii() and rid.isprintable()
    ):
        raise ValueError(
            f"its caller state's run_id is {type(rid).__name__} {rid!r:.60}, "
            "expected a string of at most 64 printable ASCII characters"
        )


# The records of the run's history (log.py: RunLog.flush, loop.py's evals), field -> whether it
# is the step number (else any number: a diverged run's loss is NaN). The summary and --plot
# read them after the run: a record without them would fail only there.
_RECORD_FIELDS = {
    "steps": {"step": True, "loss": False, "grad_norm": False, "lr": False},
    "val": {"step": True, "val_loss": False},
}


def _check_records(records: Any, key: str, step: int) -> None:
    fields = _RECORD_FIELDS[key]
    if not isinstance(records, list):
        raise ValueError(
            f"its caller state's {key} is {type(records).__name__}, expected a list of records"
        )
    for i, r in enumerate(records):
        if not isinstance(r, dict) or set(r) != set(fields):
            raise ValueError(
                f"its caller state's {key}[{i}] is {str(r)[:80]!r}, expected a "
                f"record with the keys {sorted(fields)}"
            )
        for f, is_step in fields.items():
            v = r[f]
            ok = not isinstance(v, bool) and (
                isinstance(v, int) and 0 <= v <= step if is_step else isinstance(v, (int, float))
            )
            if not ok:
                want = f"a whole number in [0, {step}] (its step)" if is_step else "a number"
                raise ValueError(f"its caller state's {key}[{i}].{f} is {v!r:.60}, expected {want}")


def _same_form(v: Any, ref: Any, where: str) -> None:
    """`v` has the keys, lengths and types of `ref` (ints and floats as numbers): what
    LambdaLR.load_state_dict would install attribute by attribute."""
    if isinstance(ref, bool) or ref is None:
        ok = type(v) is type(ref)
    elif isinstance(ref, (int, float)):
        ok = (
            not isinstance(v, bool)
            and isinstance(v, (int, float))
            and (isinstance(ref, float) or isinstance(v, int))
        )
    elif isinstance(ref, (list, tuple)):
        ok = isinstance(v, (list, tuple)) and len(v) == len(ref)
        if ok:
            for i, (a, b) in enumerate(zip(v, ref)):
                _same_form(a, b, f"{where}[{i}]")
    elif isinstance(ref, dict):
        ok = isinstance(v, dict) and set(v) == set(ref)
        if ok:
            for k in ref:
                _same_form(v[k], ref[k], f"{where}.{k}")
    else:
        ok = type(v) is type(ref)
    if not ok:
        raise ValueError(
            f"its {where} is {type(v).__name__} {str(v)[:60]!r}, expected the "
            f"form of {type(ref).__name__} {str(ref)[:60]!r}"
        )


def latest_checkpoint(cfg: TrainConfig, *, checksums: bool = True) -> checkpoint.Latest:
    """The checkpoint --resume loads: find_latest's, or a tensor-parallel root itself (load
    reads each tp folder's newest), saved at this run's --tp."""
    root = Path(cfg.ckpt_dir or "")
    rec = tp_record(root)
    if rec is None:
        return checkpoint.find_latest(root, checksums=checksums)
    if rec["tp"] != cfg.tp:
        raise checkpoint.CheckpointError(
            f"it was saved at --tp {rec['tp']}, this run has --tp {cfg.tp}: resume with --tp "
            f"{rec['tp']} (a run saves into a root at one --tp; checkpoint.load reshards it "
            "across tp sizes: docs/tensor_parallel.md)"
        )
    return checkpoint.Latest(root, root, [])


def resume(cfg: TrainConfig, opt: ZeroAdamW, sched: LambdaLR, log: RunLog) -> int:
    # This run's flags are what runs (and what --out-json records): the groups keep their
    # betas and decay, and the scheduler's lr base is put back after load_state_dict.
    base_lrs = list(sched.base_lrs)
    try:
        # The newest checkpoint that verifies (a corrupt newest one or a lost `latest` falls
        # back, with a warning); rank 0 decides so every rank loads the same one.
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = latest_checkpoint(cfg)
                if tp_record(Path(cfg.ckpt_dir or "")) is None:  # a tp root: its folders' own
                    other = other_model(checkpoint.read_manifest(box[0].path), opt)
                    if other is not None:
                        box[0] = UsageError(
                            f"--resume: {box[0].path} holds another model: {other}; pass the "
                            "model flags it was trained with (--n-layer, --n-head, --n-embd, "
                            "--block-size)"
                        )
            # Whatever rank 0 meets reaches the broadcast, which every rank waits in.
            except (checkpoint.CheckpointError, *_LOAD_ERRORS) as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        found = box[0]
        for why in found.skipped if dist.get_rank() == 0 else ():
            print(f"fusedzero: warning: --resume: skipped {why}", file=sys.stderr, flush=True)
        # find_latest hashed every shard on rank 0 to choose; each rank still hashes the bytes
        # it loads, in the same read (see [Note: load what was verified] in
        # checkpoint/_shardfile.py): a shard swapped since is refused, never trained on. Rank
        # 0's files are read twice (the second time mostly from the page cache).
        rank = dist.get_rank()
        loaded = checkpoint.load(
            opt,
            found.path,
            verify=True,
            load_hyperparams=False,
            check_caller=lambda st: check_caller_state(cfg, sched, rank, st),
        )
    except (CollectiveTimeout, UsageError):
        raise
    except _LOAD_ERRORS as e:
        msg = " ".join(str(e).split())
        raise UsageError(
            f"--resume: cannot load a checkpoint from {cfg.ckpt_dir!r}: {type(e).__name__}: {msg}"
        ) from None
    # Rank 0's caller state (always there) goes to all: only it holds the run's history, and a
    # run with more ranks than the saving one gets None on the new ranks.
    box = [loaded.caller_state]
    with waiting_for("the broadcast of the resumed run's state"):
        dist.broadcast_object_list(box, src=0)
    state = box[0]  # checked by check_caller_state on rank 0
    step = int(state["step"])
    saved = _saved_hparams(state)
    sched.load_state_dict(state["scheduler"])
    sched.base_lrs = base_lrs
    changed = [
        f"--{k.replace('_', '-')} {v} (checkpoint: {saved[k]})"
        for k, v in _hparams(cfg).items()
        if k in saved and saved[k] != v
    ]
    # Other memory modes resume too: the checkpoint's states are converted
    # (fusedzero/memory_modes.py).
    modes = state.get("modes", {"master": "fp32", "states": "fp32"})
    changed += [
        f"--{k} {getattr(cfg, k)} (checkpoint: {v}, converted)"
        for k, v in modes.items()
        if getattr(cfg, k) != v
    ]
    stop = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    if dist.get_rank() == 0 and step < stop:  # else the caller says there is nothing to train
        print(resumed_line(step, checkpoint.read_manifest(loaded.path), opt, changed), flush=True)
    # LambdaLR.load_state_dict restores the schedule position only: set the groups' lr to the
    # exact value the uninterrupted run would use for the next update (LambdaLR's own formula).
    lrs = [
        base * lam(sched.last_epoch) for base, lam in zip(base_lrs, sched.lr_lambdas, strict=True)
    ]
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    log.steps[:] = state.get("steps", [])
    log.val[:] = state.get("val", [])
    log.run_id = state.get("run_id") or log.run_id  # older checkpoints have none
    return step


def other_model(manifest: dict[str, Any], opt: ZeroAdamW) -> str | None:
    """None when the checkpoint's params have this optimizer's names and shapes, else a short
    phrase naming the first that differs (`checkpoint.load` would list every difference: a
    line of kilobytes for a model one flag wider)."""
    saved = {p["name"]: list(p["shape"]) for p in manifest["params"]}
    mine = {p.name: list(p.shape) for p in opt.param_infos()}
    differ = [n for n in mine if saved.get(n) != mine[n]] + [n for n in saved if n not in mine]
    if not differ:
        return None
    n = differ[0]
    first = (
        f"{n} is {saved[n]} there, {mine[n]} in this run"
        if n in saved and n in mine
        else f"{n} is only in the checkpoint"
        if n in saved
        else f"{n} is only in this run's model"
    )
    return f"{first} ({len(differ)} of {len(set(mine) | set(saved))} param names differ)"


def resumed_line(step: int, manifest: dict[str, Any], opt: ZeroAdamW, changed: list[str]) -> str:
    """One line: the step resumed from with the checkpoint's world size and stage, then what
    differs now (resharded onto another world size or stage, flags that override)."""
    was, now = (manifest["world_size"], manifest["stage"]), (opt.world_size, int(opt.stage))
    line = f"fusedzero: resumed from step {step} (world {was[0]}, stage {was[1]})"
    if now != was:
        line += f"; now world {now[0]}, stage {now[1]} (resharded)"
    if changed:
        line += f"; flags override the checkpoint: {', '.join(changed)}"
    return line


def _saved_hparams(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint run's hyper-parameter flags (recorded in the caller state since they can
    change on resume; older checkpoints have only the lr, in the scheduler's state)."""
    if isinstance(state.get("hparams"), dict):
        return dict(state["hparams"])
    base = (state.get("scheduler") or {}).get("base_lrs") or [None]
    return {} if base[0] is None else {"lr": base[0]}
