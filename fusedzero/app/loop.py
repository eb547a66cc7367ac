"""The training loop of one rank: the model, ZeroAdamW, the lr schedule, logging and evals.

Reproducibility: the model is initialised from `--seed` on every rank; the global batch of step s
is drawn from (seed, s) alone (`fusedzero.app.data.BatchSampler`), so the same seed and global
batch train on the same data at any world size and grad accumulation.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusedzero import Groups, ZeroAdamW, ZeroMuon, _dtypes as dtypes, _safe_paths as safe_paths
from fusedzero.app import resume as resume_mod, tp_plan, watch
from fusedzero.app.config import MIN_LR_RATIO, TrainConfig, UsageError
from fusedzero.app.data import BatchSampler, Split, eval_batches
from fusedzero.app.log import PendingStep, RunLog, waiting_for
from fusedzero.app.model import GPT, GPTConfig, gpt_muon_param_groups, gpt_param_groups
from fusedzero.app.summary import format_table, summarize
from fusedzero.kernels import LAUNCHES


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


def train_rank(
    cfg: TrainConfig, device: torch.device, data: Split, progress: Any = None
) -> dict[str, Any]:
    """The training loop of one rank in an initialised process group. Returns the summary
    (identical on every rank); rank 0 also prints the closing table and writes --out-json.
    `progress` (a shared array, one slot per rank) gets this rank's step as each one starts,
    so the launcher can name the step of a rank that dies."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train_data, val_data = data
    param_dtype = cfg.params_dtype(device.type == "cuda")
    reduce_dtype = dtypes.SHORT_NAMES[cfg.reduce_dtype]

    # Initialised on the CPU and moved: the same weights on every device (the CPU generator),
    # and .to() keeps the tied weight tied.
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**cfg.model_config())).to(device)
    # --tp: the (dp, tp) mesh; data and ZeroAdamW follow the dp group (the world at --tp 1).
    mesh = tp_plan.parallelize(model, cfg.tp, device)
    dpr, dpw = mesh.dp_rank, mesh.dp_size
    # NCCL: param all-gathers on a communicator of their own.
    gather = tp_plan.gather_group(mesh) if device.type == "cuda" else None
    engine: dict[str, Any] = dict(
        stage=cfg.stage,
        module=model,
        max_grad_norm=cfg.clip or None,
        precision=cfg.precision(device.type == "cuda"),
        wire=cfg.wire_policy(),
        groups=Groups(shard=mesh.dp_group, gather=gather),
        sharding=cfg.sharding(),
    )
    opt: ZeroAdamW | ZeroMuon
    if cfg.optimizer == "muon":
        opt = ZeroMuon(
            gpt_muon_param_groups(
                model,
                cfg.weight_decay,
                muon_lr=cfg.muon_lr,
                lr=cfg.lr,
                betas=(cfg.beta1, cfg.beta2),
            ),
            **engine,
        )
    else:
        opt = ZeroAdamW(
            gpt_param_groups(model, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            **engine,
        )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_for(cfg))
    sampler = BatchSampler(train_data, cfg.block_size, cfg.batch_size, cfg.seed)
    val = eval_batches(val_data, cfg.block_size, cfg.eval_seqs, 1)[0]
    log = RunLog(world, run_id=_agreed_run_id(device))

    start = 0
    if cfg.resume:
        start = resume_mod.resume(cfg, opt, sched, log)
    replace_old = cfg.overwrite  # until the first save of this run
    stop = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    if start >= stop:
        return _nothing_to_train(cfg, opt, world, device, param_dtype, reduce_dtype, log, start)
    A = cfg.grad_accum
    tokens_per_step = cfg.batch_size * cfg.block_size
    micro_rows = cfg.batch_size // (dpw * A)  # evaluate in training-sized forwards

    bar = None
    if rank == 0 and cfg.progress:
        from tqdm.auto import tqdm  # imported here: only rank 0 draws a bar

        # tqdm's default lock includes a multiprocessing semaphore, which a spawned rank's
        # os._exit would leave behind (resource_tracker warns): one process, one thread lock.
        tqdm.set_lock(threading.RLock())
        # Redrawn at most every 0.2 s on a terminal, every 10 s into a log file.
        bar = tqdm(
            total=cfg.steps,
            initial=start,
            desc=f"ZeRO-{cfg.stage} x{world}",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0.2 if sys.stderr.isatty() else 10.0,
        )

    def say(msg: str) -> None:
        if rank == 0:
            (bar.write if bar is not None else print)(msg)

    try:
        metrics = (
            watch.MetricsLog(cfg.log_jsonl, run_id=log.run_id, start_step=start)
            if (rank == 0 and cfg.log_jsonl)
            else None
        )
    except ValueError as e:  # the launcher ends the other ranks, waiting in the first eval
        raise UsageError(str(e)) from None
    if start == 0 or not log.val:
        log.val.append({"step": start, "val_loss": evaluate(model, val, dpr, dpw, micro_rows)})
        if metrics is not None:  # the untrained model's: where the curve starts
            metrics.write(start, val_loss=log.val[-1]["val_loss"])
        say(f"step {start:5d}: val loss {log.val[-1]['val_loss']:.4f}")

    comm_total = dict.fromkeys(opt.comm.bytes, 0)
    train_time, timed_steps = 0.0, 0
    seg_start, seg_steps = time.perf_counter(), 0

    written = len(log.steps)  # log.steps already in the metrics file (resume: the saved ones)

    def close_segment() -> float | None:
        """Add the steps since the last boundary to the throughput clock (after a host sync);
        return the segment's seconds per step (None: no timed step in it)."""
        nonlocal train_time, timed_steps, seg_start, seg_steps
        per_step = None
        if seg_steps:
            dt = time.perf_counter() - seg_start
            train_time += dt
            timed_steps += seg_steps
            per_step = dt / seg_steps
        seg_start, seg_steps = time.perf_counter(), 0
        return per_step

    def write_metrics(per_step: float | None) -> None:
        nonlocal written
        if metrics is not None:
            for s in log.steps[written:]:
                metrics.write(
                    s["step"],
                    loss=s["loss"],
                    grad_norm=s["grad_norm"],
                    lr=s["lr"],
                    skipped=log.skipped.get(s["step"]),
                    tokens_per_s=tokens_per_step / per_step if per_step else None,
                    step_ms=per_step * 1e3 if per_step else None,
                )
        written = len(log.steps)

    launches: dict[str, int] | None = None
    for step in range(start + 1, stop + 1):
        if progress is not None:
            progress[rank] = step
        before = dict(opt.comm.bytes)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for m in range(A):
            x, y = (to_device(t, device) for t in sampler.batch(step - 1, dpr, dpw, m, A))
            with opt.no_sync() if m < A - 1 else contextlib.nullcontext():
                _, loss = model(x, y)
                (loss / A).backward()
            loss_sum += loss.detach().float()
        launched = dict(LAUNCHES)
        opt.step()
        # Counted over a real step (the last one is what the summary reports), not computed.
        launches = {k: LAUNCHES[k] - launched.get(k, 0) for k in ("adamw", "sumsq")}
        lr = opt.param_groups[-1]["lr"]  # --lr's schedule (muon: an AdamW group's)
        sched.step()
        opt.zero_grad()
        for k, v in opt.comm.bytes.items():
            comm_total[k] += v - before[k]
        log.pending.append(
            PendingStep(
                step,
                loss_sum / A,
                opt.grad_norm.detach().clone().reshape(()),
                lr,
                opt.skipped.detach().clone().reshape(()),
            )
        )
        seg_steps += 1

        is_eval = cfg.eval_every > 0 and step % cfg.eval_every == 0 and step != stop
        is_save = cfg.ckpt_dir is not None and (
            step == stop or (cfg.save_every > 0 and step % cfg.save_every == 0)
        )
        if step % cfg.log_every == 0 or step == stop or step == start + 1 or is_eval or is_save:
            log.flush()  # host sync: all-reduce of the pending losses
            if step == start + 1 and stop > start + 1:
                seg_start, seg_steps = time.perf_counter(), 0  # first step: warm-up, untimed
                write_metrics(None)
            else:
                write_metrics(close_segment())
            if bar is not None:
                s = log.steps[-1]
                post = {
                    "loss": f"{s['loss']:.3f}",
                    "gnorm": f"{s['grad_norm']:.2f}",
                    "lr": f"{s['lr']:.2e}",
                }
                if timed_steps:
                    post["tok/s"] = f"{tokens_per_step * timed_steps / train_time:,.0f}"
                bar.set_postfix(post, refresh=False)
        if bar is not None:
            bar.update(1)
        if is_eval:
            log.val.append({"step": step, "val_loss": evaluate(model, val, dpr, dpw, micro_rows)})
            if metrics is not None:
                metrics.write(step, val_loss=log.val[-1]["val_loss"])
            say(
                f"step {step:5d}: val loss {log.val[-1]['val_loss']:.4f}  "
                f"train loss {log.steps[-1]['loss']:.4f}"
            )
            seg_start = time.perf_counter()
        if is_save:
            resume_mod.save(cfg, opt, sched, log, step, replace_old=replace_old)
            replace_old = False
            say(f"step {step:5d}: checkpoint saved in {cfg.ckpt_dir}")
            seg_start = time.perf_counter()
    close_segment()
    if bar is not None:
        bar.close()

    final_step = max(stop, start)
    if not log.val or log.val[-1]["step"] != final_step:
        log.val.append({"step": final_step, "val_loss": evaluate(model, val, dpr, dpw, micro_rows)})
        if metrics is not None:
            metrics.write(final_step, val_loss=log.val[-1]["val_loss"])
    if metrics is not None:
        metrics.close()
    finish_watch(cfg, model, log, rank, world, say)
    run_steps = max(0, stop - start)
    summary = summarize(
        cfg,
        opt,
        world,
        device,
        param_dtype,
        reduce_dtype,
        log,
        {k: v / run_steps if run_steps else 0.0 for k, v in comm_total.items()},
        tokens_per_step * timed_steps / train_time if train_time > 0 else 0.0,
        launches,
    )
    if rank == 0:
        print(format_table(summary, stopped=cfg.stop_at is not None and stop < cfg.steps))
        if cfg.out_json:
            Path(cfg.out_json).parent.mkdir(parents=True, exist_ok=True)
            text = (json.dumps(summary, indent=1) + "\n").encode()
            safe_paths.replace_file(cfg.out_json, lambda f: f.write(text), "--out-json")
    return summary


def _nothing_to_train(
    cfg: TrainConfig,
    opt: ZeroAdamW,
    world: int,
    device: torch.device,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    log: RunLog,
    start: int,
) -> dict[str, Any]:
    """A resume at or past its last step: say so, train, evaluate and print nothing more, and
    return the checkpoint's summary (--out-json is left as the finished run wrote it)."""
    if dist.get_rank() == 0:
        where = (
            f"its last step (--steps {cfg.steps})"
            if start >= cfg.steps
            else f"past --stop-at {cfg.stop_at}"
        )
        print(
            f"fusedzero: the run in {cfg.ckpt_dir} is already at step {start}, {where}: "
            "nothing to train",
            flush=True,
        )
    return summarize(
        cfg,
        opt,
        world,
        device,
        param_dtype,
        reduce_dtype,
        log,
        dict.fromkeys(opt.comm.bytes, 0.0),
        0.0,
        None,
    )


def finish_watch(
    cfg: TrainConfig,
    model: torch.nn.Module,
    log: RunLog,
    rank: int,
    world: int,
    say: Callable[[str], None],
) -> None:
    """The end of a run a person looks at: the loss-curve PNG (--plot) and a text sample."""
    if cfg.plot and rank == 0:
        records = [{"step": s["step"], "loss": s["loss"]} for s in log.steps]
        records += [{"step": v["step"], "val_loss": v["val_loss"]} for v in log.val]
        watch.plot_losses(records, cfg.plot, f"fusedzero stage {cfg.stage}, W={world}")
        say(f"loss curves: {cfg.plot}")
    if cfg.sample_tokens > 0:
        # Every rank generates (at stage 3 each forward gathers params collectively), from the
        # same seeded generator, so all ranks draw the same bytes.
        with torch.no_grad():
            text = watch.sample_text(
                model,
                b"\n",
                cfg.sample_tokens,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                seed=cfg.seed,
            )
        how = (
            "greedy"
            if cfg.temperature == 0
            else f"temperature {cfg.temperature:g}, top-k {cfg.top_k or 'off'}"
        )
        say(f"sample ({cfg.sample_tokens} bytes, {how}, after a newline):\n" + text.strip("\n"))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto the device without a host wait: from pinned memory on CUDA (a copy from
    pageable memory may wait for the device however `non_blocking` is set)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, val: Split, rank: int, world: int, rows: int | None = None
) -> float:
    """Mean next-byte cross-entropy over the fixed validation windows, split over ranks (with
    --tp, the dp ranks: a replica's tp ranks score the same slice, which scales both sums alike),
    `rows` windows per forward (a training micro-batch: all of a rank's at once held logits 16x
    a training step's at --grad-accum 16; None: all at once).

    Every rank runs the same number of forwards (ZeRO-3 gathers params collectively, tp ranks
    meet in every layer): the largest slice's count, padded on the others with a window whose
    loss is not counted.
    """
    was_training = model.training
    model.eval()
    device = next(iter(model.parameters())).device
    x, y = val[0][rank::world], val[1][rank::world]
    most = -(-val[0].shape[0] // world)  # rank 0's slice, the largest
    rows = max(1, rows or most)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for lo in range(0, max(most, 1), rows):
        if lo >= x.shape[0]:
            model(to_device(val[0][:1], device))  # keep collective forwards in step
            continue
        logits, _ = model(to_device(x[lo : lo + rows], device))
        yy = to_device(y[lo : lo + rows], device)
        totals[0] += F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), yy.reshape(-1), reduction="sum"
        ).double()
        totals[1] += yy.numel()
    with waiting_for("the all-reduce of the validation loss"):
        dist.all_reduce(totals)
    model.train(was_training)
    return float(totals[0] / totals[1])  # host sync


def _agreed_run_id(device: torch.device) -> str:
    """Rank 0's new run id on every rank (every rank saves it). Its ASCII bytes go as a tensor:
    broadcast_object_list unpickles through numpy, which is not a dependency."""
    rid = watch.new_run_id().encode("ascii")
    t = torch.tensor(list(rid), dtype=torch.uint8, device=device)
    dist.broadcast(t, src=0)
    return bytes(t.tolist()).decode("ascii")
