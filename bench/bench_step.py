"""One training step (forward + backward + optimizer step) per ZeRO stage, fusedzero vs peers.

Every system trains the same GPT (same seed, fp32 params and grads) on the same global batch,
split over W gloo ranks (W=2 by default). Systems, by the ZeRO stage they correspond to:

  stage 0  fusedzero stage=0 | DDP + torch AdamW(fused) | DeepSpeed ZeRO-0
  stage 1  fusedzero stage=1 | DDP + torch ZeroRedundancyOptimizer(AdamW fused) | DeepSpeed ZeRO-1
  stage 2  fusedzero stage=2 | FSDP2 fully_shard(reshard_after_forward=False) | DeepSpeed ZeRO-2
  stage 3  fusedzero stage=3 | FSDP2 fully_shard(reshard_after_forward=True)  | DeepSpeed ZeRO-3

[Note: how it is timed]
All systems are built side by side in the same W spawned ranks and stepped round-robin: step i
runs every system once, starting from a different system each time. Two ranks share two cores
with whatever else runs on the machine, so step times drift by +-20-30%; alternating puts every
system under the same drift, and medians compare them. A step is timed on each rank from a
barrier to the end of `step()`; the step time is the slower rank's. The per-step times are
replayed into pytest-benchmark (its table, JSON and compare work as usual) and median/p20/p80
are in extra_info.

[Note: what is counted]
- comm_bytes: bytes on the wire per rank for one step by the ring formulas (all-reduce
  2(W-1)/W*n*b; reduce-scatter, all-gather and broadcast (W-1)/W*n*b). fusedzero: its own
  counter (`opt.comm`). Others: every torch.distributed collective called from Python is
  wrapped and counted in the ranks. DDP's all-reduce runs inside its C++ reducer, which no
  wrapper sees: it all-reduces every grad once per step, so its bytes are 2(W-1)/W * (grad bytes),
  counted from the grads (marked "formula").
- tensor_bytes: resident bytes per rank between steps, counted exactly from tensors: every
  tensor reachable from the system's objects (model, wrapper, optimizer, engine) through Python
  references, deduplicated by storage (views and flat-buffer aliases count once, freed
  storages count 0). fusedzero's own `opt.memory()` is reported beside it.
- rss_growth: how much the rank's RSS grew while the system was built and stepped once
  (allocator-dependent; `MALLOC_MMAP_THRESHOLD_=65536` makes large frees return memory). A
  cross-check only.

Env (defaults keep the whole suite under ~10 minutes on 2 cores):
  FUSEDZERO_BENCH_STEPS   timed steps per system (12)     FUSEDZERO_BENCH_WARMUP  warmup (3)
  FUSEDZERO_BENCH_WORLD   ranks (2)                       FUSEDZERO_BENCH_BATCH   global batch (8)
  FUSEDZERO_BENCH_MODEL   n_layer,n_embd,n_head,block_size (4,256,4,128: 3.3M params)
  FUSEDZERO_BENCH_BUCKET  bucket elements for every system that has buckets (1048576)
"""
from __future__ import annotations

import functools
import gc
import importlib.util
import os
import resource
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _common import SUMMARY, percentiles, replay
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

STEPS = int(os.environ.get("FUSEDZERO_BENCH_STEPS", "12"))
WARMUP = int(os.environ.get("FUSEDZERO_BENCH_WARMUP", "3"))
WORLD = int(os.environ.get("FUSEDZERO_BENCH_WORLD", "2"))
BATCH = int(os.environ.get("FUSEDZERO_BENCH_BATCH", "8"))
_L, _D, _H, _T = (int(x) for x in os.environ.get("FUSEDZERO_BENCH_MODEL", "4,256,4,128").split(","))
CFG = GPTConfig(n_layer=_L, n_embd=_D, n_head=_H, block_size=_T, vocab_size=256)
# Every system with buckets gets the same size: 2**20 elements (4 MiB of fp32) gives this
# 3M-param model a few buckets, so reduction can overlap backward the same way everywhere.
BUCKET = int(os.environ.get("FUSEDZERO_BENCH_BUCKET", str(1 << 20)))
LR, WD = 1e-3, 0.1
# Global-norm clipping at 1.0 for every system, as LLM pretraining runs use it. 0 turns it off
# everywhere (and fusedzero's non-finite check with it, which no peer does unasked).
CLIP = float(os.environ.get("FUSEDZERO_BENCH_CLIP", "1.0"))
RANK_ENV = {"DS_ACCELERATOR": "cpu", "MALLOC_MMAP_THRESHOLD_": "65536"}

# system name -> (ZeRO stage, family). Order is the order of the report.
SYSTEMS: dict[str, tuple[int, str]] = {
    "fusedzero-0": (0, "fusedzero"), "ddp+adamw_fused": (0, "torch"),
    "deepspeed-0": (0, "deepspeed"),
    "fusedzero-1": (1, "fusedzero"), "torch_zero1": (1, "torch"), "deepspeed-1": (1, "deepspeed"),
    "fusedzero-2": (2, "fusedzero"), "fsdp2_zero2": (2, "torch"), "deepspeed-2": (2, "deepspeed"),
    "fusedzero-3": (3, "fusedzero"), "fsdp2_zero3": (3, "torch"), "deepspeed-3": (3, "deepspeed"),
}


# -- availability (checked in the parent, so unavailable systems are skipped with a reason) -----
@functools.cache
def unavailable(name: str) -> str | None:
    """Why `name` cannot run here, or None."""
    stage, family = SYSTEMS[name]
    if family == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not installed (pip install deepspeed; DS_ACCELERATOR=cpu)"
    if name == "fusedzero-3":
        try:  # ZeRO-3 is being written: try one step on one process before benchmarking it.
            torch.manual_seed(0)
            m = GPT(GPTConfig(n_layer=1, n_embd=8, n_head=1, block_size=4, vocab_size=11))
            opt = ZeroAdamW(m.parameters(), stage=3, module=m)
            x = torch.randint(0, 11, (2, 4))
            m(x, x)[1].backward()
            opt.step()
        except Exception as e:  # noqa: BLE001 - any failure means "not ready"
            return f"fusedzero stage 3 does not run yet: {type(e).__name__}: {e}"
    if name.startswith("fsdp2"):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as e:
            return f"FSDP2 (torch.distributed.fsdp.fully_shard) missing: {e}"
    return None


# -- the systems, built inside a rank -----------------------------------------------------------
class System:
    """A built system: `step(x, y)` runs forward, backward and the optimizer step."""

    def __init__(self, name: str, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 roots: list[Any], params: Callable[[], list[torch.Tensor]],
                 own_comm: Callable[[], dict[str, int]] | None = None,
                 memory: Callable[[], dict[str, int]] | None = None, info: dict | None = None):
        self.name, self.step, self.roots, self.params = name, step, roots, params
        self.own_comm, self.memory, self.info = own_comm, memory, info or {}


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def build(name: str, world: int) -> System:
    stage, family = SYSTEMS[name]
    model = make_model()
    if family == "fusedzero":
        opt = ZeroAdamW(gpt_param_groups(model, WD), lr=LR, stage=stage, module=model,
                        bucket_numel=BUCKET, max_grad_norm=CLIP or None,
                        skip_nonfinite=bool(CLIP))

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        def own_comm() -> dict[str, int]:
            return dict(opt.comm.bytes)

        def reset() -> None:
            opt.comm.reset()
        s = System(name, step, [model, opt], lambda: list(model.parameters()), own_comm,
                   lambda: opt.memory()._asdict())
        s.reset_comm = reset
        return s
    if name == "ddp+adamw_fused" or name == "torch_zero1":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, bucket_cap_mb=BUCKET * 4 / 2**20, gradient_as_bucket_view=True)
        if name == "ddp+adamw_fused":
            opt = torch.optim.AdamW(gpt_param_groups(model, WD), lr=LR, fused=True)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(gpt_param_groups(model, WD),
                                          optimizer_class=torch.optim.AdamW, lr=LR, fused=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _, loss = ddp(x, y)
            loss.backward()
            if CLIP:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep the bucket views (gradient_as_bucket_view)
            return loss
        return System(name, step, [ddp, model, opt], lambda: list(model.parameters()),
                      info={"ddp_allreduce": True})
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        reshard = name == "fsdp2_zero3"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(gpt_param_groups(model, WD), lr=LR, fused=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _, loss = model(x, y)
            loss.backward()
            if CLIP:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            return loss
        return System(name, step, [model, opt], lambda: [p.to_local() for p in model.parameters()])
    if family == "deepspeed":
        import deepspeed
        opt = torch.optim.AdamW(gpt_param_groups(model, WD), lr=LR, fused=True)
        cfg = {"train_micro_batch_size_per_gpu": BATCH // world,
               "gradient_accumulation_steps": 1,
               # Stage 3: partition every param (default threshold 1e5 elements would keep this
               # model's 65k-element matrices replicated) and re-gather in backward (default
               # max_reuse_distance 1e9 keeps params gathered from forward to backward), which
               # is what fusedzero-3 and FSDP2 reshard_after_forward=True do.
               "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                     "allgather_bucket_size": BUCKET,
                                     "stage3_prefetch_bucket_size": BUCKET,
                                     "stage3_param_persistence_threshold": 0,
                                     "stage3_max_reuse_distance": 0},
               "gradient_clipping": CLIP,
               "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
               "wall_clock_breakdown": False}
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg,
                                                    dist_init_required=False)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
        info = {"deepspeed": deepspeed.__version__, "optimizer": type(ds_opt).__name__,
                "comm_backend": dist.get_backend()}
        return System(name, step, [engine, ds_opt, model],
                      lambda: list(model.parameters()), info=info)
    raise KeyError(name)


# -- counting collectives -----------------------------------------------------------------------
_COUNT: dict[str, int] = {}
# function name -> (kind, how to get the full element count from the bound arguments)
_WRAPPED = {
    "all_reduce": ("all_reduce", lambda a: _numel(a["tensor"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _numel(a["input"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _numel(a["input"])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: _numel(a["input"])),
    "reduce_scatter": ("reduce_scatter", lambda a: sum(_numel(t) for t in a["input_list"])),
    "all_gather_into_tensor": ("all_gather", lambda a: _numel(a["output_tensor"])),
    "all_gather_single": ("all_gather", lambda a: _numel(a["output_tensor"])),
    "_all_gather_base": ("all_gather", lambda a: _numel(a["output_tensor"])),
    "all_gather": ("all_gather", lambda a: sum(_numel(t) for t in a["tensor_list"])),
    "broadcast": ("broadcast", lambda a: _numel(a["tensor"])),
    "reduce": ("reduce", lambda a: _numel(a["tensor"])),
    "all_to_all_single": ("all_to_all", lambda a: _numel(a["input"])),
    "all_gather_into_tensor_coalesced": (
        "all_gather", lambda a: sum(_numel(t) for t in a["output_tensors"])),
    "reduce_scatter_tensor_coalesced": (
        "reduce_scatter", lambda a: sum(_numel(t) for t in a["inputs"])),
    "all_reduce_coalesced": ("all_reduce", lambda a: sum(_numel(t) for t in a["tensors"])),
}


def _numel(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # bytes, despite the name: n*b of the ring formulas


def _install_counters(world: int) -> None:
    import inspect
    for fname, (kind, nbytes) in _WRAPPED.items():
        fn = getattr(dist, fname, None)
        if fn is None or getattr(fn, "_bench_wrapped", False):
            continue
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, __fn=fn, __sig=sig, __kind=kind, __nbytes=nbytes,
                    **kwargs: Any) -> Any:
            try:
                b = __sig.bind(*args, **kwargs).arguments
                n = __nbytes(b)
                factor = 2 if __kind == "all_reduce" else 1
                _COUNT[__kind] = _COUNT.get(__kind, 0) + factor * (world - 1) * n // world
            except Exception:  # noqa: BLE001 - counting must never break the collective
                _COUNT["uncounted_calls"] = _COUNT.get("uncounted_calls", 0) + 1
            return __fn(*args, **kwargs)
        wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        setattr(dist, fname, wrapper)


# -- counting resident tensors ------------------------------------------------------------------
_SKIP = (types.ModuleType, type, str, bytes, int, float, bool, types.CodeType,
         types.BuiltinFunctionType)


def reachable_tensor_bytes(roots: list[Any], limit: int = 3_000_000) -> tuple[int, int]:
    """Bytes of distinct storages of tensors reachable from `roots`, and the objects visited.

    Walks Python references (gc.get_referents), not module globals: functions contribute their
    closures and defaults only, so the walk stays inside the system's own objects.
    """
    from torch.distributed.tensor import DTensor
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if isinstance(o, DTensor):
                stack.append(o._local_tensor)
            elif o.device.type != "meta":
                try:
                    st = o.untyped_storage()
                    if st.data_ptr() != 0:
                        storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
                except (RuntimeError, NotImplementedError):
                    pass
            if o.grad is not None:
                stack.append(o.grad)
            if hasattr(o, "__dict__"):
                stack.extend(vars(o).values())
            continue
        if isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in (o.__closure__ or ())
                         if _cell_ok(c))
            stack.extend(o.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(o))
    return sum(storages.values()), len(seen)


def _cell_ok(c: Any) -> bool:
    try:
        c.cell_contents  # noqa: B018
        return True
    except ValueError:  # empty cell
        return False


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _storage_bytes(ts: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in ts:
        st = t.untyped_storage()
        if st.data_ptr():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


# -- the rank worker ----------------------------------------------------------------------------
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def worker(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    _install_counters(world)
    n = BATCH // world
    systems: dict[str, System] = {}
    out: dict[str, Any] = {}
    x0, y0 = batch(0)
    # Warm the process (autograd, thread pools, gloo buffers) so the first system built does not
    # carry one-time allocations in its RSS growth.
    warm = make_model()
    warm(x0[:n], y0[:n])[1].backward()
    dist.all_reduce(torch.zeros(1))
    del warm
    for name in names:
        gc.collect()
        rss0 = _rss()
        try:
            s = build(name, world)
            s.step(x0[rank * n:(rank + 1) * n], y0[rank * n:(rank + 1) * n])
        except Exception:  # noqa: BLE001 - a system that fails is reported, not fatal
            out[name] = {"error": traceback.format_exc(limit=6)}
            dist.barrier()
            continue
        gc.collect()
        systems[name] = s
        out[name] = {"times": [], "losses": [], "rss_growth": _rss() - rss0, "info": s.info}
        dist.barrier()
    order = list(systems)
    for i in range(WARMUP + STEPS):
        x, y = batch(i + 1)
        xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        k = i % len(order)
        for name in order[k:] + order[:k]:
            s = systems[name]
            _COUNT.clear()
            if hasattr(s, "reset_comm"):
                s.reset_comm()
            dist.barrier()
            t = time.perf_counter()
            loss = s.step(xs, ys)
            dt = time.perf_counter() - t
            r = out[name]
            if i >= WARMUP:
                r["times"].append(dt)
            r["losses"].append(float(loss))
            r["comm"] = dict(s.own_comm()) if s.own_comm else dict(_COUNT)
    for name, s in systems.items():
        r = out[name]
        gc.collect()
        params = s.params()
        r["param_bytes"] = _storage_bytes(params)
        grads = [p.grad for p in params if p.grad is not None]
        r["grad_bytes"] = _storage_bytes(grads)
        r["tensor_bytes"], r["objects_walked"] = reachable_tensor_bytes(s.roots)
        if s.memory is not None:
            r["own_memory"] = s.memory()
        if s.info.get("ddp_allreduce"):
            grad_bytes = sum(p.numel() * p.element_size() for p in params)
            r["comm"]["all_reduce (DDP reducer, formula)"] = 2 * (world - 1) * grad_bytes // world
        r["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


# -- pytest ------------------------------------------------------------------------------------
_RESULTS: dict[str, Any] = {}


def results() -> dict[str, Any]:
    if not _RESULTS:
        names = [n for n in SYSTEMS if unavailable(n) is None]
        ranks = run_ranks(worker, WORLD, names, timeout=900, env=RANK_ENV)
        _RESULTS["ranks"] = ranks
        _RESULTS["names"] = names
    return _RESULTS


pytestmark = pytest.mark.timeout(1200)


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_step(benchmark, name: str) -> None:
    reason = unavailable(name)
    if reason is not None:
        pytest.skip(reason)
    ranks = results()["ranks"]
    per_rank = [r[name] for r in ranks]
    if "error" in per_rank[0]:
        pytest.skip(f"{name} failed in the ranks: {per_rank[0]['error'][-1500:]}")
    # The step of the job is the slower rank's.
    times = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
    stage, family = SYSTEMS[name]
    benchmark.group = f"step stage {stage} (W={WORLD})"
    replay(benchmark, times)
    r0 = per_rank[0]
    stats = percentiles(times)
    benchmark.extra_info.update({f"time_{k}": v for k, v in stats.items()})
    benchmark.extra_info.update({
        "subject": "step", "system": name, "stage": stage, "family": family, "world": WORLD,
        "model": {"n_layer": CFG.n_layer, "n_embd": CFG.n_embd, "n_head": CFG.n_head,
                  "block_size": CFG.block_size, "vocab_size": CFG.vocab_size,
                  "params": make_model().num_params()},
        "global_batch": BATCH, "steps": STEPS, "warmup": WARMUP, "bucket_numel": BUCKET,
        "clip": CLIP,
        "systems_in_run": results()["names"],
        "comm_bytes": r0["comm"], "comm_bytes_total": sum(r0["comm"].values()),
        "param_bytes": [r["param_bytes"] for r in per_rank],
        "grad_bytes": [r["grad_bytes"] for r in per_rank],
        "tensor_bytes": [r["tensor_bytes"] for r in per_rank],
        "own_memory": [r.get("own_memory") for r in per_rank],
        "rss_growth": [r["rss_growth"] for r in per_rank],
        "max_rss": [r["max_rss"] for r in per_rank],
        "first_loss": r0["losses"][0], "last_loss": r0["losses"][-1],
        "info": r0["info"], "loadavg_1min": os.getloadavg()[0],
    })
    SUMMARY.append(f"step stage {stage} {name:>16}: median {stats['median'] * 1e3:7.1f} ms "
                   f"(p20 {stats['p20'] * 1e3:.1f}, p80 {stats['p80'] * 1e3:.1f}); comm "
                   f"{sum(r0['comm'].values()) / 1e6:.2f} MB/step; tensors "
                   f"{r0['tensor_bytes'] / 1e6:.1f} MB/rank")
