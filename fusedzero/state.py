"""The optimizer's typed interface to everything that saves, loads or converts its state.

Checkpoints (`fusedzero.checkpoint`), importers (DCP, Hugging Face) and `plan` talk to a
`ZeroAdamW` only through these records and four methods, never through its private attributes:

    opt.shard_infos() -> list[ShardInfo]      # what this rank holds, buffer by buffer
    opt.param_infos() -> list[ParamInfo]      # the params, in optimizer order
    opt.shard_state() -> ShardState           # this rank's values (read-only views/copies)
    opt.load_shard_state(ShardState)          # write them back (collective at stages 1-3)

A "buffer" is one flat buffer of the optimizer: the params of one (param group, dtype[, stage-3
unit]). Its local shard is this rank's piece of every bucket, back to back; `layout.segments(
shard_rank)` maps param element ranges to local-shard offsets, which is what survives a change of
world size or stage.
"""

from __future__ import annotations

import dataclasses

import torch

from fusedzero._layout import FlatLayout, Segment
from fusedzero.memory_modes import (
    MemoryModes,
    decode_master,
    decode_state,
    encode_master,
    encode_state,
)

__all__ = ["ParamInfo", "ShardInfo", "ShardState"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """One flat buffer as a checkpoint sees it."""

    group_index: int  # the param group its params belong to
    dtype: torch.dtype  # the params' (model) dtype
    unit: int  # stage-3 unit (0: the root; always 0 below stage 3)
    layout: FlatLayout
    shard_rank: int  # whose piece of every bucket this rank holds (0 at stage 0: replicated)
    modes: MemoryModes = MemoryModes()  # how master and moments are held (memory_modes.py)

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


@dataclasses.dataclass(kw_only=True)
class ShardState:
    """This rank's optimizer state, one entry per buffer of `shard_infos()` (same order).

    Tensors are 1-D of `local_numel` elements in local-shard order, stored as `modes` says
    (fusedzero/memory_modes.py): master fp32 (bf16 in the bf16 master modes: the params), `comp` the
    bf16 Kahan compensation, exp_avg / exp_avg_sq fp32, bf16 or int8/uint8 codes with their
    fp32 block scales (`local_numel / QBLOCK` each). The default modes are fp32 throughout.
    `load_shard_state()` converts from `modes` into the optimizer's own (see [Note: converting
    masters] there). From `shard_state()` they may be live views of the optimizer's buffers:
    copy them before the next `step()` if they must outlive it. For `load_shard_state()`, a
    field left None is left as it is (e.g. `import_weights` sets only `master`).
    """

    master: list[torch.Tensor] | None = None
    exp_avg: list[torch.Tensor] | None = None
    exp_avg_sq: list[torch.Tensor] | None = None
    comp: list[torch.Tensor] | None = None  # bf16-kahan only
    exp_avg_scale: list[torch.Tensor] | None = None  # int8 states only
    exp_avg_sq_scale: list[torch.Tensor] | None = None  # int8 states only
    modes: MemoryModes = MemoryModes()
    step_count: float | None = None  # optimizer steps taken (skipped steps excluded)
    scaler: dict[str, float] | None = None  # {"scale": ..., "growth_tracker": ...} or None

    def tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Buffer i's tensors by field name (the fields that are set)."""
        out = {}
        for name in TENSOR_FIELDS:
            values = getattr(self, name)
            if values is not None:
                out[name] = values[i]
        return out


# Every per-buffer tensor field of ShardState, in the order checkpoints write them.
TENSOR_FIELDS = ("master", "comp", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def fields_of(modes: MemoryModes) -> tuple[str, ...]:
    """The tensor fields a buffer held in `modes` has."""
    return tuple(
        f
        for f in TENSOR_FIELDS
        if (f != "comp" or modes.kahan) and (not f.endswith("_scale") or modes.quantized)
    )


def convert(
    t: dict[str, torch.Tensor], src: MemoryModes, dst: MemoryModes
) -> dict[str, torch.Tensor]:
    """One buffer's tensors held in `src` modes, as `dst` holds them (only the fields present:
    a master without its comp is taken as the effective master; states are converted only
    when both the values and, for int8, their scales are given)."""
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
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        if name not in t:
            continue
        scale = t.get(f"{name}_scale")
        if src.states == dst.states:
            out[name] = t[name]
            if scale is not None:
                out[f"{name}_scale"] = scale
            continue
        if src.quantized and scale is None:
            raise ValueError(f"{name} is int8 without its scales")
        q, s = encode_state(decode_state(t[name], scale, signed=signed), dst, signed=signed)
        out[name] = q
        if s is not None:
            out[f"{name}_scale"] = s
    return out
