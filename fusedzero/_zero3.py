"""ZeRO-3: params sharded per unit, gathered just in time, prefetched, freed after use.

A *unit* is a module chosen by the wrapping policy (default: every child of an nn.ModuleList, i.e.
each transformer block); params in no unit, and params shared by two units (tied weights), belong
to the root unit (the whole model). Each unit's params form their own flat buffers, so a unit is
gathered by one all-gather per bucket.

This module receives the flat buffers (`fusedzero._flat`, fully built) and a communication
context; it never sees the optimizer. It decides *when* a unit's gathered buffer lives.

[Note: unit lifetimes] (the buffers themselves: see fusedzero/_flat.py)
- A unit's gathered storage is allocated by `gather` and released by `free`; while it is freed
  the params are empty tensors (`.data` swaps, as FSDP1 does): `print(p)`, `p.norm()` or
  `p.fill_()` outside a forward would otherwise read or write freed memory (a segfault). Read
  full values inside `opt.gathered_params()`, or through `model.state_dict()` (gathered on
  demand, copied); `model.load_state_dict()` writes every rank's shard (fusedzero/
  _model_state_dict.py).
- Forward: the pre-hook gathers unit u (waiting on its prefetch) and issues unit u+1's gather;
  the post-hook frees u (reshard_after_forward=True) unless it runs as a recomputation inside
  backward (activation checkpointing), or u is the root and its output needs a grad (its
  backward runs first: the root stays gathered until its grads are in). Anything that rewrites
  the shards (the update, a load) frees every unit first (`ZeroAdamW.quiesce_params`).
- Backward: a hook on the unit's outputs re-gathers u before its backward runs and prefetches the
  unit before it; when every param of u has its grad, u's buckets are reduce-scattered (by the
  optimizer) and u is freed. Whatever is still gathered at the end of backward is freed. A unit
  whose backward runs again after its grads are in (called outside a reentrant-checkpointed
  region and inside it) is gathered again, alone; its params' second grads are summed or
  refused by the buckets (see [Note: a param's grad twice in one backward] in _buckets.py).

[Note: one gather order on every rank] The all-gathers of a unit pair up across ranks by their
place in the group's sequence of collectives, not by unit: where ranks run different units (a
mixture-of-experts layer whose experts are units, each rank routing its own tokens), a gather
issued only where a rank runs the unit pairs with another unit's gather of the same size on
another rank (silently wrong params) or waits forever. So every gather a hook issues follows
the unit indices (registration order, the same on every rank): a cursor ascending in forward
(reset at the root's pre-forward), one descending in backward (reset at the end of the root's
forward and of each backward). A unit's step is what its hooks do where it runs: forward,
wait for its gather and issue the next unit's (the prefetch), then free it (with
reshard_after_forward); backward, issue the gathers down to it, wait, issue the one below. A
hook of a unit ahead of the cursor first takes the steps of the units it passes over, which
this rank skips; the end of the root's forward and of backward take those left. A unit's
backward step comes at its pre-backward hook, or at its recomputation inside backward
(activation checkpointing, whose pre-hook comes first where the checkpoint is reentrant).
In backward a skipped unit (not `armed`: its pre-hook did not fire in the root's last forward
with grads on, nor did it make an output that needs a grad since) also gets zero grads for
its params (`GradHooks.count_as_zero`), launching its buckets where a rank that ran it
launches them when its last grad arrives, and is freed: the reduce-scatters, on the same
group, keep their place among the gathers (a param with no grad counts as a zero grad, as at
stages 0-2 and in DDP with find_unused_parameters=True). A unit whose hook fires behind the
cursor (called twice) is gathered alone, as before: that is the same on every rank only where
every rank calls it there. So the units must be called in registration order, skipping any
(an order that depends on the data would not be), and an activation-checkpointed region must
run the same units on every rank or hold one unit (one expert per checkpoint). Whether a
collective is issued depends on the cursors and the units' gathered state, which these steps
keep the same on every rank; `armed` and `pending` only decide the local zero grads. The
cost: every rank gathers every unit once in forward and once in backward (the root once;
once in all with reshard_after_forward=False), and reduce-scatters every bucket, a skipped
unit's too, as a rank that runs it (tests/zero/test_zero3_routing.py counts them).

[Note: params after abandon] `abandon()` (after a failure, perhaps on this rank alone) may run
no collective, so no rank can rebuild a param's full values: it holds only its shard. Each param
instead gets full-shaped storage of its own, in its dtype and on its device, filled with NaN:
a new optimizer (any stage) accepts the model, and `checkpoint.load` (or `load_state_dict` through
it) writes every value. The NaN says what the values are worth until then: a forward on them gives
a NaN loss rather than a plausible one. The alternatives fail somewhere: `(0,)`-shaped params (as
while a unit is freed) match no checkpoint's shapes; meta params only stage 3 accepts, and it
initialises them with the model's init, which a module without `reset_parameters` lacks (See
[Note: the default init needs reset_parameters]). The cost is the full model on each rank, which
the new optimizer's construction holds transiently anyway. A unit's gathered storage is released
unless one of its all-gathers may still be in flight (never waited for): the collective writes
it until it completes, and the handle keeps the storage alive that long.

[Note: host cost per unit] gather, wait and free run a few times per unit per step on the host
path that feeds the device (forward, backward, prefetch): each Python call there costs ~0.2-1 us,
so they look nothing up that setup could have; a unit's state is one `Unit` record.

[Note: a unit with a param that got no grad] A unit is freed in backward when its last param's
grad arrives. A param that gets no grad (an unused branch, a conditional layer) kept its unit
gathered to the end of backward, each such unit one more gathered at once. A unit a backward
left gathered to its end is marked `late`; from then on its forward passes its tensor inputs
through `_AfterBackward`, whose backward runs when the grads of those inputs are complete: the
unit's own backward is done, so it is freed there (FSDP2 frees every unit that way). Autograd
runs the ready nodes of a graph latest-created first, so the unit's param-only nodes (created
after its inputs) have run by then. Grads that arrive later need no gathered params. Only late
units pay for the extra node, and a unit whose inputs need no grad keeps the end-of-backward
free.

[Note: buffers from the meta device] A model built on the meta device has its buffers there
too (a rotary embedding's `inv_freq`, BatchNorm's running stats). Buffers are not sharded: each
rank holds them in full. `_materialize` gives every meta buffer storage on the optimizer's
device, runs the init for the modules that hold one as for those that own params (the default
None: their `reset_parameters`; a transformers `_init_weights` fills its rotary module's
`inv_freq`), then broadcasts each from rank 0 over the shard and replicate groups, as it does
the params. A `ShardInit` (params only) leaves them on the meta device (not garbage: a forward
that reads one raises torch's device error).
A buffer computed in `__init__` (`1 / 10000 ** (arange / d)`, a `torch.full` constant) was
computed on the meta device, so it has no value to keep: one the init does not write would be
trained on as `torch.empty`'s bytes, so construction refuses it by module path and name
(`_unwritten`). Written means: its entry in the module replaced (`m.inv_freq = t`), its version
counter moved (`copy_`, `fill_`, any in-place op on it or a view), or its values changed from
the sentinel it holds before the init (NaN for a floating buffer, the dtype's minimum for an
integer one), which catches writes through `b.data` (a fresh version counter). A bool buffer
written only through `.data` is refused (no sentinel tells it apart).

[Note: a tied param is initialised once] A param held by two modules (an embedding's weight
tied to the output head) is initialised by the first of them in `named_modules()` order (the
embedding, built first), as an eager build leaves it: there the embedding's init ran at
construction and tying made the head share its weight. While a later holder's init runs, its
entry for that param is a stand-in whose writes are dropped (a scratch tensor of the param's
shape under `FullUnitInit`, so the global RNG stream advances as in the eager build, where the
head drew its own weight before tying; a `LocalParam` over no elements on the local path, whose
stream is keyed per param: fusedzero/_local_param.py). Its other params (the head's bias) are
initialised as usual.

[Note: the default init needs reset_parameters] With `param_init_fn=None`, each module that owns
params (or buffers) on the meta device is initialised by its own `reset_parameters()`. One that
has none (`nn.MultiheadAttention` has only `_reset_parameters`; a transformers `LlamaRMSNorm`, a
rotary embedding) would stay at zeros (or uninitialised buffers) silently, so construction
raises, naming them. This is strict on purpose: a parent whose `reset_parameters` also fills a
child's params still needs a `param_init_fn` (which may call it), since whether it does cannot
be seen from outside.

[Note: stage 3 under torch.compile] A unit's forward hooks run outside any graph: under a
whole-model `torch.compile` each is one graph break, and the unit's compute between them is one
graph. They issue and wait on collectives, resize storage and re-point the params with
`.data =`, none of which belongs in a graph. The last one is wrong there: Dynamo turns
`p.data = t` into a traced `p.set_(t)`, which AOTAutograd replays on the graph input after the
graph and which bumps the param's version counter, shared with the views of it that autograd
saved in forward (the tied lm-head weight's transpose), so backward refused them ("modified by
an inplace operation"). Run eagerly, `.data =` leaves the counter alone, as in an uncompiled
forward, and the graphs see what the eager forward sees. (`_eager.eager`: uncompiled, the hook is
called directly, without the disable wrapper's per-call cost.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fusedzero import _shard_init as shard_init, wire
from fusedzero._comm import CommContext, Handle
from fusedzero._dtensor import local, set_local
from fusedzero._eager import eager
from fusedzero._flat import FlatBuffer
from fusedzero._model_state_dict import UnitStateDict
from fusedzero._param_sync import BucketGather
from fusedzero._profiling import phase
from fusedzero._units import FullUnitInit, ParamInitFn, ShardInit, UnitPolicy, select_units

# Overwrite a tensor with group rank 0's value (over every group replicas span).
Broadcast = Callable[[torch.Tensor], None]


class UnitState(enum.Enum):
    FREE = 0
    GATHERING = 1
    GATHERED = 2


@dataclasses.dataclass(slots=True, eq=False)
class Unit:
    """One stage-3 unit: its module, its flat buffers and where it stands in this step."""

    index: int  # 0: the root
    module: nn.Module
    buffers: list[FlatBuffer] = dataclasses.field(default_factory=list)
    state: UnitState = UnitState.FREE
    handles: list[Handle] = dataclasses.field(default_factory=list)  # its all-gathers in flight
    # Its all-gathers, made at its first gather: `full` and `param_shard` are never replaced,
    # and a view of `full` follows its storage through every resize.
    gathers: list[BucketGather] | None = None
    n_trainable: int = 0  # its params
    pending: int = 0  # its params still without a grad in this backward
    numel: int = 0  # elements of its gathered storage (`Zero3.unit_numel`)
    pre_backward: Callable[[Any], None] | None = None  # the hook that re-gathers it, made once
    # A backward left it gathered to its end: see [Note: a unit with a param that got no grad].
    late: bool = False
    # Its forward ran in the root's last forward with grads on, or made outputs that need a
    # grad since (its backward may come): see [Note: one gather order on every rank].
    armed: bool = False


class Zero3:
    """The per-unit gather/free machinery of stage 3, over flat buffers it is given."""

    def __init__(
        self,
        root: nn.Module,
        policy: UnitPolicy,
        reshard_after_forward: bool,
        ctx: CommContext,
        broadcast: Broadcast,
        param_wire: wire.WireFormat | None = None,
    ) -> None:
        self.root = root
        self.param_wire = param_wire  # fusedzero.wire: other ranks' pieces arrive quantized
        self.reshard_after_forward = reshard_after_forward
        self.ctx = ctx
        self._broadcast = broadcast
        self.modules: list[nn.Module] = [root] + select_units(root, policy)
        self.units = [Unit(u, m) for u, m in enumerate(self.modules)]
        self.gathered_now = 0
        self.max_gathered = 0  # units gathered at once, the root excluded
        self.max_gathered_with_root = 0
        self.materialize_peak = 0  # most full-buffer elements alive during meta-device init
        # Elements of gathered storage alive now, and the most at once since last reset: what a
        # unit-by-unit walk (state_dict, close) is held to (one unit above the sharded state).
        self.gathered_numel = 0
        self.max_gathered_numel = 0
        self.hooks: list[Any] = []
        self.state_dict_hooks = UnitStateDict(self)
        self.unit_of_param: dict[int, int] = {}
        # See [Note: one gather order on every rank]: the last unit whose forward step was
        # taken in this forward, the last whose gather the backward issued, the last whose
        # backward step was taken (len(units): none yet).
        self._fwd = 0
        self._bwd_issued = self._bwd_done = len(self.units)
        self._fwd_grad = False  # the root's last forward ran with grads on
        # Set by the optimizer: the params of these buffers count as zero grads in this backward.
        self.count_as_zero: Callable[[list[FlatBuffer]], None] | None = None
        self._meta_init = False  # params came on the meta device: `setup` initialises them
        self.init_stats: shard_init.LocalInitStats | None = None  # the local init's counts

    @property
    def buffers(self) -> list[list[FlatBuffer]]:
        """Each unit's flat buffers, by unit index."""
        return [unit.buffers for unit in self.units]

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
            self.units[u].n_trainable += 1
        return units

    def setup(self, buffers: list[FlatBuffer], param_init_fn: ParamInitFn | None) -> None:
        """Take the units' buffers (built, params pointing at their released gathered
        buffer), initialise params on the meta device unit by unit, install the hooks."""
        for buf in buffers:
            unit = self.units[buf.unit]
            unit.buffers.append(buf)
            unit.numel += buf.layout.padded_numel
        for unit in self.units:
            unit.pre_backward = self._make_pre_backward(unit)
        if self._meta_init:
            self._materialize(param_init_fn)
        for unit in self.units:
            if not unit.buffers and unit.index != 0:  # the root's hooks move the cursors
                continue
            self.hooks.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self.hooks.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
        # model.state_dict() / load_state_dict(): full values, as collectives (see there).
        self.hooks.extend(self.state_dict_hooks.install(self.root))
        for unit in self.units:
            unit.pending = unit.n_trainable

    def close(self, params: list[nn.Parameter]) -> None:
        """Remove the hooks and leave the params as plain tensors holding their full values, unit
        by unit: one unit's gathered storage at a time beside the copies made so far."""
        self.remove_hooks()
        self.free_all()
        for u in range(len(self.units)):
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

    def abandon(self) -> None:
        """Remove the hooks and give every param full-shaped NaN storage of its own, without a
        collective or a wait: See [Note: params after abandon]."""
        self.remove_hooks()
        for unit in self.units:
            if not unit.handles:  # nothing in flight writes its storage: release it
                self._free(unit)
            for buf in unit.buffers:
                for p, slot in zip(buf.params, buf.layout.params):
                    set_local(
                        p, torch.full(slot.shape, torch.nan, dtype=buf.dtype, device=buf.device)
                    )

    def remove_hooks(self) -> None:
        """The units' forward hooks and the model's state-dict hooks; nothing waited for."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def _materialize(self, init_fn: ParamInitFn | None) -> None:
        """Initialise meta-device params: a `ShardInit` writes each local segment; a plain
        `fn(name, module)` or None (`reset_parameters`) runs on this rank's elements only
        (See [Note: local-shard init] in fusedzero/_shard_init.py). `FullUnitInit` goes module
        by module, in `named_modules()` order (the order an eager build draws its random
        numbers in, so both give the same values). A unit's full buffer lives only while its
        modules are being initialised: the whole model never exists on one rank. Each rank
        computes the same full values and keeps its own shard."""
        if isinstance(init_fn, ShardInit):
            for unit in self.units:
                for buf in unit.buffers:
                    _init_own_shard(buf, init_fn)
            return
        given = init_fn  # named by the refusal of a buffer it did not write
        # -- shard_init (the default): the model's own init on this rank's elements --
        all_bufs = [buf for unit in self.units for buf in unit.buffers]
        made = _real_buffers(self.root, all_bufs[0].device if all_bufs else None)
        if init_fn is None or (isinstance(init_fn, FullUnitInit) and init_fn.fn is None):
            self._require_reset_parameters(made)
        # See [Note: a tied param is initialised once].
        later = _later_holders(self.root, set(self.unit_of_param))
        if not isinstance(init_fn, FullUnitInit) and shard_init.applies(all_bufs):
            self.init_stats = shard_init.init_local(
                self.root, all_bufs, init_fn, self._broadcast, made.owners, later
            )
            self._same_buffers(made, given)
            return
        if isinstance(init_fn, FullUnitInit):
            init_fn = init_fn.fn
        # -- end shard_init --
        if init_fn is None:

            def init_fn(name: str, m: nn.Module) -> None:
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()

        todo: list[tuple[str, nn.Module, Unit | None]] = []
        left = [0] * len(self.units)
        for name, m in self.root.named_modules():
            owned = [p for p in m.parameters(recurse=False) if id(p) in self.unit_of_param]
            if owned:
                u = self.unit_of_param[id(owned[0])]
                todo.append((name, m, self.units[u]))
                left[u] += 1
            elif id(m) in made.owners:
                todo.append((name, m, None))  # buffers only: in no unit's full buffer
        for name, m, unit in todo:
            if unit is not None and unit.state == UnitState.FREE:
                for buf in unit.buffers:
                    buf.allocate_full()
                    buf.full.zero_()
                unit.state = UnitState.GATHERED
                self.materialize_peak = max(
                    self.materialize_peak,
                    sum(
                        buf.layout.padded_numel
                        for v in self.units
                        if v.state != UnitState.FREE
                        for buf in v.buffers
                    ),
                )
            with torch.no_grad(), _stand_ins(m, later.get(id(m), [])):
                init_fn(name, m)
            if unit is None:
                continue
            left[unit.index] -= 1
            if left[unit.index] == 0:
                for buf in unit.buffers:
                    # Every rank drew its own init: start every replica from rank 0's, as DDP.
                    self._broadcast(buf.full)
                    buf.copy_own_shard()
                for buf in unit.buffers:
                    buf.release_full()
                unit.state = UnitState.FREE
        self._same_buffers(made, given)

    def _require_reset_parameters(self, made: _MetaBuffers) -> None:
        """The default init (`reset_parameters`) reaches every module it has to fill: See
        [Note: the default init needs reset_parameters]."""
        missing = [
            f"{name or '<root>'} ({type(m).__name__})"
            for name, m in self.root.named_modules()
            if not hasattr(m, "reset_parameters")
            and (
                id(m) in made.owners
                or any(id(p) in self.unit_of_param for p in m.parameters(recurse=False))
            )
        ]
        if missing:
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise ValueError(
                "Sharding(param_init_fn=None) initialises each module with its "
                "reset_parameters(), but "
                f"{', '.join(missing[:4])}{more} own params or buffers on the meta device and "
                "have none (they would stay uninitialised): pass "
                "sharding=Sharding(param_init_fn=fn) with fn(name, module) initialising them "
                "(a transformers model: lambda name, m: model._init_weights(m))"
            )

    def _same_buffers(self, made: _MetaBuffers, init_fn: object) -> None:
        """Every buffer the init wrote: each rank and replica starts from rank 0's, as DDP; one
        it did not write is refused (See [Note: buffers from the meta device])."""
        unwritten = _unwritten(made)
        if unwritten:
            more = f" and {len(unwritten) - 4} more" if len(unwritten) > 4 else ""
            how = (
                "each module's reset_parameters()"
                if getattr(init_fn, "fn", init_fn) is None
                else f"param_init_fn={_init_name(init_fn)}"
            )
            raise ValueError(
                f"buffers {', '.join(unwritten[:4])}{more} were on the meta device and the "
                f"init ({how}) did not write them: they would hold uninitialised memory. "
                "Compute them in the module's reset_parameters(), or pass "
                "sharding=Sharding(param_init_fn=fn) with fn(name, module) filling them, or "
                "build the model off the meta device"
            )
        with torch.no_grad():
            seen: set[int] = set()
            for h in made.holders:
                b = h.module._buffers[h.name]
                # A buffer the init replaced on another device is that rank's own computation.
                if b is not None and id(b) not in seen and b.device == h.tensor.device:
                    seen.add(id(b))
                    self._broadcast(b)

    # -- gather / free --------------------------------------------------------------------------
    def gather(self, u: int) -> None:
        """Issue unit u's all-gather (async); no-op if it is gathered or on its way.
        See [Note: host cost per unit]."""
        self._gather(self.units[u])

    def _gather(self, unit: Unit) -> None:
        if unit.state is not UnitState.FREE or not unit.buffers:
            return
        with phase("fusedzero::unit_gather"):
            self._issue_gather(unit)

    def _issue_gather(self, unit: Unit) -> None:
        ctx = self.ctx
        ctx.record("gather", unit.index)
        self.gathered_numel += unit.numel
        if self.gathered_numel > self.max_gathered_numel:
            self.max_gathered_numel = self.gathered_numel
        for buf in unit.buffers:
            buf.allocate_full()  # values land when the handles are waited on
        gathers = unit.gathers
        if gathers is None:  # after allocate_full: a view of a 0-byte storage would not be made
            gathers = unit.gathers = [g for buf in unit.buffers for g in _bucket_gathers(buf)]
        handles = unit.handles
        for full, own, shard_rank in gathers:
            h = wire.all_gather(full, own, self.param_wire, ctx, shard_rank)
            if h is not None:
                handles.append(h)
        unit.state = UnitState.GATHERING
        if unit.index != 0:
            self.gathered_now += 1
            self.max_gathered = max(self.max_gathered, self.gathered_now)
        live = self.gathered_now + (self.units[0].state is not UnitState.FREE)
        if live > self.max_gathered_with_root:
            self.max_gathered_with_root = live

    def wait(self, u: int) -> None:
        self._wait(self.units[u])

    def _wait(self, unit: Unit) -> None:
        state = unit.state
        if state is UnitState.GATHERED:
            return
        if state is UnitState.FREE:
            self._gather(unit)
        if unit.state is UnitState.GATHERING:
            self._wait_handles(unit)
            unit.state = UnitState.GATHERED

    def _wait_handles(self, unit: Unit) -> None:
        handles = unit.handles
        if handles:
            with phase("fusedzero::unit_wait"):
                for h in handles:
                    self.ctx.wait(h, what=f"all-gather of unit {unit.index} params (stage 3)")
            handles.clear()

    def free(self, u: int) -> None:
        self._free(self.units[u])

    def _free(self, unit: Unit) -> None:
        if unit.state is UnitState.FREE:
            return
        with phase("fusedzero::unit_free"):
            self._wait_handles(unit)  # never release memory a collective is still writing
            for buf in unit.buffers:
                buf.release_full()
        unit.state = UnitState.FREE
        self.gathered_numel -= unit.numel
        if unit.index != 0:
            self.gathered_now -= 1
        self.ctx.record("free", unit.index)

    def unit_numel(self, u: int) -> int:
        """Elements of unit u's gathered storage (padded: what `gather` allocates)."""
        return self.units[u].numel

    def unit_params(self, u: int) -> list[nn.Parameter]:
        return [p for buf in self.units[u].buffers for p in buf.params]

    def free_units(self) -> list[int]:
        return [unit.index for unit in self.units if unit.state == UnitState.FREE]

    def free_all(self) -> None:
        for unit in self.units:
            self._free(unit)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """All params gathered (e.g. to read or export the full model); freed on exit. This holds
        the whole model on the device at once; `model.state_dict()` goes unit by unit to the
        CPU instead."""
        for unit in self.units:
            self._wait(unit)
        try:
            yield
        finally:
            self.free_all()

    # -- hooks ------------------------------------------------------------------------------------
    # See [Note: one gather order on every rank]: every gather a hook issues goes through a
    # cursor over the unit indices, ascending in forward and descending in backward.
    def _fwd_step(self, unit: Unit) -> None:
        """Unit's forward step: gathered (its all-gather issued by the step before), the next
        unit's issued."""
        self._wait(unit)
        self._fwd = u = unit.index
        if u + 1 < len(self.units):
            self._gather(self.units[u + 1])

    def _skip_forward(self, unit: Unit) -> None:
        """The forward step of a unit this rank's forward does not run: what a rank that runs it
        does in its pre- and post-hooks."""
        self.ctx.record("forward_skip", unit.index)
        self._fwd_step(unit)
        if self.reshard_after_forward:
            self._free(unit)

    def _end_forward(self) -> None:
        """The root's forward is done: the units no forward step reached are skipped; the
        backward cursors start over."""
        for v in range(self._fwd + 1, len(self.units)):
            self._skip_forward(self.units[v])
        self._bwd_issued = self._bwd_done = len(self.units)

    def _bwd_issue_through(self, u: int) -> None:
        """Issue the backward gathers of the units down to u (the root is never among them: it
        stays gathered from its forward into its backward)."""
        while self._bwd_issued > max(u, 1):
            self._bwd_issued -= 1
            self._gather(self.units[self._bwd_issued])

    def _bwd_step(self, unit: Unit) -> None:
        """Unit's backward step: its gather issued, the next unit's issued (prefetch)."""
        u = unit.index
        self._bwd_issue_through(u)
        self._wait(unit)
        if self._bwd_issued == u:
            self._bwd_issue_through(u - 1)

    def _pass_down_to(self, u: int) -> None:
        """The backward steps of the units above u that no pre-backward hook reached: a unit
        this rank's forward did not run gets its zero grads (its buckets may launch) and is
        freed, as a rank that ran it does when its grads are in."""
        for v in range(self._bwd_done - 1, u, -1):
            unit = self.units[v]
            self._bwd_step(unit)
            if not unit.armed and unit.pending:
                self.ctx.record("backward_skip", v)
                if self.count_as_zero is not None:
                    self.count_as_zero(unit.buffers)
                unit.pending = 0
                self._free(unit)
        self._bwd_done = min(self._bwd_done, max(u, 1))

    def _make_pre_forward(self, unit: Unit) -> Callable[..., Any]:
        u = unit.index
        units = self.units
        free = lambda: self._free(unit)  # noqa: E731 - made once, not per forward

        def hook(module: nn.Module, args: Any) -> Any:
            if _in_backward():  # a recomputation (activation checkpointing)
                if 0 < u < self._bwd_done:  # its backward step comes first
                    self._pass_down_to(u)
                    self._bwd_step(unit)
                    self._bwd_done = u
                else:
                    self._wait(unit)
            elif u == 0:
                self._fwd = 0
                self._fwd_grad = grad = torch.is_grad_enabled()
                if grad:
                    for v in units:
                        v.armed = False
                self._fwd_step(unit)
            else:
                if self._fwd_grad:  # (a reentrant checkpoint runs it with grads off)
                    unit.armed = True
                if u > self._fwd:
                    for v in range(self._fwd + 1, u):
                        self._skip_forward(units[v])
                    self._fwd_step(unit)
                else:  # behind the cursor (a unit called twice): alone, as on every rank
                    self._wait(unit)
            if unit.late and torch.is_grad_enabled():
                return _free_when_inputs_have_grads(args, free)
            return None

        return _eager(hook)

    def _make_post_forward(self, unit: Unit) -> Callable[..., Any]:
        u = unit.index

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            self.ctx.record("forward_end", u)
            tensors = (
                ([output] if output.requires_grad else [])
                if isinstance(output, torch.Tensor)
                else [
                    t
                    for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
            )
            if torch.is_grad_enabled() and tensors:
                unit.armed = True
                # Re-gather before this unit's backward: the grad of its output arrives first.
                # A pre-hook on the node that made the output runs then (before that node, the
                # unit's last op, computes anything), for less host time than a tensor hook.
                pre_backward = unit.pre_backward
                for t in tensors:
                    if t.grad_fn is not None:
                        t.grad_fn.register_prehook(pre_backward)
                    else:
                        t.register_hook(pre_backward)
            in_backward = _in_backward()
            if u == 0 and not in_backward:
                self._end_forward()
            # The root's backward comes first, right after this: freeing it would only
            # gather it again (one all-gather of the root per step saved, as FSDP2's root).
            keep = u == 0 and torch.is_grad_enabled() and tensors
            if self.reshard_after_forward and not in_backward and not keep:
                self._free(unit)
            return None

        return _eager(hook)

    def _make_pre_backward(self, unit: Unit) -> Callable[[Any], None]:
        u = unit.index

        def hook(grads: Any) -> None:  # a tensor's grad, or a node's grad outputs
            if u == 0:  # first in backward: the root stays gathered from its forward
                if unit.pending:
                    self._wait(unit)
                if self._bwd_issued == len(self.units):
                    self._bwd_issue_through(self._bwd_issued - 1)
                return
            if unit.pending == 0:
                # Its grads are complete, yet its backward runs again (it was also called in a
                # region a reentrant checkpoint ran as a nested backward): its params are needed
                # once more, and its params' second grads are the buckets' to refuse or sum.
                self._wait(unit)
                return
            if u < self._bwd_done:
                self._pass_down_to(u)
                self._bwd_step(unit)
                self._bwd_done = u
            else:  # behind the cursor: alone, as on every rank
                self._wait(unit)

        return hook

    def grad_ready(self, buf: FlatBuffer) -> None:
        """One more param of `buf`'s unit has its first grad of this backward (see [Note: a
        param's grad twice in one backward] in fusedzero/_buckets.py); the last one frees the
        unit."""
        unit = self.units[buf.unit]
        unit.pending -= 1
        if unit.pending == 0:
            self._free(unit)

    def finish_backward(self) -> None:
        """Before the last reductions of a backward are launched: the backward steps of the
        units no pre-backward hook reached (See [Note: one gather order on every rank])."""
        self._pass_down_to(0)

    def end_backward(self) -> None:
        """See [Note: a unit with a param that got no grad]."""
        for unit in self.units:
            if unit.state is not UnitState.FREE:
                unit.late = True
            self._free(unit)
            unit.pending = unit.n_trainable
            unit.armed = False
        self._bwd_issued = self._bwd_done = len(self.units)


class _BufferHolder(NamedTuple):
    """One module's entry for a buffer `_real_buffers` gave storage to."""

    path: str  # the buffer's qualified name in the root
    module: nn.Module
    name: str
    tensor: torch.Tensor  # the storage given, holding its sentinel
    version: int  # its version counter right after the sentinel was written


@dataclasses.dataclass(slots=True)
class _MetaBuffers:
    """The buffers `_real_buffers` gave storage to."""

    owners: set[int] = dataclasses.field(default_factory=set)  # id() of each module holding one
    holders: list[_BufferHolder] = dataclasses.field(default_factory=list)


def _sentinel(t: torch.Tensor) -> float | int | None:
    """What a buffer holds before the init, to tell whether it wrote it (See [Note: buffers
    from the meta device]); None for a bool buffer."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return math.nan
    if t.dtype == torch.bool:
        return None
    return torch.iinfo(t.dtype).min


def _real_buffers(root: nn.Module, device: torch.device | None) -> _MetaBuffers:
    """Every buffer of `root` on the meta device given storage on `device` holding a sentinel,
    in every module that holds it (See [Note: buffers from the meta device])."""
    out = _MetaBuffers()
    if device is None or device.type == "meta":
        return out  # nothing real to write (a meta-device emulation)
    made: dict[int, torch.Tensor] = {}
    for mname, m in root.named_modules():
        for name, b in list(m._buffers.items()):
            if b is None or not b.is_meta:
                continue
            real = made.get(id(b))
            if real is None:
                real = made[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
                fill = _sentinel(real)
                if fill is not None:
                    real.fill_(fill)
            m._buffers[name] = real
            path = f"{mname}.{name}" if mname else name
            out.holders.append(_BufferHolder(path, m, name, real, real._version))
            out.owners.add(id(m))
    return out


def _unwritten(made: _MetaBuffers) -> list[str]:
    """The qualified names of the buffers the init left as `_real_buffers` made them (a host
    sync per buffer, once, at construction)."""
    out = []
    for h in made.holders:
        t = h.tensor
        if h.module._buffers.get(h.name) is not t or t._version != h.version:
            continue  # replaced, or written in place
        fill = _sentinel(t)
        if fill is None:
            out.append(h.path)
        elif fill != fill:  # NaN: written through `.data` if any element is not NaN
            if bool(t.isnan().all()):
                out.append(h.path)
        elif bool((t == fill).all()):
            out.append(h.path)
    return out


def _init_name(init_fn: object) -> str:
    fn = getattr(init_fn, "fn", init_fn)  # FullUnitInit(fn)
    return getattr(fn, "__qualname__", None) or repr(fn)


def _later_holders(root: nn.Module, ids: set[int]) -> dict[int, list[str]]:
    """id(module) -> the names of its params (among `ids`) that a module before it in
    `named_modules()` order also holds (See [Note: a tied param is initialised once])."""
    first: set[int] = set()
    out: dict[int, list[str]] = {}
    for _, m in root.named_modules():
        for name, p in m._parameters.items():
            if p is None or id(p) not in ids:
                continue
            if id(p) in first:
                out.setdefault(id(m), []).append(name)
            first.add(id(p))
    return out


@contextlib.contextmanager
def _stand_ins(m: nn.Module, names: list[str]) -> Iterator[None]:
    """`m`'s params `names` replaced, for the duration, by scratch params of their shape whose
    values are dropped (See [Note: a tied param is initialised once])."""
    if not names:
        yield
        return
    real = {n: m._parameters[n] for n in names}
    for n, p in real.items():
        assert p is not None
        m._parameters[n] = nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
    try:
        yield
    finally:
        m._parameters.update(real)


def _init_own_shard(buf: FlatBuffer, init: ShardInit) -> None:
    """`init` writes this rank's segments of `buf` straight into its param shard (and master)."""
    assert buf.param_shard is not None
    names = {s.index: s.name for s in buf.layout.params}
    with torch.no_grad():
        for seg in buf.layout.segments(buf.shard_rank):
            out = buf.param_shard[seg.local : seg.local + seg.length]
            init.fn(names[seg.param], out, seg.start)
            if buf.master is not None:
                buf.master[seg.local : seg.local + seg.length].copy_(out)


def _bucket_gathers(buf: FlatBuffer) -> list[BucketGather]:
    """Per bucket of `buf`: its range of the gathered buffer and this rank's shard piece."""
    assert buf.full is not None and buf.param_shard is not None
    L, S = buf.layout, buf.layout.shard_numel
    return [
        BucketGather(
            buf.full[slice(*L.bucket_range(k))],
            buf.param_shard[k * S : (k + 1) * S],
            buf.shard_rank,
        )
        for k in range(L.num_buckets)
    ]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """See [Note: stage 3 under torch.compile]."""
    return eager(hook, reason="fusedzero stage 3: a unit's gather/free hook runs eagerly")


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; `done()` when their grads are complete (see [Note: a unit
    with a param that got no grad])."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *xs: torch.Tensor) -> Any:
        ctx.done = done
        return xs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.done()
        return (None, *grads)


def _free_when_inputs_have_grads(args: Any, done: Callable[[], None]) -> Any:
    """`args` with its tensors that need a grad passed through `_AfterBackward` (None: none)."""
    flat, spec = tree_flatten(args)
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None
    for i, t in zip(idx, _AfterBackward.apply(done, *(flat[i] for i in idx))):
        flat[i] = t
    return tree_unflatten(flat, spec)
