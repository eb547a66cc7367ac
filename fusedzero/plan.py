"""`fusedzero plan`: memory and communication per rank, before anything is allocated.

    fusedzero plan --params 7.5e9 --world-size 64          # the ZeRO paper's setting
    fusedzero plan --preset gpt2 --world-size 8 --json
    fusedzero plan --hf-config path/to/config.json --world-size 16 --reduce-dtype fp32

The numbers are what `ZeroAdamW.memory()` and `opt.comm` report on a real run, exactly: the plan
builds the same flat buffers (`fusedzero._layout.build_layout`, grouped by (param group, dtype
[, stage-3 unit]) as the optimizer groups them) from parameter shapes alone, on the meta device,
so alignment holes and bucket padding are counted to the byte. Activations, the transient bucket
buffers of stages 2-3 (at most `MAX_INFLIGHT_BUCKETS` buckets) and the gathered units of stage 3
are not resident state and are not counted (neither does `memory()`).

Defaults are the ZeRO paper's mixed-precision Adam: bf16 params, bf16 grads, fp32 master and two
fp32 moments (K = 12 bytes per param of optimizer state; `PLAN_PRECISION`). Note that `ZeroAdamW`
itself defaults to fp32 grad reduction: pass `--reduce-dtype fp32` (`Precision(reduce_dtype=
torch.float32)`) to plan for that.

[Note: alpha-beta ring model] A model of one step's communication time, not a measurement: every
collective is a ring over the W ranks, (W-1) steps for a reduce-scatter or an all-gather and 2(W-1)
for an all-reduce; each ring step costs `latency` (alpha) and moves 1/W of the collective over this
rank's link at `bandwidth` (beta). So one step takes

    ring_steps * latency + comm_bytes_per_step / bandwidth

with comm_bytes_per_step the plan's exact bytes sent. Left out: overlap with compute (a
real step hides much of it behind backward), tree and NVLS algorithms, contention, the NIC/NVLink
split of a multi-node ring (give the slowest link).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from fusedzero import _dtypes as dtypes, wire
from fusedzero._layout import FlatLayout
from fusedzero._muon_groups import muon_param_groups
from fusedzero._owner_layout import rank_costs
from fusedzero._plan_buffers import Buffer, buffers_from_groups, layout_of, units_of
from fusedzero.memory_modes import MemoryModes
from fusedzero.policy import Precision, Sharding, Wire, check_record
from fusedzero.rules import Rule, scratch_bytes
from fusedzero.rules._adamw import ADAMW
from fusedzero.rules._muon import MUON
from fusedzero.stage import Stage
from fusedzero.state import optimizer_bytes

__all__ = [
    "PLAN_PRECISION",
    "STAGES",
    "LinkModel",
    "MuonLayoutPlan",
    "Plan",
    "PlanConfig",
    "StagePlan",
    "model_layouts",
    "plan_groups",
    "plan_model",
    "plan_muon_model",
    "plan_params",
]

STAGES = (0, 1, 2, 3)
# The global grad norm (clipping, non-finite skip) is one fp32 scalar all-reduced per step.
SCALAR_BYTES = 4


class StagePlan(NamedTuple):
    """Per-rank resident bytes of one stage and bytes it sends per step (the JSON schema)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    total_bytes: int
    comm_bytes_per_step: int


class MuonLayoutPlan(NamedTuple):
    """The Muon groups' buffers at one world size as ZeroMuon builds them (the JSON schema):
    at stages 1-3 over several ranks the owner layout (fusedzero/_owner_layout.py), every Muon
    matrix whole on one rank, owners balanced by Newton-Schulz FLOPs; on one rank the flat
    layout. The unprefixed fields are stages 1-2 (one buffer per Muon group and dtype), the
    `stage3_` ones stage 3 (a buffer per unit, each its own owner layout). Stage 0 runs every
    matrix on every rank."""

    world_size: int
    muon_params: int
    """Elements of the params in Muon groups."""
    ns_flops_max: int
    """Newton-Schulz FLOPs per step of the busiest rank."""
    ns_flops_mean: float
    ns_balance: float
    """ns_flops_max / ns_flops_mean (1.0: perfectly balanced)."""
    padding: int
    """Elements of the Muon buffers that belong to no param (padded_numel - param_numel,
    summed over the buffers)."""
    padding_fraction: float
    """padding / muon_params."""
    stage3_ns_flops_max: int
    stage3_ns_flops_mean: float
    stage3_ns_balance: float
    stage3_padding: int
    stage3_padding_fraction: float
    least_padding: int
    """Stages 1-2: the padding of the layout where the bucket size allows any bins (the least
    the owner layout reaches; equal to `padding` where the bucket already allows it)."""
    least_padding_bucket_numel: int
    """The bucket size (`Sharding(bucket_numel=)`, all ranks together) from which the Muon
    buffers take that layout: their largest bucket then."""


# The ZeRO paper's mixed-precision Adam: bf16 params, bf16 grads, fp32 master and moments.
PLAN_PRECISION = Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What the optimizer would be built with: the same policy records as `ZeroAdamW` takes
    (fusedzero/policy.py; only the fields that change bytes are read). Validated at
    construction."""

    world_size: int
    """Ranks the state is sharded over (the size of ZeroAdamW's `Groups(shard=)`)."""
    precision: Precision = PLAN_PRECISION
    """Param and grad dtypes, master and state modes (ZeroAdamW's precision=). Default: the
    ZeRO paper's bf16 params and grads (ZeroAdamW's own default reduces in fp32)."""
    wire: Wire = Wire()
    """What grads and gathered params cross the network as (ZeroAdamW's wire=)."""
    sharding: Sharding = Sharding()
    """Bucket size and stage-3 units (ZeroAdamW's sharding=; units only read when planning
    from a model)."""
    grad_norm: bool = True
    """The step all-reduces the grad norm (max_grad_norm, Precision(skip_nonfinite=True): the
    default)."""
    tp: int = 1
    """Tensor-parallel ranks per replica: the params planned are one tp rank's local shards
    (fusedzero/app/tp_plan.py), and the grad norm is all-reduced over tp as well."""
    rule: Rule = ADAMW
    """The update rule (fusedzero/rules): the state fields it keeps are counted per element
    (default: AdamW's, as `ZeroAdamW` runs)."""
    group_rules: tuple[Rule, ...] = ()
    """Where param groups run different rules (`ZeroMuon`, a `ByGroup` rule): the rule of each
    group, whose fields its buffers keep (`opt.group_rules`); empty: `rule` for every group."""

    def rule_of(self, group: int) -> Rule:
        """The rule whose state fields group `group`'s buffers keep."""
        return self.group_rules[group] if self.group_rules else self.rule

    def __post_init__(self) -> None:
        for name, cls in (("precision", Precision), ("wire", Wire), ("sharding", Sharding)):
            check_record(name, getattr(self, name), cls)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    # The fields the planner reads, by the optimizer's names.
    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.precision.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.precision.reduce_dtype

    @property
    def modes(self) -> MemoryModes:
        return self.precision.modes

    @property
    def bucket_numel(self) -> int | None:
        return self.sharding.bucket_numel

    @property
    def grad_wire(self) -> wire.WireFormat | None:
        return wire.parse_wire(self.wire.grads, "Wire.grads")

    @property
    def param_wire(self) -> wire.WireFormat | None:
        return wire.parse_wire(self.wire.params, "Wire.params")


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """One step's communication time as a model, not a measurement: see
    [Note: alpha-beta ring model]."""

    bandwidth: float = 25e9
    """Bytes per second one rank sends (25 GB/s: a 200 Gb/s NIC per GPU)."""
    latency: float = 10e-6
    """Seconds per ring step (10 us: an inter-node hop with NCCL's protocol overhead)."""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(
                f"link bandwidth must be > 0 and latency >= 0, got "
                f"{self.bandwidth} B/s and {self.latency} s"
            )

    def seconds(self, ring_steps: int, comm_bytes: int) -> float:
        return ring_steps * self.latency + comm_bytes / self.bandwidth


@dataclass
class Plan:
    params: int  # Psi: trainable elements
    world_size: int
    stages: dict[int, StagePlan]
    config: PlanConfig
    source: str
    ring_steps: dict[int, int] = field(default_factory=dict)
    """Per stage, the ring steps of one step's collectives (see LinkModel)."""
    group_rules: list[Rule] = field(default_factory=list)
    """The update rule of each param group (empty: `config.rule` for every group)."""
    muon_layout: MuonLayoutPlan | None = None
    """With Muon groups: their owner layout at `world_size` (`plan_muon_model`)."""

    def comm_seconds(self, link: LinkModel) -> dict[int, float]:
        """Per stage, one step's communication time in the alpha-beta ring model."""
        return {
            s: link.seconds(self.ring_steps[s], p.comm_bytes_per_step)
            for s, p in self.stages.items()
        }

    # Bytes per step per rank of every stage under every grad wire choice ("native": the reduce
    # dtype's own collective), the rest of the config unchanged; filled by `by_wire=True`.
    comm_by_wire: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "stages": {str(s): p._asdict() for s, p in self.stages.items()},
            "world_size": self.world_size,
            "params": self.params,
        }
        if self.group_rules:
            out["group_rules"] = [r.name for r in self.group_rules]
        if self.muon_layout is not None:
            out["muon_layout"] = self.muon_layout._asdict()
        if self.comm_by_wire:
            out["comm_bytes_per_step_by_wire"] = {
                w: {str(s): b for s, b in d.items()} for w, d in self.comm_by_wire.items()
            }
        return out

    def wire_table(self) -> str:
        """comm/step of every stage (rows) under every grad wire choice (columns), in MB."""
        names = list(self.comm_by_wire)
        lines = [
            "",
            "comm/step per rank by --wire (MB = 1e6 bytes; int8 includes its fp32 "
            f"scales, one per {wire.WBLOCK}):",
            "stage " + "".join(f"{n:>12}" for n in names),
        ]
        for s in STAGES:
            lines.append(
                f"{s:<6}" + "".join(f"{self.comm_by_wire[n][s] / 1e6:>12.3f}" for n in names)
            )
        return "\n".join(lines)

    def table(self) -> str:
        """A text table: which buffer each column is, full or sharded, each value in its own
        decimal unit (B, KB, MB, GB, TB)."""
        c, W = self.config, self.world_size
        pdt = dtypes.short_name(c.param_dtype) if c.param_dtype is not None else "own dtype"
        whats = []
        for rule in dict.fromkeys(self.group_rules or [c.rule]):
            # K per element of a shard, scales included (exact per 128 elements: QBLOCK
            # divides it).
            k = optimizer_bytes(c.modes, rule, 128, c.param_dtype or torch.float32) / 128
            states = " + ".join(f.name for f in rule.state_fields(c.modes))
            if scratch_bytes(rule, 128):
                states += f" + {scratch_bytes(rule, 128) / 128:g} B scratch"
            if c.modes != MemoryModes():
                what = f"master={c.modes.master}, states={c.modes.states}"
            elif c.param_dtype == torch.float32:
                what = f"fp32 {states} (fp32 params are their own master)"
            else:
                what = f"fp32 master + {states}"
            named = f"{rule.name} groups " if self.group_rules else ""
            whats.append(f"{named}{what}: K={k:g} bytes/param")
        lines = [
            f"{self.source}: {self.params:,} params (Psi), world size W={W}",
            f"params {pdt}, grads {dtypes.short_name(c.reduce_dtype)}"
            + (f" (wire {c.wire.grads})" if c.wire.grads is not None else "")
            + (f", params gathered in {c.wire.params}" if c.wire.params is not None else "")
            + ", optimizer "
            + "; ".join(whats),
            "",
        ]
        where = {
            0: ("full", "full", "full"),
            1: ("full", "full", "1/W"),
            2: ("full", "1/W", "1/W"),
            3: ("1/W", "1/W", "1/W"),
        }
        head = ("stage", "params", "grads", "optimizer", "total/rank", "comm/step")
        rows = [head]
        for s, p in self.stages.items():
            a, b, o = where[s]
            rows.append(
                (
                    str(s),
                    f"{_gb(p.params_bytes)} {a}",
                    f"{_gb(p.grads_bytes)} {b}",
                    f"{_gb(p.optimizer_bytes)} {o}",
                    _gb(p.total_bytes),
                    _gb(p.comm_bytes_per_step),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        for r in rows:
            lines.append(
                "  ".join(
                    x.ljust(w) if i < 4 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths))
                ).rstrip()
            )
        ag = (
            "2 x all-gather (1 of the root unit, kept from forward into backward)"
            if c.sharding.reshard_after_forward
            else "1 x all-gather"
        )
        lines += [
            "",
            "KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12 bytes, resident per rank (as "
            "ZeroAdamW.memory()), padding included.",
            "comm/step = bytes this rank sends per step (as opt.comm), one micro-batch: "
            "stage 0 all-reduce of grads; 1-2 reduce-scatter of grads + all-gather of "
            f"params; 3 reduce-scatter + {ag}"
            + (" + the grad-norm scalar." if c.grad_norm else "."),
            "Not counted: activations, stage 2-3 transient grad buckets (<= 2 in flight), "
            "stage-3 gathered units (the current one and one prefetched).",
        ]
        if self.muon_layout is not None:
            lines += ["", *self.muon_lines()]
        return "\n".join(lines) + ("\n" + self.wire_table() if self.comm_by_wire else "")

    def muon_lines(self) -> list[str]:
        """The Muon layout's lines of the table."""
        m = self.muon_layout
        assert m is not None
        what = "owner layout (fusedzero/_owner_layout.py)" if m.world_size > 1 else "flat layout"
        return [
            f"Muon {what} at W={m.world_size}, as ZeroMuon builds it: "
            f"{m.muon_params:,} Muon params",
            *(
                f"  {name}: Newton-Schulz FLOPs/step per rank max {mx:.4g}, mean {mean:.4g}, "
                f"max/mean {bal:.4f}; padding {pad:,} elements ({100 * frac:.4g}% of Muon params)"
                for name, mx, mean, bal, pad, frac in (
                    (
                        "stages 1-2",
                        m.ns_flops_max,
                        m.ns_flops_mean,
                        m.ns_balance,
                        m.padding,
                        m.padding_fraction,
                    ),
                    (
                        "stage 3 (a buffer per unit)",
                        m.stage3_ns_flops_max,
                        m.stage3_ns_flops_mean,
                        m.stage3_ns_balance,
                        m.stage3_padding,
                        m.stage3_padding_fraction,
                    ),
                )
            ),
            *(
                [
                    f"  stages 1-2 with --bucket-numel >= {m.least_padding_bucket_numel:,} "
                    f"(fewer, larger bins): padding {m.least_padding:,} elements "
                    f"({100 * m.least_padding / m.muon_params:.4g}% of Muon params)"
                ]
                if m.least_padding < m.padding
                else []
            ),
            "  (stage 0: every rank runs every matrix; the padding is in the bytes above; "
            'docs/muon.md, "The owner layout")',
        ]


# A bucket size no buffer reaches: the owner layout then packs with no bound on its bins.
_ANY_BUCKET = 1 << 60

_UNITS = ("B", "KB", "MB", "GB", "TB")  # decimal, as the ZeRO paper's figures


def _gb(n: int) -> str:
    """`n` bytes in the largest decimal unit that keeps the value >= 1, 3 significant digits:
    890 KB, not 0.00089 GB."""
    v, unit = float(n), 0
    while unit < len(_UNITS) - 1 and float(f"{v:.3g}") >= 1000:
        v, unit = v / 1000, unit + 1
    return f"{v:.3g} {_UNITS[unit]}" if v < 1000 else f"{v:,.0f} {_UNITS[unit]}"


def _stage_plan(buffers: list[Buffer], stage: int, cfg: PlanConfig) -> tuple[StagePlan, int]:
    """The stage's bytes, and the ring steps of its collectives (LinkModel)."""
    W = cfg.world_size
    g = cfg.reduce_dtype.itemsize
    params = grads = opt = comm = steps = 0
    owner_load = [0] * W
    for dt, items, unit, gi in buffers:
        L = layout_of(items, dt, stage, cfg, cfg.rule_of(gi), owner_load)
        p = dt.itemsize
        params += p * (L.local_numel if stage == 3 else L.padded_numel)
        grads += g * (L.local_numel if stage >= 2 else L.padded_numel)
        opt += optimizer_bytes(cfg.modes, cfg.rule_of(gi), L.local_numel, dt)
        # One collective per bucket, counted as comm.CommCounter.add does (`_bucket_comm`); the
        # ring steps of each (an all-to-all, as a reduce-scatter, W-1) for the comm-time model.
        nb = L.num_buckets
        gathers = Stage(stage).gathers_per_step(cfg.sharding.reshard_after_forward, unit)
        comm += _bucket_comm(L, stage, cfg, dt, gathers)
        steps += nb * (2 if stage == 0 else 1 + gathers) * (W - 1)
    if stage > 0 and cfg.grad_norm:
        comm += 2 * (W - 1) * SCALAR_BYTES // W
        steps += 2 * (W - 1)
    if cfg.grad_norm and cfg.tp > 1:  # the same scalar over tp, at every stage
        comm += 2 * (cfg.tp - 1) * SCALAR_BYTES // cfg.tp
        steps += 2 * (cfg.tp - 1)
    return StagePlan(params, grads, opt, params + grads + opt, comm), steps


def _bucket_comm(L: FlatLayout, stage: int, cfg: PlanConfig, dt: torch.dtype, gathers: int) -> int:
    """Bytes one flat buffer sends per step (`gathers`: param all-gathers of each bucket,
    `Stage.gathers_per_step`): one collective per bucket, counted as
    comm.CommCounter.add does (ring formulas, integer division per call); over a wire format
    (fusedzero.wire) the packed chunks, scales included: an all-to-all sends W-1 of W chunks, a
    wire all-reduce (stage 0) adds an all-gather of the same W-1 chunks on a copy padded to
    W * WBLOCK."""
    W, B, nb = cfg.world_size, L.bucket_numel, L.num_buckets
    g, p = cfg.reduce_dtype.itemsize, dt.itemsize
    gf, pf = cfg.grad_wire, cfg.param_wire
    if stage == 0:
        if gf is not None and wire.uses_wire(gf, cfg.reduce_dtype, W):
            S = -(-B // (W * wire.WBLOCK)) * wire.WBLOCK
            return nb * 2 * (W - 1) * wire.chunk_bytes(gf, S)
        return nb * (2 * (W - 1) * B * g // W)
    grads = (
        (W - 1) * wire.chunk_bytes(gf, B // W)
        if gf is not None and wire.uses_wire(gf, cfg.reduce_dtype, W)
        else (W - 1) * B * g // W
    )
    gather = (
        (W - 1) * wire.chunk_bytes(pf, B // W)
        if pf is not None and wire.gathers_over_wire(pf, dt, W)
        else (W - 1) * B * p // W
    )
    return nb * (grads + gathers * gather)


def plan_groups(
    groups: list[list[tuple[str, nn.Parameter]]],
    cfg: PlanConfig,
    *,
    model: nn.Module | None = None,
    source: str = "model",
    by_wire: bool = False,
    rules: Sequence[Rule] = (),
) -> Plan:
    """Plan from the optimizer's param groups, each a list of (name, param); params may live on
    the meta device. `model` is needed for stage-3 units (without it: every param in one unit
    that is not the root, as in a model whose blocks hold nearly all of it: 3 Psi per step).
    `by_wire`: also the comm of every stage under every grad wire choice (`Plan.comm_by_wire`).
    `rules`: each group's update rule, as the optimizer's `group_rules` (empty: `cfg.rule`)."""
    if rules and len(rules) != len(groups):
        raise ValueError(f"{len(rules)} rules for {len(groups)} param groups")
    if rules:
        cfg = dataclasses.replace(cfg, group_rules=tuple(rules))
    flat = [p for grp in groups for _, p in grp]
    units = units_of(model, flat, cfg.sharding.units) if model is not None else [1] * len(flat)
    done = {s: _stage_plan(buffers_from_groups(groups, s, cfg, units), s, cfg) for s in STAGES}
    result = Plan(
        sum(p.numel() for p in flat),
        cfg.world_size,
        {s: d[0] for s, d in done.items()},
        cfg,
        source,
        ring_steps={s: d[1] for s, d in done.items()},
        group_rules=list(cfg.group_rules),
    )
    if by_wire:
        for name in ("native", *wire.WIRES):
            grads = None if name == "native" else name
            c = dataclasses.replace(cfg, wire=dataclasses.replace(cfg.wire, grads=grads))
            result.comm_by_wire[name] = {
                s: _stage_plan(buffers_from_groups(groups, s, c, units), s, c)[
                    0
                ].comm_bytes_per_step
                for s in STAGES
            }
    return result


def _model_groups(model: nn.Module, decay_split: bool) -> list[list[tuple[str, nn.Parameter]]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if decay_split:
        return [
            [(n, p) for n, p in named if p.dim() >= 2],
            [(n, p) for n, p in named if p.dim() < 2],
        ]
    return [named]


def plan_model(
    model: nn.Module,
    cfg: PlanConfig,
    *,
    decay_split: bool = True,
    source: str = "model",
    by_wire: bool = False,
) -> Plan:
    """Plan for `ZeroAdamW(groups, module=model)`, the groups as `fusedzero train` makes them
    (`gpt_param_groups`: >= 2-D params decayed, the rest not) or one group of every trainable
    param (`decay_split=False`)."""
    return plan_groups(
        _model_groups(model, decay_split), cfg, model=model, source=source, by_wire=by_wire
    )


def _muon_model_groups(model: nn.Module) -> tuple[list[list[tuple[str, nn.Parameter]]], list[bool]]:
    """`fusedzero train --optimizer muon`'s groups (`gpt_muon_param_groups`): the Muon params
    of `muon_param_groups(model)`, then its AdamW params split into decayed (>= 2-D) and not;
    with each group whether it is Muon's. Empty groups are left out."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[tuple[list[tuple[str, nn.Parameter]], bool]] = []
    for g in muon_param_groups(model):
        if g["use_muon"]:
            out.append(([(names[id(p)], p) for p in g["params"]], True))
            continue
        for decayed in (True, False):
            ps = [(names[id(p)], p) for p in g["params"] if (p.dim() >= 2) == decayed]
            if ps:
                out.append((ps, False))
    return [g for g, _ in out], [m for _, m in out]


def plan_muon_model(
    model: nn.Module, cfg: PlanConfig, *, source: str = "model", by_wire: bool = False
) -> Plan:
    """Plan for `ZeroMuon(groups, module=model)` with the groups `fusedzero train --optimizer
    muon` makes: the bytes of the buffers ZeroMuon builds (the Muon groups' in the owner layout
    at stages 1-3 over several ranks, keeping the Muon rule's state), and `Plan.muon_layout`,
    the Muon buffers' Newton-Schulz FLOPs per rank and padding at stages 1-2 and 3."""
    groups, is_muon = _muon_model_groups(model)
    result = plan_groups(
        groups,
        cfg,
        model=model,
        source=source,
        by_wire=by_wire,
        rules=[MUON if m else ADAMW for m in is_muon],
    )
    cfg = result.config  # with the group rules
    flat = [p for grp in groups for _, p in grp]
    units = units_of(model, flat, cfg.sharding.units)
    muon_numel = sum(p.numel() for grp, m in zip(groups, is_muon) if m for _, p in grp)
    (pad, flops, _), (pad3, flops3, _) = (
        _muon_buffers(buffers_from_groups(groups, s, cfg, units), s, cfg) for s in (1, 3)
    )
    # Stages 1-2 with a bucket that allows any bins: the least padding, and the bucket it needs.
    unbounded = dataclasses.replace(
        cfg, sharding=dataclasses.replace(cfg.sharding, bucket_numel=_ANY_BUCKET)
    )
    least, _, least_bucket = _muon_buffers(
        buffers_from_groups(groups, 1, unbounded, units), 1, unbounded
    )

    def frac(n: int) -> float:
        return n / muon_numel if muon_numel else 0.0

    def mean(xs: list[int]) -> float:
        return sum(xs) / len(xs)

    def balance(xs: list[int]) -> float:
        return max(xs) / mean(xs) if any(xs) else 1.0

    result.muon_layout = MuonLayoutPlan(
        world_size=cfg.world_size,
        muon_params=muon_numel,
        ns_flops_max=max(flops),
        ns_flops_mean=mean(flops),
        ns_balance=balance(flops),
        padding=pad,
        padding_fraction=frac(pad),
        stage3_ns_flops_max=max(flops3),
        stage3_ns_flops_mean=mean(flops3),
        stage3_ns_balance=balance(flops3),
        stage3_padding=pad3,
        stage3_padding_fraction=frac(pad3),
        least_padding=least,
        least_padding_bucket_numel=least_bucket,
    )
    return result


def _muon_buffers(buffers: list[Buffer], stage: int, cfg: PlanConfig) -> tuple[int, list[int], int]:
    """The per-matrix rules' buffers of a stage, laid out as `_stage_plan` lays them out (the
    engine's layouts): their padding in elements and each rank's cost of the blocks it holds
    (`Rule.blocks`: Newton-Schulz FLOPs for Muon), summed over the buffers, and their largest
    bucket."""
    pad, costs, largest = 0, [0] * cfg.world_size, 0
    owner_load = [0] * cfg.world_size  # carried as in `_stage_plan` and the engine
    for dt, items, _, gi in buffers:
        rule = cfg.rule_of(gi)
        if rule.element_wise:
            continue
        L = layout_of(items, dt, stage, cfg, rule, owner_load)
        pad += L.padded_numel - L.param_numel
        largest = max(largest, L.bucket_numel)
        blocks = {i: rule.blocks(shape) for i, _, shape in items}
        if L.world_size == 1:  # the flat layout (it may cut a matrix at a bucket edge)
            costs[0] += sum(math.prod(s) // blocks[i].numel * blocks[i].cost for i, _, s in items)
        else:
            costs = [a + b for a, b in zip(costs, rank_costs(L, blocks))]
    return pad, costs, largest


def model_layouts(
    model: nn.Module, cfg: PlanConfig, stage: int, *, decay_split: bool = True
) -> list[FlatLayout]:
    """The flat buffers of `ZeroAdamW(groups, module=model, stage=stage)` as layouts (the
    groups as `plan_model`'s), the same on every rank, nothing allocated: where every param
    element lives, so the segments a checkpoint's manifest lists (`FlatLayout.segments`)."""
    groups = _model_groups(model, decay_split)
    flat = [p for grp in groups for _, p in grp]
    units = units_of(model, flat, cfg.sharding.units) if stage == 3 else None
    return [
        layout_of(b.items, b.dtype, stage, cfg)
        for b in buffers_from_groups(groups, stage, cfg, units)
    ]


def plan_params(n: int, cfg: PlanConfig, *, by_wire: bool = False) -> Plan:
    """Plan for a model given only its parameter count: one flat buffer of `n` elements."""
    if n < 1:
        raise ValueError(f"--params must be >= 1, got {n}")
    p = nn.Parameter(torch.empty(n, device="meta"))
    return plan_groups([[("params", p)]], cfg, source="--params", by_wire=by_wire)
