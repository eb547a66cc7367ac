"""ZeroAdamW on one CUDA device (NCCL, world of one): what a GPU run can show that CPU cannot.

    python bench/gpu/probe.py OUT.json

- parity: stages 0-3, fp32, 5 steps of 2 micro-batches with clipping on a small GPT, against
  torch.optim.AdamW + clip_grad_norm_ on a copy (the Triton kernels compiled, for real);
- per stage and memory mode (bf16 params): the CUDA kernels one `step()` runs (torch profiler),
  whether `step()` makes a host sync (torch.cuda.set_sync_debug_mode("error") around it), and
  `opt.memory()` beside the caching allocator's count of the bytes the optimizer added.
"""

from __future__ import annotations

import datetime
import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fusedzero import Precision, Sharding, ZeroAdamW
from fusedzero._spawn import free_port
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups

DEV = torch.device("cuda", 0)
MODES = (("fp32", "fp32"), ("bf16-kahan", "int8"), ("bf16-sr", "bf16"), ("bf16", "fp32"))


def _batch(step: int, cfg: GPTConfig, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(
        0,
        cfg.vocab_size,
        (b, cfg.block_size + 1),
        generator=torch.Generator().manual_seed(100 + step),
    )
    return t[:, :-1].to(DEV), t[:, 1:].to(DEV)


def _model(cfg: GPTConfig, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    with torch.device(DEV):
        return GPT(cfg).to(dtype)


def _train(model, opt, cfg, steps: int, accum: int, clip_ref: bool = False) -> None:  # type: ignore[no-untyped-def]
    for s in range(steps):
        x, y = _batch(s, cfg, 4 * accum)
        for m in range(accum):
            _, loss = model(x[m * 4 : (m + 1) * 4], y[m * 4 : (m + 1) * 4])
            (loss / accum).backward()
        if clip_ref:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def parity(stage: int) -> dict:
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)
    model, ref = _model(cfg), _model(cfg)
    opt = ZeroAdamW(
        gpt_param_groups(model, 0.1),
        lr=3e-3,
        betas=(0.9, 0.95),
        stage=stage,
        module=model,
        max_grad_norm=1.0,
        sharding=Sharding(bucket_numel=4096),
    )
    ref_opt = torch.optim.AdamW(gpt_param_groups(ref, 0.1), lr=3e-3, betas=(0.9, 0.95))
    _train(model, opt, cfg, 5, 2)
    _train(ref, ref_opt, cfg, 5, 2, clip_ref=True)
    with opt.gathered_params():
        rel = max(
            float(((p - q).abs() / q.abs().clamp_min(1e-3)).max())
            for p, q in zip(model.parameters(), ref.parameters())
        )
    opt.close()
    return {"check": "parity", "stage": stage, "worst_rel_diff": rel}


def step_facts(stage: int, master: str, states: str) -> dict:
    cfg = GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=64)
    model = _model(cfg, torch.bfloat16)
    gc.collect()
    before = torch.cuda.memory_allocated(DEV)
    opt = ZeroAdamW(
        gpt_param_groups(model, 0.1),
        lr=3e-3,
        stage=stage,
        module=model,
        max_grad_norm=1.0,
        precision=Precision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, master=master, states=states
        ),
    )
    _train(model, opt, cfg, 3, 1)
    torch.cuda.synchronize()
    added, mem = torch.cuda.memory_allocated(DEV) - before, opt.memory()
    x, y = _batch(99, cfg, 4)
    model(x, y)[1].backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
        sync = ""
    except RuntimeError as e:
        sync = str(e)[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    opt.zero_grad()
    model(x, y)[1].backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    kernels: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0) + 1
    opt.close()
    return {
        "check": "step",
        "stage": stage,
        "master": master,
        "states": states,
        "host_sync_in_step": sync,
        "kernels": kernels,
        "memory_report": mem._asdict(),
        "memory_report_total": mem.total,
        "allocator_added": added,
        "params_before": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def main(out: Path) -> None:
    torch.cuda.set_device(DEV)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
        device_id=DEV,
    )
    rows = []
    jobs = [(parity, (s,)) for s in range(4)]
    jobs += [(step_facts, (s, m, st)) for s in range(4) for m, st in MODES]
    for fn, args in jobs:
        try:
            rows.append(fn(*args))
        except Exception:  # noqa: BLE001 - one failing case is reported, the rest still run
            rows.append(
                {"check": fn.__name__, "args": list(args), "error": traceback.format_exc()[-2000:]}
            )
        print(json.dumps(rows[-1])[:300], flush=True)
    out.write_text(
        json.dumps(
            {"device": torch.cuda.get_device_name(DEV), "torch": torch.__version__, "rows": rows},
            indent=1,
        )
        + "\n"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
