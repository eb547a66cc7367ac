"""The run's summary (what `--out-json` writes and `run()` returns) and the closing table.

Resident and communicated bytes sit next to what plain DDP would hold and send, from the
formulas of docs/design.md, so the table shows what sharding saves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from fusedzero import _dtypes as dtypes
from fusedzero.app.config import TrainConfig
from fusedzero.app.log import RunLog
from fusedzero.app.model import GPTConfig, flops_per_token
from fusedzero.memory_modes import MemoryModes
from fusedzero.optim import ZeroOptimizer

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from NVIDIA's datasheets, matched in order
# against torch.cuda.get_device_name (first match wins: each variant before the name it
# contains: "H200 NVL" before "H200", "L40S" and "L40" before "L4").
BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)


def bf16_peak(device: torch.device) -> tuple[float | None, str]:
    """(peak bf16 FLOP/s of one such device, its name); None where no peak is known (a CPU, a
    GPU not in BF16_PEAKS): MFU is then reported as n/a rather than against a guess."""
    if device.type != "cuda":
        return None, device.type
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAKS if key in name), None), name


def mfu(tokens_per_s: float, flops: int, world: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all `world` devices."""
    return None if peak is None or tokens_per_s <= 0 else tokens_per_s * flops / (world * peak)


def summarize(
    cfg: TrainConfig,
    opt: ZeroOptimizer,
    world: int,
    device: torch.device,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    log: RunLog,
    comm_per_step: dict[str, float],
    tokens_per_s: float,
    launches_per_step: dict[str, int] | None = None,
) -> dict[str, Any]:
    mem = opt.memory()
    # Max over ranks: shards can differ by padding. Logging, so dist directly.
    res = torch.tensor([mem.params, mem.grads, mem.optimizer], dtype=torch.int64, device=device)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)
    params_b, grads_b, opt_b = res.tolist()
    psi = int(mem.param_elements)
    pb, gb = param_dtype.itemsize, reduce_dtype.itemsize
    master = 4 if param_dtype != torch.float32 else 0
    # Plain DDP with torch's optimizers: each group's rule's state fields in fp32 (AdamW two
    # moments, Muon one momentum buffer), and an fp32 master beside non-fp32 params.
    fp32_fields = [len(r.state_fields(MemoryModes())) for r in opt.group_rules]
    state = sum(4 * fp32_fields[fg.group_index] * fg.layout.param_numel for fg in opt.flat_groups)
    ddp = {"params": psi * pb, "grads": psi * gb, "optimizer": psi * master + state}
    ddp_comm = 2 * (world - 1) * psi * gb // world
    flops = flops_per_token(GPTConfig(**cfg.model_config()))
    peak, device_name = bf16_peak(device)
    return {
        "stage": cfg.stage,
        "world_size": world,
        "params": psi,
        "padded_params": sum(fg.layout.padded_numel for fg in opt.flat_groups),
        # Stage 3: the root unit's share (gathered once a step; every other unit twice).
        "padded_root_params": sum(fg.layout.padded_numel for fg in opt.flat_groups if fg.unit == 0)
        if cfg.stage == 3
        else None,
        "steps": list(log.steps),
        "train_loss": log.steps[-1]["loss"] if log.steps else None,
        "val_loss": log.val[-1]["val_loss"] if log.val else None,
        "val": list(log.val),
        "tokens_per_s": tokens_per_s,
        # Model FLOPs per token (forward + backward, fusedzero.app.model.flops_per_token) and
        # their share of the devices' dense bf16 peak; None (n/a) where no peak is known.
        "flops_per_token": flops,
        "device_name": device_name,
        "bf16_peak_flops": peak,
        "mfu": mfu(tokens_per_s, flops, world, peak),
        "resident_bytes": {"params": params_b, "grads": grads_b, "optimizer": opt_b},
        "ddp_resident_bytes": ddp,
        "comm_bytes_per_step": comm_per_step,
        # Fused-kernel launches counted over the run's last step (None: no step was run).
        "kernel_launches_per_step": launches_per_step,
        "ddp_comm_bytes_per_step": {"all_reduce": ddp_comm},
        "dtypes": {
            "param": dtypes.name(param_dtype),
            "master": "float32" if opt.modes.fp32_master else opt.modes.master,
            "states": opt.modes.states,
            "grad_reduce": dtypes.name(reduce_dtype),
            "wire": opt.wire.grads,
            "param_wire": opt.wire.params,
        },
        "modes": opt.modes.to_json(),
        "device": device.type,
        "config": dataclasses.asdict(cfg),
    }


def _mfu_text(s: dict[str, Any]) -> str:
    if s.get("mfu") is None:
        why = (
            "no bf16 peak for a CPU"
            if s.get("device") == "cpu"
            else f"no known bf16 peak for {s.get('device_name')}"
        )
        return f"MFU n/a: {why}"
    return (
        f"MFU {s['mfu']:.1%} of {s['world_size']} x {s['device_name']} at "
        f"{s['bf16_peak_flops'] / 1e12:.0f} TFLOP/s bf16"
    )


def format_table(s: dict[str, Any], stopped: bool = False) -> str:
    MB = 1e6
    r, d = s["resident_bytes"], s["ddp_resident_bytes"]
    c = s["comm_bytes_per_step"]
    first_val = s["val"][0]["val_loss"] if s["val"] else float("nan")
    last = s["steps"][-1]["step"] if s["steps"] else 0

    def fmt(v):
        return "-" if v is None else f"{v:.4f}"

    rows = [
        ("stage", f"ZeRO-{s['stage']}"),
        ("world size", f"{s['world_size']} ({s['device']})"),
        ("params", f"{s['params']:,} ({s['padded_params']:,} padded)"),
        (
            "dtypes",
            (
                f"params {s['dtypes']['param']}, master {s['dtypes']['master']}, "
                f"states {s['dtypes'].get('states', 'fp32')}, "
                f"grad reduce {s['dtypes']['grad_reduce']}"
                + (f", wire {s['dtypes']['wire']}" if s["dtypes"].get("wire") else "")
                + (
                    f", param wire {s['dtypes']['param_wire']}"
                    if s["dtypes"].get("param_wire")
                    else ""
                )
            ),
        ),
        ("steps", f"{last}" + ("  (stopped early: resume with --resume)" if stopped else "")),
        ("train loss", fmt(s["train_loss"])),
        ("val loss", f"{fmt(s['val_loss'])}  (at start {first_val:.4f})"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}  ({_mfu_text(s)})"),
    ]
    w = max(len(k) for k, _ in rows)
    out = ["", "fusedzero train: done"] + [f"  {k:<{w}}  {v}" for k, v in rows]
    out.append("")
    out.append(f"  {'MB per rank':<22}{'ZeRO-' + str(s['stage']):>12}{'plain DDP':>12}")
    for k in ("params", "grads", "optimizer"):
        out.append(f"  {k:<22}{r[k] / MB:>12.3f}{d[k] / MB:>12.3f}")
    out.append(f"  {'total':<22}{sum(r.values()) / MB:>12.3f}{sum(d.values()) / MB:>12.3f}")
    out.append("  comm MB per step per rank")
    out.append(
        f"  {'  all_reduce':<22}{c['all_reduce'] / MB:>12.3f}"
        f"{s['ddp_comm_bytes_per_step']['all_reduce'] / MB:>12.3f}"
    )
    for k in ("reduce_scatter", "all_gather", "all_to_all"):
        out.append(f"  {'  ' + k:<22}{c[k] / MB:>12.3f}{0.0:>12.3f}")
    return "\n".join(out)
