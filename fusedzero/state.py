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

from fusedzero.layout import FlatLayout, Segment


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """One flat buffer as a checkpoint sees it."""

    group_index: int  # the param group its params belong to
    dtype: torch.dtype  # the params' (model) dtype; master and moments are fp32
    unit: int  # stage-3 unit (0: the root; always 0 below stage 3)
    layout: FlatLayout
    shard_rank: int  # whose piece of every bucket this rank holds (0 at stage 0: replicated)

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

    Tensors are 1-D fp32 of `local_numel` elements in local-shard order. From `shard_state()`
    they may be live views of the optimizer's buffers: copy them before the next `step()` if
    they must outlive it. For `load_shard_state()`, a field left None is left as it is (e.g.
    `import_weights` sets only `master`).
    """

    master: list[torch.Tensor] | None = None
    exp_avg: list[torch.Tensor] | None = None
    exp_avg_sq: list[torch.Tensor] | None = None
    step_count: float | None = None  # optimizer steps taken (skipped steps excluded)
    scaler: dict[str, float] | None = None  # {"scale": ..., "growth_tracker": ...} or None
