"""`fusedzero doctor`: is this install sound on this machine? One table, exit 1 on any failure.

    fusedzero doctor            # a table: check, status (ok / FAIL / skipped / info), secs, detail
    fusedzero doctor --json     # the same rows as JSON, with per-variant data, for scripts

Checks, in order: versions; the device and the kernel backend used on it; every kernel variant
on this device against the float64 reference, and the step's scalar kernels bitwise against
their torch path (`kernel_checks.py`; on CPU: the torch path here,
the Triton kernel code through the interpreter in a child, the offline sm_90 compile in another
child when ptxas is there; on a GPU: the compiled kernels, for real); the update's GB/s beside a
plain device copy of the same bytes (`fusedzero._bandwidth`); a 1-rank process group (nccl on a
GPU, gloo on CPU); a ZeroAdamW step in it against torch.optim.AdamW; a checkpoint round trip in
a temp dir, compared bitwise.

The module reads top to bottom: the rows of the table and how one check becomes a row; the
distributed checks (a 1-rank process group, a ZeroAdamW step in it, a checkpoint round trip);
then the single-process checks and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import enum
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusedzero import _bandwidth as bandwidth
from fusedzero._spawn import reserved_port
from fusedzero.app import kernel_checks


# -- rows ------------------------------------------------------------------------------------------
class Status(enum.Enum):
    OK = "ok"
    FAIL = "FAIL"
    SKIPPED = "skipped"
    INFO = "info"  # ran and measured, but the figure is no pass/fail on this device


@dataclasses.dataclass
class Row:
    check: str
    status: Status
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


class Skip(Exception):
    """Raised by a check that cannot run here; the message is the reason."""


class Measured(Exception):
    """Raised by a check that ran but can give no verdict here; the message says what ran and
    what its figure means on this device, `data` holds the figures."""

    def __init__(self, detail: str, data: dict[str, Any]) -> None:
        super().__init__(detail)
        self.data = data


def row(check: str, fn: Callable[[], tuple[str, dict[str, Any]] | str]) -> Row:
    """Run one check: ok with its detail, FAIL with the error, skipped with the reason, info
    with what a measurement means here."""
    t = time.perf_counter()
    try:
        got = fn()
        detail, data = got if isinstance(got, tuple) else (got, {})
        status = Status.OK
    except Measured as e:
        status, detail, data = Status.INFO, str(e), e.data
    except Skip as e:
        status, detail, data = Status.SKIPPED, str(e), {}
    except Exception as e:  # noqa: BLE001 - every failure is a row, the other checks still run
        status, detail, data = Status.FAIL, f"{type(e).__name__}: {' '.join(str(e).split())}", {}
    return Row(check, status, detail, time.perf_counter() - t, data)


# -- distributed checks --------------------------------------------------------------------------
# --checks names that stand for several checks.
GROUPS = {"distributed": ("process-group", "zero-step", "checkpoint")}


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[str]:
    """A world of one on a free local port; destroyed on exit (gloo can abort at interpreter
    exit with a live group)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with reserved_port() as port:  # held until the store listens on it
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def _tiny_model(device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 4)).to(device)


def _train(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # two steps: the second reads the moments the first wrote
        x = torch.randn(16, 8, generator=gen).to(device)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def zero_step(device: torch.device) -> tuple[str, dict[str, Any]]:
    """Two ZeroAdamW steps (stage 2) vs torch.optim.AdamW on a copy of the model. fp32 on both
    sides, each param moves by ~lr per step: torch's fp32 tolerances (1.3e-6 relative, 1e-5
    absolute) are far under a semantic error (a lost weight decay or bias correction moves a
    param by ~1e-3 here)."""
    from fusedzero import ZeroAdamW

    model = _tiny_model(device, seed=0)
    ref = copy.deepcopy(model)
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = ZeroAdamW(model.parameters(), stage=2, module=model, **hp)
    try:
        _train(model, opt, device)
        _train(ref, torch.optim.AdamW(ref.parameters(), **hp), device)
        with opt.gathered_params():
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        opt.close()
    return "stage 2, 2 steps on a 2-layer MLP = torch.optim.AdamW (fp32 tolerance)", {}


def checkpoint_round_trip(device: torch.device) -> tuple[str, dict[str, Any]]:
    """Save a trained optimizer, load it into a fresh one (other init), compare bitwise."""
    from fusedzero import ZeroAdamW, checkpoint

    model, other = _tiny_model(device, seed=0), _tiny_model(device, seed=1)
    opts = [ZeroAdamW(m.parameters(), lr=1e-2, stage=2, module=m) for m in (model, other)]
    try:
        _train(model, opts[0], device)
        with tempfile.TemporaryDirectory(prefix="fusedzero-doctor-") as d:
            checkpoint.save(opts[0], d, step=2)
            got = checkpoint.load(opts[1], d)
        if got.step != 2:
            raise RuntimeError(f"loaded step {got.step}, saved 2")
        a, b = opts[0].shard_state(), opts[1].shard_state()
        pairs = [
            (f"{f}[{i}]", x, y)
            for f in a.names()
            for i, (x, y) in enumerate(zip(a.get(f), b.get(f)))  # type: ignore[arg-type]
        ]
        with opts[0].gathered_params(), opts[1].gathered_params():
            pairs += [(n, p, q) for (n, p), q in zip(model.named_parameters(), other.parameters())]
            diff = [n for n, x, y in pairs if not torch.equal(x, y)]
        if diff or a.step_count != b.step_count:
            raise RuntimeError(
                f"not bit-exact after load: {diff[:5]}, step count {a.step_count} vs {b.step_count}"
            )
    finally:
        for o in opts:
            o.close()
    return f"save + load of {len(pairs)} tensors in a temp dir, bit-exact", {}


def distributed_rows(
    device: torch.device, checks: tuple[str, ...] = GROUPS["distributed"]
) -> list[Row]:
    """The process group (always: the others run in it), then the ZeroAdamW step and the
    checkpoint round trip where `checks` names them."""
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:

        def group() -> str:
            backend = stack.enter_context(one_rank_group(device))
            t = torch.arange(4, dtype=torch.float32, device=device)
            dist.all_reduce(t)
            if not torch.equal(t.cpu(), torch.arange(4, dtype=torch.float32)):
                raise RuntimeError(f"all_reduce over one rank changed the tensor: {t.tolist()}")
            return f"{backend}, 1 rank: init, all_reduce, destroy"

        rows.append(row("process group", group))
        for check, name, fn in (
            ("zero-step", "ZeroAdamW step", zero_step),
            ("checkpoint", "checkpoint", checkpoint_round_trip),
        ):
            if check not in checks:
                continue
            if rows[0].status is Status.OK:
                rows.append(row(name, lambda fn=fn: fn(device)))
            else:
                rows.append(Row(name, Status.SKIPPED, "needs the process group above"))
    return rows


# Update size for the bandwidth row. GPU: 64M elements (1.8 GB at 28 B/param, far past H100's
# 50 MB L2), halved while update + copy buffers would take more than half the free memory. CPU: a
# modest 4M (112 MB per update), a fraction of a second per rep.
GPU_NUMEL, CPU_NUMEL = 64 << 20, 4 << 20
CHILD_TIMEOUT_S = 240.0
CHECKS = (
    "versions",
    "device",
    "kernels",
    "interpreter",
    "compile",
    "bandwidth",
    "process-group",
    "zero-step",
    "checkpoint",
)


# -- versions and device ---------------------------------------------------------------------------


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return out.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (no nvidia-smi)"


def versions() -> tuple[str, dict[str, Any]]:
    import safetensors
    import triton

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "safetensors": safetensors.__version__,
        "fusedzero": importlib.metadata.version("fusedzero"),
    }
    if torch.cuda.is_available():
        v["cuda_runtime"] = torch.version.cuda or "?"
        v["driver"] = _driver_version()
    else:
        v["cuda"] = (
            f"none (torch built with CUDA {torch.version.cuda})"
            if torch.version.cuda
            else "none (CPU build of torch)"
        )
    return ", ".join(f"{k} {x}" for k, x in v.items()), v


def device_row(device: torch.device) -> tuple[str, dict[str, Any]]:
    from fusedzero.kernels import _launch

    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        what = (
            f"{p.name}, sm_{p.major}{p.minor}, {total / 2**30:.1f} GiB "
            f"({free / 2**30:.1f} free), {p.multi_processor_count} SMs"
        )
        if _launch.interpreting():
            raise RuntimeError(
                f"{what}: TRITON_INTERPRET=1 is set, so the CUDA kernels would "
                "run in the interpreter; unset it"
            )
    else:
        what = (
            f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads"
        )
    path = (
        "Triton kernels, compiled" if _launch.use_triton(device) else "torch path"
    ) + f" (FUSEDZERO_BACKEND={_launch.backend()})"
    return f"{what}; kernels: {path}", {"device": str(device), "kernel_path": path}


# -- kernels ---------------------------------------------------------------------------------------


def _summary(results: list[kernel_checks.VariantResult]) -> tuple[str, dict[str, Any]]:
    data = {"variants": [dataclasses.asdict(r) for r in results]}
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(
            f"{len(bad)}/{len(results)} variants wrong: "
            + "; ".join(f"{r.name}: {r.error}" for r in bad[:4])
        )
    parts = []
    for kernel in ("adamw", "sumsq"):
        rs = [r for r in results if r.kernel == kernel]
        worst = max(r.worst_ulps / r.bound_ulps for r in rs)
        parts.append(f"{kernel} {len(rs)}/{len(rs)} ok (worst error {worst:.0%} of its bound)")
    if any(r.kernel == "scalars" for r in results):
        parts.append("step scalars and rows bitwise as the torch path")
    return (f"{', '.join(parts)}; {kernel_checks.NUMEL} elements vs float64", data)


def _kernel_path(device: torch.device) -> str:
    from fusedzero.kernels import _launch

    try:
        if not _launch.use_triton(device):
            return "torch path"
    except (ValueError, RuntimeError):  # a bad FUSEDZERO_BACKEND: the device row says which
        return "path unknown"
    return "Triton interpreter" if _launch.interpreting() else "compiled"


def kernels_here(device: torch.device) -> tuple[str, dict[str, Any]]:
    return _summary(kernel_checks.run_all(device))


def kernels_interpreter(proc: subprocess.Popen[str] | None) -> tuple[str, dict[str, Any]]:
    if proc is None:
        raise Skip("a GPU is here: the compiled kernels ran on it")
    return _summary(kernel_checks.interpreter_results(proc, CHILD_TIMEOUT_S))


def kernels_compiled(job: kernel_checks.CompileJob | None, why_not: str) -> tuple[str, dict]:
    if job is None:
        raise Skip(why_not)
    rows = kernel_checks.compile_results(job, CHILD_TIMEOUT_S)
    spills = [r for r in rows if r["spill_bytes"]]
    if spills:
        raise RuntimeError(f"{len(spills)} variants spill: {spills[:3]}")
    regs = [int(r["regs"]) for r in rows]
    return (
        f"{len(rows)} variants compiled for sm_90, no spills, {min(regs)}-{max(regs)} "
        f"registers per thread",
        {"variants": rows},
    )


# -- bandwidth -------------------------------------------------------------------------------------


def _update_numel(device: torch.device, bytes_per_param: int) -> int:
    if device.type != "cuda":
        return CPU_NUMEL
    free, _ = torch.cuda.mem_get_info(device)
    n = GPU_NUMEL
    # update buffers (16 B: fp32 master, moments, bf16 grad, out) + the copy (bytes_per_param)
    while n > (1 << 20) and n * (16 + bytes_per_param) > free // 2:
        n //= 2
    return n


def update_bandwidth(device: torch.device) -> tuple[str, dict[str, Any]]:
    """The ZeRO mixed setup (bf16 grad, bf16 out) timed as `fusedzero._bandwidth` times it."""
    from fusedzero.kernels import AdamWPlan

    g, o = torch.bfloat16, torch.bfloat16
    per_param = bandwidth.update_bytes_per_param(g, o)
    n = _update_numel(device, per_param)
    f32 = dict(dtype=torch.float32, device=device)
    master, m, v = torch.randn(n, **f32), torch.zeros(n, **f32), torch.zeros(n, **f32)
    grad, out = torch.randn(n, **f32).to(g), torch.empty(n, dtype=o, device=device)
    scalars = dict(
        lr=torch.full((1,), 1e-3, **f32),
        step=torch.ones(1, **f32),
        grad_scale=torch.ones(1, **f32),
        skip=torch.zeros(1, **f32),
    )

    # Planned once, as the optimizer does (a plan per call would time the table's copy to the
    # device). The torch path divides the grad in place by grad_scale = 1: values stay.
    plan = AdamWPlan(master, grad, m, v, out, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def update() -> None:
        plan(**scalars)

    nbytes = per_param * n
    # CPU: 7 rounds of ~0.05 s; CUDA: do_bench's ~100 ms of reps per op and round.
    times = bandwidth.time_with_copy(
        {"update": update}, nbytes, device, rounds=7 if device.type == "cpu" else 3
    )
    t_update = statistics.median(times["update"])
    copy_gbps = bandwidth.copy_gbps(times[bandwidth.COPY], nbytes)
    got = bandwidth.gbps(nbytes, t_update)
    data = {
        "numel": n,
        "bytes_per_param": per_param,
        "update_s": t_update,
        "update_gbps": got,
        "copy_gbps": copy_gbps,
        "pct_of_copy": 100 * got / copy_gbps,
        "timing": bandwidth.timing_method(device),
    }
    figure = (
        f"bf16 grad + bf16 out, {n / 2**20:g}M elements ({per_param} B/param): "
        f"{got:.1f} GB/s = {data['pct_of_copy']:.0f}% of a device copy of the same bytes "
        f"({copy_gbps:.1f} GB/s); {data['timing']}"
    )
    if device.type != "cuda":
        # The fused kernel runs only on a GPU; on CPU the update is the torch path, several
        # passes over memory, so its share of a copy says nothing about the kernel.
        raise Measured(
            f"no verdict on CPU: the update ran on the torch path (several passes "
            f"over memory; the one-pass fused kernel runs on a GPU, where this row "
            f"compares it with a copy): {figure}",
            data,
        )
    return figure, data


# -- the command -----------------------------------------------------------------------------------


def run(checks: tuple[str, ...] = CHECKS) -> list[Row]:
    """Every check in `checks` (names of CHECKS or GROUPS), in CHECKS order; the child
    processes start first and run meanwhile."""
    checks = tuple(c for name in checks for c in GROUPS.get(name, (name,)))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    on_cpu = device.type == "cpu"
    interp = kernel_checks.start_interpreter() if on_cpu and "interpreter" in checks else None
    why_not = (
        "a GPU is here: the compiled kernels ran on it"
        if not on_cpu
        else kernel_checks.ptxas_missing()
        if "compile" in checks
        else ""
    )
    job = kernel_checks.start_compile(90) if "compile" in checks and not why_not else None
    plan: list[tuple[str, Callable[[], Any]]] = [
        ("versions", versions),
        ("device", lambda: device_row(device)),
        ("kernels", lambda: kernels_here(device)),
        ("interpreter", lambda: kernels_interpreter(interp)),
        ("compile", lambda: kernels_compiled(job, why_not)),
        ("bandwidth", lambda: update_bandwidth(device)),
    ]
    labels = {
        "kernels": f"kernels on {device} ({_kernel_path(device)})",
        "interpreter": "kernels, Triton interpreter",
        "compile": "offline compile sm_90",
        "bandwidth": "update bandwidth",
    }
    try:
        rows = [row(labels.get(name, name), fn) for name, fn in plan if name in checks]
        if any(c in checks for c in GROUPS["distributed"]):
            rows += distributed_rows(device, checks)
    finally:  # an interrupted doctor leaves no child behind (no-op for those that finished)
        for proc in (interp, job.proc if job else None):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if job is not None:
            job.tmp.cleanup()
    return rows


def format_table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':{width}}  status   secs  detail"]
    lines += [f"{r.check:{width}}  {r.status.value:7} {r.seconds:5.1f}  {r.detail}" for r in rows]
    bad = sum(r.status is Status.FAIL for r in rows)
    lines.append(
        f"{'FAIL' if bad else 'ok'}: {len(rows) - bad}/{len(rows)} checks passed, "
        f"skipped with a reason, or measured without a verdict (info)"
    )
    return "\n".join(lines)


def doctor(args: argparse.Namespace) -> int:
    t = time.perf_counter()
    rows = run(tuple(args.checks))
    if args.json:
        print(
            json.dumps(
                {
                    "ok": all(r.status is not Status.FAIL for r in rows),
                    "seconds": time.perf_counter() - t,
                    "rows": [{**dataclasses.asdict(r), "status": r.status.value} for r in rows],
                },
                indent=1,
            )
        )
    else:
        print(format_table(rows))
        print(f"({time.perf_counter() - t:.1f} s)")
    return 1 if any(r.status is Status.FAIL for r in rows) else 0


def add_doctor_subparser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this install: versions, device, kernels vs "
        "float64, bandwidth, process group, checkpoint",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument(
        "--checks",
        nargs="+",
        choices=CHECKS + tuple(GROUPS),
        default=list(CHECKS),
        metavar="CHECK",
        help=f"run only these ({', '.join(CHECKS)}; distributed: "
        f"the last three; zero-step and checkpoint run in a process group, whose row "
        f"shows too); default all",
    )
    p.set_defaults(func=doctor)
