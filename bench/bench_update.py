"""The AdamW update over one flat shard: fusedzero's `adamw_step` vs torch.optim.AdamW.

Providers (one flat tensor of N elements each; the torch optimizers get one nn.Parameter):
  fusedzero        adamw_step, fp32 master + fp32 grad, no output copy
  fusedzero_bf16   adamw_step, fp32 master + bf16 grad + bf16 output (the ZeRO mixed setup)
  torch_fused      torch.optim.AdamW(fused=True)
  torch_foreach    torch.optim.AdamW(foreach=True)
On CPU fusedzero runs its torch path; on CUDA (when present) its Triton kernel.

GB/s is reported two ways, per provider, in extra_info:
  gbps_min   bytes the update must touch given its dtypes / median time ("effective bandwidth");
  gbps_impl  bytes this implementation's passes actually move / median time.
The byte counts per parameter are derived below from each code path.

Env: FUSEDZERO_BENCH_UPDATE_SIZES (comma list of element counts, default 1M,4M,16M),
FUSEDZERO_BENCH_UPDATE_SECONDS (target seconds of timed rounds per provider, default 1.0).

Providers are timed round-robin at each size (see `_measure`) and the per-round times are
replayed into pytest-benchmark, so its table compares medians taken under the same load.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import nn

from _common import SUMMARY, add_stats, replay
from fusedzero.kernels import adamw_step, backend, use_triton

SIZES = [int(s) for s in os.environ.get("FUSEDZERO_BENCH_UPDATE_SIZES",
                                       f"{1 << 20},{4 << 20},{16 << 20}").split(",")]
SECONDS = float(os.environ.get("FUSEDZERO_BENCH_UPDATE_SECONDS", "1.0"))
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
DEVICES = ["cpu", "cuda"]


class Bytes(NamedTuple):
    """Bytes per parameter per update: what the math must touch, and what the code path moves."""

    min: int
    impl: int
    note: str


def _bytes(provider: str, device: str) -> Bytes:
    # fp32 update: read p, g, m, v (16), write p, m, v (12).
    if provider in ("torch_fused", "fusedzero_fp32_triton"):
        return Bytes(28, 28, "one pass: read p,g,m,v; write p,m,v")
    if provider == "torch_foreach":
        # torch 2.13 _multi_tensor_adam, non-capturable: mul_(p) 8, lerp_(m,g) 12, mul_(v) 8,
        # addcmul_(v,g,g) 12, sqrt(v)->d 8, div_(d) 8, add_(d,eps) 8, addcdiv_(p,m,d) 16.
        return Bytes(28, 80, "8 foreach passes (mul, lerp, mul, addcmul, sqrt, div, add, addcdiv)")
    if provider == "fusedzero":
        if device == "cuda":
            return Bytes(28, 28, "Triton kernel, one pass")
        # torch._fused_adamw_ with grad_scale writes the unscaled grad back: +4.
        return Bytes(28, 32, "torch fused kernel with grad_scale: the grad is written back (+4)")
    if provider == "fusedzero_bf16":
        # read p4 g2 m4 v4, write p4 m4 v4 out2.
        if device == "cuda":
            return Bytes(28, 28, "Triton kernel, one pass")
        # CPU path: g.float() (r2 w4), fused kernel with grad write-back (r16 w16),
        # out.copy_(p) (r4 w2).
        return Bytes(28, 44, "bf16->fp32 grad cast pass + fused pass (+grad write-back) "
                             "+ bf16 output copy pass")
    raise KeyError(provider)


def _make(provider: str, n: int, device: str) -> Callable[[], None]:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(n, generator=gen).to(device=device, dtype=dtype)

    if provider.startswith("torch_"):
        p = nn.Parameter(rand())
        p.grad = rand()
        kind = provider.removeprefix("torch_")
        opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                **{kind: True})
        return opt.step

    bf16 = provider == "fusedzero_bf16"
    master, m, v = rand(), torch.zeros(n, device=device), torch.zeros(n, device=device)
    grad = rand(torch.bfloat16 if bf16 else torch.float32)
    out = torch.empty(n, dtype=torch.bfloat16, device=device) if bf16 else None
    f32 = dict(dtype=torch.float32, device=device)
    lr, step = torch.full((1,), LR, **f32), torch.zeros(1, **f32)
    scale, skip = torch.ones(1, **f32), torch.zeros(1, **f32)

    def run() -> None:
        step.add_(1)  # the optimizers count steps too
        adamw_step(master, grad, m, v, out, lr=lr, step=step, grad_scale=scale, skip=skip,
                   beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)
    return run


PROVIDERS = ["fusedzero", "fusedzero_bf16", "torch_fused", "torch_foreach"]


def _measure(device: str, n: int) -> dict[str, list[float]]:
    """Time every provider at one size, round-robin: round r times each provider once, starting
    from a different one each round, so load from other processes hits all of them alike."""
    key = (device, n)
    if key in _TIMES:
        return _TIMES[key]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fns = {p: _make(p, n, device) for p in PROVIDERS}
    for fn in fns.values():
        for _ in range(3):  # first step allocates torch's state; page the buffers in
            fn()
    sync()
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    sync()
    per_round = time.perf_counter() - t0
    rounds = max(30, min(300, int(SECONDS * len(fns) / max(per_round, 1e-6))))
    times: dict[str, list[float]] = {p: [] for p in PROVIDERS}
    for r in range(rounds):
        order = PROVIDERS[r % len(PROVIDERS):] + PROVIDERS[:r % len(PROVIDERS)]
        for p in order:
            t = time.perf_counter()
            fns[p]()
            sync()
            times[p].append(time.perf_counter() - t)
    _TIMES[key] = times
    return times


_TIMES: dict[tuple[str, int], dict[str, list[float]]] = {}


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n / (1 << 20):g}M")
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("device", DEVICES)
def test_update(benchmark, device: str, provider: str, n: int) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here (torch.cuda.is_available() is False): the Triton "
                    "kernel's speed is measured only on a GPU machine")
    load = os.getloadavg()[0]
    times = _measure(device, n)
    benchmark.group = f"update {device} {n / (1 << 20):g}M"
    replay(benchmark, times[provider])
    add_stats(benchmark)
    b = _bytes(provider, device)
    med = benchmark.extra_info["time_median"]
    ours_path = ("triton" if use_triton(torch.device(device)) else "torch") \
        if provider.startswith("fusedzero") else "torch"
    ref, ours = statistics.median(times["torch_fused"]), statistics.median(times["fusedzero"])
    benchmark.extra_info.update({
        "subject": "update", "device": device, "provider": provider, "numel": n,
        "path": ours_path, "fusedzero_backend": backend(),
        "threads": torch.get_num_threads(), "loadavg_1min": load,
        "bytes_per_param_min": b.min, "bytes_per_param_impl": b.impl, "bytes_note": b.note,
        "gbps_min": b.min * n / med / 1e9, "gbps_impl": b.impl * n / med / 1e9,
        "ratio_vs_torch_fused": med / ref,
    })
    if provider == "fusedzero":
        ratio = ours / ref
        verdict = "within" if ratio <= 1.1 else "NOT within"
        SUMMARY.append(f"update {device} n={n}: fusedzero fp32 {ours * 1e3:.2f} ms vs torch "
                       f"fused {ref * 1e3:.2f} ms (medians, interleaved) -> ratio {ratio:.3f} "
                       f"({verdict} 1.1x)")
