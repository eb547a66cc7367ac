"""Update rules: the math of an optimizer, apart from the sharding engine that runs it.

The engine (`fusedzero.optim.ZeroOptimizer`) owns the flat buffers, the grad hooks, buckets and
gathers, stage-3 units, the master copy and its memory mode, and the step's scalars (clip, skip,
loss scale, step count). It runs any `Rule` on its local shards; a rule declares:

- `state_fields(modes)`: the per-element state it keeps in a memory mode (`StateField`s: name,
  dtype, one element per `per` shard elements, and for block-quantized states the field whose
  scales a field holds). The engine allocates them in every flat buffer, `opt.memory()` and
  `fusedzero plan` count them, and checkpoints, state dicts and `ShardState` carry them by name.
- `defaults` and `check_group(group)`: its per-group hyper-parameters, their defaults and their
  validation (a ValueError naming the value, as torch.optim's).
- `build(shards, ...)`: its launches over the rank's local shards (`LocalShard`), built once; the
  engine calls `read_groups` before it waits for any reduction and `step` after the scalars are
  computed (`Update`).
- `element_wise`: True when any slice of a tensor can be updated alone (AdamW, SGD); False when
  the rule needs whole tensors on one rank (a per-matrix rule such as Newton-Schulz
  orthogonalisation): such a rule also says what one of its blocks is (`blocks(shape)`: the
  elements that must stay together and their cost), and the engine's owner layout puts each
  block whole on one rank, balancing the cost.

The AdamW rule is `fusedzero.rules._adamw.ADAMW`; docs/rules.md shows how to add one.

A rule runs per param group: `ByGroup` lets one optimizer run several (e.g. Muon for the hidden
matrices, AdamW for the rest, one set of hooks). Flat buffers never mix groups, so each buffer
holds its group's rule's fields, and each rule's launches see only its own groups' buffers
(`LocalShard.group_index` then counts that rule's groups, in order).

[Note: whole tensors for per-matrix rules] A rule with `element_wise = False` gets, in each
`LocalShard`, whole tensors only: the layout, not the rule, places each block (`Rule.blocks`: a
matrix, or each matrix of a 3-D stack) whole in one owner rank's shard of one bucket
(fusedzero/_owner_layout.py), so the reduce-scatter the engine already runs hands the owner its
full grads and the all-gather brings the params back, no extra collective. Where the layout does
not shard (stage 0, one rank) every rank holds every tensor whole. A tensor-parallel shard (a
DTensor sharded over the tp mesh) is a piece of its tensor on every rank: the engine refuses one
in such a rule's groups.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from fusedzero._layout import Segment
from fusedzero._owner_layout import Block
from fusedzero.kernels import Strided
from fusedzero.memory_modes import MemoryModes

__all__ = [
    "Block",
    "ByGroup",
    "LocalShard",
    "Rule",
    "StateField",
    "StepTensors",
    "Update",
    "WholeTensor",
]

# What a launch reads or writes: a contiguous local-shard tensor, or this rank's pieces of a full
# bucketed buffer read in place (`Strided`).
ShardView = Strided | torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StateField:
    """One per-element state tensor a rule keeps in every flat buffer, in the local-shard layout.

    Its `name` is the buffer's attribute, the `ShardState` key and the checkpoint tensor's name
    (`fg{i}.<name>`): renaming a field changes the checkpoint format.
    """

    name: str
    dtype: torch.dtype
    per: int = 1
    """One element per `per` local-shard elements (block scales: QBLOCK). Local shards are a
    multiple of QBLOCK elements, so no block straddles two params or two pieces."""
    scale_of: str | None = None
    """This field holds the block scales of that field (int8 states); None: a value field."""
    signed: bool = True
    """How a value field is quantized in the int8 mode (int8 codes; False: uint8 codes of a
    non-negative state). Conversions between memory modes go through fp32 with it."""

    def numel(self, local_numel: int) -> int:
        return local_numel // self.per

    def nbytes(self, local_numel: int) -> int:
        return self.numel(local_numel) * self.dtype.itemsize


def scale_field(fields: Sequence[StateField], name: str) -> StateField | None:
    """The field holding `name`'s block scales, if any."""
    return next((f for f in fields if f.scale_of == name), None)


class WholeTensor(NamedTuple):
    """A param held whole by a local shard: its index, where it starts in the local shard, its
    shape (its elements are `local : local + numel` of every local-shard tensor). With
    `whole_tensors(stacks=True)`, also a run of whole slices of a stack: `shape` is then the
    run's, [k, *param.shape[1:]]."""

    param: int
    local: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LocalShard:
    """What a rule's launch sees of one flat buffer: this rank's local shard of it.

    `master`, `grad` and `out` are in the local-shard layout, as `Strided` views where they are
    this rank's pieces of a full buffer (`num_buckets` pieces of `shard_numel` elements). `state`
    holds the rule's fields (`Rule.state_fields`) by name. `group_index` is the param group, the
    row of the group's hyper-parameters. `segments` say which elements of which param sit where
    in the local shard (`Segment(param, start, length, rank, local)`), `shapes` each param's
    shape by its index: a per-matrix rule finds its whole tensors there (a segment with start 0
    and the param's full numel). The master-mode extras (`comp`, `sr_offset`) belong to the
    engine's memory mode; a rule whose kernel writes the master honours them.
    """

    master: ShardView
    grad: ShardView
    out: ShardView | None  # where the cast of master goes (None: the params are the master)
    state: Mapping[str, torch.Tensor]
    num_buckets: int
    shard_numel: int
    group_index: int
    segments: tuple[Segment, ...] = ()
    shapes: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    comp: torch.Tensor | None = None  # bf16-kahan: the master's bf16 compensation
    sr_offset: int = 0  # bf16-sr: where this buffer starts in the random stream

    def whole_tensors(self, stacks: bool = False) -> list[WholeTensor]:
        """Every param this shard holds whole, contiguous in the local shard (its segments
        joined: at one rank a param may straddle two buckets, whose pieces are adjacent), in
        local order. A per-matrix rule updates these; ValueError names a param held in part or
        cut, which the engine never hands such a rule. `stacks`: a param of 3 or more dims is a
        stack of its [1:] slices, which the owner layout may share out over ranks at slice
        edges (an expert stack streamed one matrix a shard): each run of whole slices this
        shard holds comes back on its own."""
        runs: dict[int, list[Segment]] = {}
        for seg in self.segments:
            runs.setdefault(seg.param, []).append(seg)
        out = []
        for p, segs in runs.items():
            segs.sort(key=lambda s: s.start)
            shape = self.shapes[p]
            numel = math.prod(shape)
            joined = [[segs[0]]]
            for a, b in zip(segs, segs[1:]):
                if b.start == a.start + a.length and b.local == a.local + a.length:
                    joined[-1].append(b)
                else:
                    joined.append([b])
            if len(joined) == 1 and segs[0].start == 0 and sum(s.length for s in segs) == numel:
                out.append(WholeTensor(p, segs[0].local, shape))
                continue
            inner = math.prod(shape[1:])
            for run in joined:
                length = sum(s.length for s in run)
                if not stacks or len(shape) < 3 or run[0].start % inner or length % inner:
                    raise ValueError(f"param {p} is not whole in this local shard: {segs}")
                part = (length // inner, *shape[1:])
                out.append(WholeTensor(p, run[0].local, part))
        return sorted(out, key=lambda t: t.local)

    def pieces(self, view: ShardView) -> list[torch.Tensor]:
        """`view` (master, grad, out or a state field) as its piece of every bucket, in
        local-shard order: `num_buckets` tensors of `shard_numel` elements that a rule's torch
        path can update with foreach ops. Block-scale fields split by `per` first."""
        S = self.shard_numel
        if isinstance(view, torch.Tensor):
            return [view[k * S : (k + 1) * S] for k in range(self.num_buckets)]
        return [
            view.tensor[k * view.stride + view.base : k * view.stride + view.base + S]
            for k in range(self.num_buckets)
        ]


class StepTensors(NamedTuple):
    """The step's scalars as one-element device tensors, computed before the update: `step` the
    taken steps (this one counted), `grad_scale` what the reduced grads are multiplied by (inverse
    loss scale times clip coefficient), `skip` non-zero when the update must write nothing."""

    step: torch.Tensor
    grad_scale: torch.Tensor
    skip: torch.Tensor


class Update(Protocol):
    """A rule's launches over every local shard of a rank, built once (the shards are written in
    place, never replaced, so tables of their addresses stay valid)."""

    rows: Any
    """Per-group rows the step's scalar launch may write in its own launch (a
    `fusedzero.kernels._rows.Rows`, filled from `read_groups`' result), or None."""

    def read_groups(self, param_groups: list[dict[str, Any]]) -> Any:
        """This step's hyper-parameters from the groups as they are now (host values; raise on a
        bad one). Runs before the step waits for any reduction."""
        ...

    def step(self, hyper: Any, scalars: StepTensors, *, rows_written: bool) -> None:
        """Update every local shard. No host sync (scale, clip and skip are device tensors);
        `rows_written`: the scalar launch already wrote `rows` for this step."""
        ...


class Rule(Protocol):
    """An update rule as the engine runs it (see the module docstring)."""

    name: str
    element_wise: bool
    defaults: Mapping[str, Any]

    def check_group(self, group: Mapping[str, Any]) -> None:
        """Refuse a bad hyper-parameter with a ValueError naming it."""
        ...

    # Optional: `scratch_bytes(local_numel) -> int`, the bytes the rule's launches keep beside a
    # local shard of `local_numel` elements (working memory, never saved; absent: none). The
    # rule's `Update` then holds them as `scratch` tensors. `opt.memory()` counts the tensors,
    # `fusedzero plan` the formula (`scratch_bytes` below): they must agree.

    def blocks(self, shape: tuple[int, ...]) -> Block:
        """Per-matrix rules only (`element_wise = False`): what of a param of `shape` must sit
        whole on one rank (see [Note: whole tensors for per-matrix rules])."""
        ...

    def state_fields(self, modes: MemoryModes) -> tuple[StateField, ...]:
        """The per-element state kept in memory mode `modes`, in checkpoint order."""
        ...

    def build(
        self,
        shards: Sequence[LocalShard],
        *,
        device: torch.device,
        num_groups: int,
        modes: MemoryModes,
        seed: torch.Tensor | None,
    ) -> Update:
        """The launches over `shards` (every flat buffer of the rank, in order). `seed`: the
        engine's bf16-sr random stream seed (None in other master modes)."""
        ...


def scratch_bytes(rule: Rule, local_numel: int) -> int:
    """The scratch bytes `rule` keeps beside a local shard of `local_numel` elements (0 for a
    rule that declares none)."""
    fn = getattr(rule, "scratch_bytes", None)
    return 0 if fn is None else int(fn(local_numel))


@dataclasses.dataclass(frozen=True, slots=True)
class ByGroup:
    """Which rule runs each param group: the group's `key` (e.g. "use_muon") picks one of
    `rules` by its value; a group of that rule is filled from `defaults[value]`, over the
    rule's own defaults, then checked by the rule."""

    key: str
    rules: Mapping[Any, Rule]
    defaults: Mapping[Any, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def pick(self, group: Mapping[str, Any]) -> tuple[Rule, dict[str, Any]]:
        """The rule of `group` and the defaults its group is filled from."""
        if self.key not in group:
            raise ValueError(
                f"param group with keys {sorted(k for k in group if k != 'params')} has no "
                f"{self.key!r}: every group says {self.key}= one of {list(self.rules)}"
            )
        value = group[self.key]
        if value not in self.rules:
            raise ValueError(f"{self.key}={value!r}, expected one of {list(self.rules)}")
        rule = self.rules[value]
        return rule, {**rule.defaults, **self.defaults.get(value, {}), self.key: value}
