"""One training step (forward + backward + optimizer step) per ZeRO stage and precision, and the
overhead each system adds to forward + backward: fusedzero vs its peers.

Every system trains the same GPT (same seed) on the same global batch, split over W gloo ranks
(W=2 by default). Systems (`_systems.py`), by the ZeRO stage they are compared at:

  fp32   stage 0  fusedzero-0 | DDP + torch AdamW(fused) | DeepSpeed ZeRO-0
         stage 1  fusedzero-1 | DDP + ZeroRedundancyOptimizer(AdamW fused) | DeepSpeed ZeRO-1
         stage 2  fusedzero-2 | FSDP2 reshard_after_forward=False | DeepSpeed ZeRO-2
         stage 3  fusedzero-3 (reshard after forward) and -3-keep | FSDP2 both ways |
                  DeepSpeed ZeRO-3 with its defaults and with re-gather forced (-reshard)
         wire     fusedzero-<stage>-wbf16 / -wint8: grads cross the network in bf16 / int8,
                  summed in fp32 (docs/wire.md); bytes beside fusedzero-<stage>'s fp32
  bf16   (bf16 params, fp32 master) fusedzero with grads reduced in fp32 (-r32) and in bf16
         (-r16) | FSDP2 MixedPrecisionPolicy(param_dtype=bf16), reduce_dtype bf16 (its
         default) and fp32 | DeepSpeed bf16 (reduces in bf16 by default)

[Note: overhead]
Forward and backward are the same work in every system; what a sharded optimizer owns is the
rest. `bare` (and `bare-bf16`) is the plain model of the same precision on the same per-rank
batch in the same ranks: forward, backward, grads dropped; no optimizer, hook or wrapper. In
every round bare runs again before every FUSEDZERO_BENCH_BARE_EVERY (1) systems, and each
system's step is paired with the bare step just before it (same load): overhead = step - bare
(each the slower rank's). Bare before every system halves the drift between the two steps of a
pair (bare's own step time moves by 5-10% from one step to the next here).
Median and p20-p80 of the per-round overheads are reported; two systems tie where their p20-p80
ranges overlap.

[Note: how it is timed]
Each precision is one session of W spawned ranks in which its systems are built side by side and
stepped round-robin: round i runs every system once, starting from a different one each time.
Ranks share the machine's cores with whatever else runs, so step times drift by +-20-30%;
alternating puts every system under the same drift, and medians compare them. A step is timed on
each rank from a barrier to the end of `step()`; the step time is the slower rank's.
Collectives are counted in the warm-up steps only (see `_measure.py`).

[Note: what is counted]
- comm_bytes: bytes on the wire per rank for one step by the ring formulas (all-reduce
  2(W-1)/W*n*b; reduce-scatter, all-gather and broadcast (W-1)/W*n*b). fusedzero: its own
  counter (`opt.comm`). Others: every torch.distributed collective called from Python is
  wrapped and counted in the ranks, with the dtypes it carried (`comm_dtypes`: which dtype a
  system reduces in). DDP's all-reduce runs inside its C++ reducer, which no wrapper sees: it
  all-reduces every grad once per step, so its bytes are 2(W-1)/W * (grad bytes), counted from
  the grads (marked "formula").
- tensor_bytes: resident bytes per rank between steps, counted exactly from tensors reachable
  from the system's objects, deduplicated by storage. fusedzero's `opt.memory()` beside it.
- rss_growth: how much the rank's RSS grew while the system was built and stepped once
  (allocator-dependent: glibc's default keeps freed blocks for reuse). A cross-check only.

Env (defaults keep the whole run under ~10 minutes on 2 cores):
  FUSEDZERO_BENCH_STEPS   timed rounds (16)               FUSEDZERO_BENCH_WARMUP  warm-up (3)
  FUSEDZERO_BENCH_WORLD   ranks (2)                       FUSEDZERO_BENCH_BATCH   global batch (8)
  FUSEDZERO_BENCH_MODEL   n_layer,n_embd,n_head,block_size (4,256,4,128: 3.3M params)
  FUSEDZERO_BENCH_BUCKET  bucket elements for every system that has buckets (1048576)
  FUSEDZERO_BENCH_CLIP    global-norm clip for every system (1.0; 0 = off)
  FUSEDZERO_BENCH_SYSTEMS comma-separated names to run (default: all; bare always runs)
  FUSEDZERO_BENCH_BARE_EVERY  bare runs before every N systems of a round (1)
"""

from __future__ import annotations

import gc
import os
import resource
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fusedzero.testing import run_ranks

import _measure
from _common import SUMMARY, percentiles, replay
from _systems import (
    BATCH,
    BF16_MATMUL,
    BUCKET,
    CFG,
    CLIP,
    SYSTEMS,
    System,
    build,
    make_model,
    unavailable,
)

STEPS = int(os.environ.get("FUSEDZERO_BENCH_STEPS", "16"))
WARMUP = int(os.environ.get("FUSEDZERO_BENCH_WARMUP", "3"))
WORLD = int(os.environ.get("FUSEDZERO_BENCH_WORLD", "2"))
_ONLY = [s for s in os.environ.get("FUSEDZERO_BENCH_SYSTEMS", "").split(",") if s]
# No MALLOC_MMAP_THRESHOLD_ here: forcing large blocks to mmap makes every fresh allocation of
# a step (a grad set to None, a transient bucket) pay page faults a caching allocator never
# pays, and that would be billed as overhead to whoever frees between steps.
RANK_ENV = {"DS_ACCELERATOR": "cpu"}
# Bare forward+backward runs again before every BARE_EVERY systems of a round
# (see [Note: overhead]).
BARE_EVERY = int(os.environ.get("FUSEDZERO_BENCH_BARE_EVERY", "1"))


def bare_of(name: str) -> str:
    return "bare-bf16" if SYSTEMS[name].precision == "bf16" else "bare"


def selected(precision: str) -> list[str]:
    names = [
        n
        for n, s in SYSTEMS.items()
        if s.precision == precision and s.bench and (not _ONLY or n in _ONLY or s.family == "bare")
    ]
    return [n for n in names if unavailable(n) is None]


# -- the rank worker ----------------------------------------------------------------------------
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def worker(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    _measure.install_counters(world)
    n = BATCH // world
    systems: dict[str, System] = {}
    out: dict[str, Any] = {}
    x0, y0 = batch(0)
    # Warm the process (autograd, thread pools, gloo buffers) so the first system built does not
    # carry one-time allocations in its RSS growth.
    warm = make_model()
    warm(x0[:n], y0[:n])[1].backward()
    dist.all_reduce(torch.zeros(1))
    del warm
    for name in names:
        gc.collect()
        rss0 = _measure.rss()
        t0 = time.perf_counter()
        try:
            s = build(name, world)
            s.step(x0[rank * n : (rank + 1) * n], y0[rank * n : (rank + 1) * n])
        except Exception:  # noqa: BLE001 - a system that fails is reported, not fatal
            out[name] = {"error": traceback.format_exc(limit=6)}
            dist.barrier()
            continue
        gc.collect()
        systems[name] = s
        out[name] = {
            "times": [],
            "losses": [],
            "rss_growth": _measure.rss() - rss0,
            "build_s": time.perf_counter() - t0,
            "info": s.info,
        }
        dist.barrier()
    bare = next((nm for nm in systems if SYSTEMS[nm].family == "bare"), None)
    order = [nm for nm in systems if nm != bare]
    for i in range(WARMUP + STEPS):
        x, y = batch(i + 1)
        xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        k = i % max(1, len(order))
        _measure.COUNTING[0] = i < WARMUP
        last_bare = float("nan")
        for j, name in enumerate(order[k:] + order[:k]):
            # See [Note: overhead]: bare runs again before every BARE_EVERY systems; a system's step
            # is paired with the bare step just before it, so both see the same load.
            runs = [bare, name] if bare is not None and j % BARE_EVERY == 0 else [name]
            for nm in runs:
                dt, loss = _timed(systems[nm], xs, ys)
                r = out[nm]
                if nm == bare:
                    last_bare = dt
                if i >= WARMUP:
                    r["times"].append(dt)
                    r.setdefault("paired_bare", []).append(last_bare)
                r["losses"].append(float(loss))
                if i < WARMUP:
                    own = systems[nm].own_comm
                    r["comm"] = dict(own()) if own is not None else _measure.counted()
                    r["comm_dtypes"] = _measure.dtypes_seen()
    for name, s in systems.items():
        r = out[name]
        gc.collect()
        params = s.params()
        r["param_bytes"] = _measure.storage_bytes(params)
        grads = [p.grad for p in params if p.grad is not None]
        r["grad_bytes"] = _measure.storage_bytes(grads)
        r["tensor_bytes"], r["objects_walked"] = _measure.reachable_tensor_bytes(s.roots)
        if s.memory is not None:
            r["own_memory"] = s.memory()
        if s.info.get("ddp_allreduce"):
            grad_bytes = sum(p.numel() * p.element_size() for p in params)
            r["comm"]["all_reduce (DDP reducer, formula)"] = 2 * (world - 1) * grad_bytes // world
        r["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _timed(s: System, xs: torch.Tensor, ys: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One step of `s`, timed from a barrier (so every rank starts together) to its end."""
    _measure.reset_counts()
    if s.reset_comm is not None:
        s.reset_comm()
    dist.barrier()
    t = time.perf_counter()
    loss = s.step(xs, ys)
    return time.perf_counter() - t, loss


# -- pytest ------------------------------------------------------------------------------------
_RESULTS: dict[str, Any] = {}


def results(precision: str) -> dict[str, Any]:
    if precision not in _RESULTS:
        names = selected(precision)
        ranks = run_ranks(worker, WORLD, names, timeout=1200, env=RANK_ENV)
        _RESULTS[precision] = {"ranks": ranks, "names": names}
    return _RESULTS[precision]


def step_times(ranks: list[dict[str, Any]], name: str) -> list[float]:
    """Per round, the slower rank's step time."""
    return [max(ts) for ts in zip(*(r[name]["times"] for r in ranks))]


pytestmark = pytest.mark.timeout(1500)


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_step(benchmark, name: str) -> None:
    reason = unavailable(name)
    if reason is not None:
        pytest.skip(reason)
    spec = SYSTEMS[name]
    if _ONLY and name not in _ONLY and spec.family != "bare":
        pytest.skip("not in FUSEDZERO_BENCH_SYSTEMS")
    run = results(spec.precision)
    ranks = run["ranks"]
    per_rank = [r[name] for r in ranks]
    if "error" in per_rank[0]:
        pytest.skip(f"{name} failed in the ranks: {per_rank[0]['error'][-1500:]}")
    times = step_times(ranks, name)
    bare = [max(bs) for bs in zip(*(r[name]["paired_bare"] for r in ranks))]
    overhead = [t - b for t, b in zip(times, bare)]
    benchmark.group = f"step {spec.precision} (W={WORLD})"
    replay(benchmark, times)
    r0 = per_rank[0]
    stats = percentiles(times)
    benchmark.extra_info.update({f"time_{k}": v for k, v in stats.items()})
    benchmark.extra_info.update({f"overhead_{k}": v for k, v in percentiles(overhead).items()})
    benchmark.extra_info.update(
        {
            "subject": "step",
            "system": name,
            "family": spec.family,
            "precision": spec.precision,
            "stages": list(spec.stages),
            "reduce": spec.reduce,
            "regather": spec.regather,
            "note": spec.note,
            "world": WORLD,
            "model": {
                "n_layer": CFG.n_layer,
                "n_embd": CFG.n_embd,
                "n_head": CFG.n_head,
                "block_size": CFG.block_size,
                "vocab_size": CFG.vocab_size,
                "params": make_model().num_params(),
            },
            "global_batch": BATCH,
            "steps": STEPS,
            "warmup": WARMUP,
            "bucket_numel": BUCKET,
            "clip": CLIP,
            "systems_in_run": run["names"],
            "bf16_matmul": BF16_MATMUL,
            "round_times": times,
            "round_overheads": overhead,
            "comm_bytes": r0["comm"],
            "comm_bytes_total": sum(r0["comm"].values()),
            "comm_dtypes": r0.get("comm_dtypes", {}),
            "tensor_bytes": [r["tensor_bytes"] for r in per_rank],
            "own_memory": [r.get("own_memory") for r in per_rank],
            "rss_growth": [r["rss_growth"] for r in per_rank],
            "build_s": r0["build_s"],
            "first_loss": r0["losses"][0],
            "last_loss": r0["losses"][-1],
            "info": r0["info"],
            "loadavg_1min": os.getloadavg()[0],
        }
    )
    ov = percentiles(overhead)
    SUMMARY.append(
        f"step {spec.precision} {name:>26}: median {stats['median'] * 1e3:7.1f} ms, "
        f"overhead {ov['median'] * 1e3:6.1f} ms (p20 {ov['p20'] * 1e3:.1f}, "
        f"p80 {ov['p80'] * 1e3:.1f}); comm {sum(r0['comm'].values()) / 1e6:.2f} MB"
    )
