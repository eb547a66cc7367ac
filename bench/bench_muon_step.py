"""Host time of `step()`: ZeroMuon against ZeroAdamW on 2 gloo ranks, per stage, side by side.

Both optimizers train the same GPT (`fusedzero.app.model`, the default `fusedzero train` shape:
2 layers x 128, 8 hidden matrices) from the same seed in the same ranks: ZeroAdamW on every
param (`gpt_param_groups`), ZeroMuon with the hidden matrices in a Muon group and the rest in
AdamW groups (`gpt_muon_param_groups`, as `fusedzero train --optimizer muon`). At stage 0 every
rank runs Newton-Schulz on every matrix; at stages 1-2 the owner layout puts each matrix whole on
one rank, which runs it alone (fusedzero/_owner_layout.py).

Each round runs every provider once (starting from a different one each round, as bench_step.py),
forward and backward untimed, then times `step()` on each rank from a barrier to its end; a
round's time is the slower rank's. On CPU this is the step's wall time: the update, the stage's
reduce-scatter / all-gather (stages 1-2) and, for Muon, the bf16 Newton-Schulz iterations (which
dominate here: a CPU without bf16 GEMMs). Reported: median and p20/p80 per step, and the median
per param element and per param tensor.

Env: FUSEDZERO_BENCH_MUON_ROUNDS (timed rounds, 20), FUSEDZERO_BENCH_MUON_STAGES (0,1,2),
FUSEDZERO_BENCH_MUON_MODEL (n_layer,n_embd,n_head,block_size: 2,128,4,128),
FUSEDZERO_BENCH_MUON_THREADS (torch threads per rank, 1: two ranks share a 2-core machine).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import pytest
import torch

from fusedzero.testing import run_ranks

from _common import SUMMARY, add_stats, percentiles, replay

ROUNDS = int(os.environ.get("FUSEDZERO_BENCH_MUON_ROUNDS", "20"))
WARMUP = 2  # the first step builds once-only state (moments, momentum, Newton-Schulz buffers)
STAGES = [int(s) for s in os.environ.get("FUSEDZERO_BENCH_MUON_STAGES", "0,1,2").split(",")]
MODEL = [int(x) for x in os.environ.get("FUSEDZERO_BENCH_MUON_MODEL", "2,128,4,128").split(",")]
THREADS = int(os.environ.get("FUSEDZERO_BENCH_MUON_THREADS", "1"))
WORLD = 2
BATCH = 4  # sequences per rank: forward and backward are untimed, kept short
PROVIDERS = [f"{opt}-s{s}" for s in STAGES for opt in ("adamw", "muon")]


def _build(provider: str) -> tuple[Any, Any, Any]:
    """(model, optimizer, batch) for `provider`, the same model on every rank and provider."""
    from fusedzero import ZeroAdamW, ZeroMuon
    from fusedzero.app.model import GPT, GPTConfig, gpt_muon_param_groups, gpt_param_groups

    n_layer, n_embd, n_head, block = MODEL
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block))
    opt_name, stage = provider.split("-s")
    opt: Any
    if opt_name == "muon":
        groups = gpt_muon_param_groups(model, 0.1, muon_lr=0.05, lr=3e-3, betas=(0.9, 0.95))
        opt = ZeroMuon(groups, stage=int(stage), module=model, max_grad_norm=1.0)
    else:
        opt = ZeroAdamW(
            gpt_param_groups(model, 0.1),
            lr=3e-3,
            betas=(0.9, 0.95),
            stage=int(stage),
            module=model,
            max_grad_norm=1.0,
        )
    x = torch.randint(0, 256, (BATCH, block), generator=torch.Generator().manual_seed(1))
    return model, opt, x


def _rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(THREADS)
    built = {p: _build(p) for p in PROVIDERS}
    times: dict[str, list[float]] = {p: [] for p in PROVIDERS}
    for r in range(WARMUP + ROUNDS):
        k = r % len(PROVIDERS)
        for p in PROVIDERS[k:] + PROVIDERS[:k]:
            model, opt, x = built[p]
            model(x, x)[1].backward()
            dist.barrier()
            t = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t
            opt.zero_grad()
            if r >= WARMUP:
                times[p].append(dt)
    params = {
        p: (sum(q.numel() for q in m.parameters()), len(list(m.parameters())))
        for p, (m, _, _) in built.items()
    }
    for _, opt, _ in built.values():
        opt.close()
    return {"times": times, "params": params}


_RESULT: dict[str, Any] = {}


def _measure() -> dict[str, Any]:
    if not _RESULT:
        ranks = run_ranks(_rank, WORLD, timeout=1800)
        slower = {
            p: [max(ts) for ts in zip(*(r["times"][p] for r in ranks), strict=True)]
            for p in PROVIDERS
        }
        _RESULT.update(times=slower, params=ranks[0]["params"], load=os.getloadavg()[0])
    return _RESULT


@pytest.mark.parametrize("provider", PROVIDERS)
def test_muon_step_against_adamw(benchmark: Any, provider: str) -> None:
    res = _measure()
    times = res["times"][provider]
    numel, tensors = res["params"][provider]
    benchmark.group = f"step() host time, W={WORLD} gloo, GPT {MODEL}, cpu"
    replay(benchmark, times)
    add_stats(benchmark)
    med = statistics.median(times)
    opt_name, stage = provider.split("-s")
    benchmark.extra_info.update(
        {
            "subject": "muon_step",
            "provider": provider,
            "stage": int(stage),
            "world": WORLD,
            "model": MODEL,
            "threads": THREADS,
            "params": numel,
            "param_tensors": tensors,
            "ns_per_param": med / numel * 1e9,
            "us_per_param_tensor": med / tensors * 1e6,
            "loadavg_1min": res["load"],
            **{f"step_{k}": v for k, v in percentiles(times).items()},
        }
    )
    if opt_name == "muon":
        adamw = statistics.median(res["times"][f"adamw-s{stage}"])
        SUMMARY.append(
            f"stage {stage}, W={WORLD}: step() ZeroMuon {med * 1e3:.1f} ms "
            f"({med / numel * 1e9:.0f} ns/param, {med / tensors * 1e6:.0f} us/tensor) vs "
            f"ZeroAdamW {adamw * 1e3:.1f} ms ({adamw / numel * 1e9:.0f} ns/param, "
            f"{adamw / tensors * 1e6:.0f} us/tensor); {numel} params in {tensors} tensors"
        )
