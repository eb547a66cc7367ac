"""The systems the step bench compares, and how each is built inside a rank (see bench_step.py).

A system is one way to train the same GPT on the same per-rank batch: fusedzero at a stage,
or a peer (DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed), in fp32 or bf16. `bare` is the
model alone (forward + backward, grads dropped): no optimizer, no hook, no wrapper. What a
system spends beyond `bare` in the same round is its overhead.

[Note: bf16 matmuls on CPUs without bf16 units] A CPU without AVX-512 (this machine: AVX2) has
no bf16 GEMM: torch runs bf16 linears 7-100x slower than fp32 ones (bare bf16 forward + backward
3.5 s vs 0.19 s here), which buries any optimizer's overhead in fwd/bwd noise and ran the bf16
session past its time limit. "fp32" computes every linear of the bench model from its bf16 operands
in fp32 and rounds the result to bf16: bf16 x bf16 products are exact in fp32, so this is a bf16
GEMM with fp32 accumulation, what native bf16 GEMMs do, up to the order of the sum. Params, grads
and everything the optimizers see stay bf16. Every system gets the same model, so the comparison is
unchanged. FUSEDZERO_BENCH_BF16_MATMUL=native|fp32 overrides the choice (default: native only where
torch reports AVX-512).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fusedzero import Groups, Precision, Sharding, Wire, ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups

_L, _D, _H, _T = (int(x) for x in os.environ.get("FUSEDZERO_BENCH_MODEL", "4,256,4,128").split(","))
CFG = GPTConfig(n_layer=_L, n_embd=_D, n_head=_H, block_size=_T, vocab_size=256)
BATCH = int(os.environ.get("FUSEDZERO_BENCH_BATCH", "8"))
# Every system with buckets gets the same size: 2**20 elements (4 MiB of fp32) gives this
# 3M-param model a few buckets, so reduction can overlap backward the same way everywhere.
BUCKET = int(os.environ.get("FUSEDZERO_BENCH_BUCKET", str(1 << 20)))
LR, WD = 1e-3, 0.1
# Global-norm clipping at 1.0 for every system, as LLM pretraining runs use it. 0 turns it off
# everywhere (and fusedzero's non-finite check with it, which no peer does unasked).
CLIP = float(os.environ.get("FUSEDZERO_BENCH_CLIP", "1.0"))
BF16, F32 = torch.bfloat16, torch.float32


def _bf16_matmul_mode() -> str:
    """How the bench model's bf16 linears multiply: "native" or "fp32" (see
    [Note: bf16 matmuls on CPUs without bf16 units])."""
    mode = os.environ.get("FUSEDZERO_BENCH_BF16_MATMUL", "auto")
    if mode == "auto":
        mode = "native" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "fp32"
    if mode not in ("native", "fp32"):
        raise ValueError(f"FUSEDZERO_BENCH_BF16_MATMUL must be auto, native or fp32, got {mode!r}")
    return mode


BF16_MATMUL = _bf16_matmul_mode()


class Fp32AccumLinear(torch.nn.Linear):
    """nn.Linear whose bf16/fp16 inputs are multiplied in fp32 and rounded back
    (see [Note: bf16 matmuls on CPUs without bf16 units]); fp32 inputs take nn.Linear's path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == F32:
            return super().forward(x)
        b = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), self.weight.float(), b).to(x.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
    """One system of the bench."""

    family: str  # bare | fusedzero | torch | deepspeed
    precision: str  # fp32 | bf16 (bf16 params for compute, fp32 master and moments)
    stages: tuple[int, ...] = ()  # the ZeRO stages it is compared at (FSDP2 keep: 2 and 3)
    reduce: str = "fp32"  # dtype grads are reduced in (what the system does by default or is told)
    regather: str = ""  # stage 3: "reshard" (free after forward, gather again) or "keep"
    note: str = ""
    wire: str | None = None  # fusedzero: grads cross the network as (docs/wire.md), fp32 sum
    bench: bool = True  # timed by bench_step.py; False: a parity reference (bench/gpu/multi.py)


def _fz(stage: int, precision: str = "fp32", reduce: str = "fp32", regather: str = "") -> Spec:
    return Spec(
        family="fusedzero", precision=precision, stages=(stage,), reduce=reduce, regather=regather
    )


# name -> spec; order is the report's order within a precision.
SYSTEMS: dict[str, Spec] = {
    "bare": Spec(family="bare", precision="fp32", reduce=""),
    "fusedzero-0": _fz(0),
    "fusedzero-1": _fz(1),
    "fusedzero-2": _fz(2),
    "fusedzero-3": _fz(3, regather="reshard"),
    "fusedzero-3-keep": _fz(3, regather="keep"),
    "ddp+adamw_fused": Spec(family="torch", precision="fp32", stages=(0,)),
    # torch.optim.AdamW's default (foreach): its bias corrections are host float64, where the
    # fused CUDA kernel's are fp32 on the device (bench/gpu/numerics.py measures both).
    "ddp+adamw": Spec(
        family="torch",
        precision="fp32",
        stages=(0,),
        bench=False,
        note="torch.optim.AdamW(foreach=True): the fp32 parity reference",
    ),
    "torch_zero1": Spec(family="torch", precision="fp32", stages=(1,)),
    "fsdp2-keep": Spec(
        family="torch",
        precision="fp32",
        stages=(2, 3),
        regather="keep",
        note="reshard_after_forward=False",
    ),
    "fsdp2-reshard": Spec(
        family="torch",
        precision="fp32",
        stages=(3,),
        regather="reshard",
        note="reshard_after_forward=True",
    ),
    **{f"deepspeed-{s}": Spec(family="deepspeed", precision="fp32", stages=(s,)) for s in range(3)},
    "deepspeed-3": Spec(
        family="deepspeed",
        precision="fp32",
        stages=(3,),
        regather="default",
        note="DeepSpeed's defaults: max_reuse_distance 1e9, params under 1e5 "
        "elements stay replicated",
    ),
    "deepspeed-3-reshard": Spec(
        family="deepspeed",
        precision="fp32",
        stages=(3,),
        regather="reshard",
        note="max_reuse_distance 0, persistence threshold 0",
    ),
    # bf16: bf16 params, fp32 master. Ours both ways: grads reduced in fp32 and in bf16.
    "bare-bf16": Spec(family="bare", precision="bf16", reduce=""),
    **{
        f"fusedzero-{s}-bf16-r{r}": _fz(
            s, "bf16", {"32": "fp32", "16": "bf16"}[r], "reshard" if s == 3 else ""
        )
        for s in range(4)
        for r in ("32", "16")
    },
    "fusedzero-3-keep-bf16-r16": _fz(3, "bf16", "bf16", "keep"),
    # Compressed wire (fp32 params and grads): the bucket quantized, all-to-all, fp32 sum.
    **{
        f"fusedzero-{s}-w{w}": dataclasses.replace(
            _fz(s, regather="reshard" if s == 3 else ""), wire=w, note=f"wire={w}"
        )
        for s in range(4)
        for w in ("bf16", "int8")
    },
    "fsdp2-keep-bf16-r16": Spec(
        family="torch",
        precision="bf16",
        stages=(2, 3),
        reduce="bf16",
        regather="keep",
        note="MixedPrecisionPolicy(param_dtype=bf16), reduce_dtype default (= param_dtype)",
    ),
    "fsdp2-reshard-bf16-r16": Spec(
        family="torch",
        precision="bf16",
        stages=(3,),
        reduce="bf16",
        regather="reshard",
        note="as above, reshard_after_forward",
    ),
    "fsdp2-keep-bf16-r32": Spec(
        family="torch",
        precision="bf16",
        stages=(2, 3),
        reduce="fp32",
        regather="keep",
        note="reduce_dtype=float32",
    ),
    "fsdp2-reshard-bf16-r32": Spec(
        family="torch",
        precision="bf16",
        stages=(3,),
        reduce="fp32",
        regather="reshard",
        note="reduce_dtype=float32",
    ),
    **{
        f"deepspeed-{s}-bf16": Spec(
            family="deepspeed",
            precision="bf16",
            stages=(s,),
            reduce="bf16",
            regather="default" if s == 3 else "",
            note="bf16.enabled, communication_data_type default (bf16)",
        )
        for s in range(4)
    },
}


def stage_of(name: str) -> int:
    """The stage a fusedzero or DeepSpeed system runs (peers: their first comparison stage)."""
    return SYSTEMS[name].stages[0]


@functools.cache
def unavailable(name: str) -> str | None:
    """Why `name` cannot run here, or None (checked in the parent: skipped with the reason)."""
    spec = SYSTEMS[name]
    if spec.family == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install -e '.[peers]'; DS_ACCELERATOR=cpu)"
    if name.startswith("fsdp2"):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as e:
            return f"FSDP2 (torch.distributed.fsdp.fully_shard) missing: {e}"
    return None


class System:
    """A built system: `step(x, y)` runs forward, backward and the optimizer step."""

    def __init__(
        self,
        name: str,
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        roots: list[Any],
        params: Callable[[], list[torch.Tensor]],
        own_comm: Callable[[], dict[str, int]] | None = None,
        memory: Callable[[], dict[str, int]] | None = None,
        reset_comm: Callable[[], None] | None = None,
        info: dict | None = None,
    ):
        self.name, self.step, self.roots, self.params = name, step, roots, params
        self.own_comm, self.memory, self.reset_comm = own_comm, memory, reset_comm
        self.info = info or {}


def make_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    if BF16_MATMUL == "fp32":
        for m in model.modules():
            if type(m) is torch.nn.Linear:
                m.__class__ = Fp32AccumLinear  # same params and state dict, other forward
    return model


def _train_step(model: Any, opt: Any, clip_params: Any = None) -> Callable:
    # A list, not the iterable given: `model.parameters()` is a generator, empty after the first
    # step, and clip_grad_norm_ then clips nothing (only warns) from the second step on.
    clip_params = None if clip_params is None else list(clip_params)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = model(x, y)
        loss.backward()
        if CLIP and clip_params is not None:
            torch.nn.utils.clip_grad_norm_(clip_params, CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def build(name: str, world: int) -> System:
    spec = SYSTEMS[name]
    model = make_model()
    params = lambda: list(model.parameters())  # noqa: E731
    if spec.family == "bare":
        if spec.precision == "bf16":
            model.to(BF16)

        def bare(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _, loss = model(x, y)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss

        return System(name, bare, [model], params)
    if spec.family == "fusedzero":
        bf16 = spec.precision == "bf16"
        pg = None
        opt = ZeroAdamW(
            gpt_param_groups(model, WD),
            lr=LR,
            stage=spec.stages[0],
            module=model,
            max_grad_norm=CLIP or None,
            precision=Precision(
                skip_nonfinite=bool(CLIP),
                param_dtype=BF16 if bf16 else None,
                reduce_dtype=BF16 if spec.reduce == "bf16" else F32,
            ),
            wire=Wire(grads=spec.wire),
            groups=Groups(shard=pg),
            sharding=Sharding(bucket_numel=BUCKET, reshard_after_forward=spec.regather != "keep"),
        )
        return System(
            name,
            _train_step(model, opt),
            [model, opt],
            params,
            own_comm=lambda: dict(opt.comm.bytes),
            memory=lambda: opt.memory()._asdict(),
            reset_comm=opt.comm.reset,
        )
    if name in ("ddp+adamw_fused", "ddp+adamw", "torch_zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=BUCKET * 4 / 2**20, gradient_as_bucket_view=True)
        if name.startswith("ddp+"):
            opt = torch.optim.AdamW(
                gpt_param_groups(model, WD),
                lr=LR,
                **({"fused": True} if name == "ddp+adamw_fused" else {"foreach": True}),
            )
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                gpt_param_groups(model, WD), optimizer_class=torch.optim.AdamW, lr=LR, fused=True
            )

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _, loss = ddp(x, y)
            loss.backward()
            if CLIP:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep the bucket views (gradient_as_bucket_view)
            return loss

        return System(name, step, [ddp, model, opt], params, info={"ddp_allreduce": True})
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy()
        if spec.precision == "bf16":
            mp = MixedPrecisionPolicy(
                param_dtype=BF16, reduce_dtype=F32 if spec.reduce == "fp32" else None
            )
        reshard = spec.regather == "reshard"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
        opt = torch.optim.AdamW(gpt_param_groups(model, WD), lr=LR, fused=True)
        return System(
            name,
            _train_step(model, opt, model.parameters()),
            [model, opt],
            lambda: [p.to_local() for p in model.parameters()],
        )
    if spec.family == "deepspeed":
        return _deepspeed(name, spec, model, world)
    raise KeyError(name)


def _deepspeed(name: str, spec: Spec, model: GPT, world: int) -> System:
    import deepspeed

    stage = spec.stages[0]
    opt = torch.optim.AdamW(gpt_param_groups(model, WD), lr=LR, fused=True)
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": BUCKET,
        "allgather_bucket_size": BUCKET,
        "stage3_prefetch_bucket_size": BUCKET,
    }
    if stage == 3:
        # DeepSpeed's default replaces torch.nn.functional.linear process-wide with its own
        # autograd Function (deepspeed/runtime/zero/linear.py) and never puts it back: every
        # system built after it in the same ranks, `bare` included, would then run its linears
        # through DeepSpeed's Python Function (seen with py-spy; in bf16 it made the run several
        # times slower). Off, each system runs torch's own linear.
        zero["memory_efficient_linear"] = False
    if spec.regather == "reshard":
        # Partition every param (the default threshold, 1e5 elements, keeps this model's
        # 65k-element matrices replicated) and re-gather in backward (the default
        # max_reuse_distance, 1e9, keeps params gathered from forward to backward): what
        # fusedzero-3 and FSDP2 reshard_after_forward=True do.
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "gradient_clipping": CLIP,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if spec.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, ds_opt, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, config=cfg, dist_init_required=False
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    info = {
        "deepspeed": deepspeed.__version__,
        "optimizer": type(ds_opt).__name__,
        "comm_backend": dist.get_backend(),
    }
    return System(name, step, [engine, ds_opt, model], lambda: list(model.parameters()), info=info)
