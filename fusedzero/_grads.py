"""The autograd side: hooks that catch each param's grad, find the end of backward, and decide
what `p.grad` holds between backward passes. The buckets (`fusedzero._buckets`) do the rest.

[Note: a grad onto a placeholder] A backward before the grads are consumed (the
next micro-batch) finds the placeholder in `p.grad`, and p's AccumulateGrad node adds
the new grad to it: `add_` in place (grad mode off), or `add` (create_graph=True), whose
result becomes `p.grad`. The placeholder counts as zero: the in-place add keeps the new
grad on the placeholder for the post-accumulate hook to take (`take`); the other returns
a copy (the result gets autograd history, which must not land on the new grad itself).
Checked by identity: only the AccumulateGrad node of this very param gets here; any
other op still raises. (A per-param hook that dropped the placeholder before the
accumulation cost ~2 us of host per param on every backward.)

[Note: end of backward] The end-of-backward callback must run on the outermost
autograd graph task. Queued from the first param grad, it lands on an inner task when
that grad comes from a reentrant checkpoint (`use_reentrant=True` runs a nested backward
for the checkpointed part) and would fire when that part is done. The grad of the
model's output arrives first, in the outer task: queue it from there. (A forward run as
a recomputation inside backward adds no hook: the outer backward is already running.)

Under torch.compile the graph-task query is skipped (Dynamo cannot trace it: it would
break the graph at the end of every forward). Only a recomputation of the whole model
inside backward could tell the difference, and there the hook fires in the nested task
that the first param grad would have queued the callback on anyway.

[Note: user grad clipping] A view of grad_flat where that view is this param's true
grad: stage 0 with grads in the param dtype, where after backward it holds the grad
averaged over ranks on every rank, so `torch.nn.utils.clip_grad_norm_` computes the
true global norm and clips it in place, identically on every replica (as with DDP); and
stage 1 until its bucket is reduced (local grads, as DDP's inside `no_sync`). Elsewhere
this rank holds only a shard of the reduced grad (or a copy in another dtype), and a
norm over `.grad` would be silently wrong or, over None, silently zero: `.grad` is then
a placeholder that raises, naming `max_grad_norm` and `opt.grad_norm`, on any use.

[Note: a backward that raised] autograd runs no final callback when a backward
raises (an OOM, an error in a hook or a custom Function), so `in_backward` would stay
True and every later step() refuse, and the next backward would never queue its own
end. Outside any backward (step(), zero_grad(), the model's next forward) that state
is stale: the reductions already launched are completed (every rank issued the same
ones if every rank raised at the same place), grads kept for unlaunched buckets are
dropped and the counts reset. zero_grad() then discards what the raised backward left,
as with a plain torch backward; without it, stages 0-1 keep every grad that arrived (as
torch's `.grad` does) and stages 2-3 what was already reduced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fusedzero._buckets import BucketSchedule
from fusedzero._comm import CommContext
from fusedzero._dtensor import is_dtensor, local_grad
from fusedzero._flat import FlatBuffer
from fusedzero._profiling import phase
from fusedzero._reduce import Bucket
from fusedzero.stage import Stage


class NoLocalGrad(torch.Tensor):
    """`p.grad` where this rank holds no full, reduced grad of p (see [Note: user grad
    clipping]): no storage; any op on it raises, saying what to use instead, except autograd's
    own accumulation of p's next grad (see [Note: a grad onto a placeholder])."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like: torch.Tensor, stage: Stage, name: str) -> NoLocalGrad:
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device
        )
        t.why = (
            f"{name}.grad is not available: ZeroAdamW at stage {int(stage)} keeps grads in "
            "flat buffers reduced across ranks, and this rank holds only its shard (or a "
            "copy in the reduce dtype), so a norm or clip computed from .grad (e.g. "
            "torch.nn.utils.clip_grad_norm_) would be wrong. Clip with "
            "ZeroAdamW(max_grad_norm=...) and read the global norm from opt.grad_norm"
        )
        t.param_id = id(like)  # (an id, not the param: p.grad -> t -> p would be a cycle)
        t.arrived = None
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        t = next(a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, NoLocalGrad))
        if func in _ACCUMULATE and args[0] is t and not kwargs and len(args) == 2:
            node = torch._C._current_autograd_node()
            if node is not None and id(getattr(node, "variable", None)) == t.param_id:
                return t.accumulate(func, args[1])
        raise RuntimeError(f"{t.why} (op: {func})")

    def accumulate(self, func: Any, grad: torch.Tensor) -> torch.Tensor:
        """`p.grad`'s next grad added onto the placeholder: see [Note: a grad onto a
        placeholder]."""
        if func is torch.ops.aten.add_.Tensor:
            self.arrived = grad if self.arrived is None else self.arrived + grad
            return self
        return grad.clone()

    def take(self) -> torch.Tensor | None:
        g, self.arrived = self.arrived, None
        return g

    def __repr__(self) -> str:
        return f"<no local grad: {self.why}>"


_ACCUMULATE = (torch.ops.aten.add_.Tensor, torch.ops.aten.add.Tensor)


@dataclasses.dataclass(slots=True, eq=False)
class ParamHook:
    """What a param's grad hook needs, looked up once at construction, not on every grad."""

    buf: FlatBuffer
    pos: int  # the param's position in `buf.params`
    view: torch.Tensor | None  # its grad as a view of the bucket (`FlatBuffer.param_grad_view`)
    buckets: tuple[Bucket, ...]  # the buckets holding it (`BucketSchedule.buckets_of`)
    param: torch.Tensor
    dtensor: bool  # a DTensor param: its grad's local tensor goes into the bucket
    # Its NoLocalGrad, built on first use: a stage-3 param has its full shape only while
    # gathered.
    placeholder: NoLocalGrad | None = None
    # The backward (`GradHooks._backward_no`) its last grad came in: see [Note: a param's grad
    # twice in one backward] in fusedzero/_buckets.py.
    seen: int = -1


class GradHooks:
    """Owns the grad hooks and the backward life cycle (in backward or not, on which graph
    task). `on_unit_grad(buf)` and `on_backward_end()` let stage 3 follow along."""

    def __init__(
        self,
        schedule: BucketSchedule,
        stage: Stage,
        ctx: CommContext,
        module: nn.Module | None,
        params: list[nn.Parameter],
        on_unit_grad: Callable[[FlatBuffer], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
        before_backward_end: Callable[[], None] | None = None,
    ) -> None:
        self.schedule = schedule
        self.stage = stage
        self.ctx = ctx
        self.on_unit_grad = on_unit_grad
        self.on_backward_end = on_backward_end
        self.before_backward_end = before_backward_end
        self.in_backward = False
        self._task_id = -1  # autograd graph task the end-of-backward callback is queued on
        self._grads_arrived = False  # a param grad came in the current backward
        self._backward_no = 0  # backwards begun so far (`ParamHook.seen`)
        # A backward brought param grads since the grads were last consumed (step, zero_grad):
        # see [Note: one step per backward].
        self.grads_since_step = False
        self._where: dict[int, ParamHook] = {
            id(p): ParamHook(
                buf, pos, buf.param_grad_view(pos), schedule.buckets_of(buf, pos), p, is_dtensor(p)
            )
            for buf in schedule.buffers
            for pos, p in enumerate(buf.params)
        }
        # The records of the params whose .grad a placeholder was put on since the grads were
        # last consumed: no walk over every param to take them off.
        self._placed: dict[int, ParamHook] = {}
        self.hooks: list[Any] = []
        for p in params:
            self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for buf in schedule.buffers:
            buf.attach_grad_views()
        if module is not None:
            self.hooks.append(module.register_forward_hook(self._on_model_output))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def _on_model_output(self, module: nn.Module, args: Any, output: Any) -> None:
        """Queue the end-of-backward callback from the output's grad: see [Note: end of
        backward]."""
        if not torch.is_grad_enabled():
            return
        if not torch.compiler.is_compiling():
            if torch._C._current_graph_task_id() != -1:
                return
            self.recover()  # a new forward: an earlier backward that raised is over
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if not self.in_backward:
            self._begin_backward()

    def _begin_backward(self) -> None:
        self.in_backward = True
        self._grads_arrived = False
        self._backward_no += 1
        self._task_id = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, p: torch.Tensor) -> None:
        grad = p.grad  # read once: every attribute read is a call into torch
        if type(grad) is NoLocalGrad:  # See [Note: a grad onto a placeholder]
            grad = grad.take()
        if grad is None:
            return
        if not self.in_backward:
            self._first_grad()
        self._grads_arrived = True
        h = self._where[id(p)]
        view = h.view
        kept: torch.Tensor | None = None  # None: accumulated into the bucket view
        if view is None or grad.data_ptr() != view.data_ptr():
            # Not (or no longer: reduced, or the user reset .grad) a view of our bucket: put it in.
            if grad.is_sparse:
                raise RuntimeError(
                    f"param {h.buf.layout.params[h.pos].name} got a sparse grad; "
                    "sparse gradients are not supported"
                )
            kept = local_grad(p, grad) if h.dtensor else grad
        if h.seen == self._backward_no:  # See [Note: a param's grad twice in one backward]
            self.schedule.add_grad_again(h.buckets, h.pos, kept)
            if kept is not None:
                self._set_idle(h)
            return
        h.seen = self._backward_no
        self.schedule.add_grad(h.buckets, h.pos, kept)
        if kept is not None:
            self._set_idle(h)
        if self.on_unit_grad is not None:
            self.on_unit_grad(h.buf)

    def count_as_zero(self, buffers: list[FlatBuffer]) -> None:
        """Stage 3: the params of `buffers` (a unit this rank's forward did not run) get no grad
        in this backward; they count as zero grads now, so their buckets complete where they do
        on a rank that ran the unit (see [Note: one gather order on every rank] in
        fusedzero/_zero3.py). A grad of one that comes after all is a second grad."""
        no = self._backward_no
        for buf in buffers:
            for p in buf.params:
                h = self._where[id(p)]
                if h.seen != no:
                    h.seen = no
                    self.schedule.add_grad(h.buckets, h.pos, None)

    def _first_grad(self) -> None:
        """The first grad of a backward that no output-grad hook began (no `module`, or a
        nested backward)."""
        if torch._C._current_graph_task_id() < self._task_id:
            # Graph task ids grow: a grad from an older task than the one our callback was
            # queued on means that one was a nested (reentrant) backward and the callback
            # fired early. (While in backward no such grad can come: a nested backward runs
            # to its end, callback included, before its outer task goes on.)
            raise RuntimeError(
                "ZeroAdamW: a grad arrived from an outer autograd graph task after the end-of-"
                "backward callback ran on a nested one (reentrant activation checkpointing, "
                "torch.utils.checkpoint(..., use_reentrant=True)). Pass module=model to "
                "ZeroAdamW (the callback is then queued from the model output's grad) or use "
                "use_reentrant=False"
            )
        self._begin_backward()

    def _set_idle(self, h: ParamHook) -> None:
        """Set `h.param.grad` to what it holds between backward passes: see [Note: user grad
        clipping]."""
        p = h.param
        if h.view is not None and not self.schedule.was_reduced(h.buf, h.pos):
            p.grad = h.view
            return
        ng = h.placeholder
        p.grad = ng if ng is not None else self._placeholder(h)
        self._placed[id(p)] = h  # what it holds again once the grads are consumed: h.view

    def _placeholder(self, h: ParamHook) -> NoLocalGrad:
        ng = h.placeholder = NoLocalGrad(h.param, self.stage, h.buf.layout.params[h.pos].name)
        return ng

    def recover(self) -> None:
        """Leave the state a raised backward left: see [Note: a backward that raised]."""
        if not self.in_backward or torch._C._current_graph_task_id() != -1:
            return
        self.in_backward = False
        self.grads_since_step |= self._grads_arrived
        self.schedule.abandon()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _end_backward(self) -> None:
        with phase("fusedzero::end_backward"):
            if self.before_backward_end is not None:
                self.before_backward_end()
            self.in_backward = False
            self.grads_since_step |= self._grads_arrived
            reduced = self.schedule.end_backward(self._grads_arrived)
            if reduced and self.stage.shards_state and self.stage.keeps_full_grads:
                # Stage 1: only this rank's pieces hold reduced grads now: no param's .grad is
                # a true view.
                self.reset_idle_grads()
            if self.on_backward_end is not None:
                self.on_backward_end()
            self.ctx.record("backward_end", 0)

    def reset_idle_grads(self) -> None:
        """Stage 1 after a reducing backward: every bucket was reduced, so every param's .grad
        is its placeholder (a loop of assignments: this runs once per param per backward)."""
        for h in self._where.values():
            ng = h.placeholder
            h.param.grad = ng if ng is not None else self._placeholder(h)
        self._placed = dict(self._where)

    def drop_placeholders(self) -> None:
        """The grads are consumed: placeholders go (stage 1: autograd accumulates into the
        bucket views again). Only the params a placeholder was put on are visited."""
        for h in self._placed.values():
            p = h.param
            if type(p.grad) is NoLocalGrad:
                p.grad = h.view
        self._placed.clear()

    def reset_grads(self) -> None:
        """zero_grad(): every param's .grad is its bucket view again (None where it has none),
        whatever it held."""
        for h in self._where.values():
            h.param.grad = h.view
        self._placed.clear()
