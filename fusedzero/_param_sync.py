"""Stages 1-2: the all-gather of updated params into the full param buffers, and the waits.

[Note: all-gather overlap] With `module` given, a module's forward pre-hook waits for the
buckets of every param its forward can read: its own, and those of its whole subtree (a forward
may read a child's params without calling the child: nn.MultiheadAttention reads
`out_proj.weight`; nn.TransformerEncoderLayer in eval under no_grad reads every child's params
in one fused op), except the subtrees of *units* below it (`Sharding(units=)`, as at stage 3: by
default every element of an nn.ModuleList), which are read by calling the unit, whose own hook
waits for its subtree. So the root waits for the params outside the blocks, each block for its
own, and the gather of later blocks overlaps the forward of earlier ones. A forward that reads a
unit's params without calling it (stacking the weights of an nn.ModuleList of experts) needs a
policy under which they are not units (`Sharding(units=lambda m: False)`: the root waits for
everything; no overlap, always correct). Without `module`, `gather()` waits before returning.
The next step (whose kernel rewrites the params) and `gathered_params()` wait for whatever is
still in flight. On NCCL a wait orders the streams; it is not a host sync.

[Note: gather order] Buckets are gathered in the order forward first waits for them, recorded
on the first forward after construction (which waits for nothing: no gather is in flight yet),
so the first block's buckets are not queued behind the last block's. Before that forward, and
for buckets no forward waited for, the order is the flat buffers' own. The recorded order is
this rank's, from its own forward: ranks that run different modules first would issue their
collectives in different orders, which a mismatched NCCL collective turns into a hang or wrong
values, so the order is made identical on every rank by taking rank 0's (one broadcast of a
small index table, at the end of the first `step()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from fusedzero import _comm as comm, wire
from fusedzero._comm import CommContext, Handle
from fusedzero._dtensor import local
from fusedzero._flat import FlatBuffer
from fusedzero._profiling import phase
from fusedzero._units import UnitPolicy, select_units
from fusedzero.wire import WireFormat

# (id of a flat buffer, bucket index): one all-gather.
BucketKey = tuple[int, int]


class BucketGather(NamedTuple):
    """One bucket's all-gather: its range of the full param buffer and this rank's piece."""

    full: torch.Tensor
    own: torch.Tensor
    shard_rank: int


def _bucket_gather(buf: FlatBuffer, k: int) -> BucketGather:
    L = buf.layout
    assert buf.param_flat is not None
    lo, hi = L.bucket_range(k)
    plo, phi = L.piece(k, buf.shard_rank)
    return BucketGather(buf.param_flat[lo:hi], buf.param_flat[plo:phi], buf.shard_rank)


class ParamSync:
    """Owns the in-flight param all-gathers of `buffers` (empty below stage 1 and at stage 3,
    whose params are gathered per unit by `fusedzero._zero3`) and the forward waits on them."""

    def __init__(
        self,
        buffers: list[FlatBuffer],
        ctx: CommContext,
        module: nn.Module | None,
        units: UnitPolicy = None,
        param_wire: WireFormat | None = None,
    ) -> None:
        self.buffers = buffers
        self.ctx = ctx
        self.param_wire = param_wire  # fusedzero.wire: other ranks' pieces arrive quantized
        self._handles: dict[BucketKey, Handle] = {}
        self.hooks: list[Any] = []
        self._buf = {id(buf): buf for buf in buffers}
        self._index = {id(buf): i for i, buf in enumerate(buffers)}  # trace: (buffer, bucket)
        # Per bucket, made once (no view op per step): its range of the param buffer, this
        # rank's piece of it, and the rank that piece is.
        self._views: dict[BucketKey, BucketGather] = {
            (id(buf), k): _bucket_gather(buf, k)
            for buf in buffers
            for k in range(buf.layout.num_buckets)
        }
        # Every bucket, in the flat buffers' order, then (once recorded) in forward order.
        self.order: list[BucketKey] = [
            (id(buf), k) for buf in buffers for k in range(buf.layout.num_buckets)
        ]
        self._seen: dict[BucketKey, None] = {}  # keys in the order forward first waited
        self._recording = True
        self._module_waits = module is not None and bool(buffers)
        if self._module_waits:
            assert module is not None
            self._install_waits(module, select_units(module, units))

    def gather(self, after_step: bool = False) -> None:
        """Issue the all-gather of every bucket's updated params (async), in forward order.
        The first gather after a step ends the recording (every rank steps in lockstep, so
        every rank joins its broadcast, whatever forwards it ran)."""
        if after_step and self._recording and self._module_waits:
            self._fix_order()
        views = self._views
        with phase("fusedzero::all_gather"):
            for key in self.order:
                full, own, shard_rank = views[key]
                self.ctx.record("param_gather", (self._index[key[0]], key[1]))
                self._handles[key] = wire.all_gather(
                    full, own, self.param_wire, self.ctx, shard_rank
                )
        if not self._module_waits:
            self.wait()

    def _fix_order(self) -> None:
        """End the recording: forward order first, the rest after; rank 0's order on every
        rank (see [Note: gather order]). Once per optimizer; on NCCL `tolist()` is a host sync."""
        self._recording = False
        pos = {key: i for i, key in enumerate(self.order)}
        perm = [pos[key] for key in self._seen] + [
            i for key, i in pos.items() if key not in self._seen
        ]
        if self.ctx.world_size > 1:
            t = torch.tensor(perm, dtype=torch.int64, device=self.buffers[0].device)
            self.ctx.wait(
                comm.broadcast(t, self.ctx.group, self.ctx.world_size),
                what="broadcast of rank 0's param gather order",
            )
            perm = t.tolist()
        self.order = [self.order[i] for i in perm]

    def wait(self, keys: Iterable[BucketKey] | None = None) -> None:
        """Wait for in-flight param all-gathers (all, or those buckets)."""
        if not self._handles:
            return
        with phase("fusedzero::param_wait"):
            for key in list(self._handles) if keys is None else keys:
                h = self._handles.pop(key, None)
                if h is not None:
                    self.ctx.record("param_wait", (self._index[key[0]], key[1]))
                    self.ctx.wait(h, what=f"param all-gather of (flat group, bucket) {key}")

    def _before_forward(self, keys: tuple[BucketKey, ...]) -> None:
        if self._recording:
            for key in keys:
                self._seen.setdefault(key)
        self.wait(keys)

    def _install_waits(self, module: nn.Module, units: list[nn.Module]) -> None:
        """Forward pre-hooks: each module whose forward can read params of ours waits for
        their buckets (see [Note: all-gather overlap])."""
        where = {id(p): (buf, pos) for buf in self.buffers for pos, p in enumerate(buf.params)}
        unit_ids = {id(u) for u in units}
        for m in module.modules():
            keys: dict[BucketKey, None] = {}
            for p in _readable(m, unit_ids):
                if id(p) in where:
                    buf, pos = where[id(p)]
                    for k in buf.layout.buckets_of(buf.layout.params[pos]):
                        keys.setdefault((id(buf), k))
            if keys:
                self.hooks.append(
                    m.register_forward_pre_hook(
                        lambda mod, args, keys=tuple(keys): self._before_forward(keys)
                    )
                )

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


def _readable(m: nn.Module, unit_ids: set[int]) -> Iterator[nn.Parameter]:
    """The params `m`'s forward may read without calling a unit: its subtree's, in registration
    order, units strictly below `m` left out."""
    yield from m.parameters(recurse=False)
    for c in m.children():
        if id(c) not in unit_ids:
            yield from _readable(c, unit_ids)


def broadcast_from_rank0(t: torch.Tensor, ctxs: Iterable[CommContext]) -> None:
    """Overwrite `t` (contiguous) with rank 0's value over each group in turn (the shard group,
    then the replicate group: rank 0 of both reaches every rank of a 2-D mesh)."""
    for ctx in ctxs:
        ctx.wait(
            comm.broadcast(t, ctx.group, ctx.world_size),
            what="broadcast of rank 0's values (construction)",
        )


def start_from_rank0(tensors: Iterable[torch.Tensor], ctxs: Iterable[CommContext]) -> None:
    """Start every replica from rank 0's params and buffers, as DDP does at construction:
    ranks that initialised differently (another seed) would otherwise train apart (stage 0) or
    silently mix their inits shard by shard (stages 1-3). Meta tensors have no values yet:
    stage 3 broadcasts them as it materialises them."""
    # DTensors (tensor parallel): their local tensors, which replicas along dp share.
    todo = [local(t) for t in {id(t): t for t in tensors}.values() if not t.is_meta]
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
