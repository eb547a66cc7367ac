"""One world size of the GPU proof, one process per GPU under torchrun (NCCL):

    torchrun --nproc_per_node W bench/gpu/multi.py OUT.json
    torchrun --nproc_per_node 2 bench/gpu/multi.py OUT.json --cpu    (gloo: the dry run)

- parity: every stage against DDP + torch.optim.AdamW (fp32: params within max(3 x the
  reference's own run-to-run difference, 1e-6 relative + 1e-6 absolute, the tolerance
  tests/zero/test_parity.py derives): see [Note: a check's noise floor]; torch's default foreach
  AdamW, and stage 2 once more against the fused one, whose CUDA kernel differs from float64
  by more: bench/gpu/numerics.py), and in bf16 against FSDP2
  with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (losses within 2^-7 relative:
  one bf16 ulp of the logits' scale; params are not compared, bf16 rounding differs by design);
- step time of every system of bench/_systems.py that runs here (DDP, FSDP2, DeepSpeed where
  installed), interleaved rounds, beside `bare` forward+backward;
- the exposed-communication fraction of a fusedzero stage-2 step from a profiler trace
  (bench/gpu/timeline.py); on CPU the host timeline stands in (not a measurement);
- at W=1 on CUDA: a whole step (forward, backward, update) captured in a CUDA graph, replayed,
  and compared with the same steps run eagerly, beside two eager runs compared (the control).

Parity runs attention on torch's math kernel on CUDA by default, the graph check under the
math and the default kernels: the flash and memory-efficient backward kernels accumulate with
atomics, so two runs of the same step may differ in the last bits (bench/gpu/numerics.py) and
fp32 params drift apart by more than rounding; the controls measure by how much.
FUSEDZERO_MULTI_SECTIONS (comma-separated: parity, timing, exposed, graph) runs a subset;
FUSEDZERO_PARITY_KINDS (fp32, bf16) the parity rows, FUSEDZERO_PARITY_ATTENTION and
FUSEDZERO_GRAPH_ATTENTION (math, default) the attention kernels parity and the graph run under.

[Note: a check's noise floor] A difference between two runs means something only beside the
difference between two runs that should be the same. Each reference of the parity check runs
twice, built afresh from the same seed on the same batches (the control), and the CUDA graph's
eager twin has an eager twin of its own; a check passes when its difference is at most
max(NOISE_K x control, floor). NOISE_K = 3: the control is one draw of the run-to-run noise
(the worst element of tens of millions, which moves by tens of percent between draws), and the
compared run carries its own draw plus the update's rounding against the reference's (ours vs
torch foreach: a few fp32 ulps per step, bench/gpu/numerics.py). The floor is the fp32
tolerance above for parity (a deterministic reference leaves the old check unchanged) and 0 for
the graph (a deterministic eager step must replay bit for bit).

Same model, batch and bucket size as bench/gpu/step_overhead.py (FUSEDZERO_BENCH_MODEL, ...).
Each section records its error instead of ending the run; rank 0 writes OUT.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timeline import exposed_fraction  # noqa: E402

from fusedzero import _comm as comm  # noqa: E402

import _systems as S  # noqa: E402  (bench/ is a folder of scripts)

PARITY_STEPS = 5
RTOL = ATOL = 1e-6  # fp32 (see the docstring)
BF16_LOSS_RTOL = 2.0**-7
NOISE_K = 3.0  # See [Note: a check's noise floor]


class Verdict(NamedTuple):
    """A difference beside its control's: tolerance = max(NOISE_K x control, floor)."""

    diff: float
    control: float
    tolerance: float
    ok: bool


def noise_verdict(diff: float, control: float, floor: float) -> Verdict:
    """See [Note: a check's noise floor]."""
    tol = max(NOISE_K * control, floor)
    return Verdict(diff, control, tol, diff <= tol)


def setup(cpu: bool) -> torch.device:
    if cpu:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    comm.nccl_watchdog_env()
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=dev)
    # fp32 parity means fp32 matmuls: TF32 would differ from DDP by 1e-3, not by rounding order.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return dev


def batch(step: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    t = torch.randint(0, S.CFG.vocab_size, (S.BATCH, S.CFG.block_size + 1), generator=g)
    return t[:, :-1].to(dev), t[:, 1:].to(dev)


def build(name: str, dev: torch.device) -> S.System:
    with torch.device(dev):  # only while building (a default device taxes every op)
        return S.build(name, dist.get_world_size())


def full_params(s: S.System) -> list[torch.Tensor]:
    """Every param's full value, fp32, in model order."""
    if S.SYSTEMS[s.name].family == "fusedzero":
        model, opt = s.roots
        with opt.gathered_params():
            return [p.detach().float().clone() for p in model.parameters()]
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for p in s.roots[-2 if s.name.startswith("fsdp2") else 1].parameters()
    ]


def run_losses(s: S.System, dev: torch.device, steps: int) -> list[float]:
    out = []
    for step in range(steps):
        loss = s.step(*batch(step, dev)).detach().float()
        dist.all_reduce(loss)
        out.append(loss.item() / dist.get_world_size())
    return out


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a - b| / (ATOL + RTOL |b|): at most 1 is within the fp32 tolerance."""
    return max(((x - y).abs() / (ATOL + RTOL * y.abs())).max().item() for x, y in zip(a, b))


def attention_kernels(dev: torch.device, which: str) -> contextlib.AbstractContextManager[None]:
    """`math`: attention on torch's math kernel on CUDA (see the module docstring); `default`:
    torch's choice (flash / memory-efficient). A no-op on CPU."""
    if which not in ("math", "default"):
        raise ValueError(f"attention kernels {which!r}: expected math or default")
    if dev.type == "cuda" and which == "math":
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


class Pair(NamedTuple):
    """One parity row: our system against a reference, compared as `kind` (fp32 or bf16)."""

    ours: str
    ref: str
    kind: str


def parity(dev: torch.device, pairs: list[Pair], attention: str = "math") -> list[dict[str, Any]]:
    with attention_kernels(dev, attention):
        rows = _parity(dev, pairs)
    for r in rows:
        r["attention"] = attention
    return rows


class Run(NamedTuple):
    """One system's parity run: mean loss per step, and (fp32) every param's full value."""

    losses: list[float]
    params: list[torch.Tensor] | None


def _run(name: str, dev: torch.device, with_params: bool) -> Run:
    s = build(name, dev)
    losses = run_losses(s, dev, PARITY_STEPS)
    return Run(losses, full_params(s) if with_params else None)


def _compare(a: Run, b: Run) -> dict[str, float]:
    out = {"loss_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(a.losses, b.losses))}
    if a.params is not None and b.params is not None:
        out["param_worst_over_tol"] = worst(a.params, b.params)
        out["param_max_abs_diff"] = max(
            (x - y).abs().max().item() for x, y in zip(a.params, b.params)
        )
    return out


def _parity(dev: torch.device, pairs: list[Pair]) -> list[dict[str, Any]]:
    """Each system runs once (a system in two pairs is reused); each reference runs a second
    time from the same seed, the control (see [Note: a check's noise floor])."""
    runs: dict[str, Run] = {}
    controls: dict[str, dict[str, float]] = {}
    rows = []
    for ours, ref, kind in pairs:
        row: dict[str, Any] = {"ours": ours, "ref": ref, "kind": kind}
        try:
            fp32 = kind == "fp32"
            for name in (ours, ref):
                if name not in runs:
                    runs[name] = _run(name, dev, fp32)
            if ref not in controls:
                controls[ref] = _compare(_run(ref, dev, fp32), runs[ref])
            got, ctl = _compare(runs[ours], runs[ref]), controls[ref]
            row.update(got)
            row["losses"] = {"ours": runs[ours].losses, "ref": runs[ref].losses}
            row["control"] = ctl
            if fp32:
                v = noise_verdict(got["param_worst_over_tol"], ctl["param_worst_over_tol"], 1.0)
                row["tolerance_over_tol"] = v.tolerance
                row["ok_fixed_tolerance"] = got["param_worst_over_tol"] <= 1.0
                row["ok"] = v.ok
            else:
                row["ok"] = row["loss_rel_diff"] <= BF16_LOSS_RTOL
        except Exception:  # noqa: BLE001 - reported in the results
            row["error"] = traceback.format_exc()[-1500:]
        rows.append(row)
    return rows


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timing(dev: torch.device, names: list[str], rounds: int, steps: int) -> dict[str, Any]:
    systems, errors = {}, {}
    for n in names:
        why = S.unavailable(n)
        if why:
            errors[n] = why
            continue
        try:
            systems[n] = build(n, dev)
            for i in range(3):
                systems[n].step(*batch(i, dev))
        except Exception as e:  # noqa: BLE001 - a system that cannot run here is reported
            errors[n] = f"{type(e).__name__}: {e}"[:300]
    times: dict[str, list[float]] = {n: [] for n in systems}
    x, y = batch(0, dev)
    for _ in range(rounds):
        for n, s in systems.items():
            dist.barrier()
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                s.step(x, y)
            sync(dev)
            times[n].append((time.perf_counter() - t0) / steps)
    rows = [
        {"system": n, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
        for n, t in times.items()
    ]
    return {"rows": rows, "errors": errors, "rounds": rounds, "steps_per_round": steps}


def exposed(dev: torch.device, name: str, steps: int) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    s = build(name, dev)
    x, y = batch(0, dev)
    for _ in range(3):
        s.step(x, y)
    acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    sync(dev)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            s.step(x, y)
        sync(dev)
    wall = time.perf_counter() - t0
    want = DeviceType.CUDA if dev.type == "cuda" else DeviceType.CPU
    kernels = [
        (
            e.time_range.start,
            e.time_range.end,
            # CPU stand-in: the host's gloo calls play the collectives' part.
            e.name if dev.type == "cuda" or "gloo" not in e.name else "nccl:" + e.name,
        )
        for e in prof.events()
        if e.device_type == want
    ]
    out = exposed_fraction(kernels)
    out.update(
        system=name,
        steps=steps,
        wall_s=wall,
        kernels=len(kernels),
        timeline="device" if dev.type == "cuda" else "host (CPU stand-in)",
    )
    return out


def graph_capture(
    dev: torch.device, name: str, steps: int, attention: str = "math"
) -> dict[str, Any]:
    """Capture one whole step after warm-up; replay it `steps` times on one system and run the
    same steps eagerly on two twins: replayed vs eager beside eager vs eager (the control, see
    [Note: a check's noise floor])."""
    with attention_kernels(dev, attention):
        out = _graph_capture(dev, name, steps)
    out["attention"] = attention
    return out


def _graph_capture(dev: torch.device, name: str, steps: int) -> dict[str, Any]:
    eager, twin, graphed = build(name, dev), build(name, dev), build(name, dev)
    x, y = batch(0, dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs advises
        for _ in range(3):
            for s in (eager, twin, graphed):
                s.step(x, y)
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed.step(x, y)
    for _ in range(steps):
        g.replay()
        eager.step(x, y)
        twin.step(x, y)
    sync(dev)
    a, b, c = full_params(graphed), full_params(eager), full_params(twin)
    diff = max((p - q).abs().max().item() for p, q in zip(a, b))
    control = max((p - q).abs().max().item() for p, q in zip(c, b))
    v = noise_verdict(diff, control, 0.0)
    return {
        "system": name,
        "replays": steps,
        "max_abs_diff_vs_eager": diff,
        "control_max_abs_diff_eager_vs_eager": control,
        "tolerance": v.tolerance,
        "ok_bit_exact": diff == 0.0,
        "ok": v.ok,
    }


def _listed(var: str, default: str) -> list[str]:
    return [k for k in os.environ.get(var, default).split(",") if k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU (the dry run)")
    args = ap.parse_args()
    dev = setup(args.cpu)
    W = dist.get_world_size()
    rounds, steps = int(os.environ.get("ROUNDS", "5")), int(os.environ.get("STEPS", "10"))
    pairs = {
        "fp32": [Pair(f"fusedzero-{s}", "ddp+adamw", "fp32") for s in range(4)]
        + [Pair("fusedzero-2", "ddp+adamw_fused", "fp32")],
        "bf16": [Pair(f"fusedzero-{s}-bf16-r32", "fsdp2-keep-bf16-r32", "bf16") for s in range(4)],
    }
    kinds = _listed("FUSEDZERO_PARITY_KINDS", "fp32,bf16")
    if not set(kinds) <= set(pairs):
        ap.error(f"FUSEDZERO_PARITY_KINDS={','.join(kinds)}: expected a list of fp32, bf16")
    chosen = [p for k in kinds for p in pairs[k]]
    names = [
        "bare",
        *(f"fusedzero-{s}" for s in range(4)),
        "fusedzero-3-keep",
        "ddp+adamw_fused",
        "fsdp2-keep",
        "fsdp2-reshard",
    ]
    if not args.cpu:
        names += ["deepspeed-1", "deepspeed-2", "deepspeed-3"]
    result: dict[str, Any] = {
        "world_size": W,
        "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
        "torch": torch.__version__,
        "model": S.CFG.__dict__,
        "batch_per_rank": S.BATCH,
        "bucket_numel": S.BUCKET,
        "errors": {},
    }
    sections = {
        "parity": lambda: [
            r for a in _listed("FUSEDZERO_PARITY_ATTENTION", "math") for r in parity(dev, chosen, a)
        ],
        "timing": lambda: timing(dev, names, rounds, steps),
    }
    if dev.type == "cuda" or W == 1:
        sections["exposed"] = lambda: exposed(dev, "fusedzero-2", steps)
    else:  # the CPU dry run at W > 1
        result["exposed_skipped"] = (
            "CPU at W>1: torch's CPU profiler killed a gloo rank with SIGSEGV after "
            "profiler_stop in 2 of about 6 dry runs on the 2-core CI machine (torch 2.13.0); "
            "W=1 and every CUDA run are profiled"
        )
    if dev.type == "cuda" and W == 1:
        sections["graph"] = lambda: [
            graph_capture(dev, "fusedzero-2", steps, a)
            for a in _listed("FUSEDZERO_GRAPH_ATTENTION", "math,default")
        ]
    only = _listed("FUSEDZERO_MULTI_SECTIONS", "")
    for key, fn in sections.items():
        if only and key not in only:
            continue
        try:
            result[key] = fn()
        except Exception:  # noqa: BLE001 - reported in the results
            result["errors"][key] = traceback.format_exc()[-1500:]
        dist.barrier()
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
