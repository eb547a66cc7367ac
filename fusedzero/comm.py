"""Collectives as free functions, each counted in bytes on the wire.

Every call is `async_op=True` and returns a handle (or None when the group has one rank: world
size 1 is the degenerate case of the same code, with nothing to send). gloo (CPU) and NCCL (GPU)
run the same calls; on NCCL the work handle orders the streams.

Bytes are counted per rank by the ring formulas, with n the full (unsharded) element count of the
collective and b its element size: all-reduce 2(W-1)/W*n*b, reduce-scatter and all-gather
(W-1)/W*n*b. These are exact integers because n is a multiple of W for every sharded buffer.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclasses.dataclass
class CommCounter:
    """Bytes on the wire and element counts per collective kind, for this rank."""

    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    numel: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    calls: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, kind: str, numel: int, element_size: int, world_size: int) -> None:
        factor = 2 if kind == "all_reduce" else 1
        self.bytes[kind] += factor * (world_size - 1) * numel * element_size // world_size
        self.numel[kind] += numel
        self.calls[kind] += 1

    def reset(self) -> None:
        for d in (self.bytes, self.numel, self.calls):
            for k in d:
                d[k] = 0

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "numel": dict(self.numel), "calls": dict(self.calls)}

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def group_size(group: Any) -> int:
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# torch 2.13 renamed the tensor collectives to *_single and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, world_size: int,
                   counter: CommCounter) -> Any:
    """Sum `inp` over ranks; this rank's 1/W slice lands in `out` (may alias that slice)."""
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    counter.add("reduce_scatter", inp.numel(), inp.element_size(), world_size)
    return _reduce_scatter(out, inp, group=group, async_op=True)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, world_size: int,
               counter: CommCounter) -> Any:
    """Concatenate every rank's `inp` into `out` (`inp` may be this rank's slice of `out`)."""
    if world_size == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    counter.add("all_gather", out.numel(), out.element_size(), world_size)
    return _all_gather(out, inp, group=group, async_op=True)


def all_reduce(t: torch.Tensor, group: Any, world_size: int, counter: CommCounter) -> Any:
    """Sum `t` over ranks in place."""
    if world_size == 1:
        return None
    counter.add("all_reduce", t.numel(), t.element_size(), world_size)
    return dist.all_reduce(t, group=group, async_op=True)


def wait(handle: Any) -> None:
    if handle is not None:
        handle.wait()


def broadcast(t: torch.Tensor, group: Any, world_size: int) -> Any:
    """Overwrite `t` with the value group rank 0 holds (async). Used once, at construction, to
    start replicas from one copy (as DDP); not per-step traffic, so not counted."""
    if world_size == 1:
        return None
    src = 0 if group is None else dist.get_global_rank(group, 0)
    return dist.broadcast(t, src=src, group=group, async_op=True)
