"""The grouped AdamW kernel on one CUDA device, per memory mode and launch shape.

    python bench/gpu/update_modes.py OUT.json [BLOCKxWARPS,...]

64M elements per update (past any L2), planned once (`AdamWPlan`), timed with
triton.testing.do_bench (CUDA events, L2 flushed between reps), beside a device copy of 28 bytes
per element and torch.optim.AdamW(fused=True) on fp32. MemoryModes: the ZeRO mixed default (fp32
master, bf16 grad, bf16 out), fp32 throughout, and bf16-kahan master + int8 states with bf16
grads. Launch shapes other than the shipped one (kernels/_adamw.py BLOCK, NUM_WARPS) are set by
patching those module constants before the plan is built: a sweep, not a product setting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from fusedzero.kernels import QBLOCK, AdamWPlan, _adamw as A, bytes_per_param

N = 64 << 20
HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
MODES = {  # name: (master_mode, states, grad dtype, out dtype)
    "fp32-master bf16-grad bf16-out": ("fp32", "fp32", torch.bfloat16, torch.bfloat16),
    "fp32-master fp32-grad": ("fp32", "fp32", torch.float32, None),
    "bf16-kahan int8 bf16-grad": ("bf16-kahan", "int8", torch.bfloat16, None),
}


def _streams(
    master_mode: str, states: str, g_dt: torch.dtype, o_dt: torch.dtype | None, dev: torch.device
) -> tuple[tuple, dict]:
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(dt: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(N, generator=gen, device=dev) * scale).to(dt)

    if states == "fp32":
        out = None if o_dt is None else torch.empty(N, dtype=o_dt, device=dev)
        return (rand(), rand(g_dt), rand(scale=0.1), rand(scale=0.01).abs(), out), {}
    q = N // QBLOCK
    f32 = dict(dtype=torch.float32, device=dev)
    kw = dict(
        master_mode=master_mode,
        states=states,
        kahan=torch.zeros(N, dtype=torch.bfloat16, device=dev),
        exp_avg_scale=torch.full((q,), 1e-3, **f32),
        exp_avg_sq_scale=torch.full((q,), 1e-4, **f32),
    )
    codes = (
        torch.randint(-100, 100, (N,), dtype=torch.int8, device=dev),
        torch.randint(0, 200, (N,), dtype=torch.uint8, device=dev),
    )
    return (rand(torch.bfloat16), rand(g_dt), *codes, None), kw


def main(out: Path, shapes: list[tuple[int, int]]) -> None:
    dev = torch.device("cuda", 0)
    f32 = dict(dtype=torch.float32, device=dev)
    scalars = dict(
        lr=torch.full((1,), 1e-3, **f32),
        step=torch.full((1,), 5.0, **f32),
        grad_scale=torch.ones(1, **f32),
        skip=torch.zeros(1, **f32),
    )
    src = torch.empty(N * 14, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = (
        do_bench(lambda dst=dst, src=src: dst.copy_(src), warmup=25, rep=300) / 1e3
    )  # 28 B/element moved
    del src, dst
    p = torch.nn.Parameter(torch.randn(N, **f32))
    p.grad = torch.randn(N, **f32)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    torch_s = do_bench(opt.step, warmup=25, rep=300) / 1e3
    del p, opt
    shipped = (A.BLOCK, A.NUM_WARPS)
    rows = []
    for name, (mm, st, g_dt, o_dt) in MODES.items():
        streams, kw = _streams(mm, st, g_dt, o_dt, dev)
        bpp = bytes_per_param(mm, st, g_dt, o_dt)
        for block, warps in [shipped] + [s for s in shapes if s != shipped]:
            A.BLOCK, A.NUM_WARPS = block, warps
            plan = AdamWPlan(*streams, **HP, **kw)
            plan(**scalars)
            t = do_bench(lambda: plan(**scalars), warmup=25, rep=300) / 1e3  # noqa: B023
            rows.append(
                {
                    "mode": name,
                    "block": block,
                    "warps": warps,
                    "shipped": (block, warps) == shipped,
                    "seconds": t,
                    "bytes_per_param": bpp,
                    "gbps": N * bpp / t / 1e9,
                }
            )
        A.BLOCK, A.NUM_WARPS = shipped
        del streams, kw
    out.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(dev),
                "torch": torch.__version__,
                "numel": N,
                "copy_28B_seconds": copy_s,
                "copy_gbps": N * 28 / copy_s / 1e9,
                "torch_fused_fp32_seconds": torch_s,
                "torch_fused_gbps": N * 28 / torch_s / 1e9,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    extra = sys.argv[2].split(",") if len(sys.argv) > 2 else []
    main(Path(sys.argv[1]), [tuple(int(v) for v in s.split("x")) for s in extra])  # type: ignore[misc]
