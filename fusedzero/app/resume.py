"""Checkpoints of a training run: save a step with the caller state a resume needs, and resume
from the newest checkpoint that verifies (at any world size or stage).

Nothing besides the optimizer consumes randomness (no dropout, data drawn from (seed, step)), so
a checkpoint needs no RNG state: the step number is the data position.
"""
from __future__ import annotations

import shutil
import sys
from typing import Any

import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from fusedzero import checkpoint
from fusedzero.app.config import TrainConfig, UsageError
from fusedzero.app.log import RunLog, waiting_for
from fusedzero.comm import CollectiveTimeout
from fusedzero.optim import ZeroAdamW

# Hyper-parameter flags a resume may change (the others must match the checkpoint's run).
_HPARAMS = ("lr", "beta1", "beta2", "weight_decay", "clip", "warmup")


def _hparams(cfg: TrainConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in _HPARAMS}


def caller_state(cfg: TrainConfig, sched: LambdaLR, log: RunLog, step: int) -> dict[str, Any]:
    """Everything besides the optimizer a resume needs, identical on every rank, JSON-able."""
    return {"step": step, "scheduler": sched.state_dict(), "steps": list(log.steps),
            "val": list(log.val), "model": cfg.model_config(), "seed": cfg.seed,
            "batch_size": cfg.batch_size, "total_steps": cfg.steps, "hparams": _hparams(cfg),
            "modes": {"master": cfg.master, "states": cfg.states}, "run_id": log.run_id}


def save(cfg: TrainConfig, opt: ZeroAdamW, sched: LambdaLR, log: RunLog, step: int,
          replace_old: bool = False) -> None:
    """Save step `step`; with `replace_old` (--overwrite, first save of the run) then remove
    every other checkpoint in the folder: the old run's stay until this one has a complete
    save (keep_last waits too: it would keep the old run's higher steps instead)."""
    log.flush()
    root = checkpoint.save_root(cfg.ckpt_dir or "")
    with waiting_for(f"the checkpoint save of step {step}"):
        checkpoint.save(opt, root, step=step,
                        caller_state=caller_state(cfg, sched, log, step),
                        keep_last=None if replace_old else cfg.keep_last)
    if replace_old and dist.get_rank() == 0:
        new = root / checkpoint.step_dir_name(step)
        for old in checkpoint.list_checkpoints(root):
            if old.resolve() != new.resolve():
                shutil.rmtree(old)


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
                box[0] = checkpoint.find_latest(cfg.ckpt_dir)
                other = other_model(checkpoint.read_manifest(box[0].path), opt)
                if other is not None:
                    box[0] = UsageError(f"--resume: {box[0].path} holds another model: {other}; "
                                        "pass the model flags it was trained with (--n-layer, "
                                        "--n-head, --n-embd, --block-size)")
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
    except (CollectiveTimeout, UsageError):
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        msg = " ".join(str(e).split())
        raise UsageError(f"--resume: cannot load a checkpoint from {cfg.ckpt_dir!r}: "
                         f"{type(e).__name__}: {msg}") from None
    # Every saving rank stored the same caller state, but a run with more ranks than the saving
    # one gets None on the new ranks: rank 0's (always there) goes to all.
    box = [loaded.caller_state]
    with waiting_for("the broadcast of the resumed run's state"):
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
    # Other memory modes resume too: the checkpoint's states are converted (fusedzero/memory_modes.py).
    modes = state.get("modes", {"master": "fp32", "states": "fp32"})
    changed += [f"--{k} {getattr(cfg, k)} (checkpoint: {v}, converted)" for k, v in modes.items()
                if getattr(cfg, k) != v]
    stop = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    if dist.get_rank() == 0 and step < stop:  # else the caller says there is nothing to train
        print(resumed_line(step, checkpoint.read_manifest(loaded.path), opt, changed), flush=True)
    # LambdaLR.load_state_dict restores the schedule position only: set the groups' lr to the
    # exact value the uninterrupted run would use for the next update (LambdaLR's own formula).
    lrs = [base * lam(sched.last_epoch) for base, lam in zip(base_lrs, sched.lr_lambdas,
                                                              strict=True)]
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
    first = (f"{n} is {saved[n]} there, {mine[n]} in this run" if n in saved and n in mine
             else f"{n} is only in the checkpoint" if n in saved
             else f"{n} is only in this run's model")
    return f"{first} ({len(differ)} of {len(mine)} params differ)"


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
