"""Forward, backward, step and zero_grad timed apart, per system, at world size 1.

Systems (the same model, the same batch, two param groups: decay / no decay):
  bare           forward + backward only, grads dropped (no optimizer, no hook)
  torch_adamw    torch.optim.AdamW(fused=True) where the device has it, else foreach
  fsdp2          fully_shard per block and the root, torch.optim.AdamW on the DTensors
  fusedzero-S    ZeroAdamW(stage=S, module=model), S = 0..3
every one in a 1-rank process group (gloo on CPU, NCCL on CUDA). On CUDA the params are bf16
(fp32 master: fusedzero; torch_adamw updates the bf16 params themselves; fsdp2: bf16 compute
over fp32 shards); on CPU fp32 (this CPU has no bf16 GEMM). Every phase ends with
`torch.cuda.synchronize()` on CUDA. Systems run round-robin, one step each, so a slow patch of
a shared machine hits all of them; medians of STEPS steps after WARMUP.

Models: `llama`, the Llama-shaped decoder of fusedzero.app.model.PRESETS["llama-254m"] (d 1024,
16 layers, 16 heads, 8 kv heads, SwiGLU 2816, vocab 32000, untied head; 8 x 1024 tokens a step),
scaled down on CPU unless FUSEDZERO_BENCH_PHASES_FULL=1 (or `--full`): d 128, 4 layers, 4 heads,
2 kv heads, SwiGLU 352, vocab 2048, 4 x 64 tokens; and `gpt`, the step bench's GPT
(bench/_systems.py: FUSEDZERO_BENCH_MODEL, FUSEDZERO_BENCH_BATCH).

Hook host time: a chain of HOOK_LAYERS tiny layers (Linear(4, 4): 2 params each, so nearly all of
backward is per-param host work) at world size 1; backward (and forward, and backward plus
zero_grad) with ZeroAdamW's hooks minus bare, over the number of params, in this thread's CPU
time (autograd runs CPU graphs on the calling thread; other processes on shared cores do not
count), the fastest of HOOK_ROUNDS rounds. Target: <= 10 us per param. `--hook-dtype bf16` runs
the chain in bf16 (fp32 reduce: each grad is cast into its bucket, by one foreach op per
bucket); `--hook-ops` also prints the aten ops each backward dispatches over bare, per param
(tests/zero/test_hook_ops.py bounds them at W=2), machine-independent where the times are not.
Each Linear is a stage-3 unit there (2 params each), so stage 3's figure is mostly its cost per
unit: a second chain with 10 Linear layers per unit separates the two (`stage 3 apart`).

    python bench/bench_phases.py [--full] [--model llama|gpt] [--steps N]
    pytest bench/bench_phases.py --benchmark-only
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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from fusedzero import Precision, Sharding, ZeroAdamW  # noqa: E402
from fusedzero._spawn import reserved_port  # noqa: E402
from fusedzero.app.model import GPT, PRESETS, GPTConfig, gpt_param_groups  # noqa: E402

from _common import SUMMARY, add_stats, replay  # noqa: E402

FULL = os.environ.get("FUSEDZERO_BENCH_PHASES_FULL", "0") == "1"
STEPS = int(os.environ.get("FUSEDZERO_BENCH_PHASES_STEPS", "10"))
WARMUP = 2
HOOK_LAYERS = int(os.environ.get("FUSEDZERO_BENCH_PHASES_HOOK_LAYERS", "200"))
HOOK_ROUNDS = int(os.environ.get("FUSEDZERO_BENCH_PHASES_HOOK_ROUNDS", "30"))
HOOK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Torch threads on CPU (default 1: on a shared machine OpenMP threads spin-wait on each other
# when one is descheduled, which swamps the phases; see bench_host.py).
THREADS = int(os.environ.get("FUSEDZERO_BENCH_PHASES_THREADS", "1"))
PHASES = ("forward", "backward", "step", "zero_grad")
SYSTEMS = (
    "bare",
    "torch_adamw",
    "fsdp2",
    "fusedzero-0",
    "fusedzero-1",
    "fusedzero-2",
    "fusedzero-3",
)
LR, WD, CLIP = 1e-3, 0.1, 1.0


def device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def model_shape(name: str, full: bool = FULL) -> tuple[GPTConfig, int]:
    """(model config, batch) of `llama` or `gpt` (see the module docstring)."""
    if name == "gpt":
        from _systems import BATCH, CFG

        return CFG, BATCH
    if full or device().type == "cuda":
        return GPTConfig(**PRESETS["llama-254m"]), 8
    return GPTConfig(
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        n_embd=128,
        mlp="swiglu",
        mlp_hidden=352,
        vocab_size=2048,
        block_size=64,
        tie_head=False,
    ), 4


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A 1-rank group for FSDP2 (ZeroAdamW would run without one); kept if one exists."""
    if dist.is_initialized():
        yield
        return
    cuda = device().type == "cuda"
    with reserved_port() as port:  # held until the store listens on it
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
            **({"device_id": device()} if cuda else {}),
        )
    try:
        yield
    finally:
        dist.destroy_process_group()


class Phased:
    """One system: forward, backward, step and zero_grad as separate calls."""

    def __init__(self, name: str, cfg: GPTConfig) -> None:
        dev = device()
        bf16 = dev.type == "cuda"
        torch.manual_seed(0)
        self.model = model = GPT(cfg).to(dev)
        self.opt: object | None = None
        self.clip: Callable[[], object] = lambda: None
        if name == "bare":
            if bf16:
                model.to(torch.bfloat16)
        elif name == "torch_adamw":
            if bf16:
                model.to(torch.bfloat16)
            fused = {"fused": True} if _has_fused(dev) else {"foreach": True}
            self.opt = torch.optim.AdamW(gpt_param_groups(model, WD), lr=LR, **fused)
            params = list(model.parameters())
            self.clip = lambda: nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        elif name == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = (
                MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
            )
            for block in model.blocks:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            self.opt = torch.optim.AdamW(
                gpt_param_groups(model, WD), lr=LR, **({"fused": True} if _has_fused(dev) else {})
            )
            params = list(model.parameters())
            self.clip = lambda: nn.utils.clip_grad_norm_(params, CLIP)
        else:
            stage = int(name.rsplit("-", 1)[1])
            self.opt = ZeroAdamW(
                gpt_param_groups(model, WD),
                lr=LR,
                stage=stage,
                module=model,
                max_grad_norm=CLIP,
                precision=Precision(param_dtype=torch.bfloat16 if bf16 else None),
            )
        self.name = name

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)[1]

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        if self.opt is not None:
            self.clip()
            self.opt.step()  # type: ignore[attr-defined]

    def zero_grad(self) -> None:
        if self.opt is None:
            self.model.zero_grad(set_to_none=True)
        else:
            self.opt.zero_grad()  # type: ignore[attr-defined]


def _has_fused(dev: torch.device) -> bool:
    """torch.optim.AdamW(fused=True) on this device's params (CPU since torch 2.4)."""
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1, device=dev))], fused=True)
        return True
    except (RuntimeError, ValueError):
        return False


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_phases(
    model: str, systems: tuple[str, ...] = SYSTEMS, steps: int = STEPS, full: bool = FULL
) -> dict[str, dict[str, list[float]]]:
    """Seconds per phase per step, by system: {system: {phase: [steps]}}."""
    cfg, batch = model_shape(model, full)
    dev = device()
    if dev.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(THREADS)
        try:
            return _measure_phases(cfg, batch, systems, steps)
        finally:
            torch.set_num_threads(threads)
    return _measure_phases(cfg, batch, systems, steps)


def _measure_phases(
    cfg: GPTConfig, batch: int, systems: tuple[str, ...], steps: int
) -> dict[str, dict[str, list[float]]]:
    dev = device()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(dev)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(dev)
    with one_rank_group():
        built = {s: Phased(s, cfg) for s in systems}
        times = {s: {p: [] for p in PHASES} for s in systems}
        for i in range(WARMUP + steps):
            for s in systems[i % len(systems) :] + systems[: i % len(systems)]:
                sysm, out = built[s], times[s]
                _sync()
                t0 = time.perf_counter()
                loss = sysm.forward(x, y)
                _sync()
                t1 = time.perf_counter()
                sysm.backward(loss)
                _sync()
                t2 = time.perf_counter()
                sysm.step()
                _sync()
                t3 = time.perf_counter()
                sysm.zero_grad()
                _sync()
                t4 = time.perf_counter()
                if i >= WARMUP:
                    for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                        out[p].append(dt)
        for s in built.values():
            if isinstance(s.opt, ZeroAdamW):
                s.opt.close()
    return times


def profile_system(model: str, system: str, steps: int = 3) -> str:
    """torch.profiler tables of `steps` steps of one system after warm-up: where forward,
    backward and step spend host and device time (ops by self time; CUDA kernels on CUDA)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cfg, batch = model_shape(model)
    dev = device()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(dev)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with one_rank_group():
        s = Phased(system, cfg)
        for _ in range(WARMUP):
            loss = s.forward(x, y)
            s.backward(loss)
            s.step()
            s.zero_grad()
        _sync()
        with profile(activities=acts) as prof:
            for _ in range(steps):
                for phase in PHASES:
                    with record_function(f"phase:{phase}"):
                        if phase == "forward":
                            loss = s.forward(x, y)
                        elif phase == "backward":
                            s.backward(loss)
                        else:
                            getattr(s, phase)()
                    _sync()
        if isinstance(s.opt, ZeroAdamW):
            s.opt.close()
    ka = prof.key_averages()
    out = [f"profile: {system} on {model}, {steps} steps, {dev}"]
    out.append(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if dev.type == "cuda":
        out.append(ka.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    return "\n".join(out)


# -- hook host time -------------------------------------------------------------------------------
def _chain(per_unit: int = 1, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """HOOK_LAYERS x Linear(4, 4) in blocks of `per_unit` (each block one stage-3 unit)."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(*[nn.Linear(4, 4) for _ in range(per_unit)])
            for _ in range(HOOK_LAYERS // per_unit)
        ]
    ).to(dtype)


# Linear layers per unit in the second stage-3 chain (1 where the chain is too short for two).
COARSE = max(1, min(10, HOOK_LAYERS // 2))


def _is_block(root: nn.Module) -> Callable[[nn.Module], bool]:
    return lambda m: isinstance(m, nn.Sequential) and m is not root


def measure_hooks(
    stages: tuple[int, ...] = (0, 1, 2, 3),
    rounds: int = HOOK_ROUNDS,
    dtype: torch.dtype = torch.float32,
    ops: bool = False,
) -> dict[str, dict[str, float]]:
    """Thread CPU seconds of forward, backward and zero_grad, by system (`bare`, `fusedzero-S`),
    on the CPU with one torch thread, the fastest of `rounds` rounds (thread CPU time: another
    process on the core can only add to it, so the minimum is the cost itself; a median moved
    by up to 2x between quiet and busy moments of a shared machine), plus the per-param overhead
    over bare in microseconds: `forward_us_per_param`, `backward_us_per_param` and
    `backward_zero_grad_us_per_param` (backward plus zero_grad: bare frees its grads in
    `zero_grad(set_to_none=True)`, stages 2-3 free theirs in backward, once a bucket is built:
    the same frees, counted on both sides). Stage 3 also on a chain of COARSE layers per unit
    (`fusedzero-3/10` over `bare/10`): from the two, its cost per unit and per param apart
    (`*_us_per_unit`, `*_us_per_param_alone`). `dtype`: the chain's (fp32 reduce); `ops`: also
    `backward_ops_per_param`, the aten ops each backward dispatches over bare's, per param."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(2, 4, dtype=dtype)
        models: dict[str, tuple[nn.Module, ZeroAdamW | None]] = {"bare": (_chain(1, dtype), None)}
        for s in stages:
            m = _chain(1, dtype)
            models[f"fusedzero-{s}"] = (
                m,
                ZeroAdamW(
                    m.parameters(), lr=LR, stage=s, module=m, sharding=Sharding(units=_is_block(m))
                ),
            )
        split = 3 in stages and COARSE > 1
        if split:
            models[f"bare/{COARSE}"] = (_chain(COARSE, dtype), None)
            m = _chain(COARSE, dtype)
            models[f"fusedzero-3/{COARSE}"] = (
                m,
                ZeroAdamW(
                    m.parameters(), lr=LR, stage=3, module=m, sharding=Sharding(units=_is_block(m))
                ),
            )
        parts = ("forward", "backward", "zero_grad")
        t: dict[str, dict[str, list[float]]] = {k: {p: [] for p in parts} for k in models}
        for r in range(3 + rounds):
            for name, (m, opt) in models.items():
                t0 = time.thread_time()
                loss = m(x).float().square().sum()
                t1 = time.thread_time()
                loss.backward()
                t2 = time.thread_time()
                if opt is not None:
                    opt.step()
                    t3 = time.thread_time()
                    opt.zero_grad()
                else:
                    t3 = time.thread_time()
                    m.zero_grad(set_to_none=True)
                t4 = time.thread_time()
                if r >= 3:
                    for p, dt in zip(parts, (t1 - t0, t2 - t1, t4 - t3)):
                        t[name][p].append(dt)
        # Params counted on the bare chains (a freed stage-3 param is empty).
        count = {
            k: sum(p.numel() > 0 for p in m.parameters())
            for k, (m, _) in models.items()
            if k.startswith("bare")
        }
        med = {k: {p: min(v) for p, v in d.items()} for k, d in t.items()}
        for d in med.values():
            d["backward_zero_grad"] = d["backward"] + d["zero_grad"]
        for k, d in med.items():
            base = f"bare/{COARSE}" if k.endswith(f"/{COARSE}") else "bare"
            d["params"] = count[base]
            d["rounds"] = rounds
            for p in ("forward", "backward", "backward_zero_grad"):
                d[f"{p}_us_per_param"] = (d[p] - med[base][p]) / count[base] * 1e6
        if split:
            # overhead = a * params + b * units, on both chains: solve for a and b.
            fine, coarse = med["fusedzero-3"], med[f"fusedzero-3/{COARSE}"]
            pf, pc = count["bare"], count[f"bare/{COARSE}"]
            uf, uc = HOOK_LAYERS, HOOK_LAYERS // COARSE
            for p in ("forward", "backward"):
                of, oc = fine[f"{p}_us_per_param"] * pf, coarse[f"{p}_us_per_param"] * pc
                b = (of * pc - oc * pf) / (uf * pc - uc * pf)
                fine[f"{p}_us_per_unit"] = b
                fine[f"{p}_us_per_param_alone"] = (of - b * uf) / pf
        if ops:
            n_ops = {}
            for name, (m, opt) in models.items():
                loss = m(x).float().square().sum()
                with _OpCount() as c:
                    loss.backward()
                n_ops[name] = c.n
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
                else:
                    m.zero_grad(set_to_none=True)
            for k, d in med.items():
                base = f"bare/{COARSE}" if k.endswith(f"/{COARSE}") else "bare"
                d["backward_ops_per_param"] = (n_ops[k] - n_ops[base]) / count[base]
        for _, opt in models.values():
            if opt is not None:
                opt.close()
        return med
    finally:
        torch.set_num_threads(threads)


class _OpCount(TorchDispatchMode):
    """Every op dispatched (views and collectives included), as tests/zero/test_hook_ops.py."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


# -- pytest-benchmark -----------------------------------------------------------------------------
_CACHE: dict[str, dict] = {}


def _phases(model: str) -> dict[str, dict[str, list[float]]]:
    if model not in _CACHE:
        _CACHE[model] = measure_phases(model)
    return _CACHE[model]


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_phases(benchmark, model: str, system: str) -> None:
    times = _phases(model)[system]
    total = [sum(ts) for ts in zip(*(times[p] for p in PHASES))]
    benchmark.group = f"phases at W=1, {model}, {device().type}"
    replay(benchmark, total)
    add_stats(benchmark)
    benchmark.extra_info.update(
        {
            "subject": "phases",
            "device": device().type,
            "model": model,
            "system": system,
            "full": FULL,
            **{f"{p}_ms": statistics.median(times[p]) * 1e3 for p in PHASES},
        }
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hook_host_time(benchmark, stage: int) -> None:
    if "hooks" not in _CACHE:
        _CACHE["hooks"] = measure_hooks()
    med = _CACHE["hooks"]
    d = med[f"fusedzero-{stage}"]
    benchmark.group = f"hook host time per param, {HOOK_LAYERS} tiny layers, cpu"
    replay(benchmark, [d["backward"]])
    benchmark.extra_info.update(
        {
            "subject": "hooks",
            "stage": stage,
            "params": d["params"],
            "backward_us_per_param": d["backward_us_per_param"],
            "backward_zero_grad_us_per_param": d["backward_zero_grad_us_per_param"],
            "forward_us_per_param": d["forward_us_per_param"],
        }
    )
    SUMMARY.append(
        f"hook host time stage {stage}: backward +{d['backward_us_per_param']:.1f} "
        f"us/param (with zero_grad +{d['backward_zero_grad_us_per_param']:.1f}), "
        f"forward +{d['forward_us_per_param']:.1f} us/param over bare"
    )
    if stage == 3:
        SUMMARY.append(per_unit_line(med))


# -- command line ---------------------------------------------------------------------------------
def format_phases(model: str, times: dict[str, dict[str, list[float]]]) -> str:
    cfg, batch = model_shape(model)
    head = f"{'system':<14}" + "".join(f"{p + ' ms':>24}" for p in PHASES) + f"{'total ms':>10}"
    lines = [
        f"{model}: {cfg.n_layer} layers, d {cfg.n_embd}, {batch} x {cfg.block_size} tokens, "
        f"{device()}; medians of {len(next(iter(times.values()))['step'])} steps "
        f"(p20-p80 in brackets)",
        head,
    ]
    for s, d in times.items():
        row = f"{s:<14}"
        for p in PHASES:
            q = (
                torch.quantile(
                    torch.tensor(d[p], dtype=torch.float64),
                    torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64),
                )
                * 1e3
            )
            row += f"{q[1]:.2f} [{q[0]:.2f}-{q[2]:.2f}]".rjust(24)
        row += f"{sum(statistics.median(d[p]) for p in PHASES) * 1e3:>10.2f}"
        lines.append(row)
    return "\n".join(lines)


def format_hooks(med: dict[str, dict[str, float]], dtype: str = "fp32") -> str:
    n = int(med["bare"]["params"])
    ops = "backward_ops_per_param" in med["bare"]
    lines = [
        f"hook host time: {HOOK_LAYERS} x Linear(4, 4) in {dtype}, {n} params, thread CPU "
        f"time, fastest of {int(med['bare']['rounds'])} rounds; us/param over bare "
        "(bwd+zg: backward plus zero_grad)" + ("; bwd ops/p: aten ops over bare" if ops else ""),
        f"{'system':<14}{'fwd ms':>9}{'bwd ms':>9}{'zg ms':>8}{'fwd us/p':>10}{'bwd us/p':>10}"
        f"{'bwd+zg us/p':>13}" + (f"{'bwd ops/p':>11}" if ops else ""),
    ]
    for k, d in med.items():
        lines.append(
            f"{k:<14}{d['forward'] * 1e3:>9.2f}{d['backward'] * 1e3:>9.2f}"
            f"{d['zero_grad'] * 1e3:>8.2f}{d['forward_us_per_param']:>10.1f}"
            f"{d['backward_us_per_param']:>10.1f}"
            f"{d['backward_zero_grad_us_per_param']:>13.1f}"
            + (f"{d['backward_ops_per_param']:>11.2f}" if ops else "")
        )
    lines += [per_unit_line(med)] if "backward_us_per_unit" in med.get("fusedzero-3", {}) else []
    return "\n".join(lines)


def per_unit_line(med: dict[str, dict[str, float]]) -> str:
    """Stage 3's cost split into per unit and per param (from the 1- and COARSE-layer units)."""
    d = med["fusedzero-3"]
    return (
        f"stage 3 apart: backward {d['backward_us_per_unit']:.0f} us per unit + "
        f"{d['backward_us_per_param_alone']:.1f} us per param, forward "
        f"{d['forward_us_per_unit']:.0f} us per unit + {d['forward_us_per_param_alone']:.1f} "
        f"us per param (1 and {COARSE} Linear layers per unit)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="the full 254M Llama shape on CPU too")
    p.add_argument("--model", choices=("llama", "gpt", "both"), default="both")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--no-hooks", dest="hooks", action="store_false")
    p.add_argument("--no-phases", dest="phases", action="store_false")
    p.add_argument(
        "--hook-dtype",
        choices=tuple(HOOK_DTYPES),
        default="fp32",
        help="dtype of the hook chain's params (fp32 reduce either way)",
    )
    p.add_argument(
        "--hook-ops",
        action="store_true",
        help="also count the aten ops of each backward over bare, per param",
    )
    p.add_argument("--json", type=Path, help="also write the raw times here (bench/gpu/report.py)")
    p.add_argument(
        "--profile",
        metavar="SYSTEM",
        action="append",
        default=[],
        help="print torch.profiler tables of this system's steps (repeatable)",
    )
    args = p.parse_args(argv)
    for system in args.profile:
        for model in ("llama", "gpt") if args.model == "both" else (args.model,):
            print(profile_system(model, system))
            print()
    record: dict[str, object] = {
        "device": str(device()),
        "torch": torch.__version__,
        "phases": {},
        "shapes": {},
    }
    if torch.cuda.is_available():
        record["device_name"] = torch.cuda.get_device_name()
    if args.phases:
        for model in ("llama", "gpt") if args.model == "both" else (args.model,):
            times = measure_phases(model, steps=args.steps, full=args.full)
            cfg, batch = model_shape(model, args.full)
            record["phases"][model] = times  # type: ignore[index]
            record["shapes"][model] = {
                "n_layer": cfg.n_layer,
                "n_embd": cfg.n_embd,  # type: ignore[index]
                "batch": batch,
                "tokens": cfg.block_size,
            }
            print(format_phases(model, times))
            print()
    if args.hooks:
        record["hooks"] = med = measure_hooks(dtype=HOOK_DTYPES[args.hook_dtype], ops=args.hook_ops)
        print(format_hooks(med, args.hook_dtype))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
