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
[Note: the default init needs reset_parameters] in fusedzero/_meta_init.py). The cost is the
full model on each rank, which the new optimizer's construction holds transiently anyway. A
unit's gathered storage is released unless one of its all-gathers may still be in flight (never
waited for): the collective writes it until it completes, and the handle keeps the storage alive
that long.

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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fusedzero import _meta_init as meta_init, _shard_init as shard_init, wire
from fusedzero._comm import CommContext, Handle
from fusedzero._dtensor import local, set_local
from fusedzero._eager import eager
from fusedzero._flat import FlatBuffer
from fusedzero._meta_init import Broadcast
from fusedzero._model_state_dict import UnitStateDict
from fusedzero._param_sync import BucketGather
from fusedzero._profiling import phase
from fusedzero._units import ParamInitFn, UnitPolicy, select_units


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
            done = meta_init.materialize(
                self.root,
                [unit.buffers for unit in self.units],
                self.unit_of_param,
                self._broadcast,
                param_init_fn,
            )
            self.init_stats, self.materialize_peak = done.local_stats, done.peak_numel
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
