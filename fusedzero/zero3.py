"""ZeRO-3: params sharded per unit, gathered just in time, prefetched, freed after use.

A *unit* is a module chosen by the wrapping policy (default: every child of an nn.ModuleList, i.e.
each transformer block); params in no unit, and params shared by two units (tied weights), belong
to the root unit (the whole model). Each unit's params form their own flat buffers, so a unit is
gathered by one all-gather per bucket.

This module receives the flat buffers (`fusedzero.flat`, fully built) and a communication
context; it never sees the optimizer. It decides *when* a unit's gathered buffer lives.

[Note: unit lifetimes] (the buffers themselves: see fusedzero/flat.py)
- A unit's gathered storage is allocated by `gather` and released by `free`; while it is freed
  the params are empty tensors (`.data` swaps, as FSDP1 does): `print(p)`, `p.norm()` or
  `p.fill_()` outside a forward would otherwise read or write freed memory (a segfault). Read
  full values inside `opt.gathered_params()`, or through `model.state_dict()` (gathered on
  demand, copied); `model.load_state_dict()` writes every rank's shard (fusedzero/
  model_state_dict.py).
- Forward: the pre-hook gathers unit u (waiting on its prefetch) and issues unit u+1's gather;
  the post-hook frees u (reshard_after_forward=True) unless it runs as a recomputation inside
  backward (activation checkpointing), or u is the root and its output needs a grad (its
  backward runs first: the root stays gathered until its grads are in). Anything that rewrites
  the shards (the update, a load) frees every unit first (`ZeroAdamW.quiesce_params`).
- Backward: a hook on the unit's outputs re-gathers u before its backward runs and prefetches the
  unit before it; when every param of u has its grad, u's buckets are reduce-scattered (by the
  optimizer) and u is freed. Whatever is still gathered at the end of backward is freed.
"""
from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fusedzero import wire
from fusedzero.after_backward import free_when_inputs_have_grads
from fusedzero.comm import CommContext, Handle, eager
from fusedzero.dtensor import local, set_local
from fusedzero.flat import FlatBuffer
from fusedzero.model_state_dict import UnitStateDict
from fusedzero import shard_init
from fusedzero.units import FullUnitInit, ParamInitFn, ShardInit, UnitPolicy, select_units

# Overwrite a tensor with group rank 0's value (over every group replicas span).
Broadcast = Callable[[torch.Tensor], None]


class UnitState(enum.Enum):
    FREE = 0
    GATHERING = 1
    GATHERED = 2


class Zero3:
    """The per-unit gather/free machinery of stage 3, over flat buffers it is given."""

    def __init__(self, root: nn.Module, policy: UnitPolicy, reshard_after_forward: bool,
                 ctx: CommContext, broadcast: Broadcast,
                 param_wire: wire.WireFormat | None = None) -> None:
        self.root = root
        self.param_wire = param_wire  # fusedzero.wire: other ranks' pieces arrive quantized
        self.reshard_after_forward = reshard_after_forward
        self.ctx = ctx
        self._broadcast = broadcast
        self.modules: list[nn.Module] = [root] + select_units(root, policy)
        n = len(self.modules)
        self.buffers: list[list[FlatBuffer]] = [[] for _ in range(n)]
        self.state = [UnitState.FREE] * n
        self.handles: list[list[Handle]] = [[] for _ in range(n)]
        # Per unit, made at its first gather: each buffer's (gathered bucket, own shard piece)
        # views. `full` and `param_shard` are never replaced, and a view of `full` follows its
        # storage through every resize.
        self._gather_views: list[list[tuple[FlatBuffer, list[tuple[torch.Tensor,
                                                                    torch.Tensor]]]] | None]
        self._gather_views = [None] * n
        self.pending = [0] * n
        self.n_trainable = [0] * n
        self.gathered_now = 0
        self.max_gathered = 0  # units gathered at once, the root excluded
        self.max_gathered_with_root = 0
        self.materialize_peak = 0  # most full-buffer elements alive during meta-device init
        # Elements of gathered storage alive now, and the most at once since last reset: what a
        # unit-by-unit walk (state_dict, close) is held to (one unit above the sharded state).
        self.gathered_numel = 0
        self.max_gathered_numel = 0
        self.hooks: list[Any] = []
        self._numel = [0] * n  # per unit: elements of its gathered storage (`unit_numel`)
        self._pre_backward: list[Callable[[Any], None]] = []  # per unit, made once
        # Units a backward left gathered to its end: freed once their inputs' grads are in.
        self.late: set[int] = set()
        self.unit_of_param: dict[int, int] = {}
        self._meta_init = False  # params came on the meta device: `setup` initialises them
        self.init_stats: shard_init.LocalInitStats | None = None  # the local init's counts

    # -- construction -------------------------------------------------------------------------
    def assign(self, params: list[nn.Parameter]) -> list[int]:
        """The unit of each param: the unit module that holds it, or the root (0) for params
        in no unit or shared by two (tied weights)."""
        owner: dict[int, int] = {}
        for u, m in enumerate(self.modules[1:], start=1):
            for p in m.parameters():
                if id(p) in owner and owner[id(p)] != u:
                    owner[id(p)] = 0  # shared by two units: the root holds it
                else:
                    owner.setdefault(id(p), u)
        units = [owner.get(id(p), 0) for p in params]
        # Asked here, before the buffers are built: they move meta params onto real storage.
        self._meta_init = any(p.is_meta for p in params)
        for p, u in zip(params, units):
            self.unit_of_param[id(p)] = u
            self.n_trainable[u] += 1
        return units

    def setup(self, buffers: list[FlatBuffer], param_init_fn: ParamInitFn | None) -> None:
        """Take the units' buffers (built, params pointing at their released gathered
        buffer), initialise params on the meta device unit by unit, install the hooks."""
        for buf in buffers:
            self.buffers[buf.unit].append(buf)
            self._numel[buf.unit] += buf.layout.padded_numel
        self._pre_backward = [self._make_pre_backward(u) for u in range(len(self.modules))]
        if self._meta_init:
            self._materialize(param_init_fn)
        for u, m in enumerate(self.modules):
            if not self.buffers[u]:
                continue
            self.hooks.append(m.register_forward_pre_hook(self._make_pre_forward(u)))
            self.hooks.append(m.register_forward_hook(self._make_post_forward(u)))
        # model.state_dict() / load_state_dict(): full values, as collectives (see there).
        self.hooks.extend(UnitStateDict(self).install(self.root))
        self.pending = list(self.n_trainable)

    def close(self, params: list[nn.Parameter]) -> None:
        """Remove the hooks and leave the params as plain tensors holding their full values, unit
        by unit: one unit's gathered storage at a time beside the copies made so far."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.free_all()
        for u in range(len(self.modules)):
            own = self.unit_params(u)
            if not own:
                continue
            self.wait(u)
            with torch.no_grad():
                full = [local(p).detach().clone() for p in own]  # off the unit buffers
            self.free(u)
            # After the free, which points the params at empty tensors: they keep their values.
            for p, t in zip(own, full):
                set_local(p, t)

    def _materialize(self, init_fn: ParamInitFn | None) -> None:
        """Initialise meta-device params: a `ShardInit` writes each local segment; a plain
        `fn(name, module)` or None (`reset_parameters`) runs on this rank's elements only
        (See [Note: local-shard init] in fusedzero/shard_init.py). `FullUnitInit` goes module
        by module, in `named_modules()` order (the order an eager build draws its random
        numbers in, so both give the same values). A unit's full buffer lives only while its
        modules are being initialised: the whole model never exists on one rank. Each rank
        computes the same full values and keeps its own shard."""
        if isinstance(init_fn, ShardInit):
            for bufs in self.buffers:
                for buf in bufs:
                    _init_own_shard(buf, init_fn)
            return
        # -- shard_init: the model's own init on this rank's elements (issue 43) --
        all_bufs = [buf for bufs in self.buffers for buf in bufs]
        if not isinstance(init_fn, FullUnitInit) and shard_init.applies(all_bufs):
            self.init_stats = shard_init.init_local(self.root, all_bufs, init_fn,
                                                    self._broadcast)
            return
        if isinstance(init_fn, FullUnitInit):
            init_fn = init_fn.fn
        # -- end shard_init --
        if init_fn is None:
            def init_fn(name: str, m: nn.Module) -> None:
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        todo: list[tuple[str, nn.Module, int]] = []
        left = [0] * len(self.modules)
        for name, m in self.root.named_modules():
            owned = [p for p in m.parameters(recurse=False) if id(p) in self.unit_of_param]
            if owned:
                u = self.unit_of_param[id(owned[0])]
                todo.append((name, m, u))
                left[u] += 1
        for name, m, u in todo:
            if self.state[u] == UnitState.FREE:
                for buf in self.buffers[u]:
                    buf.allocate_full()
                    buf.full.zero_()
                self.state[u] = UnitState.GATHERED
                self.materialize_peak = max(self.materialize_peak, sum(
                    buf.layout.padded_numel for v in range(len(self.modules))
                    if self.state[v] != UnitState.FREE for buf in self.buffers[v]))
            with torch.no_grad():
                init_fn(name, m)
            left[u] -= 1
            if left[u] == 0:
                for buf in self.buffers[u]:
                    # Every rank drew its own init: start every replica from rank 0's, as DDP.
                    self._broadcast(buf.full)
                    buf.copy_own_shard()
                for buf in self.buffers[u]:
                    buf.release_full()
                self.state[u] = UnitState.FREE

    # -- gather / free --------------------------------------------------------------------------
    def gather(self, u: int) -> None:
        """Issue unit u's all-gather (async); no-op if it is gathered or on its way.
        [Note: host cost per unit] gather, wait and free run a few times per unit per step on
        the host path that feeds the device (forward, backward, prefetch): each Python call
        here costs ~0.2-1 us, so they look nothing up that setup could have."""
        if self.state[u] is not UnitState.FREE or not self.buffers[u]:
            return
        ctx = self.ctx
        ctx.record("gather", u)
        self.gathered_numel += self._numel[u]
        if self.gathered_numel > self.max_gathered_numel:
            self.max_gathered_numel = self.gathered_numel
        for buf in self.buffers[u]:
            buf.allocate_full()  # values land when the handles are waited on
        views = self._gather_views[u]
        if views is None:  # after allocate_full: a view of a 0-byte storage would not be made
            views = self._gather_views[u] = [(buf, _bucket_views(buf)) for buf in self.buffers[u]]
        handles = self.handles[u]
        for buf, pairs in views:
            for full, own in pairs:
                h = wire.all_gather(full, own, self.param_wire, ctx, buf.shard_rank)
                if h is not None:
                    handles.append(h)
        self.state[u] = UnitState.GATHERING
        if u != 0:
            self.gathered_now += 1
            self.max_gathered = max(self.max_gathered, self.gathered_now)
        live = self.gathered_now + (self.state[0] is not UnitState.FREE)
        if live > self.max_gathered_with_root:
            self.max_gathered_with_root = live

    def wait(self, u: int) -> None:
        state = self.state[u]
        if state is UnitState.GATHERED:
            return
        if state is UnitState.FREE:
            self.gather(u)
        if self.state[u] is UnitState.GATHERING:
            self._wait_handles(u)
            self.state[u] = UnitState.GATHERED

    def _wait_handles(self, u: int) -> None:
        handles = self.handles[u]
        if handles:
            for h in handles:
                self.ctx.wait(h, what=f"all-gather of unit {u} params (stage 3)")
            handles.clear()

    def free(self, u: int) -> None:
        if self.state[u] is UnitState.FREE:
            return
        self._wait_handles(u)  # never release memory a collective is still writing
        for buf in self.buffers[u]:
            buf.release_full()
        self.state[u] = UnitState.FREE
        self.gathered_numel -= self._numel[u]
        if u != 0:
            self.gathered_now -= 1
        self.ctx.record("free", u)

    def unit_numel(self, u: int) -> int:
        """Elements of unit u's gathered storage (padded: what `gather` allocates)."""
        return self._numel[u]

    def unit_params(self, u: int) -> list[nn.Parameter]:
        return [p for buf in self.buffers[u] for p in buf.params]

    def free_units(self) -> list[int]:
        return [u for u in range(len(self.modules)) if self.state[u] == UnitState.FREE]

    def free_all(self) -> None:
        for u in range(len(self.modules)):
            self.free(u)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """All params gathered (e.g. to read or export the full model); freed on exit. This holds
        the whole model on the device at once; `model.state_dict()` goes unit by unit to the
        CPU instead."""
        for u in range(len(self.modules)):
            self.wait(u)
        try:
            yield
        finally:
            self.free_all()

    # -- hooks ------------------------------------------------------------------------------------
    def _next_unit(self, u: int, step: int) -> int | None:
        v = u + step
        return v if 1 <= v < len(self.modules) else None

    def _make_pre_forward(self, u: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any) -> Any:
            self.wait(u)
            nxt = self._next_unit(u, +1) if u else self._next_unit(0, +1)
            if nxt is not None and not _in_backward():
                self.gather(nxt)  # prefetch: overlaps this unit's compute
            if u in self.late and torch.is_grad_enabled():
                return free_when_inputs_have_grads(args, lambda: self.free(u))
            return None
        return _eager(hook)

    def _make_post_forward(self, u: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            self.ctx.record("forward_end", u)
            tensors = ([output] if output.requires_grad else []) \
                if isinstance(output, torch.Tensor) else \
                [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)
                 and t.requires_grad]
            if torch.is_grad_enabled() and tensors:
                # Re-gather before this unit's backward: the grad of its output arrives first.
                # A pre-hook on the node that made the output runs then (before that node, the
                # unit's last op, computes anything), for less host time than a tensor hook.
                pre_backward = self._pre_backward[u]
                for t in tensors:
                    if t.grad_fn is not None:
                        t.grad_fn.register_prehook(pre_backward)
                    else:
                        t.register_hook(pre_backward)
            # The root's backward comes first, right after this: freeing it would only
            # gather it again (one all-gather of the root per step saved, as FSDP2's root).
            keep = u == 0 and torch.is_grad_enabled() and tensors
            if self.reshard_after_forward and not _in_backward() and not keep:
                self.free(u)
            return None
        return _eager(hook)

    def _make_pre_backward(self, u: int) -> Callable[[Any], None]:
        def hook(grads: Any) -> None:  # a tensor's grad, or a node's grad outputs
            if self.pending[u] == 0:
                return  # this unit's grads are already complete for this backward
            self.wait(u)
            prev = self._next_unit(u, -1) if u else self._next_unit(len(self.modules), -1)
            if prev is not None:
                self.gather(prev)
        return hook

    def grad_ready(self, buf: FlatBuffer) -> None:
        """One more param of `buf`'s unit has its grad; the last one frees the unit."""
        u = buf.unit
        self.pending[u] -= 1
        if self.pending[u] == 0:
            self.free(u)

    def end_backward(self) -> None:
        # [Note: a unit with a param that got no grad] (fusedzero/after_backward.py)
        self.late.update(u for u, s in enumerate(self.state) if s is not UnitState.FREE)
        self.free_all()
        self.pending = list(self.n_trainable)


def _init_own_shard(buf: FlatBuffer, init: ShardInit) -> None:
    """`init` writes this rank's segments of `buf` straight into its param shard (and master)."""
    assert buf.param_shard is not None
    names = {s.index: s.name for s in buf.layout.params}
    with torch.no_grad():
        for seg in buf.layout.segments(buf.shard_rank):
            out = buf.param_shard[seg.local:seg.local + seg.length]
            init.fn(names[seg.param], out, seg.start)
            if buf.master is not None:
                buf.master[seg.local:seg.local + seg.length].copy_(out)


def _bucket_views(buf: FlatBuffer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per bucket of `buf`: (its range of the gathered buffer, this rank's shard piece)."""
    assert buf.full is not None and buf.param_shard is not None
    L, S = buf.layout, buf.layout.shard_numel
    return [(buf.full[slice(*L.bucket_range(k))], buf.param_shard[k * S:(k + 1) * S])
            for k in range(L.num_buckets)]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """[Note: stage 3 under torch.compile] A unit's forward hooks run outside any graph: under a
    whole-model `torch.compile` each is one graph break, and the unit's compute between them is
    one graph. They issue and wait on collectives, resize storage and re-point the params with
    `.data =`, none of which belongs in a graph. The last one is wrong there: Dynamo turns
    `p.data = t` into a traced `p.set_(t)`, which AOTAutograd replays on the graph input after
    the graph and which bumps the param's version counter, shared with the views of it that
    autograd saved in forward (the tied lm-head weight's transpose), so backward refused them
    ("modified by an inplace operation"). Run eagerly, `.data =` leaves the counter alone, as
    in an uncompiled forward, and the graphs see what the eager forward sees. (`comm.eager`:
    uncompiled, the hook is called directly, without the disable wrapper's per-call cost.)"""
    return eager(hook, reason="fusedzero stage 3: a unit's gather/free hook runs eagerly")
