"""The ZeRO collectives on gloo: torch's, fusedzero's direct sends, its shared memory (CPU ranks).

[Note: gloo has no reduce-scatter] in fusedzero/direct.py says why: torch's gloo
`reduce_scatter_tensor` clones its input and all-reduces all of it (2(W-1)/W of the buffer on the
wire, twice a reduce-scatter's), and `all_gather_into_tensor` gathers into a temporary and copies
out. fusedzero sends each peer its slice directly.

Providers, each a reduce-scatter (in place: the output is this rank's slice of the input, as at
stage 1), an all-gather (in place: the input is this rank's slice of the output) and an
all-reduce (stage 0) of one bucket of N elements, fp32 and bf16:
  torch_gloo  torch.distributed's reduce_scatter_single / all_gather_single / all_reduce (what
              FSDP2, DDP and DeepSpeed call)
  direct      fusedzero.direct.reduce_scatter / all_gather (ZeroAdamW on gloo where ranks cannot
              share memory; no all-reduce of its own)
  shm         fusedzero.shm ([Note: shared-memory collectives]: ZeroAdamW's default for gloo
              ranks on one host)
Timed inside W spawned gloo ranks from a barrier to the end of the wait (the slower rank's time
per round), providers interleaved round-robin; bytes sent per rank are the ring formula for
direct and twice it for torch's reduce-scatter (its all-reduce).

Env: FUSEDZERO_BENCH_COLL_NUMEL (elements per bucket, default 2**20, the step bench's bucket),
FUSEDZERO_BENCH_COLL_ROUNDS (default 30), FUSEDZERO_BENCH_WORLD (default 2).
"""
from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _common import add_stats, replay
from fusedzero import comm, direct
from fusedzero.testing import run_ranks

NUMEL = int(os.environ.get("FUSEDZERO_BENCH_COLL_NUMEL", str(1 << 20)))
ROUNDS = int(os.environ.get("FUSEDZERO_BENCH_COLL_ROUNDS", "30"))
WORLD = int(os.environ.get("FUSEDZERO_BENCH_WORLD", "2"))
WARMUP = 3
PROVIDERS = ("torch_gloo", "direct", "shm")
COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _one(provider: str, kind: str, buf: torch.Tensor, rank: int, world: int) -> None:
    S = buf.numel() // world
    mine = buf[rank * S:(rank + 1) * S]
    if provider == "shm":
        ch = comm._route_of(None, buf).channel
        h = (ch.reduce_scatter(mine, buf) if kind == "reduce_scatter" else
             ch.all_gather(buf, mine) if kind == "all_gather" else ch.all_reduce(buf))
    elif provider == "direct":
        h = (direct.reduce_scatter(mine, buf, None, world, rank) if kind == "reduce_scatter"
             else direct.all_gather(buf, mine, None, world, rank))
    elif kind == "reduce_scatter":
        h = comm._reduce_scatter(mine, buf, async_op=True)
    elif kind == "all_gather":
        h = comm._all_gather(buf, mine, async_op=True)
    else:
        h = dist.all_reduce(buf, async_op=True)
    h.wait()


def _available(provider: str, kind: str) -> bool:
    return not (provider == "direct" and kind == "all_reduce")


def _worker(rank: int, world: int) -> dict[str, list[float]]:
    bufs = {dt: torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank)).to(d)
            for dt, d in DTYPES.items()}
    comm.set_gloo_collectives(None, "shm")
    if comm.gloo_collectives() != "shm":
        raise RuntimeError("this machine's ranks cannot share memory: no shm provider")
    keys = [(p, k, dt) for dt in DTYPES for k in COLLECTIVES for p in PROVIDERS
            if _available(p, k)]
    times: dict[str, list[float]] = {"/".join(key): [] for key in keys}
    for i in range(WARMUP + ROUNDS):
        for j in range(len(keys)):
            p, k, dt = keys[(i + j) % len(keys)]
            dist.barrier()
            t0 = time.perf_counter()
            _one(p, k, bufs[dt], rank, world)
            if i >= WARMUP:
                times[f"{p}/{k}/{dt}"].append(time.perf_counter() - t0)
    return times


_RESULTS: dict[str, list[float]] = {}


def _results() -> dict[str, list[float]]:
    if not _RESULTS:
        ranks = run_ranks(_worker, WORLD, timeout=600)
        for key in ranks[0]:
            _RESULTS[key] = [max(ts) for ts in zip(*(r[key] for r in ranks))]
    return _RESULTS


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("provider,collective", [(p, k) for k in COLLECTIVES for p in PROVIDERS
                                                 if _available(p, k)])
def test_gloo_collective(benchmark: Any, provider: str, collective: str, dtype: str) -> None:
    times = _results()[f"{provider}/{collective}/{dtype}"]
    replay(benchmark, times)
    add_stats(benchmark)
    esize = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    formula = (2 if collective == "all_reduce" else 1) * (WORLD - 1) * NUMEL * esize // WORLD
    emulated = provider == "torch_gloo" and collective == "reduce_scatter"
    benchmark.extra_info.update(
        subject="collectives", provider=provider, collective=collective, dtype=dtype,
        numel=NUMEL, world=WORLD, bytes_sent=2 * formula if emulated else formula,
        bytes_formula=formula)


def report_section(rows: list[dict[str, Any]]) -> str:
    """bench/REPORT.md's section for this file (called by bench/report.py)."""
    by = {(r["extra_info"]["provider"], r["extra_info"]["collective"], r["extra_info"]["dtype"]):
          r["extra_info"] for r in rows}
    lines = ["## ZeRO collectives on gloo (`bench_collectives.py`)", "",
             "One bucket per call, in place, W gloo ranks on this machine; the slower rank's time "
             "from a barrier to the end of the wait, providers interleaved. `torch_gloo` is "
             "torch's `reduce_scatter_single` / `all_gather_single` on gloo (a clone and an "
             "all-reduce of the whole bucket; a temporary and a copy) and `all_reduce`, `direct` is "
             "`fusedzero/direct.py` (point-to-point sends; ZeroAdamW on gloo ranks that cannot "
             "share memory), `shm` is `fusedzero/shm.py` (ZeroAdamW's default for gloo ranks on "
             "one host; bytes sent = bytes its peers read out of its memory).", "",
             "| collective | dtype | elements | W | provider | bytes sent per rank | "
             "median ms (p20 - p80) | / torch_gloo |", "|---|---|---|---|---|---|---|---|"]
    for (p, k, dt), x in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        ref = by.get(("torch_gloo", k, dt))
        ratio = (f"{x['time_median'] / ref['time_median']:.2f}"
                 if p != "torch_gloo" and ref else "")
        lines.append(f"| {k} | {dt} | {x['numel']} | {x['world']} | {p} | {x['bytes_sent']} | "
                     f"{1e3 * x['time_median']:.2f} ({1e3 * x['time_p20']:.2f} - "
                     f"{1e3 * x['time_p80']:.2f}) | {ratio} |")
    return "\n".join(lines) + "\n"

