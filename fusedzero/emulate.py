"""Play rank r of W in one process: large-W behaviour proven on one CPU.

    from fusedzero.emulate import emulate
    r = emulate("llama-8b", world_size=1024, rank=1023, stage=3)
    r.resident_bytes, r.comm_bytes_per_step, r.padding_fraction, r.construct_s

The optimizer is a real `ZeroAdamW`, built by this process as rank `rank` of a `world_size`-rank
group of torch's fake backend (`torch.testing._internal.distributed.fake_pg`: every collective
returns at once and moves nothing). The model is built on the meta device, so no full weight
ever exists here:

- stage 3 materialises only this rank's local shard (params, master, moments, grad shard) on
  the CPU, through a `ShardInit` that writes each local segment directly (no unit is ever
  gathered, nothing is broadcast);
- stages 0-2 keep the full params on every rank by design (16 GB of bf16 for an 8B model), so
  they are built on the meta device entirely: every buffer has its real shape and dtype, and
  the byte counts are exact, but nothing is allocated.

Resident bytes are `ZeroAdamW.memory()`; communication per step is counted by issuing one
step's collectives (`fusedzero._comm`, the optimizer's own free functions, on meta tensors of
each bucket's shape) over the fake group. `python -m fusedzero.emulate --table` prints the
table of docs/scale.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from fusedzero import _comm as comm, wire
from fusedzero._comm import CommCounter
from fusedzero._flat import FlatBuffer
from fusedzero._units import ShardInit
from fusedzero.kernels._quant import new_packed
from fusedzero.plan import PLAN_PRECISION, Plan, PlanConfig, plan_model
from fusedzero.policy import Precision, Sharding, Wire
from fusedzero.stage import Stage
from fusedzero.wire import WBLOCK, WireFormat

__all__ = [
    "SHAPES",
    "TABLE_ROWS",
    "Emulation",
    "LlamaShape",
    "ModelSource",
    "emulate",
    "fake_group",
    "meta_model",
    "param_groups",
    "step_comm",
    "table",
]


# -- model shapes (plain nn modules, Llama-style: no forward, they are only ever built) ----------
@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """A decoder-only transformer's parameter shapes (grouped-query attention, SwiGLU MLP)."""

    n_layer: int
    """Transformer blocks (each one stage-3 unit)."""
    d: int
    """Model width."""
    ffn: int
    """MLP hidden width (gate, up and down projections)."""
    vocab: int
    """Embedding rows; the output head is a separate (untied) matrix."""
    n_head: int
    """Attention heads (d / n_head is the head width)."""
    n_kv_head: int
    """Key/value heads (k and v project to n_kv_head * d / n_head)."""

    @property
    def params(self) -> int:
        kv = self.n_kv_head * self.d // self.n_head
        block = 2 * self.d * self.d + 2 * self.d * kv + 3 * self.d * self.ffn + 2 * self.d
        return self.n_layer * block + 2 * self.vocab * self.d + self.d


SHAPES: dict[str, LlamaShape] = {
    "llama-70b": LlamaShape(n_layer=80, d=8192, ffn=28672, vocab=128256, n_head=64, n_kv_head=8),
    "llama-8b": LlamaShape(n_layer=32, d=4096, ffn=14336, vocab=128256, n_head=32, n_kv_head=8),
    "llama-1b": LlamaShape(n_layer=16, d=2048, ffn=8192, vocab=128256, n_head=32, n_kv_head=8),
    "tiny": LlamaShape(n_layer=2, d=256, ffn=512, vocab=1024, n_head=4, n_kv_head=2),
}


class Block(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        kv = s.n_kv_head * s.d // s.n_head
        self.attn_norm = nn.RMSNorm(s.d)
        self.q = nn.Linear(s.d, s.d, bias=False)
        self.k = nn.Linear(s.d, kv, bias=False)
        self.v = nn.Linear(s.d, kv, bias=False)
        self.o = nn.Linear(s.d, s.d, bias=False)
        self.mlp_norm = nn.RMSNorm(s.d)
        self.gate = nn.Linear(s.d, s.ffn, bias=False)
        self.up = nn.Linear(s.d, s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.d, bias=False)


class Llama(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        # `_weight`: no init (the normal_ of a meta tensor runs torch's Python reference
        # decomposition, ~15 ms; nothing needs values here).
        self.embed = nn.Embedding(s.vocab, s.d, _weight=torch.empty(s.vocab, s.d))
        self.layers = nn.ModuleList(Block(s) for _ in range(s.n_layer))
        self.norm = nn.RMSNorm(s.d)
        self.head = nn.Linear(s.d, s.vocab, bias=False)


def meta_model(shape: LlamaShape | str) -> nn.Module:
    """The shape as plain nn modules on the meta device (nothing allocated)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    with torch.device("meta"):
        return Llama(s)


def param_groups(model: nn.Module, decay_split: bool = True) -> list[dict]:
    """Decay (>= 2-D) and no-decay groups, as `fusedzero train` and `fusedzero plan` make
    them, or one group (`decay_split=False`)."""
    ps = [p for p in model.parameters() if p.requires_grad]
    if not decay_split:
        return [{"params": ps}]
    groups = [
        {"params": [p for p in ps if p.dim() >= 2]},
        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


# -- the fake group -------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[None]:
    """This process as `rank` of `world_size` in torch's fake backend (the default group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised; emulate in a fresh process or destroy it first"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


_META = torch.device("meta")


def _zero_init(name: str, out: torch.Tensor, start: int) -> None:
    out.zero_()  # values do not matter to the emulation; writing them touches the pages


def step_comm(
    buffers: list[FlatBuffer],
    stage: Stage,
    reshard_after_forward: bool,
    world_size: int,
    grad_norm: bool = True,
    wire_format: WireFormat | None = None,
    param_wire: WireFormat | None = None,
) -> CommCounter:
    """One step's collectives of these buffers (one micro-batch), issued through
    `fusedzero._comm` on meta tensors of each bucket's shape: what the optimizer's counter
    records on a real step (tests/zero/test_scale_comm.py checks it against one). Over a wire
    format (`fusedzero.wire`, ZeroAdamW's `Wire(grads=, params=)`) the packed uint8 buffers
    its paths send: the quantized bucket all-to-all'd (stage 0: a copy padded to W * WBLOCK,
    then its summed chunks all-gathered), packed param pieces all-gathered. Needs a (fake)
    default group of `world_size` ranks."""
    c, W = CommCounter(), world_size
    for buf in buffers:
        L = buf.layout
        B, S = L.bucket_numel, L.shard_numel
        grads_wire = wire.uses_wire(wire_format, buf.reduce_dtype, W)
        params_wire = wire.gathers_over_wire(param_wire, buf.dtype, W) and S % WBLOCK == 0
        gathers = stage.gathers_per_step(reshard_after_forward, buf.unit)
        for _ in range(L.num_buckets):
            if not stage.shards_state and grads_wire:  # wire.all_reduce_start
                assert wire_format is not None
                packed = new_packed(wire_format, W, -(-B // (W * WBLOCK)) * WBLOCK, _META)
                comm.all_to_all(packed, packed, None, W, c)
                comm.all_gather(packed, packed[: packed.numel() // W], None, W, c)
            elif not stage.shards_state:
                comm.all_reduce(torch.empty(B, dtype=buf.reduce_dtype, device=_META), None, W, c)
            elif grads_wire:  # wire.reduce_scatter_start
                assert wire_format is not None
                packed = new_packed(wire_format, W, S, _META)
                comm.all_to_all(packed, packed, None, W, c)
            else:
                grads = torch.empty(B, dtype=buf.reduce_dtype, device=_META)
                comm.reduce_scatter(grads[:S], grads, None, W, c)
            for _ in range(gathers):  # wire.all_gather
                full = (
                    new_packed(param_wire, W, S, _META)
                    if params_wire  # type: ignore[arg-type]
                    else torch.empty(B, dtype=buf.dtype, device=_META)
                )
                comm.all_gather(full, full[: full.numel() // W], None, W, c)
    if stage.shards_state and grad_norm:
        comm.all_reduce(torch.empty(1, dtype=torch.float32, device=_META), None, W, c)
    return c


def rss_bytes() -> int:
    """This process's resident set now (Linux), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True, kw_only=True)
class Emulation:
    """What rank `rank` of `world_size` holds and sends, from a real optimizer."""

    shape: str
    world_size: int
    rank: int
    stage: int
    params: int
    """Psi: trainable elements."""
    resident_bytes: int
    """`ZeroAdamW.memory().total`: params + grads + optimizer state, padding included."""
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    padding_elements: int
    """Param-buffer elements that are no param (alignment holes, bucket tail padding)."""
    comm_bytes_per_step: int
    """Bytes this rank sends in one step (one micro-batch), by collective kind summed."""
    plan_bytes: int
    """`fusedzero plan`'s total for the same configuration."""
    plan_comm_bytes: int
    construct_s: float
    """Wall time of `ZeroAdamW(...)`."""
    rss_delta_bytes: int
    """Process RSS after construction minus before (a cross-check: allocator-dependent)."""
    materialized: bool
    """True: the local shard is real CPU memory; False: everything on the meta device."""

    @property
    def padding_fraction(self) -> float:
        return self.padding_elements / max(1, self.params)

    @property
    def equals_plan(self) -> bool:
        """Resident and per-step comm bytes both equal to the plan's, to the byte."""
        return (
            self.resident_bytes == self.plan_bytes
            and self.comm_bytes_per_step == self.plan_comm_bytes
        )


ModelSource = LlamaShape | str | Callable[[], nn.Module]


def _build(model: ModelSource) -> nn.Module:
    return model() if callable(model) and not isinstance(model, LlamaShape) else meta_model(model)


def emulate(
    model: ModelSource,
    *,
    world_size: int,
    rank: int = 0,
    stage: int = 3,
    precision: Precision = PLAN_PRECISION,
    wire: Wire = Wire(),
    sharding: Sharding = Sharding(),
    decay_split: bool = True,
    materialize: bool | None = None,
    plan: Plan | None = None,
    init: Literal["zeros", "model"] = "zeros",
) -> Emulation:
    """Build `ZeroAdamW` as `rank` of `world_size` under the fake backend and report it.

    `model`: a name in SHAPES, a LlamaShape, or a function returning a model on the meta
    device (called twice: once for the optimizer, once for the plan it is compared with).
    Param groups as `fusedzero plan` makes them (`decay_split`: >= 2-D params and the rest).
    `precision`, `wire`, `sharding`: ZeroAdamW's (fusedzero/policy.py); by default the plan's
    bf16 params and grads. `sharding.param_init_fn` is replaced (stage 3 materialised: zeros).
    `materialize` (default: stage 3) puts the local shard in CPU memory; stages 0-2 hold the
    full params and cannot, they are built on the meta device. `plan`: the plan to compare
    with (`fusedzero plan` passes the one it prints); default: `plan_model` of the same
    model and options. `init` (stage 3, materialised): "zeros" writes each local segment
    (a `ShardInit`), "model" runs the model's own `reset_parameters` on this rank's elements
    (fusedzero/_shard_init.py), what a user's build does."""
    if init not in ("zeros", "model"):
        raise ValueError(f"init must be 'zeros' or 'model', got {init!r}")
    st = Stage(stage)
    if materialize is None:
        materialize = st.shards_params
    if materialize and not st.shards_params:
        raise ValueError(
            f"stage {stage} keeps the full params on every rank: only stage 3 "
            "can materialise the local shard alone (pass materialize=False)"
        )
    if plan is not None and plan.world_size != world_size:
        raise ValueError(f"the plan is for W={plan.world_size}, the emulation for W={world_size}")
    from fusedzero.optim import ZeroAdamW

    name = model if isinstance(model, str) else getattr(model, "__name__", "model")
    m = _build(model)
    groups = param_groups(m, decay_split)
    with fake_group(rank, world_size):
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        opt = ZeroAdamW(
            groups,
            stage=st,
            module=m,
            max_grad_norm=1.0,
            device="cpu" if materialize else "meta",
            precision=precision,
            wire=wire,
            sharding=dataclasses.replace(
                sharding,
                param_init_fn=ShardInit(_zero_init) if materialize and init == "zeros" else None,
            ),
        )
        construct_s = time.perf_counter() - t0
        rss = rss_bytes() - rss0
        mem = opt.memory()
        sent = step_comm(
            opt.flat_groups,
            st,
            sharding.reshard_after_forward,
            world_size,
            wire_format=opt.grad_wire,
            param_wire=opt.param_wire,
        )
        # Not closed: close() gathers every unit (the full model). The model is dropped.
        del opt
    if plan is None:
        cfg = PlanConfig(world_size=world_size, precision=precision, wire=wire, sharding=sharding)
        plan = plan_model(_build(model), cfg, decay_split=decay_split)
    planned = plan.stages[int(st)]
    return Emulation(
        shape=name,
        world_size=world_size,
        rank=rank,
        stage=int(st),
        params=mem.param_elements,
        resident_bytes=mem.total,
        params_bytes=mem.params,
        grads_bytes=mem.grads,
        optimizer_bytes=mem.optimizer,
        padding_elements=mem.padding_elements,
        comm_bytes_per_step=sent.total_bytes,
        plan_bytes=planned.total_bytes,
        plan_comm_bytes=planned.comm_bytes_per_step,
        construct_s=construct_s,
        rss_delta_bytes=rss,
        materialized=materialize,
    )


# -- the table of docs/scale.md ------------------------------------------------------------------
TABLE_ROWS: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("llama-8b", 1, (8, 64, 256, 1024)),
    ("llama-8b", 2, (8, 64, 256, 1024)),
    ("llama-8b", 3, (8, 64, 256, 1024)),
    ("llama-70b", 3, (64, 256, 1024)),
)


def table(
    rows: tuple[tuple[str, int, tuple[int, ...]], ...] = TABLE_ROWS, rank: int | None = None
) -> str:
    """A markdown table, one emulated rank per row (the last rank unless `rank` is given), all
    on the meta device (the byte counts are the same as a materialised build's, and fast)."""
    out = [
        "| model | stage | W | resident bytes per rank | padding | comm bytes per step | = plan |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape, stage, worlds in rows:
        for W in worlds:
            e = emulate(
                shape,
                world_size=W,
                rank=W - 1 if rank is None else rank,
                stage=stage,
                materialize=False,
            )
            out.append(
                f"| {shape} | {stage} | {W} | {e.resident_bytes:,} | "
                f"{100 * e.padding_fraction:.4f}% | {e.comm_bytes_per_step:,} | "
                f"{'yes' if e.equals_plan else 'NO'} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fusedzero.emulate", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--table",
        action="store_true",
        required=True,
        help="print docs/scale.md's table (model x stage x W, rank W-1)",
    )
    ap.parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
