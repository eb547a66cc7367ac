"""The optimizer's typed interface to everything that saves, loads or converts its state.

Checkpoints (`fusedzero.checkpoint`), importers (DCP, Hugging Face) and `plan` talk to an
optimizer (`ZeroOptimizer`, e.g. `ZeroAdamW`) only through these records and these methods,
never through its private attributes:

    opt.shard_infos() -> list[ShardInfo]      # what this rank holds, buffer by buffer
    opt.param_infos() -> list[ParamInfo]      # the params, in optimizer order
    opt.shard_state() -> ShardState           # this rank's values (read-only views/copies)
    opt.load_shard_state(ShardState)          # write them back (collective at stages 1-3)
    opt.write_param_runs(read) -> bool        # stage 3: params written run by run, unstaged
    opt.rule                                  # the update rule: its state fields by name
    opt.group_rules                           # each param group's rule (opt.rule: None where
                                              # they differ); a buffer holds its group's fields

and its public attributes (`params`, `param_names`, `param_groups`, `module`, `world_size`,
`rank`, `process_group`, `stage`, `bucket_numel`, `param_dtype`, `seed`, `step_count`, `replicas`,
`replica_rank`, `replicate_group`, `tp`). The state a buffer holds is the engine's master (and the
bf16-kahan `comp`) plus the rule's fields (`Rule.state_fields(modes)`, fusedzero/rules): every
record, conversion and checkpoint tensor is keyed by those names (`tensor_fields`).

A "buffer" is one flat buffer of the optimizer: the params of one (param group, dtype[, stage-3
unit]). Its local shard is this rank's piece of every bucket, back to back; `layout.segments(
shard_rank)` maps param element ranges to local-shard offsets, which is what survives a change of
world size or stage.
"""

from __future__ import annotations

import dataclasses

import torch

from fusedzero._layout import FlatLayout, Segment
from fusedzero.kernels import quantize_blockwise
from fusedzero.memory_modes import (
    MemoryModes,
    decode_master,
    decode_state,
    encode_master,
)
from fusedzero.rules import Rule, StateField, scale_field, scratch_bytes

__all__ = ["ParamInfo", "ShardInfo", "ShardState", "tensor_fields"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """One flat buffer as a checkpoint sees it."""

    group_index: int  # the param group its params belong to
    dtype: torch.dtype  # the params' (model) dtype
    unit: int  # stage-3 unit (0: the root; always 0 below stage 3)
    layout: FlatLayout
    shard_rank: int  # whose piece of every bucket this rank holds (0 at stage 0: replicated)
    modes: MemoryModes = MemoryModes()  # how master and state are held (memory_modes.py)

    @property
    def local_numel(self) -> int:
        return self.layout.local_numel

    def segments(self) -> list[Segment]:
        return self.layout.segments(self.shard_rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """One trainable param, in the optimizer's order (param groups in order, params in order)."""

    index: int
    name: str  # its name in `module` (or "param.i" without one)
    shape: tuple[int, ...]
    dtype: torch.dtype  # the model dtype the optimizer keeps it in
    group_index: int


class ShardState:
    """This rank's optimizer state, one entry per buffer of `shard_infos()` (same order).

    Tensors are 1-D of `local_numel` elements in local-shard order (a block-scale field:
    `local_numel / QBLOCK`), stored as `modes` says (fusedzero/memory_modes.py): `master` fp32
    (bf16 in the bf16 master modes: the params), `comp` the bf16 Kahan compensation, and the
    rule's state fields by name (`states`, also read as attributes: `st.exp_avg` for AdamW),
    in the dtypes the rule gives them in `modes` (`tensor_fields`). The default modes are fp32
    throughout. `load_shard_state()` converts from `modes` into the optimizer's own (see [Note:
    converting masters]). From `shard_state()` they may be live views of the optimizer's
    buffers: copy them before the next `step()` if they must outlive it. For
    `load_shard_state()`, a field left out (or None) is left as it is (e.g. `import_weights`
    sets only `master`). Where param groups run different rules (`ByGroup`), a field's entry
    is None for a buffer whose rule does not keep that field.
    """

    def __init__(
        self,
        *,
        master: list[torch.Tensor] | None = None,
        comp: list[torch.Tensor] | None = None,
        modes: MemoryModes = MemoryModes(),
        step_count: float | None = None,
        scaler: dict[str, float] | None = None,
        **states: list[torch.Tensor] | None,
    ) -> None:
        self.master = master
        self.comp = comp  # bf16-kahan only
        self.states: dict[str, list[torch.Tensor]] = {
            k: v for k, v in states.items() if v is not None
        }
        self.modes = modes
        self.step_count = step_count  # optimizer steps taken (skipped steps excluded)
        self.scaler = scaler  # {"scale": ..., "growth_tracker": ...} or None

    def __getattr__(self, name: str) -> list[torch.Tensor]:
        # A rule's field by name (`st.exp_avg`); only called when normal lookup fails.
        states = self.__dict__.get("states", {})
        if name in states:
            return states[name]
        raise AttributeError(f"ShardState has no field {name!r} (it holds {sorted(states)})")

    def get(self, name: str) -> list[torch.Tensor] | None:
        """A field's buffers by name (master, comp or a rule's field), None when not set."""
        if name in ("master", "comp"):
            return getattr(self, name)
        return self.states.get(name)

    def names(self) -> tuple[str, ...]:
        """The fields that are set, master and comp first."""
        own = tuple(n for n in ("master", "comp") if getattr(self, n) is not None)
        return own + tuple(self.states)

    def tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Buffer i's tensors by field name (the fields that are set for it)."""
        out = {name: self.get(name)[i] for name in self.names()}  # type: ignore[index]
        return {name: t for name, t in out.items() if t is not None}


def tensor_fields(modes: MemoryModes, rule: Rule) -> tuple[StateField, ...]:
    """Every per-buffer tensor a buffer held in `modes` by `rule` has, in the order checkpoints
    write them: the engine's master (bf16 in the bf16 master modes) and bf16-kahan
    compensation, then the rule's state fields."""
    master = StateField(name="master", dtype=torch.float32 if modes.fp32_master else torch.bfloat16)
    comp = (StateField(name="comp", dtype=torch.bfloat16),) if modes.kahan else ()
    return (master, *comp, *rule.state_fields(modes))


def optimizer_bytes(
    modes: MemoryModes, rule: Rule, local_numel: int, param_dtype: torch.dtype
) -> int:
    """Resident optimizer bytes of a local shard of `local_numel` elements (a multiple of
    QBLOCK) whose params are `param_dtype`: the master beside the params (`master_bytes`) and
    the rule's state fields, and the rule's scratch (`rules.scratch_bytes`). The formula
    `fusedzero plan` uses; `opt.memory()` counts the same tensors."""
    return (
        modes.master_bytes(local_numel, param_dtype)
        + sum(f.nbytes(local_numel) for f in rule.state_fields(modes))
        + scratch_bytes(rule, local_numel)
    )


def fields_of(modes: MemoryModes, rule: Rule) -> tuple[str, ...]:
    """The names of `tensor_fields(modes, rule)`."""
    return tuple(f.name for f in tensor_fields(modes, rule))


def convert(
    t: dict[str, torch.Tensor], src: MemoryModes, dst: MemoryModes, rule: Rule
) -> dict[str, torch.Tensor]:
    """One buffer's tensors held in `src` modes, as `dst` holds them (only the fields present:
    a master without its comp is taken as the effective master; a rule's state is converted
    only when both its values and, where it is block-quantized, its scales are given). States
    go through fp32 into the dtypes `rule` gives them in `dst`."""
    out: dict[str, torch.Tensor] = {}
    if "master" in t:
        if src.master == dst.master and ("comp" in t or not dst.kahan):
            out["master"] = t["master"]
            if "comp" in t:
                out["comp"] = t["comp"]
        else:
            m, c = encode_master(decode_master(t["master"], t.get("comp")), dst)
            out["master"] = m
            if c is not None:
                out["comp"] = c
    src_fields, dst_fields = rule.state_fields(src), rule.state_fields(dst)
    want = {f.name: f for f in dst_fields}
    for f in src_fields:
        if f.scale_of is not None or f.name not in t:
            continue
        s_scale, d_scale = scale_field(src_fields, f.name), scale_field(dst_fields, f.name)
        scale = None if s_scale is None else t.get(s_scale.name)
        if src.states == dst.states:
            out[f.name] = t[f.name]
            if scale is not None:
                out[s_scale.name] = scale  # type: ignore[union-attr]
            continue
        if s_scale is not None and scale is None:
            raise ValueError(f"{f.name} is int8 without its scales")
        x = decode_state(t[f.name], scale, signed=f.signed)
        if d_scale is not None:
            q, sc = quantize_blockwise(x.float().contiguous(), signed=f.signed)
            out[f.name], out[d_scale.name] = q, sc
        else:
            out[f.name] = x.to(want[f.name].dtype)
    return out
