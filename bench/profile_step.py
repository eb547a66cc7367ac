"""Where a system's step overhead goes: cProfile inside rank 0, summed by category.

    python bench/profile_step.py                      # fusedzero at every stage, fp32
    python bench/profile_step.py --systems bare-bf16,fusedzero-2-bf16-r16,deepspeed-2-bf16

Same model, batch, bucket size and clip as `bench_step.py` (`_systems.py`), W gloo ranks. First
every system is stepped round-robin with bare forward+backward before each (bench_step.py's, see
[Note: overhead]) and the overhead median printed; then each system's steps run under cProfile
in rank 0 and the profile's own time (tottime) is summed per category, in ms per step:

- model: forward and backward of the model (`run_backward`, the model's ops), what bare does too;
- comm wait: blocking on a collective's handle (on gloo, its worker thread competes with the
  ranks' compute for the same cores: this is where a collective's run time shows);
- comm launch: issuing a collective (gloo's reduce-scatter copies its input on the caller);
- update: the AdamW pass and the bf16/fp16 casts around it (torch's fused kernel on CPU);
- norm: the sum of squares for clipping and non-finite detection;
- grad passes: other full passes over grads (zeroing, pre-division, copies into buckets);
- python: Python code of the system (hooks, bookkeeping), the rest.

Profiling inflates Python time; compare categories within a run. This is a diagnostic, not the
benchmark: the numbers to quote come from `bench_step.py` (bench/REPORT.md).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.distributed as dist  # noqa: E402
from bench_step import RANK_ENV, batch  # noqa: E402

from fusedzero.testing import run_ranks  # noqa: E402

from _systems import BATCH, CFG, SYSTEMS, build  # noqa: E402

CATEGORIES = ("model", "comm wait", "comm launch", "update", "norm", "grad passes", "python")
_COMM = (
    "allreduce",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "_reduce_scatter",
    "_allgather",
)
_UPDATE = (
    "_fused_adamw_",
    "_fused_adam_",
    "_foreach_copy_",
    "_foreach_add",
    "_foreach_mul",
    "_foreach_addcdiv",
    "_foreach_lerp",
    "_foreach_sqrt",
    "_foreach_div",
    "_foreach_addcmul",
)
_NORM = ("cat", "square_", "sum", "_foreach_norm", "stack", "vector_norm", "isfinite")
_PASSES = ("zero_", "mul_", "mul", "copy_", "add_", "div_", "_foreach_zero_")


def category(key: tuple[str, int, str]) -> str:
    """The category of one pstats entry (file, line, function)."""
    file, _, fn = key
    name = fn.strip("<>{} ").removeprefix("built-in method ").removeprefix("method ")
    name = name.split(" of ")[0].split(".")[-1]
    if name == "wait" and ("c10d" in fn or "Work" in fn):
        return "comm wait"
    if any(name.startswith(c) for c in _COMM) and file == "~":
        return "comm launch"
    if name in _UPDATE:
        return "update"
    if name in _NORM:
        return "norm"
    if name in _PASSES:
        return "grad passes"
    if file == "~" or "/torch/" in file or "fusedzero/app/model.py" in file:
        return "model"
    return "python"


def _step(name: str, s: Any, xs: Any, ys: Any) -> float:
    dist.barrier()
    t = time.perf_counter()
    s.step(xs, ys)
    return time.perf_counter() - t


def worker(rank: int, world: int, names: list[str], rounds: int, prof_steps: int) -> dict[str, Any]:
    n = BATCH // world
    systems = {nm: build(nm, world) for nm in names}
    bare = {nm: ("bare-bf16" if SYSTEMS[nm].precision == "bf16" else "bare") for nm in names}
    for b in set(bare.values()):
        if b not in systems:
            systems[b] = build(b, world)
    over: dict[str, list[float]] = {nm: [] for nm in names}
    for i in range(rounds + 2):
        x, y = batch(i)
        xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        for nm in names:
            b = _step(bare[nm], systems[bare[nm]], xs, ys)
            t = _step(nm, systems[nm], xs, ys)
            if i >= 2:
                over[nm].append(t - b)
    cats: dict[str, dict[str, float]] = {}
    for nm in names:
        pr = cProfile.Profile()
        for i in range(prof_steps):
            x, y = batch(100 + i)
            xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
            dist.barrier()
            pr.enable()
            systems[nm].step(xs, ys)
            pr.disable()
        c = dict.fromkeys(CATEGORIES, 0.0)
        for key, (_, _, tt, _, _) in pstats.Stats(pr).stats.items():  # type: ignore[attr-defined]
            c[category(key)] += tt / prof_steps
        cats[nm] = c
    return {"overhead": over, "categories": cats}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--systems",
        default="fusedzero-0,fusedzero-1,fusedzero-2,fusedzero-3",
        help="comma-separated names from bench/_systems.py (bare runs anyway)",
    )
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args(argv)
    names = [s for s in a.systems.split(",") if s and not s.startswith("bare")]
    ranks = run_ranks(worker, a.world, names, a.rounds, a.profile_steps, timeout=1200, env=RANK_ENV)
    r0 = ranks[0]
    print(
        f"GPT {CFG.n_layer}x{CFG.n_embd}, global batch {BATCH}, W={a.world}; "
        f"{a.rounds} rounds; profile of rank 0 over {a.profile_steps} steps, ms per step"
    )
    head = f"{'system':28s} {'overhead':>9s} " + " ".join(f"{c:>11s}" for c in CATEGORIES)
    print(head)
    for nm in names:
        o = statistics.median(max(v) for v in zip(*(r["overhead"][nm] for r in ranks)))
        cells = " ".join(f"{1e3 * r0['categories'][nm][c]:11.1f}" for c in CATEGORIES)
        print(f"{nm:28s} {1e3 * o:9.1f} {cells}")


if __name__ == "__main__":
    main()
