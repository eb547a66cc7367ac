"""ZeroAdamW: data-parallel AdamW over flat sharded buffers, ZeRO stages 0 to 3.

    opt = ZeroAdamW(model.parameters(), lr=3e-4, stage=2, module=model, max_grad_norm=1.0)
    loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()

Stage 0: plain data parallelism (bucketed all-reduce, full optimizer state on every rank).
Stage 1: optimizer state sharded; full grads kept, each bucket reduce-scattered in place.
Stage 2: grads sharded too: each bucket lives only while it is being reduced.
Stage 3: params sharded per unit as well (see `fusedzero.zero3`).

Grads follow DDP: averaged over ranks, summed over micro-batches (divide the loss by the number of
micro-batches, as with DDP), with or without `no_sync()` (a speed switch, never a correctness
one). The step consumes the grads: after `step()` they are zero. Replicas start from rank 0's
params and buffers (broadcast at construction, as DDP). When `backward()` returns, every
reduction it started is complete (on NCCL: stream-ordered).

[Note: accumulating across reductions] Every reduction sums grads pre-divided by the world size
(as DDP and FSDP2: an fp16 sum of W ranks cannot overflow sooner than one rank's grad), so a
reduced buffer holds the average. A backward outside `no_sync` reduces what was accumulated so
far; a later micro-batch of the same step must add only its own new grads:
- stage 0: the bucket holds the average A, identical on every rank; the next micro-batch adds
  its local g; dividing by W and all-reducing gives A + mean(g) (linearity, as DDP).
- stage 1: after an in-place reduce-scatter only this rank's piece holds A; the other pieces
  hold local grads already contributed. Before new grads land in a reduced bucket those pieces
  are zeroed, and the new grads are added pre-divided (`.grad` is no longer a bucket view, so
  autograd cannot add them raw): the next reduce-scatter, which divides nothing, gives
  A + mean(g) in this rank's piece.
- stages 2-3: each backward reduces a fresh bucket and adds the result into grad_shard.

[Note: buffer lifetimes]
- param_flat (stages 0-2): the full param buffer; model params are views into it, so the
  all-gather after the update writes the model's weights in place.
- grad_flat (stages 0-1): the full grad buffer in the reduce dtype. Reduce-scatter is in place:
  afterwards only this rank's pieces hold reduced sums, and the kernel reads them there.
- bucket buffers (stages 2-3): allocated when a bucket's first grad arrives (only the alignment
  holes are zeroed; every param range is copied in whole), reduce-scattered, copied (first
  micro-batch of a step) or added (later ones) into grad_shard, freed at the end of backward.
- master / exp_avg / exp_avg_sq / grad_shard: this rank's local shard, contiguous, fp32
  (grad_shard: reduce dtype). With fp32 params the master *is* the param buffer's own pieces.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fusedzero import comm
from fusedzero.comm import CommCounter
from fusedzero.kernels import Strided, adamw_step, sumsq
from fusedzero.layout import DEFAULT_BUCKET_NUMEL, FlatLayout, build_layout


class Stage(enum.IntEnum):
    DP = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


class MemoryReport(NamedTuple):
    """Resident bytes this rank owns, exactly, from the tensors themselves."""

    params: int
    grads: int
    optimizer: int
    padding_elements: int  # elements of params that are padding (alignment + bucket tail)
    param_elements: int  # Psi: trainable elements

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Stages 2-3: reduce-scatters of transient bucket buffers allowed in flight at once. Two keep the
# network busy (one bucket reducing while the next is sent) and bound the full-size grad memory
# of a backward to a few buckets instead of the whole model.
MAX_INFLIGHT_BUCKETS = 2


class FlatGroup:
    """One flat buffer: the params of one (param group, dtype[, unit]) and their shard state."""

    def __init__(self, *, group_index: int, params: list[nn.Parameter], names: list[str],
                 indices: list[int], dtype: torch.dtype, stage: Stage, world_size: int,
                 rank: int, bucket_numel: int, reduce_dtype: torch.dtype, device: torch.device,
                 unit: int = 0) -> None:
        self.group_index, self.dtype, self.stage, self.unit = group_index, dtype, stage, unit
        self.params = params
        self.world_size, self.rank = world_size, rank
        # Stage 0 replicates everything: its layout is the world-size-1 layout.
        shard_world = 1 if stage == Stage.DP else world_size
        self.shard_rank = 0 if stage == Stage.DP else rank
        self.layout: FlatLayout = build_layout(
            [(i, n, tuple(p.shape)) for i, n, p in zip(indices, names, params)],
            shard_world, bucket_numel)
        L = self.layout
        self.device = device
        self.reduce_dtype = reduce_dtype
        n_local = L.local_numel
        f32 = dict(dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(n_local, **f32)
        self.exp_avg_sq = torch.zeros(n_local, **f32)
        self.lr = torch.zeros(1, **f32)
        self._lr_value: float | None = None
        self.param_flat: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.grad_flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.bucket_grads: dict[int, torch.Tensor] = {}
        # Buckets whose reduced grads already landed in grad_shard since the last step: the first
        # reduction of a step copies into the shard, later micro-batches add (no zeroing pass).
        self.shard_written: set[int] = set()
        # Stage 1: buckets already reduce-scattered since the last step, and those of them whose
        # other ranks' pieces were zeroed since (see [Note: accumulating across reductions]).
        self.reduced: set[int] = set()
        self.cleaned: set[int] = set()
        self._holes: dict[int, list[tuple[int, int]]] = {}
        self._grad_views: list[torch.Tensor | None] | None = None
        self.full: torch.Tensor | None = None  # stage 3: gathered params (storage freed between)
        self.param_base: torch.Tensor | None = None

        if stage == Stage.PARAMETERS:
            return  # zero3.py builds the param shard itself
        self.param_flat = torch.zeros(L.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, slot in zip(params, L.params):
                self.param_flat[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        if dtype != torch.float32:
            # From the original values, before the params become (possibly bf16) views.
            self.master = torch.zeros(n_local, **f32)
            self.copy_params_into(self.master)
        for p, slot in zip(params, L.params):
            p.data = self.param_flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
        if stage in (Stage.DP, Stage.OPTIMIZER):
            self.grad_flat = torch.zeros(L.padded_numel, dtype=reduce_dtype, device=device)
        else:
            self.grad_shard = torch.zeros(n_local, dtype=reduce_dtype, device=device)

    def copy_params_into(self, dst: torch.Tensor) -> None:
        """This rank's pieces of the params' current full values into a local-shard tensor,
        segment by segment (cast to dst's dtype). Params still on the meta device are skipped."""
        pos = {s.index: i for i, s in enumerate(self.layout.params)}
        with torch.no_grad():
            for seg in self.layout.segments(self.shard_rank):
                p = self.params[pos[seg.param]]
                if not p.is_meta:
                    dst[seg.local:seg.local + seg.length].copy_(
                        p.detach().reshape(-1)[seg.start:seg.start + seg.length])

    # -- views the kernel and the collectives use ---------------------------------------------
    def own(self, full: torch.Tensor) -> Strided:
        """This rank's pieces of a full bucketed buffer."""
        L = self.layout
        return Strided(full, L.bucket_numel, self.shard_rank * L.shard_numel)

    def master_stream(self) -> Strided | torch.Tensor:
        if self.master is not None:
            return self.master
        if self.param_shard is not None:
            return self.param_shard
        assert self.param_flat is not None
        return self.own(self.param_flat)

    def out_stream(self) -> Strided | torch.Tensor | None:
        if self.master is None:
            return None
        if self.param_shard is not None:
            return self.param_shard
        assert self.param_flat is not None
        return self.own(self.param_flat)

    def grad_stream(self) -> Strided | torch.Tensor:
        if self.grad_shard is not None:
            return self.grad_shard
        assert self.grad_flat is not None
        return self.own(self.grad_flat)

    def bucket_grad(self, k: int) -> torch.Tensor:
        lo, hi = self.layout.bucket_range(k)
        if self.grad_flat is not None:
            return self.grad_flat[lo:hi]
        buf = self.bucket_grads.get(k)
        if buf is None:
            # Every param range is written whole by `accumulate` (a copy) or `zero_missing`:
            # only the alignment holes and the tail need zeros, not the whole bucket.
            buf = torch.empty(hi - lo, dtype=self.reduce_dtype, device=self.device)
            for a, b in self.holes(k):
                buf[a:b].zero_()
            self.bucket_grads[k] = buf
        return buf

    def _overlap(self, pos: int, k: int) -> tuple[int, int, int]:
        """(start in bucket k, end in bucket k, start in the param) of param `pos` in bucket k."""
        slot, B = self.layout.params[pos], self.layout.bucket_numel
        a, b = max(slot.offset, k * B), min(slot.offset + slot.numel, (k + 1) * B)
        return a - k * B, b - k * B, a - slot.offset

    def holes(self, k: int) -> list[tuple[int, int]]:
        """Ranges of bucket k that belong to no param (alignment gaps, tail padding)."""
        if k not in self._holes:
            spans = sorted(self._overlap(pos, k)[:2] for pos, s in enumerate(self.layout.params)
                           if k in self.layout.buckets_of(s))
            out, cur = [], 0
            for a, b in spans:
                if a > cur:
                    out.append((cur, a))
                cur = max(cur, b)
            if cur < self.layout.bucket_numel:
                out.append((cur, self.layout.bucket_numel))
            self._holes[k] = out
        return self._holes[k]

    def zero_missing(self, k: int, positions: Iterable[int]) -> None:
        """Transient bucket k: zero the ranges of params whose grad did not arrive."""
        buf = self.bucket_grad(k)
        for pos in positions:
            a, b, _ = self._overlap(pos, k)
            buf[a:b].zero_()

    def reduced_into_shard(self, k: int, piece: torch.Tensor) -> None:
        S = self.layout.shard_numel
        assert self.grad_shard is not None
        dst = self.grad_shard[k * S:(k + 1) * S]
        if k in self.shard_written:
            dst.add_(piece)
        else:
            dst.copy_(piece)
            self.shard_written.add(k)

    def forget_reductions(self) -> None:
        self.shard_written.clear()  # the next reduction copies into grad_shard
        self.reduced.clear()
        self.cleaned.clear()

    def zero_unwritten_shard(self) -> None:
        """Shard pieces no reduction reached since the last step hold stale grads: zero them."""
        if self.grad_shard is None:
            return
        S = self.layout.shard_numel
        for k in range(self.layout.num_buckets):
            if k not in self.shard_written:
                self.grad_shard[k * S:(k + 1) * S].zero_()
                self.shard_written.add(k)

    def grad_view(self, pos: int) -> torch.Tensor | None:
        """The param's grad as a view of grad_flat, when autograd can accumulate into it
        directly (stages 0-1 with grads reduced in the param dtype), else None. Built once:
        the grad hook compares against it on every backward."""
        if self._grad_views is None:
            usable = self.grad_flat is not None and self.grad_flat.dtype == self.dtype
            self._grad_views = [
                self.grad_flat[s.offset:s.offset + s.numel].view(s.shape) if usable else None
                for s in self.layout.params]
        return self._grad_views[pos]

    def attach_grad_views(self) -> None:
        """[Note: grads as bucket views] `p.grad` is a view of grad_flat, so autograd's
        AccumulateGrad adds each new grad in place into the bucket: no per-step grad allocation
        and no copy (DDP's gradient_as_bucket_view)."""
        for pos, p in enumerate(self.params):
            view = self.grad_view(pos)
            if view is not None:
                p.grad = view

    def accumulate(self, pos: int, grad: torch.Tensor, inv_world: float) -> None:
        """Put a param's grad into the bucket buffer(s) it falls in.

        Transient buckets (stages 2-3): a copy pre-divided by the world size, fused into the
        copy (each param's grad arrives once per backward). grad_flat (stages 0-1): an add,
        which accumulates over micro-batches; pre-divided here only into a stage-1 bucket that
        was already reduced this step (its reduction then divides nothing again)."""
        g = grad.reshape(-1)
        for k in self.layout.buckets_of(self.layout.params[pos]):
            a, b, p = self._overlap(pos, k)
            dst = self.bucket_grad(k)[a:b]
            src = g[p:p + b - a]
            if self.grad_flat is None:
                if inv_world == 1.0:
                    dst.copy_(src)
                else:
                    torch.mul(src, inv_world, out=dst)
            elif k in self.reduced:
                self.clean(k)
                dst.add_(src, alpha=inv_world)
            else:
                dst.add_(src)

    def clean(self, k: int) -> None:
        """Stage 1, bucket k reduced this step: zero the pieces other ranks own (their local
        grads were contributed already and must not be counted again)."""
        if k in self.cleaned:
            return
        lo, hi = self.layout.bucket_range(k)
        plo, phi = self.layout.piece(k, self.shard_rank)
        assert self.grad_flat is not None
        self.grad_flat[lo:plo].zero_()
        self.grad_flat[phi:hi].zero_()
        self.cleaned.add(k)

    def set_lr(self, lr: float | torch.Tensor) -> None:
        if isinstance(lr, torch.Tensor):
            self.lr.copy_(lr.reshape(1))
            self._lr_value = None
        elif lr != self._lr_value:
            self.lr.fill_(lr)  # a host-to-device scalar write, not a sync
            self._lr_value = lr

    def resident(self) -> tuple[int, int, int]:
        def b(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()
        params = b(self.param_flat) + b(self.param_shard)
        grads = b(self.grad_flat) + b(self.grad_shard)
        opt = b(self.master) + b(self.exp_avg) + b(self.exp_avg_sq)
        return params, grads, opt


@dataclasses.dataclass
class _Bucket:
    fg: FlatGroup
    k: int
    slots: list[int]  # positions in fg.layout.params overlapping this bucket
    pending: int = 0
    arrived: set[int] = dataclasses.field(default_factory=set)  # slots whose grad came


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW with ZeRO sharding over a process group and one fused kernel per flat buffer.

    Args:
        params: parameters or param-group dicts, as for `torch.optim.AdamW`. Params with
            `requires_grad=False` are left out (frozen).
        lr, betas, eps, weight_decay, maximize: as `torch.optim.AdamW` (decoupled weight decay).
        stage: 0 (DP), 1 (optimizer state), 2 (+ grads), 3 (+ params; needs `module`).
        module: the model; gives parameter names (checkpoints) and, for stage 3, the units.
        process_group: the group params, grads and state are sharded over (default: the world;
            none initialised = 1 rank).
        replicate_group: for a 2-D mesh (shard within a node, replicate across nodes): the group
            of ranks that hold the same shard. Their grad shards are all-reduced once per step,
            after accumulation, before the update; everything else stays within
            `process_group`. Grads are averaged over both groups.
        param_dtype: dtype of the model's params (e.g. torch.bfloat16, with an fp32 master);
            default keeps each param's dtype (fp32 params are their own master).
        reduce_dtype: dtype grads are reduced and accumulated in (fp32 default; bf16 halves bytes).
        bucket_numel: elements per bucket (rounded so buckets are equal and divide by W*ALIGN).
        max_grad_norm: clip the global grad norm to this (None: no clipping).
        skip_nonfinite: skip the whole step (on the device, no sync) when a grad is inf/nan.
        loss_scale: "dynamic" for fp16 dynamic loss scaling, a float for a static scale, None.
        unit_policy: stage 3 units: None (each child of an nn.ModuleList), a module class or
            tuple of classes, a callable(module) -> bool, or a minimum element count.
        reshard_after_forward: stage 3: free a unit after its forward and gather it again for
            backward (3 Psi of traffic per step); False keeps it until backward (2 Psi).
        param_init_fn: stage 3 with params on the meta device: `fn(name, module)` initialises the
            params a module owns directly (default: `module.reset_parameters()`).
        device: where meta-device params are materialised (default: cuda if present, else cpu).
        trace: record the order of collectives and unit events in `self.trace` (tests).

    One live optimizer per model: `close()` detaches it (hooks removed, params left as plain
    tensors) before another is built on the same params.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        maximize: bool = False,
        *,
        stage: int | Stage = 1,
        module: nn.Module | None = None,
        process_group: Any = None,
        replicate_group: Any = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        loss_scale: str | float | None = None,
        unit_policy: Any = None,
        reshard_after_forward: bool = True,
        param_init_fn: Callable[[str, nn.Module], None] | None = None,
        device: torch.device | str | None = None,
        trace: bool = False,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        try:
            stage = Stage(stage)
        except ValueError:
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}") from None
        if reduce_dtype not in FLOAT_DTYPES:
            raise ValueError(f"reduce_dtype {reduce_dtype} not in {FLOAT_DTYPES}")
        if param_dtype is not None and param_dtype not in FLOAT_DTYPES:
            raise ValueError(f"param_dtype {param_dtype} not in {FLOAT_DTYPES}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        if stage == Stage.PARAMETERS and module is None:
            raise ValueError("stage 3 needs module=model: units are modules")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        maximize=maximize)
        super().__init__(_trainable(params), defaults)
        for g in self.param_groups:
            _check_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"])

        self.stage = stage
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        self.rank = comm.group_rank(process_group)
        self.replicate_group = replicate_group
        self.replicas = 1 if replicate_group is None else comm.group_size(replicate_group)
        self.replica_rank = 0 if replicate_group is None else comm.group_rank(replicate_group)
        self.reduce_dtype = reduce_dtype
        self.param_dtype = param_dtype
        self.bucket_numel = bucket_numel
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.comm = CommCounter()
        self.trace: list[tuple[str, Any]] | None = [] if trace else None
        self.module = module

        for gi, g in enumerate(self.param_groups):
            if len({id(p) for p in g["params"]}) != len(g["params"]):
                raise ValueError(f"param group {gi} lists a parameter twice; list each "
                                 "parameter once")
        all_params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in all_params}) != len(all_params):
            raise ValueError("a parameter appears in more than one param group")
        devices = {p.device for p in all_params}
        if len(devices) > 1:
            raise ValueError(f"all params must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        if self.device.type == "meta":
            if stage != Stage.PARAMETERS:
                raise ValueError("params on the meta device need stage=3, which materialises "
                                 "them unit by unit; other stages hold the full model anyway")
            if module is not None and any(p.is_meta for p in module.parameters()
                                          if not p.requires_grad):
                raise ValueError("frozen params on the meta device are not supported: "
                                 "materialise them before building the optimizer")
            self.device = torch.device(device if device is not None else
                                       ("cuda" if torch.cuda.is_available() else "cpu"))
        elif device is not None and torch.device(device) != self.device:
            raise ValueError(f"device={device} but the params are on {self.device}")
        names = _param_names(module, all_params)
        for p, n in zip(all_params, names):
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"param {n} has layout {p.layout}; only dense params are "
                                 "supported")
            if p.dtype not in FLOAT_DTYPES:
                raise ValueError(f"param {n} has dtype {p.dtype}; expected one of {FLOAT_DTYPES}")
        self.param_names = names
        if module is not None:
            for n, m in module.named_modules():
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                    raise ValueError(f"module {n or type(m).__name__} has sparse=True: sparse "
                                     "gradients are not supported; build it with sparse=False")
        self.params = all_params
        _check_not_owned(module, all_params, names)
        self._sync_replicas(module)

        f32 = dict(dtype=torch.float32, device=self.device)
        self._step = torch.zeros(1, **f32)
        self._skip = torch.zeros(1, **f32)
        self._grad_scale = torch.ones(1, **f32)
        self._norm = torch.zeros(1, **f32)
        # Grads are pre-divided before every reduction ([Note: accumulating across
        # reductions]): the reduced buffers hold the average, and the kernel's grad scale is
        # 1 (times the inverse loss scale and the clip coefficient).
        self._one = torch.ones(1, **f32)
        self._inv_w = 1.0 / self.world_size
        self.scaler = _LossScaler(loss_scale, self.device) if loss_scale is not None else None

        self._zero3: Any = None
        if stage == Stage.PARAMETERS:
            from fusedzero.zero3 import build_zero3
            self.flat_groups = build_zero3(self, module, unit_policy, reshard_after_forward,
                                           param_init_fn)
        else:
            self.flat_groups = self._build_flat_groups()
        self._buckets = self._order_buckets()
        self._where: dict[int, tuple[FlatGroup, int]] = {}
        for fg in self.flat_groups:
            for pos, p in enumerate(fg.params):
                self._where[id(p)] = (fg, pos)
        self._bucket_of: dict[tuple[int, int], _Bucket] = {(id(b.fg), b.k): b
                                                           for b in self._buckets}
        self._handles: list[tuple[Any, Callable[[], None] | None]] = []
        self.max_live_buckets = 0  # most transient bucket buffers alive at once (stages 2-3)
        self._gather_handles: dict[tuple[int, int], Any] = {}
        self._sync = True
        self._in_backward = False
        self._task_id = -1  # autograd graph task the end-of-backward callback is queued on
        self._grads_arrived = False  # a param grad came in the current backward
        self._closed = False
        self._no_grad: dict[int, torch.Tensor] = {}  # per param: its _NoLocalGrad, built once
        self._next = 0
        self._reset_pending()
        self._hooks: list[Any] = []
        for p in all_params:
            self._hooks.append(p.register_hook(functools.partial(self._before_accumulate, p)))
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for fg in self.flat_groups:
            fg.attach_grad_views()
        if module is not None:
            self._hooks.append(module.register_forward_hook(self._on_model_output))
        self._module_waits = module is not None and stage in (Stage.OPTIMIZER, Stage.GRADIENTS)
        if self._module_waits:
            self._install_param_waits(module)
        for p in {id(p): p for p in self._owned(module)}.values():
            setattr(p, _OWNER, weakref.ref(self))

    # -- construction -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the flat buffers and their sharding are built once."""
        if hasattr(self, "flat_groups"):
            raise NotImplementedError(
                "ZeroAdamW cannot add param groups after construction (its flat buffers are "
                "sharded at build time); pass every group to the constructor")
        super().add_param_group(param_group)

    def _owned(self, module: nn.Module | None) -> list[torch.Tensor]:
        """Every tensor replicas must agree on: the optimizer's params, and the module's params
        (frozen ones too) and buffers."""
        out = list(self.params)
        if module is not None:
            out += list(module.parameters()) + list(module.buffers())
        return out

    def _sync_replicas(self, module: nn.Module | None) -> None:
        """Start every replica from rank 0's params and buffers, as DDP does at construction:
        ranks that initialised differently (another seed) would otherwise train apart (stage 0)
        or silently mix their inits shard by shard (stages 1-3). Over the shard group, then the
        replicate group: rank 0 of both reaches every rank of a 2-D mesh. Meta tensors have no
        values yet: stage 3 broadcasts them as it materialises them."""
        tensors = [t for t in {id(t): t for t in self._owned(module)}.values() if not t.is_meta]
        for group, size in ((self.process_group, self.world_size),
                            (self.replicate_group, self.replicas)):
            if size == 1:
                continue
            work = []
            for t in tensors:
                buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
                work.append((t, buf, comm.broadcast(buf, group, size)))
            with torch.no_grad():
                for t, buf, h in work:
                    comm.wait(h)
                    if buf.data_ptr() != t.data_ptr():
                        t.copy_(buf)

    def broadcast_from_rank0(self, t: torch.Tensor) -> None:
        """Overwrite `t` (contiguous) with rank 0's value over the shard and replicate groups."""
        for group, size in ((self.process_group, self.world_size),
                            (self.replicate_group, self.replicas)):
            comm.wait(comm.broadcast(t, group, size))

    def close(self) -> None:
        """Detach from the model: finish in-flight collectives, remove every hook this optimizer
        installed, and leave the params as plain tensors holding their current full values
        (stage 3: gathered once more into storage of their own). `.grad` is reset to None.
        Afterwards the model can get a new optimizer; this one refuses `step()`. Idempotent."""
        if self._closed:
            return
        if self._in_backward:
            raise RuntimeError("close() called during backward")
        self._wait_reductions()
        self._wait_params()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._zero3 is not None:
            for h in self._zero3._hooks:
                h.remove()
            self._zero3._hooks.clear()
            # Copies taken while gathered, installed after the exit frees the units (a freed
            # unit points its params at an empty tensor).
            with self._zero3.gathered(), torch.no_grad():
                full = [p.detach().clone() for p in self.params]
            for p, value in zip(self.params, full):
                p.data = value
        for p in {id(p): p for p in self._owned(self.module)}.values():
            if getattr(p, _OWNER, None) is not None and getattr(p, _OWNER)() is self:
                delattr(p, _OWNER)
        for p in self.params:
            p.grad = None
        self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}() on a closed ZeroAdamW: build a new optimizer")

    def _build_flat_groups(self) -> list[FlatGroup]:
        out = []
        index = 0
        for gi, g in enumerate(self.param_groups):
            by_dtype: dict[torch.dtype, list[tuple[int, nn.Parameter]]] = {}
            for p in g["params"]:
                dt = self.param_dtype or p.dtype
                by_dtype.setdefault(dt, []).append((index, p))
                index += 1
            for dt, items in by_dtype.items():
                out.append(FlatGroup(
                    group_index=gi, params=[p for _, p in items],
                    names=[self.param_names[i] for i, _ in items], indices=[i for i, _ in items],
                    dtype=dt, stage=self.stage, world_size=self.world_size, rank=self.rank,
                    bucket_numel=self.bucket_numel, reduce_dtype=self.reduce_dtype,
                    device=self.device))
        return out

    def _order_buckets(self) -> list[_Bucket]:
        """Launch order, identical on every rank (collectives must match): the bucket expected
        to be complete first goes first. Backward produces grads in about reverse forward order,
        and a bucket is complete when its earliest-used param's grad arrives, so buckets go in
        descending order of their earliest param's place in `module.parameters()` (the
        optimizer's order without a module). A bucket that mixes early and late layers (a small
        no-decay group of biases and norms) thus waits at the end instead of holding up every
        other bucket."""
        buckets = []
        for fg in self.flat_groups:
            L = fg.layout
            for k in range(L.num_buckets):
                slots = [i for i, s in enumerate(L.params) if k in L.buckets_of(s)]
                buckets.append(_Bucket(fg, k, slots))
        if self.stage == Stage.PARAMETERS:
            # Units finish backward in reverse forward order; the root (unit 0) finishes last.
            buckets.sort(key=lambda b: (b.fg.unit == 0, -b.fg.unit, -b.k))
            return buckets
        order = {id(p): i for i, p in enumerate(
            self.module.parameters() if self.module is not None else self.params)}
        first = {id(b): min((order.get(id(b.fg.params[i]), -1) for i in b.slots), default=-1)
                 for b in buckets}
        buckets.sort(key=lambda b: (-first[id(b)], -b.k))
        return buckets

    def _reset_pending(self) -> None:
        for b in self._buckets:
            b.pending = len(b.slots)
            b.arrived.clear()
        self._next = 0

    # -- backward -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally for the micro-batches inside (stages 0-1), saving their
        reductions; a speed switch only: without it the result is the same. Stages 2-3 still
        reduce-scatter every micro-batch: they keep no full grad buffer to accumulate in."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _on_model_output(self, module: nn.Module, args: Any, output: Any) -> None:
        """[Note: end of backward] The end-of-backward callback must run on the outermost
        autograd graph task. Queued from the first param grad, it lands on an inner task when
        that grad comes from a reentrant checkpoint (`use_reentrant=True` runs a nested backward
        for the checkpointed part) and would fire when that part is done. The grad of the
        model's output arrives first, in the outer task: queue it from there. (A forward run as
        a recomputation inside backward adds no hook: the outer backward is already running.)"""
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._begin_backward()

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._grads_arrived = False
        self._task_id = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _before_accumulate(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Runs before autograd accumulates into `p.grad`: a placeholder `p.grad` is dropped, so
        the new grad arrives as a fresh tensor for `_on_grad` to put where it belongs."""
        if type(p.grad) is _NoLocalGrad:
            p.grad = None

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if p.grad.is_sparse:
            raise RuntimeError(f"param {self.param_names[self._index(p)]} got a sparse grad; "
                               "sparse gradients are not supported")
        task = torch._C._current_graph_task_id()
        if task < self._task_id:
            # Graph task ids grow: a grad from an older task than the one our callback is queued
            # on means that one was a nested (reentrant) backward and the callback fired early.
            raise RuntimeError(
                "ZeroAdamW: a grad arrived from an outer autograd graph task after the end-of-"
                "backward callback ran on a nested one (reentrant activation checkpointing, "
                "torch.utils.checkpoint(..., use_reentrant=True)). Pass module=model to "
                "ZeroAdamW (the callback is then queued from the model output's grad) or use "
                "use_reentrant=False")
        if not self._in_backward:
            self._begin_backward()
        self._grads_arrived = True
        fg, pos = self._where[id(p)]
        view = fg.grad_view(pos)
        if view is None or p.grad.data_ptr() != view.data_ptr():
            # Not (or no longer: reduced, or the user reset .grad) a view of our bucket: put it in.
            with torch.no_grad():
                fg.accumulate(pos, p.grad, self._inv_w)
            p.grad = self._idle_grad(fg, pos, p)
        for k in fg.layout.buckets_of(fg.layout.params[pos]):
            b = self._bucket_of[(id(fg), k)]
            b.pending -= 1
            b.arrived.add(pos)
        self._launch_ready(force=False)
        if self._zero3 is not None:
            self._zero3.grad_ready(fg.unit)

    def _idle_grad(self, fg: FlatGroup, pos: int, p: torch.Tensor) -> torch.Tensor | None:
        """What `p.grad` holds between backward passes. [Note: user grad clipping] A view of
        grad_flat where that view is this param's true grad: stage 0 with grads in the param
        dtype, where after backward it holds the grad averaged over ranks on every rank, so
        `torch.nn.utils.clip_grad_norm_` computes the true global norm and clips it in place,
        identically on every replica (as with DDP); and stage 1 until its bucket is reduced
        (local grads, as DDP's inside `no_sync`). Elsewhere this rank holds only a shard of the
        reduced grad (or a copy in another dtype), and a norm over `.grad` would be silently
        wrong or, over None, silently zero: `.grad` is then a placeholder that raises, naming
        `max_grad_norm` and `opt.grad_norm`, on any use."""
        view = fg.grad_view(pos)
        if view is not None and not any(k in fg.reduced
                                        for k in fg.layout.buckets_of(fg.layout.params[pos])):
            return view
        ng = self._no_grad.get(id(p))
        if ng is None:
            ng = _NoLocalGrad(p, self.stage, fg.layout.params[pos].name)
            self._no_grad[id(p)] = ng
        return ng

    def _index(self, p: torch.Tensor) -> int:
        return next(i for i, q in enumerate(self.params) if q is p)

    def _reduces_now(self) -> bool:
        return self._sync or self.stage >= Stage.GRADIENTS

    def _launch_ready(self, force: bool) -> None:
        if not self._reduces_now():
            return
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if b.pending > 0 and not force:
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        fg, k = b.fg, b.k
        if fg.grad_flat is None and len(b.arrived) < len(b.slots):
            fg.zero_missing(k, (pos for pos in b.slots if pos not in b.arrived))
        buf = fg.bucket_grad(k)
        if self.trace is not None:
            self.trace.append(("reduce", (fg.unit, fg.group_index, k)))
        if fg.grad_flat is not None:  # transient buckets were pre-divided in `accumulate`
            if k in fg.reduced:
                fg.clean(k)  # new grads were added pre-divided: divide nothing again
            elif self.world_size > 1:
                buf.mul_(self._inv_w)
            if self.stage == Stage.OPTIMIZER:
                fg.reduced.add(k)
                fg.cleaned.discard(k)  # the other pieces are contributed again by this one
        if self.stage == Stage.DP:
            h = comm.all_reduce(buf, self.process_group, self.world_size, self.comm)
            self._handles.append((h, None))
            return
        lo, hi = fg.layout.piece(k, fg.shard_rank)
        lo, hi = lo - k * fg.layout.bucket_numel, hi - k * fg.layout.bucket_numel
        h = comm.reduce_scatter(buf[lo:hi], buf, self.process_group, self.world_size, self.comm)
        finish = None
        if fg.grad_shard is not None:
            def finish(fg: FlatGroup = fg, k: int = k, lo: int = lo, hi: int = hi) -> None:
                fg.reduced_into_shard(k, fg.bucket_grads.pop(k)[lo:hi])
        self._handles.append((h, finish))
        if finish is not None:
            self.max_live_buckets = max(self.max_live_buckets,
                                        sum(len(g.bucket_grads) for g in self.flat_groups))
            self._bound_inflight()

    def _bound_inflight(self) -> None:
        """Finish the oldest transient reductions beyond MAX_INFLIGHT_BUCKETS: their buffers
        are freed as backward goes on. (On NCCL the wait orders streams; it does not block.)"""
        live = [i for i, (_, f) in enumerate(self._handles) if f is not None]
        for i in live[:max(0, len(live) - MAX_INFLIGHT_BUCKETS)]:
            h, finish = self._handles[i]
            comm.wait(h, what="grad reduction of a backward bucket", group=self.process_group)
            finish()
            self._handles[i] = (None, None)

    def _end_backward(self) -> None:
        self._in_backward = False
        # A backward that reached the model's output but no param (torch.autograd.grad w.r.t.
        # inputs) has nothing to reduce.
        reduced = self._reduces_now() and self._grads_arrived
        if reduced:
            self._launch_ready(force=True)
        # Every stage: the grads are final when backward returns (what the user does next may
        # read them), the next micro-batch never writes into a buffer a collective is reading,
        # and stages 2-3 free their bucket buffers. On NCCL the wait orders the streams.
        self._wait_reductions()
        if reduced and self.stage == Stage.OPTIMIZER:
            # Only this rank's pieces hold reduced grads now: no param's .grad is a true view.
            for fg in self.flat_groups:
                for pos, p in enumerate(fg.params):
                    p.grad = self._idle_grad(fg, pos, p)
        if self._zero3 is not None:
            self._zero3.end_backward()
        if self.trace is not None:
            self.trace.append(("backward_end", len(self._handles)))
        self._reset_pending()

    def _wait_reductions(self) -> None:
        for h, finish in self._handles:
            comm.wait(h, what="grad reduction of a backward bucket", group=self.process_group)
            if finish is not None:
                finish()
        self._handles.clear()

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
        if self._in_backward:
            raise RuntimeError("step() called during backward")
        self._check_frozen()
        self._wait_params()  # the kernel rewrites this rank's pieces of the param buffer
        if self._zero3 is not None:
            # Likewise at stage 3: a unit still gathering (a no-grad or partial forward since
            # backward) has all-gathers reading param_shard, which the kernel rewrites. Wait and
            # free them all first; a gathered unit would be stale after the update anyway.
            self._zero3.free_all()
        self._wait_reductions()
        for fg in self.flat_groups:
            fg.zero_unwritten_shard()
        self._reduce_replicas()
        self._prepare_scalars()
        # The step counter advances only for steps that are taken.
        self._step.add_(1.0 - self._skip)
        for fg in self.flat_groups:
            g = self.param_groups[fg.group_index]
            fg.set_lr(g["lr"])
            beta1, beta2 = g["betas"]
            adamw_step(fg.master_stream(), fg.grad_stream(), fg.exp_avg, fg.exp_avg_sq,
                       fg.out_stream(), lr=fg.lr, step=self._step, grad_scale=self._grad_scale,
                       skip=self._skip, beta1=beta1, beta2=beta2, eps=g["eps"],
                       weight_decay=g["weight_decay"], maximize=g["maximize"],
                       num_buckets=fg.layout.num_buckets, shard_numel=fg.layout.shard_numel)
        if self.scaler is not None:
            self.scaler.update(self._skip)
        self._gather_params()
        self._zero_grad_buffers()
        return loss

    def _check_frozen(self) -> None:
        """A param frozen after construction still sits in a flat buffer the fused kernel
        updates as a whole: momentum and weight decay would keep moving it. Refuse, naming it
        (a Python attribute read per param: no host sync)."""
        frozen = [n for n, p in zip(self.param_names, self.params) if not p.requires_grad]
        if frozen:
            raise RuntimeError(
                f"params {frozen} were set requires_grad=False after ZeroAdamW was built; the "
                "fused update would keep moving them (momentum, weight decay). Freeze params "
                "before building the optimizer (frozen params are left out), or unfreeze them; "
                "to change the set mid-run: checkpoint.save, close(), build a new ZeroAdamW")

    def _reduce_replicas(self) -> None:
        """2-D mesh: average this rank's grad shard over the replicas that hold the same shard.
        Once per step, after accumulation: replicas then hold equal grads and stay in step."""
        if self.replicas == 1:
            return
        handles = []
        for fg in self.flat_groups:
            for piece in _stream_pieces(fg.grad_stream(), fg.layout):
                piece.mul_(1.0 / self.replicas)  # pre-divided: the sum is the average
                handles.append(comm.all_reduce(piece, self.replicate_group, self.replicas,
                                               self.comm))
        for h in handles:
            comm.wait(h, what="grad all-reduce across replicas", group=self.replicate_group)

    def _prepare_scalars(self) -> None:
        need_norm = self.max_grad_norm is not None or self.skip_nonfinite or self.scaler
        inv = self._one if self.scaler is None else self._one / self.scaler.scale
        if not need_norm:
            self._grad_scale.copy_(inv)
            self._skip.zero_()
            return
        total = torch.zeros(1, dtype=torch.float32, device=self.device)
        for fg in self.flat_groups:
            total += sumsq(fg.grad_stream(), num_buckets=fg.layout.num_buckets,
                           shard_numel=fg.layout.shard_numel)
        if self.stage != Stage.DP:  # stage 0 grads are replicated: the local sum is global
            comm.wait(comm.all_reduce(total, self.process_group, self.world_size, self.comm),
                      what="grad-norm all-reduce", group=self.process_group)
        finite = torch.isfinite(total)
        torch.mul(total.sqrt(), inv, out=self._norm)
        scale = inv
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1.
            coef = (self.max_grad_norm / (self._norm + 1e-6)).clamp_(max=1.0)
            scale = inv * torch.where(finite, coef, torch.ones_like(coef))
        self._grad_scale.copy_(scale)
        if self.skip_nonfinite or self.scaler is not None:
            self._skip.copy_(~finite)
        else:
            self._skip.zero_()

    def _gather_params(self) -> None:
        """Issue the all-gather of every bucket's updated params (stages 1-2), async.

        [Note: all-gather overlap] With `module` given, each module that owns params waits, in
        its forward pre-hook, only for the buckets holding them: the gather of later buckets
        overlaps the forward of earlier layers. Without `module`, `step()` waits before
        returning. The next `step()` (whose kernel rewrites the params) and `gathered_params()`
        wait for whatever is still in flight.
        """
        if self.stage in (Stage.DP, Stage.PARAMETERS):
            return  # stage 0 updates the full buffer; stage 3 gathers per unit just in time
        for fg in self.flat_groups:
            L = fg.layout
            assert fg.param_flat is not None
            for k in range(L.num_buckets):
                lo, hi = L.bucket_range(k)
                plo, phi = L.piece(k, self.rank)
                h = comm.all_gather(fg.param_flat[lo:hi], fg.param_flat[plo:phi],
                                    self.process_group, self.world_size, self.comm)
                self._gather_handles[(id(fg), k)] = h
        if not self._module_waits:
            self._wait_params()

    def _wait_params(self, keys: Iterable[tuple[int, int]] | None = None) -> None:
        """Wait for in-flight param all-gathers (all, or those buckets). On NCCL this orders
        the streams; it is not a host sync."""
        if not self._gather_handles:
            return
        for key in list(self._gather_handles) if keys is None else keys:
            h = self._gather_handles.pop(key, None)
            if h is not None:
                if self.trace is not None:
                    self.trace.append(("param_wait", key))
                comm.wait(h, what=f"param all-gather of (flat group, bucket) {key}",
                          group=self.process_group)

    def _install_param_waits(self, module: nn.Module) -> None:
        """Forward pre-hooks: each module with params of ours waits for their buckets."""
        for m in module.modules():
            keys = []
            for p in m.parameters(recurse=False):
                where = self._where.get(id(p))
                if where is not None:
                    fg, pos = where
                    keys += [(id(fg), k) for k in fg.layout.buckets_of(fg.layout.params[pos])]
            if keys:
                keys = sorted(set(keys))
                self._hooks.append(m.register_forward_pre_hook(
                    lambda mod, args, keys=keys: self._wait_params(keys)))
        # A param a parent uses directly (not through a submodule) is in the parent's own
        # parameters(recurse=False), so the parent's hook covers it.

    def _zero_grad_buffers(self) -> None:
        for fg in self.flat_groups:
            if fg.grad_flat is not None:
                fg.grad_flat.zero_()
            # The grads are consumed: placeholders go (stage 1: autograd accumulates into the
            # bucket views again).
            for pos, p in enumerate(fg.params):
                if type(p.grad) is _NoLocalGrad:
                    p.grad = fg.grad_view(pos)
            fg.forget_reductions()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Grads live in the flat buffers and are consumed (zeroed) by `step()`; this empties
        the buffers (e.g. to drop a micro-batch). Stages 0-1 with grads reduced in the param
        dtype keep `.grad` as views of the zeroed buffer whatever `set_to_none` says; elsewhere
        `.grad` is None between backward passes."""
        self._check_open("zero_grad")
        for fg in self.flat_groups:
            for pos, p in enumerate(fg.params):
                p.grad = fg.grad_view(pos)
        if not self._in_backward:
            self._wait_reductions()
            self._zero_grad_buffers()

    # -- introspection ---------------------------------------------------------------------------
    def gathered_params(self) -> contextlib.AbstractContextManager[None]:
        """Context in which every model param holds its full value (stage 3 gathers all units
        and frees them on exit; other stages always hold full params)."""
        if self._zero3 is not None:
            return self._zero3.gathered()
        self._wait_params()
        return contextlib.nullcontext()

    @property
    def grad_norm(self) -> torch.Tensor:
        """Global grad norm of the last step (before clipping), a device tensor."""
        return self._norm

    @property
    def skipped(self) -> torch.Tensor:
        return self._skip

    @property
    def step_count(self) -> torch.Tensor:
        return self._step

    def memory(self) -> MemoryReport:
        params = grads = opt = pad = 0
        for fg in self.flat_groups:
            a, b, c = fg.resident()
            params, grads, opt = params + a, grads + b, opt + c
            pad += fg.layout.padded_numel - fg.layout.param_numel
        # From the layout: stage-3 params are empty tensors while their unit is freed.
        return MemoryReport(params, grads, opt, pad,
                            sum(fg.layout.param_numel for fg in self.flat_groups))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the current loss scale (identity without loss scaling)."""
        return loss if self.scaler is None else loss * self.scaler.scale

    # -- state dict (this rank's shard; `fusedzero.checkpoint` reshards) ----------------------
    def state_dict(self) -> dict[str, Any]:
        groups = []
        index = 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(d)
        flat = []
        for fg in self.flat_groups:
            flat.append({"master": self.master_shard(fg).clone(), "exp_avg": fg.exp_avg.clone(),
                         "exp_avg_sq": fg.exp_avg_sq.clone()})
        state = {"step": self._step.clone(), "flat": flat}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return {"state": state, "param_groups": groups, "layout": self.layout_key()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = state_dict.get("layout")
        if key != self.layout_key():
            raise ValueError(f"state dict was saved with layout {key}, this optimizer has "
                             f"{self.layout_key()}; use fusedzero.checkpoint to load across "
                             "world sizes or stages")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, optimizer has "
                             f"{len(self.param_groups)}")
        for mine, saved in zip(self.param_groups, groups):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError("param group sizes differ between state dict and optimizer")
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        st = state_dict["state"]
        with torch.no_grad():
            self._step.copy_(st["step"])
            for fg, d in zip(self.flat_groups, st["flat"], strict=True):
                fg.exp_avg.copy_(d["exp_avg"])
                fg.exp_avg_sq.copy_(d["exp_avg_sq"])
                self.set_master_shard(fg, d["master"])
            if self.scaler is not None and "scaler" in st:
                self.scaler.load_state_dict(st["scaler"])

    def layout_key(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "rank": self.rank, "stage": int(self.stage),
                "bucket_numel": self.bucket_numel,
                "flat": [(fg.group_index, str(fg.dtype), fg.unit, fg.layout.local_numel)
                         for fg in self.flat_groups]}

    def master_shard(self, fg: FlatGroup) -> torch.Tensor:
        """This rank's fp32 master values of `fg`, as a contiguous local-shard tensor."""
        m = fg.master_stream()
        if isinstance(m, torch.Tensor):
            return m if m.dtype == torch.float32 else m.float()
        # fp32 params are their own master: let the param all-gather in flight land first.
        self._wait_params()
        pieces = _stream_pieces(m, fg.layout)
        return torch.cat(pieces) if pieces else m.tensor.new_zeros(0)

    def set_master_shard(self, fg: FlatGroup, values: torch.Tensor) -> None:
        """Write this rank's fp32 master (and the param copy derived from it), then gather."""
        with torch.no_grad():
            for stream in (fg.master_stream(), fg.out_stream()):
                if stream is None:
                    continue
                pieces = _stream_pieces(stream, fg.layout)
                size = max(1, pieces[0].numel()) if pieces else 1
                for dst, src in zip(pieces, values.split(size)):
                    dst.copy_(src)
        self._gather_params()
        self._wait_params()

    # ---- BEGIN TEMPORARY SHIM (branch rckpt) -----------------------------------------------
    # fusedzero/state.py's typed interface over today's flat groups, so that fusedzero.checkpoint
    # needs no private attribute. rcore implements these four methods for real: the lead drops
    # this block in favour of rcore's when merging.
    def shard_infos(self) -> list[ShardInfo]:
        from fusedzero.state import ShardInfo
        return [ShardInfo(group_index=fg.group_index, dtype=fg.dtype, unit=fg.unit,
                          layout=fg.layout, shard_rank=fg.shard_rank) for fg in self.flat_groups]

    def param_infos(self) -> list[ParamInfo]:
        from fusedzero.state import ParamInfo
        out = {}
        for fg in self.flat_groups:
            for s in fg.layout.params:
                out[s.index] = ParamInfo(index=s.index, name=s.name, shape=tuple(s.shape),
                                         dtype=fg.dtype, group_index=fg.group_index)
        return [out[i] for i in range(len(self.params))]

    def shard_state(self) -> ShardState:
        from fusedzero.state import ShardState
        scaler = None
        if self.scaler is not None:
            sd = self.scaler.state_dict()
            scaler = {"scale": float(sd["scale"].reshape(-1)[0]),
                      "growth_tracker": float(sd["growth_tracker"].reshape(-1)[0])}
        return ShardState(master=[self.master_shard(fg) for fg in self.flat_groups],
                          exp_avg=[fg.exp_avg for fg in self.flat_groups],
                          exp_avg_sq=[fg.exp_avg_sq for fg in self.flat_groups],
                          step_count=float(self._step.reshape(-1)[0]), scaler=scaler)

    def load_shard_state(self, st: ShardState) -> None:
        with torch.no_grad():
            for i, fg in enumerate(self.flat_groups):
                if st.exp_avg is not None:
                    fg.exp_avg.copy_(st.exp_avg[i])
                if st.exp_avg_sq is not None:
                    fg.exp_avg_sq.copy_(st.exp_avg_sq[i])
                if st.master is not None:
                    self.set_master_shard(fg, st.master[i])  # collective at stages 1-3
            if st.step_count is not None:
                self._step.fill_(st.step_count)
            if st.scaler is not None and self.scaler is not None:
                self.scaler.load_state_dict({
                    "scale": torch.tensor([st.scaler["scale"]], dtype=torch.float32),
                    "growth_tracker": torch.tensor([int(st.scaler["growth_tracker"])],
                                                   dtype=torch.int32)})
    # ---- END TEMPORARY SHIM (branch rckpt) -------------------------------------------------


class _NoLocalGrad(torch.Tensor):
    """`p.grad` where this rank holds no full, reduced grad of p (see [Note: user grad
    clipping]): no storage; any op on it raises, saying what to use instead."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like: torch.Tensor, stage: Stage, name: str) -> _NoLocalGrad:
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype,
                                                device=like.device)
        t.why = (f"{name}.grad is not available: ZeroAdamW at stage {int(stage)} keeps grads in "
                 "flat buffers reduced across ranks, and this rank holds only its shard (or a "
                 "copy in the reduce dtype), so a norm or clip computed from .grad (e.g. "
                 "torch.nn.utils.clip_grad_norm_) would be wrong. Clip with "
                 "ZeroAdamW(max_grad_norm=...) and read the global norm from opt.grad_norm")
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        t = next(a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, _NoLocalGrad))
        raise RuntimeError(f"{t.why} (op: {func})")

    def __repr__(self) -> str:
        return f"<no local grad: {self.why}>"


# Attribute a param carries while a live ZeroAdamW owns it: a weak reference to that optimizer.
_OWNER = "_fusedzero_owner"


def _check_not_owned(module: nn.Module | None, params: list[nn.Parameter],
                     names: list[str]) -> None:
    """Two optimizers on one model would both hook every grad and both rewrite the params."""
    tensors = list(zip(params, names))
    if module is not None:
        tensors += list(module.named_parameters())
    for p, n in tensors:
        ref = getattr(p, _OWNER, None)
        owner = ref() if ref is not None else None
        if owner is not None and not owner._closed:
            raise ValueError(f"param {n} already belongs to a live ZeroAdamW (stage "
                             f"{int(owner.stage)}); call close() on that optimizer before "
                             "building another one on the same model")


def _stream_pieces(s: Strided | torch.Tensor, L: FlatLayout) -> list[torch.Tensor]:
    """A shard stream as views, in local-shard order: the whole tensor if it is local, else
    its piece of every bucket."""
    if isinstance(s, torch.Tensor):
        return [s[:L.local_numel]]
    return [s.tensor[k * s.stride + s.base:k * s.stride + s.base + L.shard_numel]
            for k in range(L.num_buckets)]


class _LossScaler:
    """Dynamic (or static) loss scale kept on the device; updated without a host sync."""

    def __init__(self, loss_scale: str | float, device: torch.device, init: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.dynamic = loss_scale == "dynamic"
        if not self.dynamic and not (isinstance(loss_scale, (int, float)) and loss_scale > 0):
            raise ValueError(f"loss_scale must be 'dynamic', a positive number or None, "
                             f"got {loss_scale!r}")
        value = init if self.dynamic else float(loss_scale)
        self.scale = torch.full((1,), value, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval

    def update(self, found_inf: torch.Tensor) -> None:
        if self.dynamic:
            torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf,
                                     self.growth_factor, self.backoff_factor,
                                     self.growth_interval)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.scale.copy_(d["scale"])
        self.growth_tracker.copy_(d["growth_tracker"])


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    lr_v = float(lr) if not isinstance(lr, torch.Tensor) else float(lr.reshape(-1)[0])
    if not lr_v >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2 or not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _trainable(params: Any) -> list[Any]:
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    if isinstance(params[0], dict):
        out = []
        for g in params:
            g = dict(g)
            ps = g["params"]
            g["params"] = [p for p in ([ps] if isinstance(ps, torch.Tensor) else ps)
                           if p.requires_grad]
            out.append(g)
        return out
    return [p for p in params if p.requires_grad]


def _param_names(module: nn.Module | None, params: list[nn.Parameter]) -> list[str]:
    names: dict[int, str] = {}
    if module is not None:
        for n, p in module.named_parameters(remove_duplicate=True):
            names.setdefault(id(p), n)
    out = [names.get(id(p), f"param.{i}") for i, p in enumerate(params)]
    if module is not None:
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise ValueError(f"params at positions {missing} are not parameters of `module`")
    return out
