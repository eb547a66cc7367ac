"""ZeroOptimizer, the sharding engine that `ZeroAdamW` and `ZeroMuon` (fusedzero/optim.py) run
their update rules on: data parallelism over flat sharded buffers, ZeRO stages 0 to 3.

    opt = ZeroAdamW(model.parameters(), lr=3e-4, stage=2, module=model, max_grad_norm=1.0,
                    precision=Precision(param_dtype=torch.bfloat16))
    loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()

Stage 0: plain data parallelism (bucketed all-reduce, full optimizer state on every rank).
Stage 1: optimizer state sharded; full grads kept, each bucket reduce-scattered in place.
Stage 2: grads sharded too: each bucket lives only while it is being reduced.
Stage 3: params sharded per unit as well (see `fusedzero._zero3`).

Grads follow DDP: averaged over ranks, summed over micro-batches (divide the loss by the number of
micro-batches, as with DDP), with or without `no_sync()` (a speed switch, never a correctness
one). The step consumes the grads: after `step()` they are zero, and a second `step()` without a
backward is refused (see [Note: one step per backward]). Replicas start from rank 0's params and
buffers (broadcast at construction, as DDP). When `backward()` returns, every reduction it
started is complete (on NCCL: stream-ordered).

[Note: one step per backward] torch.optim.AdamW keeps `.grad` until `zero_grad()`, so a second
`step()` without a backward applies the same grads again. ZeroAdamW's step consumes its grads
(the flat buffers are emptied for the next backward, stage 1's reduced pieces and stages 2-3's
grad shards included), so a second step would apply zero grads (a silent update by momentum and
weight decay alone). It is refused instead, in one line: `step()` needs a backward that brought
param grads since the last `step()` or `zero_grad()`.

The engine does not know its update rule (fusedzero/rules: the state fields it keeps, its
hyper-parameters, its launches); `ZeroOptimizer` composes the parts, runs the rule's launches
on the local shards and keeps the torch.optim contract; each part owns its state:
  fusedzero/_flat.py       FlatBuffer: params, shard state and the views the kernel reads
  fusedzero/_grads.py      autograd hooks, end of backward, what `p.grad` holds
  fusedzero/_buckets.py    bucket launch order, in-flight bound, no_sync
  fusedzero/_reduce.py     how a stage reduces a bucket (all-reduce / reduce-scatter / into shard)
  fusedzero/_scalars.py    step count, norm, clip, skip, loss scale (device scalars)
  fusedzero/_param_sync.py stages 1-2 param all-gather and its forward waits
  fusedzero/_zero3.py      stage 3 units: gather, prefetch, free
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fusedzero import _comm as comm, _validate as validate, wire as wire_mod
from fusedzero._buckets import BucketSchedule
from fusedzero._comm import CommContext, CommCounter
from fusedzero._dtensor import grouped_sumsq, tp_info
from fusedzero._flat import FlatBuffer, MemoryReport, build_buffers, memory_report
from fusedzero._grads import GradHooks
from fusedzero._model_state_dict import FullParamsLoad, without_params
from fusedzero._param_sync import ParamSync, broadcast_from_rank0, start_from_rank0
from fusedzero._profiling import phase
from fusedzero._scalars import LossScaler, StepScalars
from fusedzero._shards import ShardAccess, ShardStateMethods
from fusedzero._zero3 import Zero3
from fusedzero.policy import Groups, Precision, Sharding, Wire, check_record
from fusedzero.rules import ByGroup, Rule, StepTensors, Update
from fusedzero.stage import Stage

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer(ShardStateMethods, torch.optim.Optimizer):
    """An update rule run with ZeRO sharding over a process group: the engine.

    Args:
        params: parameters or param-group dicts, as for the rule's torch.optim counterpart.
            Params with `requires_grad=False` are left out (frozen).
        rule: the update rule of every group (fusedzero/rules; `ZeroAdamW` passes the AdamW
            rule), or a `ByGroup` naming each group's rule (`ZeroMuon`: Muon and AdamW).
        defaults: with one rule, the default hyper-parameters of every group, over
            `rule.defaults` (a `ByGroup` carries its rules' defaults). Each group is checked
            by its rule's `check_group`.
        stage: 0 (DP), 1 (optimizer state), 2 (+ grads), 3 (+ params; needs `module`).
        module: the model; gives parameter names (checkpoints) and, for stage 3, the units.
        max_grad_norm: clip the global grad norm to this (None: no clipping).
        precision: dtypes, master and state modes, loss scaling, non-finite skip
            (`fusedzero.Precision`; default: fp32 throughout).
        wire: what grads and gathered params cross the network as (`fusedzero.Wire`).
        groups: the process groups to shard over, replicate over and all-gather on
            (`fusedzero.Groups`; default: the world, no replicas). Params may be DTensors on a
            tensor-parallel mesh (`parallelize_module`): pass the dp group as `shard`; `self.tp`
            then describes the tp mesh (fusedzero/_dtensor.py, docs/tensor_parallel.md).
        sharding: bucket size and stage-3 units (`fusedzero.Sharding`).
        device: where meta-device params are materialised (default: cuda if present, else cpu);
            otherwise it must be the params' device. "meta" with meta params: a dry build.
        trace: record the order of collectives and unit events in `self.trace` (tests).

    The records are described in docs/api.md.

    One live optimizer per model: `close()` detaches it (hooks removed, params left as plain
    tensors) before another is built on the same params.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        rule: Rule | ByGroup,
        defaults: dict[str, Any] | None = None,
        *,
        stage: int | Stage = 1,
        module: nn.Module | None = None,
        max_grad_norm: float | None = None,
        precision: Precision = Precision(),
        wire: Wire = Wire(),
        groups: Groups = Groups(),
        sharding: Sharding = Sharding(),
        device: torch.device | str | None = None,
        trace: bool = False,
    ) -> None:
        if isinstance(rule, ByGroup):
            if defaults:
                raise ValueError("defaults= with a ByGroup rule: put them in ByGroup.defaults")
            self._by_group: ByGroup | None = rule
            self._single: Rule | None = None
            defaults = {}
        else:
            self._by_group, self._single = None, rule
            defaults = {**rule.defaults, **(defaults or {})}
            rule.check_group(defaults)
        self.precision = check_record("precision", precision, Precision)
        self.wire = check_record("wire", wire, Wire)
        self.groups = check_record("groups", groups, Groups)
        self.sharding = check_record("sharding", sharding, Sharding)
        self.modes = precision.modes
        stage = validate.check_stage(stage)
        validate.check_max_grad_norm(max_grad_norm)
        validate.check_module(module)
        if stage.shards_params and module is None:
            raise ValueError("stage 3 needs module=model: units are modules")
        process_group, replicate_group = groups.shard, groups.replicate
        param_dtype, reduce_dtype = precision.param_dtype, precision.reduce_dtype
        bucket_numel, seed = sharding.bucket_numel, precision.seed
        super().__init__(validate.trainable(params), defaults)
        # Each group's rule, in param-group order (`add_param_group` filled its defaults).
        self.group_rules: list[Rule] = [self._rule_of(g) for g in self.param_groups]
        all_params = validate.check_groups(
            self.param_groups, lambda g: self._rule_of(g).check_group(g)
        )
        # The rule every group runs, None where groups run different rules.
        self.rule: Rule | None = self._single or _only(self.group_rules)
        # Asked here, before anything touches the model: a rule refuses a memory mode it
        # cannot hold by raising.
        group_fields = [r.state_fields(self.modes) for r in self.group_rules]

        self.stage = stage
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        self.rank = comm.group_rank(process_group)
        self.replicate_group = replicate_group
        self.replicas = 1 if replicate_group is None else comm.group_size(replicate_group)
        self.replica_rank = 0 if replicate_group is None else comm.group_rank(replicate_group)
        self.reduce_dtype = reduce_dtype
        self.grad_wire = wire_mod.parse_wire(wire.grads, "Wire.grads")
        self.param_wire = wire_mod.parse_wire(wire.params, "Wire.params")
        self.param_dtype = param_dtype
        self.bucket_numel = bucket_numel
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = precision.skip_nonfinite
        self.comm = CommCounter()
        self.trace: list[tuple[str, Any]] | None = [] if trace else None
        self.module = module
        self.device = validate.resolve_device(all_params, module, stage.shards_params, device)
        names = validate.param_names(module, all_params)
        validate.check_params(module, all_params, names)
        validate.check_modes(self.modes, all_params, names, param_dtype)
        self.param_names = names
        self.params = all_params
        validate.check_not_owned(module, all_params, names)
        # Tensor parallel: DTensor params on a tp mesh (None: a plain model).
        self.tp = tp_info(all_params, names, process_group, replicate_group)
        self._check_whole_over_tp(names)
        self._ctx = CommContext.of(process_group, self.comm, self.trace, self.device)
        gather_group = groups.gather
        if gather_group is not None:
            comm.check_same_ranks(gather_group, process_group, "Groups(gather=...)")
        self._gather_ctx = (
            self._ctx
            if gather_group is None
            else CommContext.of(gather_group, self.comm, self.trace, self.device)
        )
        self._tp_ctx = (
            None
            if self.tp is None
            else CommContext.of(self.tp.group, self.comm, self.trace, self.device)
        )
        # No replicate group: a group of one (None would mean the world here).
        self._replica_ctx = (
            CommContext.of(replicate_group, self.comm, self.trace, self.device)
            if replicate_group is not None
            else CommContext(group=None, world_size=1, rank=0, counter=self.comm, trace=self.trace)
        )
        start_from_rank0(validate.replicated(all_params, module), (self._ctx, self._replica_ctx))

        ls = precision.loss_scale
        self.scaler = LossScaler(ls, self.device) if ls is not None else None
        self.scalars = StepScalars(
            self.device,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=precision.skip_nonfinite,
            scaler=self.scaler,
        )
        self.zero3: Zero3 | None = None
        units = [0] * len(all_params)
        if stage.shards_params:
            assert module is not None
            self.zero3 = Zero3(
                module,
                sharding.units,
                sharding.reshard_after_forward,
                self._gather_ctx,
                lambda t: broadcast_from_rank0(t, (self._ctx, self._replica_ctx)),
                self.param_wire,
            )
            units = self.zero3.assign(all_params)
        self.flat_groups: list[FlatBuffer] = build_buffers(
            self.param_groups,
            names,
            units,
            param_dtype=param_dtype,
            stage=stage,
            world_size=self.world_size,
            rank=self.rank,
            bucket_numel=bucket_numel,
            reduce_dtype=reduce_dtype,
            device=self.device,
            modes=self.modes,
            state_fields=group_fields,
            seed=seed,
            tp_replicated=None if self.tp is None else [self.tp.replicated(p) for p in all_params],
            blocks=[None if r.element_wise else r.blocks for r in self.group_rules],
        )
        self.seed = seed
        if self.zero3 is not None:
            self.zero3.setup(self.flat_groups, sharding.param_init_fn)
        order = list(module.parameters()) if module is not None else all_params
        self.buckets = BucketSchedule(
            self.flat_groups, stage, self._ctx, order, self._replica_ctx, self.grad_wire
        )
        z = self.zero3
        self.grads = GradHooks(
            self.buckets,
            stage,
            self._ctx,
            module,
            all_params,
            on_unit_grad=z.grad_ready if z is not None else None,
            on_backward_end=z.end_backward if z is not None else None,
            before_backward_end=z.finish_backward if z is not None else None,
        )
        if z is not None:
            z.count_as_zero = self.grads.count_as_zero
        self.param_sync = ParamSync(
            self.flat_groups if stage.gathers_after_step else [],
            self._gather_ctx,
            module,
            sharding.units,
            self.param_wire,
        )
        self.shards = ShardAccess(
            self.group_rules, self.flat_groups, self.scalars, self.param_sync, self.quiesce_params
        )
        self._build_update()
        # model.load_state_dict() at stages 0-2 (at stage 3 the unit hooks do it).
        self._load_hooks = (
            []
            if module is None or self.zero3 is not None
            else FullParamsLoad(self.flat_groups, self.param_sync.wait).install(module)
        )
        self.closed = False
        validate.claim(self, validate.replicated(all_params, module))

    # -- construction -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the flat buffers and their sharding are built once. With
        a `ByGroup` rule the group is filled from its own rule's defaults."""
        if hasattr(self, "flat_groups"):
            raise NotImplementedError(
                f"{type(self).__name__} cannot add param groups after construction (its flat "
                "buffers are sharded at build time); pass every group to the constructor"
            )
        if self._by_group is not None:
            _, defaults = self._by_group.pick(param_group)
            param_group = {**defaults, **param_group}
        super().add_param_group(param_group)

    def _check_whole_over_tp(self, names: list[str]) -> None:
        """A per-matrix rule's params must be whole on each rank: a tensor-parallel shard of a
        matrix is a piece of it (See [Note: whole tensors for per-matrix rules])."""
        if self.tp is None:
            return
        index = 0
        for g, rule in zip(self.param_groups, self.group_rules):
            for p in g["params"]:
                if not rule.element_wise and not self.tp.replicated(p):
                    raise NotImplementedError(
                        f"the {rule.name} rule updates whole tensors, and {names[index]} is a "
                        f"tensor-parallel shard (placements {self.tp.placements[id(p)]}): "
                        "replicate it over the tp mesh or put it in a group of an element-wise "
                        "rule"
                    )
                index += 1

    def _rule_of(self, group: dict[str, Any]) -> Rule:
        if self._by_group is None:
            assert self._single is not None
            return self._single
        return self._by_group.pick(group)[0]

    def _build_update(self) -> None:
        """Each rule's launches over its own groups' flat buffers, and one sum-of-squares
        launch per grad dtype per step, built once. Their tables hold the buffers' addresses:
        the buffers are never replaced, only written in place (checkpoint loads,
        load_state_dict, zero3 all `copy_`)."""
        parts = []
        for rule in dict.fromkeys(self.group_rules):  # in order of first appearance
            gis = [i for i, r in enumerate(self.group_rules) if r is rule]
            own = {gi: k for k, gi in enumerate(gis)}  # the rule's own group numbering
            shards = [
                dataclasses.replace(b.local_shard(), group_index=own[b.group_index])
                for b in self.flat_groups
                if b.group_index in own
            ]
            update = rule.build(
                shards,
                device=self.device,
                num_groups=len(gis),
                modes=self.modes,
                seed=self.flat_groups[0].seed if self.flat_groups else None,
            )
            parts.append(_RulePart(update, tuple(gis)))
        self._update = _Updates(parts)
        self._sumsq = self._grouped_sumsq()

    def _grouped_sumsq(self) -> Callable[[], torch.Tensor]:
        return grouped_sumsq(self.flat_groups, self.device, self.tp)

    def broadcast_from_rank0(self, t: torch.Tensor) -> None:
        """Overwrite `t` (contiguous) with rank 0's value over the shard and replicate groups."""
        broadcast_from_rank0(t, (self._ctx, self._replica_ctx))

    def close(self) -> None:
        """Detach from the model: finish in-flight collectives, remove every hook this optimizer
        installed, and leave the params as plain tensors holding their current full values
        (stage 3: gathered once more into storage of their own). `.grad` is reset to None.
        Afterwards the model can get a new optimizer; this one refuses `step()`. Idempotent."""
        if self.closed:
            return
        self.grads.recover()
        if self.grads.in_backward:
            raise RuntimeError("close() called during backward")
        self.buckets.wait_all()
        self.param_sync.wait()
        self._remove_hooks()
        if self.zero3 is not None:
            self.zero3.close(self.params)
        self._release()

    def abandon(self) -> None:
        """Detach from the model without a collective or a wait on other ranks, after a run that
        failed (on this rank alone, perhaps): remove every hook this optimizer installed. Unlike
        `close()`, this rank does not gather (stage 3) or wait for collectives in flight, which
        the other ranks may never match: it can raise its error and exit instead of blocking.

        The params keep their shapes, not their values: at stages 0-2 they hold what they held
        (possibly a half-finished all-gather); at stage 3, where this rank had only its shard,
        each is full-shaped storage of its own filled with NaN (See [Note: params after
        abandon] in fusedzero/_zero3.py). Either way the model can be handed to a new optimizer
        (any stage) and a checkpoint loaded into it (`fusedzero.checkpoint.load`), which writes
        every param; until then the values mean nothing. Afterwards this optimizer refuses
        `step()`; a no-op on a closed one."""
        if self.closed:
            return
        self._remove_hooks()
        if self.zero3 is not None:
            self.zero3.abandon()
        self._release()

    def _remove_hooks(self) -> None:
        """The grad, param-sync and load hooks (stage 3's unit hooks are Zero3's)."""
        self.grads.remove()
        self.param_sync.remove_hooks()
        for h in self._load_hooks:
            h.remove()

    def _release(self) -> None:
        validate.release(self, validate.replicated(self.params, self.module))
        for p in self.params:
            p.grad = None
        self.closed = True

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what}() on a closed {type(self).__name__}: build a new optimizer")

    # -- backward -----------------------------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate grads locally for the micro-batches inside (stages 0-1), saving their
        reductions; a speed switch only: without it the result is the same. Stages 2-3 still
        reduce-scatter every micro-batch: they keep no full grad buffer to accumulate in."""
        return self.buckets.no_sync()

    # -- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update. No host sync on CUDA: scale, clip and skip are computed on the device.

        With `module` given (stages 1-2), the params' all-gather is still in flight when this
        returns; the model's forward waits for each bucket as it needs it. To read params
        outside a forward, use `with opt.gathered_params():` (as with FSDP).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open("step")
        with phase("fusedzero::step"):
            self._step()
        return loss

    def _step(self) -> None:
        self.grads.recover()
        if self.grads.in_backward:
            raise RuntimeError("step() called during backward")
        if not self.grads.grads_since_step:  # See [Note: one step per backward]
            raise RuntimeError(
                "step() without a backward since the last step() or zero_grad(): "
                f"{type(self).__name__}'s step consumes the grads, so this one would apply zero "
                "grads (a torch.optim optimizer would apply the same .grad again); run backward "
                "before each step()"
            )
        validate.check_not_frozen(self.params, self.param_names)
        hyper = self._update.read_groups(self.param_groups)
        self.quiesce_params()  # the kernel rewrites this rank's pieces of the param buffer
        self.buckets.wait_all()
        self.buckets.before_step()
        self.buckets.finish_replicas()
        s = self.scalars
        # The rule's per-group rows, if it has them, are written by the scalars' launch (one
        # launch for both).
        rows = self._update.rows
        with phase("fusedzero::grad_norm"):
            # Stage 0 grads are replicated: the local sum of squares is already global.
            s.prepare(
                self._sumsq,
                self._ctx if self.stage.shards_state else None,
                self._tp_ctx,
                rows=rows,
                hyper=self._update.rows_hyper(hyper),
            )
        with phase("fusedzero::update"):
            self._update.step(
                hyper, StepTensors(s.step, s.grad_scale, s.skip), rows_written=rows is not None
            )
        s.finish()
        self.param_sync.gather(after_step=True)
        self._consume_grads()

    def _consume_grads(self) -> None:
        self.buckets.reset_step()
        self.grads.drop_placeholders()
        self.grads.grads_since_step = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Grads live in the flat buffers and are consumed (zeroed) by `step()`; this empties
        the buffers (e.g. to drop a micro-batch). Stages 0-1 with grads reduced in the param
        dtype keep `.grad` as views of the zeroed buffer whatever `set_to_none` says; elsewhere
        `.grad` is None between backward passes."""
        self._check_open("zero_grad")
        with phase("fusedzero::zero_grad"):
            self.grads.recover()
            self.grads.reset_grads()
            if not self.grads.in_backward:
                self.buckets.wait_all()
                self.buckets.reset_step()
                self.grads.grads_since_step = False

    def quiesce_params(self) -> None:
        """Before this rank's param shards are rewritten (the update, a load): wait for the
        all-gathers reading them, and at stage 3 free every unit (one still gathering reads
        param_shard; a gathered one would be stale after the write)."""
        self.param_sync.wait()
        if self.zero3 is not None:
            self.zero3.free_all()

    # -- introspection ---------------------------------------------------------------------------
    def gathered_params(self) -> contextlib.AbstractContextManager[None]:
        """Context in which every model param holds its full value (stage 3 gathers all units
        and frees them on exit; other stages always hold full params)."""
        if self.zero3 is not None:
            return self.zero3.gathered()
        self.param_sync.wait()
        return contextlib.nullcontext()

    def full_state_dict(
        self, module: nn.Module | None = None, *, rank0_only: bool = False
    ) -> dict[str, Any]:
        """`module.state_dict()` (default: the `module=` given to the constructor) with every
        param at its full value; a collective at stages 1-3: call it on every rank. Stage 3
        gathers unit by unit into CPU copies. `rank0_only=True`: only global rank 0 keeps the
        params; the other ranks still join every gather and get the non-param entries alone
        (buffers, extra state). See [Note: rank-0-only full state dict] in
        fusedzero/_model_state_dict.py."""
        module = self._state_dict_module(module)
        keep = not rank0_only or comm.group_rank(None) == 0  # the global rank
        if self.zero3 is not None:
            with self.zero3.state_dict_hooks.params_in("copied" if keep else "gathered"):
                return module.state_dict()
        with self.gathered_params():
            state = module.state_dict()
        return state if keep else without_params(module, state)

    def state_dict_without_params(self, module: nn.Module | None = None) -> dict[str, Any]:
        """`module.state_dict()` less its params (buffers, extra state): no gather, not a
        collective (e.g. beside a sharded checkpoint that holds the params)."""
        module = self._state_dict_module(module)
        if self.zero3 is not None:
            with self.zero3.state_dict_hooks.params_in("left_out"):
                return module.state_dict()
        return without_params(module, module.state_dict())

    def _state_dict_module(self, module: nn.Module | None) -> nn.Module:
        module = self.module if module is None else module
        if module is None:
            raise ValueError(
                "ZeroAdamW's state-dict methods need the model: pass it "
                "(opt.full_state_dict(model)) or build ZeroAdamW with module=model"
            )
        return module

    @property
    def grad_norm(self) -> torch.Tensor:
        """Global grad norm of the last step (before clipping), a device tensor."""
        return self.scalars.norm

    @property
    def skipped(self) -> torch.Tensor:
        return self.scalars.skip

    @property
    def step_count(self) -> torch.Tensor:
        return self.scalars.step

    @property
    def max_live_buckets(self) -> int:
        """Most transient bucket buffers alive at once in a backward (stages 2-3)."""
        return self.buckets.max_live_buckets

    def memory(self) -> MemoryReport:
        """Resident bytes this rank owns now, from the tensors themselves: the flat buffers, and
        in `optimizer` the rules' scratch too (`Update.scratch`, e.g. Muon's Newton-Schulz
        stacks)."""
        report = memory_report(self.flat_groups)
        scratch = sum(
            t.numel() * t.element_size()
            for p in self._update.parts
            for t in getattr(p.update, "scratch", ())
        )
        return report._replace(optimizer=report.optimizer + scratch)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the current loss scale (identity without loss scaling)."""
        return loss if self.scaler is None else loss * self.scaler.scale


def _only(rules: Sequence[Rule]) -> Rule | None:
    """The rule every group runs, or None where they differ."""
    distinct = list(dict.fromkeys(rules))
    return distinct[0] if len(distinct) == 1 else None


class _RulePart(NamedTuple):
    """One rule's launches and the param groups (their indices) they update."""

    update: Update
    groups: tuple[int, ...]


class _Updates:
    """Every rule's launches as one: each reads its own groups' hyper-parameters and updates
    its own groups' buffers. The step's scalar launch writes the rows of one rule, the first
    that has any; the others write theirs in their own launches."""

    def __init__(self, parts: list[_RulePart]) -> None:
        self.parts = parts
        self._writer = next((k for k, p in enumerate(parts) if p.update.rows is not None), None)
        self.rows = None if self._writer is None else parts[self._writer].update.rows

    def read_groups(self, param_groups: list[dict[str, Any]]) -> list[Any]:
        return [p.update.read_groups([param_groups[i] for i in p.groups]) for p in self.parts]

    def rows_hyper(self, hyper: list[Any]) -> Any:
        """The hyper-parameters of the rule whose rows the scalar launch writes (or None)."""
        return None if self._writer is None else hyper[self._writer]

    def step(self, hyper: list[Any], scalars: StepTensors, *, rows_written: bool) -> None:
        for k, (p, h) in enumerate(zip(self.parts, hyper)):
            p.update.step(h, scalars, rows_written=rows_written and k == self._writer)
