"""The wire kernels (fusedzero/kernels/_quant.py) on one device: quantize a bucket and
dequantize-sum W chunks into a grad shard, per wire format; median time and GB/s of the bytes
each launch must move (read the input, write the packed bytes; read W packed chunks and the
shard, write the shard).

    python bench/gpu/wire_kernels.py OUT.json [--device cuda] [--numel 67108864] [--world 8]

CUDA: `triton.testing.do_bench` (CUDA events). CPU (`--device cpu`, the torch path): a smoke run
with perf_counter, not a figure to quote.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fusedzero.kernels._quant import (
    WireFormat,
    chunk_bytes,
    dequant_sum_into,
    new_packed,
    quantize_into,
)


def _time(fn, device: torch.device) -> float:
    """Median seconds of one call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--numel", type=int, default=1 << 26, help="bucket elements (fp32 grads)")
    ap.add_argument("--world", type=int, default=8)
    args = ap.parse_args()
    dev, W = torch.device(args.device), args.world
    S = args.numel // (W * 128) * 128
    x = torch.randn(W * S, device=dev)
    shard = torch.zeros(S, device=dev)
    rows = []
    for fmt in WireFormat:
        packed = new_packed(fmt, W, S, dev)
        moved_q = x.numel() * 4 + packed.numel()
        moved_d = packed.numel() + 2 * S * 4
        tq = _time(lambda packed=packed, fmt=fmt: quantize_into(x, packed, fmt, W, S), dev)
        td = _time(
            lambda packed=packed, fmt=fmt: dequant_sum_into(
                shard, packed, fmt, W, S, scale=1.0 / W, accumulate=True
            ),
            dev,
        )
        rows.append(
            {
                "wire": fmt.value,
                "world": W,
                "bucket_numel": W * S,
                "wire_bytes_per_rank": (W - 1) * chunk_bytes(fmt, S),
                "quantize_s": tq,
                "quantize_gbps": moved_q / tq / 1e9,
                "dequant_sum_s": td,
                "dequant_sum_gbps": moved_d / td / 1e9,
            }
        )
        print(
            f"{fmt.value}: quantize {tq * 1e6:.1f} us ({rows[-1]['quantize_gbps']:.0f} GB/s), "
            f"dequant-sum {td * 1e6:.1f} us ({rows[-1]['dequant_sum_gbps']:.0f} GB/s)"
        )
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
