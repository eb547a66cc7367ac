"""The step rows per model shape: the shapes, the systems timed on them, and the update's
memory-traffic limit (bench/gpu/step_overhead.py --shape runs them).

Shapes (W=1, bf16 compute):
  gpt2-124m    fusedzero.app.model.PRESETS["gpt2"]: 12 x 768, 12 heads, vocab 50257, tied head;
               8 x 1024 tokens a step
  llama-255m   PRESETS["llama-254m"] (255.4M params here, see its comment): 16 x 1024, 16 heads,
               8 kv heads, SwiGLU 2816, vocab 32000, untied head; 8 x 1024 tokens
With `tiny=True` (the CPU dry run) each keeps its kind (tied GPT, Llama-like) at 2 layers,
d 64, vocab 512, 2 x 32 tokens: the code runs, nothing is measured.

Systems (clip 1.0 everywhere, lr 1e-3, weight decay 0.1 on matrices):
  bare             bf16 params: forward + backward, grads dropped (no optimizer, no hook)
  bare-autocast    fp32 params under torch.autocast(bf16): forward + backward, grads dropped
  fusedzero-S      ZeroAdamW(stage=S, precision=Precision(param_dtype=bf16)), other defaults: fp32
                   master and moments, grads reduced in fp32 (the update reads fp32 grads), bf16
                   params out
  ddp-autocast     what most users run (nanoGPT's loop): DDP(model) on fp32 params, forward under
                   torch.autocast(bf16), torch.optim.AdamW(fused=True), clip_grad_norm_(1.0),
                   zero_grad() (set_to_none)
  fsdp2            fully_shard per block and the root, MixedPrecisionPolicy(param_dtype=bf16)
                   (reduce dtype: its default, the param dtype), AdamW(fused=True) on the fp32
                   shards, clip_grad_norm_(1.0); reshard_after_forward=True (the default)
  fsdp2-keep       the same with reshard_after_forward=False (stage 2's policy)
  NAME+graph       NAME's whole step captured in one CUDA graph after warm-up and replayed: the
                   device's time for the same work with no host in the loop (bare and stages
                   0-2; CUDA only)

[Note: the update's memory-traffic limit] At W=1 one update reads and writes every param's
streams once: limit = params x B / copy_bandwidth, where B is the kernel's own count of bytes
per param for the configured dtypes (fusedzero.kernels.bytes_per_param: fp32 master r+w 8,
grad r (4 in fp32, 2 in bf16), exp_avg r+w 8, exp_avg_sq r+w 8, bf16 param out w 2: 30 B with
fp32 grads) and copy_bandwidth is a device copy of the same bytes measured in the same process
(fusedzero._bandwidth: a copy of B/2 bytes each way). The target for stages 0-2:
total <= bare + 1.2 x limit; stage 3: total <= stage 2 + 1 ms.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from fusedzero import Precision, ZeroAdamW
from fusedzero._bandwidth import copy_op, time_ops
from fusedzero.app.model import GPT, PRESETS, GPTConfig, gpt_param_groups
from fusedzero.kernels import bytes_per_param
from fusedzero.kernels._memory_modes import stream_bytes

LR, WD, CLIP = 1e-3, 0.1, 1.0
BF16 = torch.bfloat16
# fusedzero-S's dtypes as configured (ZeroAdamW's defaults but param_dtype): what its update moves.
MASTER, STATES, GRAD_DTYPE, PARAM_DTYPE = "fp32", "fp32", torch.float32, BF16
# Each system's step: forward, backward, optimizer (or none), ready for the next step.
StepFn = Callable[[torch.Tensor, torch.Tensor], object]


class Shape(NamedTuple):
    """A model shape and the batch of one step."""

    name: str
    config: GPTConfig
    batch: int


def shape(name: str, tiny: bool = False) -> Shape:
    """`gpt2-124m` or `llama-255m` (see the module docstring); `tiny`: the dry run's size."""
    presets = {"gpt2-124m": "gpt2", "llama-255m": "llama-254m"}
    if name not in presets:
        raise ValueError(f"shape {name!r}: expected one of {sorted(presets)}")
    fields = dict(PRESETS[presets[name]])
    if not tiny:
        return Shape(name, GPTConfig(**fields), 8)
    fields.update(n_layer=2, n_embd=64, n_head=4, vocab_size=512, block_size=32)
    if fields.get("n_kv_head"):
        fields.update(n_kv_head=2, mlp_hidden=176)
    return Shape(name, GPTConfig(**fields), 2)


class SystemName(NamedTuple):
    """A parsed system name: its base (`fusedzero-2`) and whether its step is a CUDA graph."""

    base: str
    graph: bool


BASES = (
    "bare",
    "bare-autocast",
    "fusedzero-0",
    "fusedzero-1",
    "fusedzero-2",
    "fusedzero-3",
    "ddp-autocast",
    "fsdp2",
    "fsdp2-keep",
)
GRAPHABLE = ("bare", "fusedzero-0", "fusedzero-1", "fusedzero-2")


def parse(name: str) -> SystemName:
    base, graph = name.removesuffix("+graph"), name.endswith("+graph")
    if base not in BASES:
        raise ValueError(f"system {name!r}: expected one of {BASES}, optionally +graph")
    if graph and base not in GRAPHABLE:
        raise ValueError(
            f"system {name!r}: +graph applies to {GRAPHABLE} (FSDP2 and DDP hooks "
            "and stage 3's frees allocate per step)"
        )
    return SystemName(base, graph)


@dataclasses.dataclass(slots=True)
class Built:
    """A system ready to time: `step()` runs one training step on the bound batch."""

    step: Callable[[], object]
    opt: object | None  # closed after timing when it is a ZeroAdamW
    note: str


def build(name: str, sh: Shape, x: torch.Tensor, y: torch.Tensor) -> Built:
    """System `name` on `sh`, on x's device, inside an existing 1-rank process group."""
    parsed = parse(name)
    dev = x.device
    torch.manual_seed(0)
    with torch.device(dev):  # only while building: a default device taxes every op
        model = GPT(sh.config)
    step, opt, note = _STEPS[parsed.base.split("-")[0]](parsed.base, model)
    if not parsed.graph:
        return Built(lambda: step(x, y), opt, note)
    if dev.type != "cuda":
        raise RuntimeError(f"{name}: CUDA graphs need a CUDA device, got {dev}")
    return Built(capture(step, x, y), opt, note + "; one CUDA graph per step, replayed")


def capture(step: StepFn, x: torch.Tensor, y: torch.Tensor) -> Callable[[], object]:
    """Warm `step` up on a side stream (as torch.cuda.graphs advises), capture one call, and
    return the graph's replay."""
    side = torch.cuda.Stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step(x, y)
    torch.cuda.current_stream(x.device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(x, y)
    return g.replay


def _bare(base: str, model: GPT) -> tuple[StepFn, None, str]:
    autocast = base == "bare-autocast"
    if not autocast:
        model.to(BF16)

    def step(x: torch.Tensor, y: torch.Tensor) -> object:
        with torch.autocast(x.device.type, dtype=BF16, enabled=autocast):
            loss = model(x, y)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    return (
        step,
        None,
        ("fp32 params, autocast bf16" if autocast else "bf16 params") + ", no optimizer",
    )


def _fusedzero(base: str, model: GPT) -> tuple[StepFn, ZeroAdamW, str]:
    opt = ZeroAdamW(
        gpt_param_groups(model, WD),
        lr=LR,
        stage=int(base.rsplit("-", 1)[1]),
        module=model,
        max_grad_norm=CLIP,
        precision=Precision(param_dtype=BF16),
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> object:
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, opt, "bf16 params, fp32 master and moments, fp32 reduce (defaults)"


def _ddp(base: str, model: GPT) -> tuple[StepFn, torch.optim.Optimizer, str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    opt = torch.optim.AdamW(gpt_param_groups(model, WD), lr=LR, fused=True)
    params = list(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> object:
        with torch.autocast(x.device.type, dtype=BF16):
            loss = ddp(x, y)[1]
        loss.backward()
        nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    return step, opt, "fp32 params, autocast bf16, AdamW(fused=True), fp32 all-reduce"


def _fsdp2(base: str, model: GPT) -> tuple[StepFn, torch.optim.Optimizer, str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=BF16)
    reshard = base != "fsdp2-keep"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
    opt = torch.optim.AdamW(gpt_param_groups(model, WD), lr=LR, fused=True)
    params = list(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> object:
        loss = model(x, y)[1]
        loss.backward()
        nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    return (
        step,
        opt,
        (
            f"MixedPrecisionPolicy(param_dtype=bf16), reshard_after_forward="
            f"{reshard}, AdamW(fused=True)"
        ),
    )


_STEPS: dict[str, Callable[[str, GPT], tuple[StepFn, object, str]]] = {
    "bare": _bare,
    "fusedzero": _fusedzero,
    "ddp": _ddp,
    "fsdp2": _fsdp2,
}


# -- the update's memory-traffic limit -------------------------------------------------------------
def update_streams() -> dict[str, float]:
    """Bytes per param of each stream of fusedzero-S's update (MASTER, STATES, GRAD_DTYPE,
    PARAM_DTYPE). See [Note: the update's memory-traffic limit]."""
    return stream_bytes(MASTER, STATES, GRAD_DTYPE, PARAM_DTYPE)


def copy_gbps(nbytes: int, device: torch.device, rounds: int = 3) -> float:
    """A device copy's bandwidth moving `nbytes` (read + write), median of its timed calls."""
    times = time_ops({"copy": copy_op(nbytes, device)}, device, rounds=rounds)["copy"]
    return nbytes / statistics.median(times) / 1e9


def traffic_limit(params: int, device: torch.device) -> dict[str, object]:
    """The record step_overhead.py writes: params, streams, B, copy GB/s, the limit in s."""
    streams = update_streams()
    per_param = bytes_per_param(MASTER, STATES, GRAD_DTYPE, PARAM_DTYPE)
    assert per_param == sum(streams.values()), (per_param, streams)
    nbytes = int(params * per_param)
    gbps = copy_gbps(nbytes, device)
    return {
        "params": params,
        "streams": streams,
        "bytes_per_param": per_param,
        "dtypes": {
            "master": MASTER,
            "states": STATES,
            "grad": str(GRAD_DTYPE),
            "param": str(PARAM_DTYPE),
        },
        "bytes": nbytes,
        "copy_gbps": gbps,
        "limit_s": nbytes / (gbps * 1e9),
        "formula": "params x bytes_per_param / copy_gbps",
    }
