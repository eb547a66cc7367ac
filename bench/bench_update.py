"""The AdamW update over one flat shard: fusedzero's `AdamWPlan` (built once) vs torch.optim.AdamW.

Providers (one flat tensor of N elements each; the torch optimizers get one nn.Parameter):
  fusedzero        AdamWPlan, fp32 master + fp32 grad, no output copy
  fusedzero_bf16   AdamWPlan, fp32 master + bf16 grad + bf16 output (the ZeRO mixed setup)
  torch_fused      torch.optim.AdamW(fused=True)
  torch_foreach    torch.optim.AdamW(foreach=True)
On CPU fusedzero runs its torch path; on CUDA (when present) its Triton kernel.

GB/s is reported two ways, per provider, in extra_info:
  gbps_min   bytes the update must touch given its dtypes / median time ("effective bandwidth");
  gbps_impl  bytes this implementation's passes actually move / median time.
The byte counts per parameter are derived below from each code path. Beside them, in the same
rounds, a plain device copy (`dst.copy_(src)`) of the same bytes (read + write of 28 B/param
in all): `copy_gbps` is what this device delivers to a streaming op, and `pct_of_copy` =
gbps_min / copy_gbps the fraction of it the update achieves (fusedzero/_bandwidth.py, the same
measurement `fusedzero doctor` makes).

Timing (fusedzero/_bandwidth.py `time_ops`), providers and the copy round-robin in one run:
  CPU   one call per provider per round, time.perf_counter, rounds sized to
        FUSEDZERO_BENCH_UPDATE_SECONDS per provider (sizes 1M, 4M, 16M elements);
  CUDA  per round and provider `triton.testing.do_bench` (CUDA events around each rep, the L2
        cache flushed before each rep), every rep recorded; sizes from 64M elements up (H100's L2
        is 50 MB; 64M elements are 1.8 GB of update traffic). A size whose buffers (about 100
        B/param for the four providers and the copy) would not fit in half the free memory is
        skipped with the numbers.

Env: FUSEDZERO_BENCH_UPDATE_SIZES (CPU element counts, comma list, default 1M,4M,16M),
FUSEDZERO_BENCH_UPDATE_CUDA_SIZES (default 64M,128M,256M), FUSEDZERO_BENCH_UPDATE_SECONDS
(CPU: target seconds of timed rounds per provider, default 1.0), FUSEDZERO_BENCH_UPDATE_ROUNDS
(CUDA: do_bench rounds per provider, default 3).

The per-rep times are replayed into pytest-benchmark, so its table compares medians taken under
the same conditions.
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

from fusedzero import _bandwidth as bandwidth
from fusedzero.kernels import AdamWPlan, backend, use_triton

from _common import SUMMARY, add_stats, replay


def _sizes(var: str, default: str) -> list[int]:
    return [int(x) for x in os.environ.get(var, default).split(",")]


SIZES = {
    "cpu": _sizes("FUSEDZERO_BENCH_UPDATE_SIZES", f"{1 << 20},{4 << 20},{16 << 20}"),
    "cuda": _sizes("FUSEDZERO_BENCH_UPDATE_CUDA_SIZES", f"{64 << 20},{128 << 20},{256 << 20}"),
}
SECONDS = float(os.environ.get("FUSEDZERO_BENCH_UPDATE_SECONDS", "1.0"))
CUDA_ROUNDS = int(os.environ.get("FUSEDZERO_BENCH_UPDATE_ROUNDS", "3"))
CASES = [(device, n) for device, sizes in SIZES.items() for n in sizes]
# Resident bytes per element while one size is measured on CUDA: each provider's p, g, m, v (16),
# foreach's temporaries (~8 more), the copy's 14 + 14.
CUDA_BYTES_PER_ELEMENT = 4 * 16 + 8 + 28
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2


class Bytes(NamedTuple):
    """Bytes per parameter per update: what the math must touch, and what the code path moves."""

    min: int
    impl: int
    note: str


# What the math must touch (fusedzero/_bandwidth.py): fp32 update, read p, g, m, v (16), write p, m,
# v (12); the ZeRO mixed setup reads a bf16 grad (2) and writes a bf16 copy (2) too.
FP32 = bandwidth.update_bytes_per_param(torch.float32, None)
MIXED = bandwidth.update_bytes_per_param(torch.bfloat16, torch.bfloat16)
# The copy beside the providers moves the bytes of the fp32 update (MIXED is the same 28).
COPY_BYTES_PER_PARAM = FP32


def _bytes(provider: str, device: str) -> Bytes:
    if provider == "torch_fused":
        return Bytes(FP32, FP32, "one pass: read p,g,m,v; write p,m,v")
    if provider == "torch_foreach":
        # torch 2.13 _multi_tensor_adam, non-capturable: mul_(p) 8, lerp_(m,g) 12, mul_(v) 8,
        # addcmul_(v,g,g) 12, sqrt(v)->d 8, div_(d) 8, add_(d,eps) 8, addcdiv_(p,m,d) 16.
        return Bytes(
            FP32, 80, "8 foreach passes (mul, lerp, mul, addcmul, sqrt, div, add, addcdiv)"
        )
    if provider == "fusedzero":
        if device == "cuda":
            return Bytes(FP32, FP32, "Triton kernel, one pass")
        # torch._fused_adamw_ with grad_scale writes the unscaled grad back: +4.
        return Bytes(
            FP32, FP32 + 4, "torch fused kernel with grad_scale: the grad is written back (+4)"
        )
    if provider == "fusedzero_bf16":
        if device == "cuda":
            return Bytes(MIXED, MIXED, "Triton kernel, one pass")
        # CPU path: g.float() (r2 w4), fused kernel with grad write-back (r16 w16),
        # out.copy_(p) (r4 w2).
        return Bytes(
            MIXED,
            44,
            "bf16->fp32 grad cast pass + fused pass (+grad write-back) + bf16 output copy pass",
        )
    raise KeyError(provider)


def _make(provider: str, n: int, device: str) -> Callable[[], None]:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(n, generator=gen).to(device=device, dtype=dtype)

    if provider.startswith("torch_"):
        p = nn.Parameter(rand())
        p.grad = rand()
        kind = provider.removeprefix("torch_")
        opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})
        return opt.step

    bf16 = provider == "fusedzero_bf16"
    master, m, v = rand(), torch.zeros(n, device=device), torch.zeros(n, device=device)
    grad = rand(torch.bfloat16 if bf16 else torch.float32)
    out = torch.empty(n, dtype=torch.bfloat16, device=device) if bf16 else None
    f32 = dict(dtype=torch.float32, device=device)
    lr, step = torch.full((1,), LR, **f32), torch.zeros(1, **f32)
    scale, skip = torch.ones(1, **f32), torch.zeros(1, **f32)

    # Planned once, as the optimizer does: the timed call is the row update and the launch.
    plan = AdamWPlan(
        master, grad, m, v, out, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD
    )

    def run() -> None:
        step.add_(1)  # the optimizers count steps too
        plan(lr=lr, step=step, grad_scale=scale, skip=skip)

    return run


PROVIDERS = ["fusedzero", "fusedzero_bf16", "torch_fused", "torch_foreach"]


def cuda_skip_reason(n: int) -> str:
    """Why the CUDA rows of size `n` cannot run here ('' when they can)."""
    if not torch.cuda.is_available():
        return (
            "no CUDA device here (torch.cuda.is_available() is False): the Triton kernel's "
            "speed is measured only on a GPU machine"
        )
    free, _ = torch.cuda.mem_get_info()
    need = CUDA_BYTES_PER_ELEMENT * n
    if need > free // 2:
        return (
            f"{n} elements need ~{need / 2**30:.1f} GiB ({CUDA_BYTES_PER_ELEMENT} B/element "
            f"for the providers and the copy), more than half the {free / 2**30:.1f} GiB "
            "free; lower FUSEDZERO_BENCH_UPDATE_CUDA_SIZES"
        )
    return ""


def _rounds(fns: dict[str, Callable[[], None]], device: str) -> int:
    """CPU: enough rounds for about SECONDS of timed calls per provider (30 to 300); CUDA:
    CUDA_ROUNDS, each of do_bench's ~100 ms of reps per provider."""
    if device == "cuda":
        return CUDA_ROUNDS
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    per_round = time.perf_counter() - t0
    return max(30, min(300, int(SECONDS * len(fns) / max(per_round, 1e-6))))


def _measure(device: str, n: int) -> dict[str, list[float]]:
    """Time every provider and the copy at one size, round-robin (fusedzero._bandwidth), so load
    from other processes and clock drift hit all of them alike."""
    key = (device, n)
    if key in _TIMES:
        return _TIMES[key]
    # The buffers live only in this call: one size's buffers at a time (CUDA's largest need it).
    fns = {p: _make(p, n, device) for p in PROVIDERS}
    for fn in fns.values():
        for _ in range(3):  # first step allocates torch's state; page the buffers in
            fn()
    if device == "cuda":
        torch.cuda.synchronize()
    _TIMES[key] = bandwidth.time_with_copy(
        fns, COPY_BYTES_PER_PARAM * n, torch.device(device), rounds=_rounds(fns, device)
    )
    return _TIMES[key]


_TIMES: dict[tuple[str, int], dict[str, list[float]]] = {}


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    "device,n", CASES, ids=lambda x: x if isinstance(x, str) else f"{x / (1 << 20):g}M"
)
def test_update(benchmark, device: str, provider: str, n: int) -> None:
    if device == "cuda" and (why := cuda_skip_reason(n)):
        pytest.skip(why)
    load = os.getloadavg()[0]
    times = _measure(device, n)
    benchmark.group = f"update {device} {n / (1 << 20):g}M"
    replay(benchmark, times[provider])
    add_stats(benchmark)
    b = _bytes(provider, device)
    med = benchmark.extra_info["time_median"]
    ours_path = (
        ("triton" if use_triton(torch.device(device)) else "torch")
        if provider.startswith("fusedzero")
        else "torch"
    )
    ref, ours = statistics.median(times["torch_fused"]), statistics.median(times["fusedzero"])
    copy_gbps = bandwidth.copy_gbps(times[bandwidth.COPY], COPY_BYTES_PER_PARAM * n)
    gbps_min = bandwidth.gbps(b.min * n, med)
    benchmark.extra_info.update(
        {
            "subject": "update",
            "device": device,
            "provider": provider,
            "numel": n,
            "path": ours_path,
            "fusedzero_backend": backend(),
            "timing": bandwidth.timing_method(torch.device(device)),
            "threads": torch.get_num_threads(),
            "loadavg_1min": load,
            "bytes_per_param_min": b.min,
            "bytes_per_param_impl": b.impl,
            "bytes_note": b.note,
            "gbps_min": gbps_min,
            "gbps_impl": bandwidth.gbps(b.impl * n, med),
            "copy_gbps": copy_gbps,
            "pct_of_copy": 100 * gbps_min / copy_gbps,
            "ratio_vs_torch_fused": med / ref,
        }
    )
    if provider == "fusedzero":
        ratio = ours / ref
        verdict = "within" if ratio <= 1.1 else "NOT within"
        SUMMARY.append(
            f"update {device} n={n}: fusedzero fp32 {ours * 1e3:.2f} ms vs torch "
            f"fused {ref * 1e3:.2f} ms (medians, interleaved) -> ratio {ratio:.3f} "
            f"({verdict} 1.1x); {gbps_min:.1f} GB/s = {100 * gbps_min / copy_gbps:.0f}"
            f"% of a device copy ({copy_gbps:.1f} GB/s)"
        )
