"""Stages 1-2: the all-gather of updated params into the full param buffers, and the waits.

[Note: all-gather overlap] With `module` given, each module that owns params waits, in its
forward pre-hook, only for the buckets holding them: the gather of later buckets overlaps the
forward of earlier layers. Without `module`, `gather()` waits before returning. The next step
(whose kernel rewrites the params) and `gathered_params()` wait for whatever is still in flight.
On NCCL a wait orders the streams; it is not a host sync.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fusedzero import comm, wire
from fusedzero.comm import CommContext, Handle
from fusedzero.flat import FlatBuffer
from fusedzero.wire import WireFormat

# (id of a flat buffer, bucket index): one all-gather.
BucketKey = tuple[int, int]


class ParamSync:
    """Owns the in-flight param all-gathers of `buffers` (empty below stage 1 and at stage 3,
    whose params are gathered per unit by `fusedzero.zero3`)."""

    def __init__(self, buffers: list[FlatBuffer], ctx: CommContext,
                 module: nn.Module | None, param_wire: WireFormat | None = None) -> None:
        self.buffers = buffers
        self.ctx = ctx
        self.param_wire = param_wire  # fusedzero.wire: other ranks' pieces arrive quantized
        self._handles: dict[BucketKey, Handle] = {}
        self.hooks: list[Any] = []
        self._module_waits = module is not None and bool(buffers)
        if self._module_waits:
            assert module is not None
            self._install_waits(module)

    def gather(self) -> None:
        """Issue the all-gather of every bucket's updated params (async)."""
        for buf in self.buffers:
            L = buf.layout
            assert buf.param_flat is not None
            for k in range(L.num_buckets):
                lo, hi = L.bucket_range(k)
                plo, phi = L.piece(k, buf.shard_rank)
                h = wire.all_gather(buf.param_flat[lo:hi], buf.param_flat[plo:phi],
                                    self.param_wire, self.ctx, buf.shard_rank)
                self._handles[(id(buf), k)] = h
        if not self._module_waits:
            self.wait()

    def wait(self, keys: Iterable[BucketKey] | None = None) -> None:
        """Wait for in-flight param all-gathers (all, or those buckets)."""
        if not self._handles:
            return
        for key in list(self._handles) if keys is None else keys:
            h = self._handles.pop(key, None)
            if h is not None:
                self.ctx.record("param_wait", key)
                self.ctx.wait(h, what=f"param all-gather of (flat group, bucket) {key}")

    def _install_waits(self, module: nn.Module) -> None:
        """Forward pre-hooks: each module with params of ours waits for their buckets. A param
        a parent uses directly (not through a submodule) is in the parent's own
        parameters(recurse=False), so the parent's hook covers it."""
        where = {id(p): (buf, pos) for buf in self.buffers for pos, p in enumerate(buf.params)}
        for m in module.modules():
            keys: list[BucketKey] = []
            for p in m.parameters(recurse=False):
                if id(p) in where:
                    buf, pos = where[id(p)]
                    keys += [(id(buf), k) for k in buf.layout.buckets_of(buf.layout.params[pos])]
            if keys:
                keys = sorted(set(keys))
                self.hooks.append(m.register_forward_pre_hook(
                    lambda mod, args, keys=keys: self.wait(keys)))

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


def broadcast_from_rank0(t: torch.Tensor, ctxs: Iterable[CommContext]) -> None:
    """Overwrite `t` (contiguous) with rank 0's value over each group in turn (the shard group,
    then the replicate group: rank 0 of both reaches every rank of a 2-D mesh)."""
    for ctx in ctxs:
        ctx.wait(comm.broadcast(t, ctx.group, ctx.world_size),
                 what="broadcast of rank 0's values (construction)")


def start_from_rank0(tensors: Iterable[torch.Tensor], ctxs: Iterable[CommContext]) -> None:
    """Start every replica from rank 0's params and buffers, as DDP does at construction:
    ranks that initialised differently (another seed) would otherwise train apart (stage 0) or
    silently mix their inits shard by shard (stages 1-3). Meta tensors have no values yet:
    stage 3 broadcasts them as it materialises them."""
    todo = [t for t in {id(t): t for t in tensors}.values() if not t.is_meta]
    for ctx in ctxs:
        if ctx.world_size == 1:
            continue
        work = []
        for t in todo:
            buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
            work.append((t, buf, comm.broadcast(buf, ctx.group, ctx.world_size)))
        with torch.no_grad():
            for t, buf, h in work:
                ctx.wait(h, what="broadcast of rank 0's params and buffers (construction)")
                if buf.data_ptr() != t.data_ptr():
                    t.copy_(buf)
