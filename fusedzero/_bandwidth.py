"""Bytes, timing and bandwidth of a memory-bound op, beside a plain device copy of the same bytes.

One measuring method for `fusedzero doctor` and `bench/bench_update.py`, so the two report the
same thing. An update that moves B bytes (reads + writes) is compared with a copy of B/2 bytes:
the copy reads B/2 and writes B/2, the same B bytes in the same read/write mix as well as one
stream can have it, so `op GB/s / copy GB/s` is the fraction of the bandwidth this device
actually delivers (not of a datasheet number).

Timing. CUDA: `triton.testing.do_bench` with every rep bracketed by CUDA events and the L2 cache
flushed before each rep (do_bench zeroes a 256 MB buffer between reps), so a buffer that fits in
L2 (50 MB on H100) is not served from it. CPU: `time.perf_counter` around each call, after one
warm-up call (which also faults the pages in); a CPU op runs synchronously.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from fusedzero.kernels import bytes_per_param


def update_bytes_per_param(grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> int:
    """Bytes the fused AdamW update must move per parameter in the default memory modes (28 B
    with bf16 grad and bf16 out, or with fp32 grad and no out): the kernel's own count
    (`fusedzero.kernels.bytes_per_param`, stream by stream)."""
    return int(bytes_per_param("fp32", "fp32", grad_dtype, out_dtype))


def timing_method(device: torch.device) -> str:
    """How `time_ops` times on `device` (reports say which)."""
    if device.type == "cuda":
        return "CUDA events, L2 flushed between reps (triton.testing.do_bench)"
    return "time.perf_counter per call"


def time_ops(
    fns: dict[str, Callable[[], object]], device: torch.device, *, rounds: int, rep_ms: int = 100
) -> dict[str, list[float]]:
    """Seconds per call of each op, timed round-robin: round r times every op once, starting
    from a different one each round, so drift and load from other processes hit all alike.

    CUDA: per round and op, do_bench's timed reps (about `rep_ms` of them, after its warm-up),
    every one of them. CPU: one warm-up call of each op (it also faults the pages in), then one
    timed call per round.
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    if device.type == "cuda":
        import triton.testing  # only here: the CPU path needs no Triton

        with torch.cuda.device(device):  # do_bench's events and cache live on the current device
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    ms = triton.testing.do_bench(
                        fns[name], warmup=25, rep=rep_ms, return_mode="all"
                    )
                    times[name] += [t / 1e3 for t in ms]
        return times
    for fn in fns.values():
        fn()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return times


def copy_op(nbytes: int, device: torch.device) -> Callable[[], object]:
    """`dst.copy_(src)` over nbytes // 2 bytes each way: it moves `nbytes` in all."""
    half = nbytes // 2
    # Filled, not zeros: a zeroed CPU buffer can be lazily mapped to one shared zero page, whose
    # reads never leave the cache.
    src = torch.empty(half, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(half, dtype=torch.uint8, device=device)
    return lambda: dst.copy_(src)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


COPY = "copy"


def time_with_copy(
    fns: dict[str, Callable[[], object]],
    nbytes: int,
    device: torch.device,
    *,
    rounds: int,
    rep_ms: int = 100,
) -> dict[str, list[float]]:
    """`time_ops` of `fns` plus, under the key COPY, a device copy moving `nbytes` (the bytes
    the ops must move), in the same rounds."""
    if COPY in fns:
        raise ValueError(f"{COPY!r} is the copy's key; rename that op")
    return time_ops({**fns, COPY: copy_op(nbytes, device)}, device, rounds=rounds, rep_ms=rep_ms)


def copy_gbps(copy_times: list[float], nbytes: int) -> float:
    """Median GB/s of the copy `time_with_copy(..., nbytes, ...)` timed."""
    return gbps(copy_bytes(nbytes), statistics.median(copy_times))


def copy_bytes(nbytes: int) -> int:
    """Bytes `copy_op(nbytes)` moves: read + write of nbytes // 2 each."""
    return 2 * (nbytes // 2)
