"""How to build a stage-2/3 grad bucket from a backward's grads on the device, timed apart:

    python bench/gpu/bucket_gather.py OUT.json [--cpu]

The grads of the Llama shape's blocks (fusedzero.app.model.PRESETS["llama-254m"], bf16) go into
one fp32 bucket per block, as ZeroAdamW's reduce-dtype buckets: per-grad `copy_` into bucket
views (one kernel each), one `torch.cat(out=)` of mixed dtypes, `torch.cat` in bf16 then one
cast, and `torch._foreach_copy_` into the views. Device time by CUDA events (host time on CPU),
median of REPS, and the bytes a copy must move (bf16 read + fp32 write) over that time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fusedzero.app.model import PRESETS

REPS = 20


def _grads(dev: torch.device) -> list[torch.Tensor]:
    c = PRESETS["llama-254m"]
    d, h, kv, ff = c["n_embd"], c["n_head"], c["n_kv_head"], c["mlp_hidden"]
    hd = d // h
    shapes = [(d,), (d, d), (kv * hd, d), (kv * hd, d), (d, d), (d,), (ff, d), (ff, d), (d, ff)]
    return [torch.randn(s, dtype=torch.bfloat16, device=dev) for s in shapes]


def _time(fn: Callable[[], None], dev: torch.device) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(REPS):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    grads = _grads(dev)
    n = sum(g.numel() for g in grads)
    bucket = torch.empty(n, dtype=torch.float32, device=dev)
    views, off = [], 0
    for g in grads:
        views.append(bucket[off : off + g.numel()])
        off += g.numel()
    flat = [g.reshape(-1) for g in grads]

    def per_copy() -> None:
        for v, g in zip(views, flat):
            v.copy_(g)

    def cat_mixed() -> None:
        torch.cat(flat, out=bucket)

    def cat_then_cast() -> None:
        bucket.copy_(torch.cat(flat))

    def foreach() -> None:
        torch._foreach_copy_(views, flat)

    rows = []
    ref = None
    for name, fn in (
        ("copy_ per grad", per_copy),
        ("cat(out=fp32)", cat_mixed),
        ("cat bf16, then cast", cat_then_cast),
        ("_foreach_copy_", foreach),
    ):
        bucket.zero_()
        s = _time(fn, dev)
        ref = bucket.clone() if ref is None else ref
        rows.append(
            {
                "method": name,
                "seconds": s,
                "GB_per_s": n * 6 / s / 1e9,
                "same_values": bool(torch.equal(bucket, ref)),
            }
        )
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "elements": n,
        "grads": len(grads),
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
