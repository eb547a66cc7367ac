"""Host time of one `step()` at stage 3 on CPU: fusedzero vs torch.optim.AdamW(fused=True).

The model is a GPT of 32 blocks at a small width (n_embd 8, 58k params), so every update is tiny
and the step is host-bound: what is timed is the Python and launch overhead around the update
(66 flat buffers at stage 3: 2 param groups x 32 units + the rest), not the update's arithmetic.

Providers (the same params, the same two groups: decay / no decay):
  fusedzero_stage3  ZeroAdamW(stage=3, module=model), 1 rank, no process group, torch path
  torch_fused       torch.optim.AdamW(fused=True) on a plain copy of the model
Each round: grads are written outside the timed region (a backward for fusedzero; random `.grad`
for torch), then `step()` alone is timed. Providers are timed round-robin, as in bench_update.py.

Env: FUSEDZERO_BENCH_HOST_LAYERS (default 32), FUSEDZERO_BENCH_HOST_ROUNDS (default 200),
FUSEDZERO_BENCH_HOST_THREADS (torch threads, default 1: on a shared 2-core machine two OpenMP
threads spin-wait on each other when one is descheduled, which swamps a host-time measurement).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import pytest
import torch

from fusedzero import ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups

from _common import SUMMARY, add_stats, replay

LAYERS = int(os.environ.get("FUSEDZERO_BENCH_HOST_LAYERS", "32"))
ROUNDS = int(os.environ.get("FUSEDZERO_BENCH_HOST_ROUNDS", "200"))
THREADS = int(os.environ.get("FUSEDZERO_BENCH_HOST_THREADS", "1"))
PROVIDERS = ["fusedzero_stage3", "torch_fused"]


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=LAYERS, n_embd=8, n_head=2, block_size=16, vocab_size=64))


def _make(provider: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(prepare, step): prepare writes this round's grads, step is what is timed."""
    model = _model()
    if provider == "torch_fused":
        opt = torch.optim.AdamW(gpt_param_groups(model, 0.1), lr=1e-3, fused=True)
        params = [p for p in model.parameters() if p.requires_grad]

        def prepare() -> None:
            for p in params:
                p.grad = torch.randn_like(p)

        return prepare, opt.step
    zopt = ZeroAdamW(gpt_param_groups(model, 0.1), lr=1e-3, stage=3, module=model)
    x = torch.randint(0, 64, (2, 16))

    def prepare_z() -> None:
        model(x, x)[1].backward()

    return prepare_z, zopt.step


def _measure() -> dict[str, list[float]]:
    if _TIMES:
        return _TIMES
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _rounds()
    finally:
        torch.set_num_threads(threads)


def _rounds() -> dict[str, list[float]]:
    fns = {p: _make(p) for p in PROVIDERS}
    for prepare, step in fns.values():
        for _ in range(3):
            prepare()
            step()
    times: dict[str, list[float]] = {p: [] for p in PROVIDERS}
    for r in range(ROUNDS):
        for p in PROVIDERS[r % 2 :] + PROVIDERS[: r % 2]:
            prepare, step = fns[p]
            prepare()
            t = time.perf_counter()
            step()
            times[p].append(time.perf_counter() - t)
    _TIMES.update(times)
    return times


_TIMES: dict[str, list[float]] = {}


@pytest.mark.parametrize("provider", PROVIDERS)
def test_step_host_time(benchmark, provider: str) -> None:
    load = os.getloadavg()[0]
    times = _measure()
    benchmark.group = f"step host time, stage 3, GPT {LAYERS} blocks, cpu"
    replay(benchmark, times[provider])
    add_stats(benchmark)
    ours = statistics.median(times["fusedzero_stage3"])
    ref = statistics.median(times["torch_fused"])
    benchmark.extra_info.update(
        {
            "subject": "host",
            "device": "cpu",
            "provider": provider,
            "layers": LAYERS,
            "threads": THREADS,
            "loadavg_1min": load,
            "ratio_vs_torch_fused": statistics.median(times[provider]) / ref,
        }
    )
    if provider == "fusedzero_stage3":
        SUMMARY.append(
            f"step host time stage 3, {LAYERS} blocks: fusedzero {ours * 1e3:.2f} ms vs "
            f"torch fused {ref * 1e3:.2f} ms (medians, interleaved)"
        )
