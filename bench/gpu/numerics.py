"""Where fp32 parity on a GPU can be lost, measured apart (bench/gpu/multi.py's parity needs it):

    python bench/gpu/numerics.py OUT.json [--cpu]

- update: 5 AdamW steps of 1M fp32 params whose grads span six decades, by torch's three
  implementations (for-loop, foreach, fused) and ours (the compiled kernel through AdamWPlan),
  each against the same steps in float64: the worst |x - x64| / max(|x64|, 1e-3), and how many
  elements are past 1e-6 of that;
- determinism: the bench GPT's forward + backward run twice on the same params and batch, with
  torch's default attention kernels and with the math kernel alone: are the grads bit-equal?
  (Flash and memory-efficient attention backward accumulate with atomics on CUDA.)

Nothing here uses a process group. On CPU (--cpu, the dry run) the same code runs, compiled
kernels or not as fusedzero picks them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fusedzero.kernels import AdamWPlan  # noqa: E402

import _systems as S  # noqa: E402  (bench/ is a folder of scripts)

LR, BETAS, EPS, WD, STEPS = 3e-3, (0.9, 0.95), 1e-8, 0.1, 5


def _data(n: int, dev: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g) * 0.02
    grads = [
        torch.randn(n, generator=g) * 10.0 ** (-6 * torch.rand(n, generator=g))
        for _ in range(STEPS)
    ]
    return p.to(dev), [x.to(dev) for x in grads]


def _fp64(p: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    p, m, v = (
        p.double(),
        torch.zeros_like(p, dtype=torch.float64),
        torch.zeros_like(p, dtype=torch.float64),
    )
    b1, b2 = BETAS
    for t, g in enumerate(grads, 1):
        g = g.double()
        p = p * (1 - LR * WD)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - LR / (1 - b1**t) * m / (v.sqrt() / (1 - b2**t) ** 0.5 + EPS)
    return p


def _torch(p: torch.Tensor, grads: list[torch.Tensor], impl: str) -> torch.Tensor:
    param = torch.nn.Parameter(p.clone())
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}[
        impl
    ]
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    return param.detach()


def _ours(p: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    dev = p.device
    master, m, v, grad = p.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.empty_like(p)
    plan = AdamWPlan(master, grad, m, v, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)
    one = lambda x: torch.tensor([x], device=dev)  # noqa: E731
    lr, skip, scale = one(LR), torch.zeros(1, dtype=torch.int32, device=dev), one(1.0)
    for t, g in enumerate(grads, 1):
        grad.copy_(g)
        plan(lr=lr, step=one(float(t)), grad_scale=scale, skip=skip)
    return master


def update(dev: torch.device, n: int) -> list[dict[str, Any]]:
    p, grads = _data(n, dev)
    ref = _fp64(p, grads)
    rows = []
    for impl in ("forloop", "foreach", "fused", "fusedzero"):
        try:
            got = _ours(p, grads) if impl == "fusedzero" else _torch(p, grads, impl)
            rel = (got.double() - ref).abs() / ref.abs().clamp_min(1e-3)
            rows.append(
                {"impl": impl, "worst_rel": rel.max().item(), "past_1e-6": int((rel > 1e-6).sum())}
            )
        except Exception as e:  # noqa: BLE001 - an implementation this device lacks is reported
            rows.append({"impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def determinism(dev: torch.device) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    with torch.device(dev):
        model = S.make_model()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, S.CFG.vocab_size, (S.BATCH, S.CFG.block_size + 1), generator=gen)
    x, y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
    rows = []
    for kernels in ("default", "math"):
        ctx = sdpa_kernel(SDPBackend.MATH) if kernels == "math" else contextlib.nullcontext()
        runs = []
        with ctx:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                model(x, y)[1].backward()
                runs.append([q.grad.clone() for q in model.parameters()])
        diff = max((a - b).abs().max().item() for a, b in zip(*runs))
        rows.append({"attention": kernels, "grads_bit_equal": diff == 0.0, "max_abs_diff": diff})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--cpu", action="store_true", help="on the CPU (the dry run)")
    args = ap.parse_args()
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "update": update(dev, 1 << 20 if dev.type == "cuda" else 1 << 14),
        "determinism": determinism(dev),
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
