"""Flat buffers: the params of one (param group, dtype[, stage-3 unit]) and their shard state.

[Note: buffer lifetimes]
- param_flat (stages 0-2): the full param buffer; model params are views into it, so the
  all-gather after the update writes the model's weights in place.
- param_shard / full / param_base (stage 3): this rank's shard of the params, always alive, and
  the gathered buffer, whose storage only lives while the unit is gathered (`fusedzero._zero3`
  decides when; `allocate_full` / `release_full` do it). Two tensor objects share that storage:
  `full` takes the collective's in-place write, `param_base` carries the param views, so the
  write does not bump the version counter of tensors autograd saved in forward. While freed,
  the params hold an empty tensor (a view of a zero-byte storage would still claim its shape,
  and reading it outside a forward read freed memory).
- grad_flat (stages 0-1): the full grad buffer in the reduce dtype. Reduce-scatter is in place:
  afterwards only this rank's pieces hold reduced sums, and the kernel reads them there.
- grad_shard (stages 2-3): the reduced grads of this rank's shard; transient bucket buffers
  (`fusedzero._reduce`) are reduced into it.
- master and the rule's state (`state`, one tensor per `StateField` of the update rule,
  fusedzero/rules): this rank's local shard, contiguous. With fp32 params the master *is* the
  param buffer's own pieces (stages 0-2) or the param shard (stage 3); so it is in the bf16
  master modes (`fusedzero.memory_modes`), where the bf16 params are the master. The master mode
  adds `comp` (bf16-kahan: the bf16 compensation, local shard); the state mode picks the dtypes
  of the rule's fields (and, for int8, the rule's block-scale fields). The optimizer hands these,
  with bf16-sr's `seed` and `sr_offset`, to the rule's launch (`local_shard()`).

[Note: grads as bucket views] `p.grad` is a view of grad_flat, so autograd's
AccumulateGrad adds each new grad in place into the bucket: no per-step grad allocation
and no copy (DDP's gradient_as_bucket_view).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from fusedzero._dtensor import local, set_local
from fusedzero._eager import eager
from fusedzero._layout import FlatLayout, ParamSlot, build_layout, default_bucket_numel
from fusedzero._owner_layout import Block, build_owner_layout
from fusedzero._streams import allocating_stream, free_storage
from fusedzero.kernels import Strided
from fusedzero.memory_modes import MemoryModes
from fusedzero.rules import LocalShard, ShardView, StateField
from fusedzero.stage import Stage


class FlatBuffer:
    """One flat buffer, fully built by its constructor at every stage."""

    def __init__(
        self,
        *,
        group_index: int,
        params: list[nn.Parameter],
        names: list[str],
        indices: list[int],
        dtype: torch.dtype,
        stage: Stage,
        world_size: int,
        rank: int,
        bucket_numel: int | None,
        reduce_dtype: torch.dtype,
        device: torch.device,
        unit: int = 0,
        modes: MemoryModes = MemoryModes(),
        state_fields: tuple[StateField, ...] = (),
        sr_offset: int = 0,
        seed: torch.Tensor | None = None,
        tp_replicated: bool = True,
        blocks: Callable[[tuple[int, ...]], Block] | None = None,
        owner_load: list[int] | None = None,
    ) -> None:
        self.group_index, self.dtype, self.stage, self.unit = group_index, dtype, stage, unit
        # Identical on every tensor-parallel rank (plain params, Replicate DTensors); False:
        # the params are tp shards (fusedzero/_dtensor.py). Each buffer holds one kind.
        self.tp_replicated = tp_replicated
        self.modes = modes
        self.world_size, self.rank = world_size, rank
        # Stage 0 replicates everything: its layout is the world-size-1 layout.
        self.shard_rank = rank if stage.shards_state else 0
        # The default bucket size follows the ranks a bucket's collective spans (all of them,
        # stage 0's all-reduce included), not the layout's shard count.
        if bucket_numel is None:
            bucket_numel = default_bucket_numel(world_size, dtype.itemsize)
        # DTensor params: the layout holds their local (tp-shard) shapes. A per-matrix rule's
        # params (`blocks`: each shape's block) take the owner layout where a shard is less
        # than the buffer (fusedzero/_owner_layout.py); the params follow the layout's order.
        items = [(i, n, tuple(local(p).shape)) for i, n, p in zip(indices, names, params)]
        shards = world_size if stage.shards_state else 1
        self.layout: FlatLayout = (
            build_owner_layout(
                items, [blocks(it[2]) for it in items], shards, owner_load, bucket_numel
            )
            if blocks is not None and shards > 1
            else build_layout(items, shards, bucket_numel)
        )
        where = {i: k for k, i in enumerate(indices)}
        self.params = [params[where[s.index]] for s in self.layout.params]
        self.device = device
        self.reduce_dtype = reduce_dtype
        n_local = self.layout.local_numel
        # The rule's state, by field name. Block-scale fields hold one element per QBLOCK:
        # n_local is a multiple of QBLOCK (every shard piece is a multiple of the layout's
        # ALIGN), so no block straddles two pieces.
        self.state_fields = state_fields
        self.state: dict[str, torch.Tensor] = {
            f.name: torch.zeros(f.numel(n_local), dtype=f.dtype, device=device)
            for f in state_fields
        }
        self.comp = (
            torch.zeros(n_local, dtype=torch.bfloat16, device=device) if modes.kahan else None
        )
        # bf16-sr: where this buffer's elements start in the random stream. Disjoint for every
        # (buffer, rank): the caller passes the padded elements of the buffers before this one,
        # and rank r's local shard takes [r * n_local, (r + 1) * n_local) of this buffer's range.
        self.sr_offset = sr_offset + self.shard_rank * n_local
        # bf16-sr: the run's seed, one device tensor shared by the buffers; the kernel reads it
        # on the device (nothing host-cached that a CUDA graph would bake in).
        self.seed = seed if modes.master == "bf16-sr" else None
        self.master: torch.Tensor | None = None
        self.param_flat: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        # Stage 3: the stream `full`'s storage was last allocated on (None off CUDA); see
        # [Note: freeing on another stream] in _streams.py.
        self.full_stream: torch.cuda.Stream | None = None
        self.param_base: torch.Tensor | None = None
        self.param_views: list[torch.Tensor] = []  # stage 3: each param's view of param_base
        self.param_empty: torch.Tensor | None = None  # stage 3: what params hold while freed
        if stage.shards_params:
            self._build_param_shard()
        else:
            self._build_param_flat()
        self.grad_flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if stage.keeps_full_grads:
            self.grad_flat = torch.zeros(
                self.layout.padded_numel, dtype=reduce_dtype, device=device
            )
        else:
            self.grad_shard = torch.zeros(n_local, dtype=reduce_dtype, device=device)
        self._grad_views = [
            self._full_grad_view(s, p) for s, p in zip(self.layout.params, self.params)
        ]

    # -- construction -------------------------------------------------------------------------
    def _build_param_flat(self) -> None:
        L = self.layout
        self.param_flat = torch.zeros(L.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, slot in zip(self.params, L.params):
                self.param_flat[slot.offset : slot.offset + slot.numel].copy_(
                    local(p).detach().reshape(-1)
                )
        if self._separate_master:
            # From the original values, before the params become (possibly bf16) views.
            self.master = torch.zeros(L.local_numel, dtype=torch.float32, device=self.device)
            self.copy_params_into(self.master)
        for p, slot in zip(self.params, L.params):
            set_local(p, self.param_flat[slot.offset : slot.offset + slot.numel].view(slot.shape))

    @property
    def _separate_master(self) -> bool:
        """An fp32 master apart from the params: bf16/fp16 params with master="fp32"."""
        return self.dtype != torch.float32 and self.modes.fp32_master

    def _build_param_shard(self) -> None:
        """Stage 3: the param shard (and master) from the params' current full values (params
        on the meta device are skipped: `fusedzero._zero3` materialises them), and the gathered
        buffer the params point into while their unit is gathered; released at once."""
        L, dev = self.layout, self.device
        self.param_shard = torch.zeros(L.local_numel, dtype=self.dtype, device=dev)
        self.copy_params_into(self.param_shard)
        if self._separate_master:
            self.master = torch.zeros(L.local_numel, dtype=torch.float32, device=dev)
            self.copy_params_into(self.master)
        self.full = torch.empty(max(L.padded_numel, 1), dtype=self.dtype, device=dev)
        self.full_stream = allocating_stream(self.full)
        base = torch.empty(0, dtype=self.dtype, device=dev)
        base.set_(self.full.untyped_storage(), 0, (self.full.numel(),))
        self.param_base = base
        for p, slot in zip(self.params, L.params):
            view = base[slot.offset : slot.offset + slot.numel].view(slot.shape)
            self.param_views.append(view)
            if p.is_meta:
                # `.data =` cannot move a tensor off the meta device; swapping keeps the Python
                # object (the module, the optimizer and tied modules all hold this one).
                torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))
            else:
                set_local(p, view)
        self.param_empty = torch.empty(0, dtype=self.dtype, device=dev)
        self.release_full()

    def copy_params_into(self, dst: torch.Tensor) -> None:
        """This rank's pieces of the params' current full values into a local-shard tensor,
        segment by segment (cast to dst's dtype). Params still on the meta device are skipped."""
        pos = {s.index: i for i, s in enumerate(self.layout.params)}
        with torch.no_grad():
            for seg in self.layout.segments(self.shard_rank):
                p = self.params[pos[seg.param]]
                if not p.is_meta:
                    dst[seg.local : seg.local + seg.length].copy_(
                        local(p).detach().reshape(-1)[seg.start : seg.start + seg.length]
                    )

    # -- stage 3: the gathered buffer ---------------------------------------------------------
    def allocate_full(self) -> None:
        """Give the gathered buffer its storage and point the params at it (values land when
        the all-gather into `full` is waited on)."""
        assert self.full is not None
        self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
        self.full_stream = allocating_stream(self.full)
        self._point_params(gathered=True)

    def release_full(self) -> None:
        assert self.full is not None
        free_storage(self.full, self.full_stream)
        self._point_params(gathered=False)

    # Never traced: Dynamo would turn `.data =` into a `set_` that bumps the version counter
    # of the views autograd saved in forward (see [Note: stage 3 under torch.compile] in _zero3.py).
    @eager
    def _point_params(self, gathered: bool) -> None:
        """`.data` swaps keep the Parameter objects and autograd's saved leaves; views autograd
        saved in forward keep the storage itself, which the next gather refills."""
        for p, view in zip(self.params, self.param_views):
            set_local(p, view if gathered else self.param_empty)

    def copy_own_shard(self) -> None:
        """param_shard and master from this rank's pieces of the (materialised) full buffer."""
        assert self.full is not None and self.param_shard is not None
        L = self.layout
        with torch.no_grad():
            for k in range(L.num_buckets):
                lo, hi = L.piece(k, self.shard_rank)
                S = L.shard_numel
                self.param_shard[k * S : (k + 1) * S].copy_(self.full[lo:hi])
                if self.master is not None:
                    # From the full-precision init when the params are bf16: the values the
                    # eager build would cast from are gone, so the master starts at the cast.
                    self.master[k * S : (k + 1) * S].copy_(self.full[lo:hi])

    # -- views the kernel and the collectives use ---------------------------------------------
    def own(self, full: torch.Tensor) -> Strided:
        """This rank's pieces of a full bucketed buffer."""
        L = self.layout
        return Strided(full, L.bucket_numel, self.shard_rank * L.shard_numel)

    def master_view(self) -> ShardView:
        """The master the kernel updates: the fp32 master, or the params themselves (fp32
        params, or bf16 params in a bf16 master mode)."""
        if self.master is not None:
            return self.master
        if self.param_shard is not None:
            return self.param_shard
        assert self.param_flat is not None
        return self.own(self.param_flat)

    def out_view(self) -> ShardView | None:
        """Where the kernel writes the params' cast of master (None: the params are master)."""
        if self.master is None:
            return None
        if self.param_shard is not None:
            return self.param_shard
        assert self.param_flat is not None
        return self.own(self.param_flat)

    def grad_view(self) -> ShardView:
        """This rank's reduced grads, as the kernel reads them."""
        if self.grad_shard is not None:
            return self.grad_shard
        assert self.grad_flat is not None
        return self.own(self.grad_flat)

    def pieces(self, view: ShardView) -> list[torch.Tensor]:
        """A shard view as plain tensors in local-shard order: the whole tensor if it is
        local, else its piece of every bucket."""
        L = self.layout
        if isinstance(view, torch.Tensor):
            return [view[: L.local_numel]]
        return [
            view.tensor[k * view.stride + view.base : k * view.stride + view.base + L.shard_numel]
            for k in range(L.num_buckets)
        ]

    def read_master(self) -> torch.Tensor:
        """This rank's master as one local-shard tensor in its own dtype (fp32; bf16 in the
        bf16 master modes), a copy where it is not one."""
        m = self.master_view()
        if isinstance(m, torch.Tensor):
            return m
        pieces = self.pieces(m)
        return torch.cat(pieces) if pieces else m.tensor.new_zeros(0)

    def write_master(self, values: torch.Tensor, comp: torch.Tensor | None = None) -> None:
        """Write this rank's master (cast to its dtype) and the param copy derived from it (not
        gathered); bf16-kahan: the compensation too (None: zero, `values` is the master)."""
        with torch.no_grad():
            for view in (self.master_view(), self.out_view()):
                if view is None:
                    continue
                pieces = self.pieces(view)
                size = max(1, pieces[0].numel()) if pieces else 1
                for dst, src in zip(pieces, values.split(size)):
                    dst.copy_(src)
            if self.comp is not None:
                if comp is None:
                    self.comp.zero_()
                else:
                    self.comp.copy_(comp)

    # -- grads as autograd sees them ----------------------------------------------------------
    def _full_grad_view(self, slot: ParamSlot, p: torch.Tensor) -> torch.Tensor | None:
        # A DTensor param's grad is a DTensor: autograd cannot accumulate it into a plain view.
        usable = self.grad_flat is not None and self.grad_flat.dtype == self.dtype and local(p) is p
        if not usable:
            return None
        assert self.grad_flat is not None
        return self.grad_flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def param_grad_view(self, pos: int) -> torch.Tensor | None:
        """The param's grad as a view of grad_flat, when autograd can accumulate into it
        directly (stages 0-1 with grads reduced in the param dtype), else None. Built once:
        the grad hook compares against it on every backward."""
        return self._grad_views[pos]

    def attach_grad_views(self) -> None:
        """Each param's `.grad` as its bucket view, where it has one: see [Note: grads as
        bucket views]."""
        for pos, p in enumerate(self.params):
            view = self._grad_views[pos]
            if view is not None:
                p.grad = view

    # -- per step ------------------------------------------------------------------------------
    def resident(self) -> tuple[int, int, int]:
        """Bytes of (params, grads, optimizer state) this buffer holds now."""

        def b(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        params = b(self.param_flat) + b(self.param_shard)
        grads = b(self.grad_flat) + b(self.grad_shard)
        opt = b(self.master) + b(self.comp) + sum(b(t) for t in self.state.values())
        return params, grads, opt

    def __getattr__(self, name: str) -> torch.Tensor:
        # The rule's state fields read as attributes (`buf.<field>`); only called when normal
        # lookup fails.
        state = self.__dict__.get("state")
        if state is not None and name in state:
            return state[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def local_shard(self) -> LocalShard:
        """This buffer as a rule's launch sees it (views, built once: see [Note: buffer
        lifetimes])."""
        return LocalShard(
            master=self.master_view(),
            grad=self.grad_view(),
            out=self.out_view(),
            state=self.state,
            num_buckets=self.layout.num_buckets,
            shard_numel=self.layout.shard_numel,
            group_index=self.group_index,
            segments=tuple(self.layout.segments(self.shard_rank)),
            shapes={s.index: s.shape for s in self.layout.params},
            comp=self.comp,
            sr_offset=self.sr_offset,
        )


def build_buffers(
    param_groups: list[dict],
    names: list[str],
    units: list[int],
    *,
    param_dtype: torch.dtype | None,
    stage: Stage,
    world_size: int,
    rank: int,
    bucket_numel: int | None,
    reduce_dtype: torch.dtype,
    device: torch.device,
    modes: MemoryModes = MemoryModes(),
    state_fields: Sequence[tuple[StateField, ...]] = (),
    seed: int = 0,
    tp_replicated: list[bool] | None = None,
    blocks: Sequence[Callable[[tuple[int, ...]], Block] | None] = (),
) -> list[FlatBuffer]:
    """One FlatBuffer per (unit, param group, dtype, tp-replicated), in that order (dtypes and
    tp kinds in order of first appearance). `units[i]` is the stage-3 unit of the i-th param
    (all 0 below stage 3); `tp_replicated[i]` whether it is the same on every tensor-parallel
    rank (default: all, a plain model). `state_fields[gi]`: the per-element state group gi's
    update rule keeps in `modes` (fusedzero/rules; none where not given). `seed`: bf16-sr's
    random stream, one device tensor for all buffers. `blocks[gi]`: group gi's per-matrix
    rule's blocks (None, or not given: an element-wise rule)."""
    seed_t = torch.tensor([seed], dtype=torch.int64, device=device)
    # The owner layouts' per-rank cost, carried from buffer to buffer (see build_owner_layout).
    owner_load = [0] * world_size
    by_key: dict[tuple[int, int, torch.dtype, bool], list[tuple[int, nn.Parameter]]] = {}
    index = 0
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            rep = True if tp_replicated is None else tp_replicated[index]
            by_key.setdefault((units[index], gi, param_dtype or p.dtype, rep), []).append(
                (index, p)
            )
            index += 1
    keys: Iterable[tuple[int, int, torch.dtype, bool]] = sorted(by_key, key=lambda k: (k[0], k[1]))
    out: list[FlatBuffer] = []
    for u, gi, dt, rep in keys:
        items = by_key[(u, gi, dt, rep)]
        out.append(
            FlatBuffer(
                group_index=gi,
                params=[p for _, p in items],
                names=[names[i] for i, _ in items],
                indices=[i for i, _ in items],
                dtype=dt,
                stage=stage,
                world_size=world_size,
                rank=rank,
                bucket_numel=bucket_numel,
                reduce_dtype=reduce_dtype,
                device=device,
                unit=u,
                modes=modes,
                state_fields=state_fields[gi] if gi < len(state_fields) else (),
                seed=seed_t,
                tp_replicated=rep,
                sr_offset=_sr_offset(out, rep),
                blocks=blocks[gi] if gi < len(blocks) else None,
                owner_load=owner_load,
            )
        )
    return out


# bf16-sr: where the random streams of tp-shard buffers start, past any replicated ones (2^48
# elements: no model comes near; the stream index is 64-bit).
_TP_SHARD_STREAM = 1 << 48


def _sr_offset(before: list[FlatBuffer], tp_replicated: bool) -> int:
    """bf16-sr: a buffer's stream starts after those of the buffers of its tp kind built
    before it. A replicated buffer's offset counts replicated buffers only, which have the same
    layout on every tp rank, so its random bits (and values) are the same on every tp rank."""
    same = sum(b.layout.padded_numel for b in before if b.tp_replicated == tp_replicated)
    return same if tp_replicated else _TP_SHARD_STREAM + same


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


def memory_report(buffers: Iterable[FlatBuffer]) -> MemoryReport:
    params = grads = opt = pad = elems = 0
    for buf in buffers:
        a, b, c = buf.resident()
        params, grads, opt = params + a, grads + b, opt + c
        pad += buf.layout.padded_numel - buf.layout.param_numel
        # From the layout: stage-3 params are empty tensors while their unit is freed.
        elems += buf.layout.param_numel
    return MemoryReport(params, grads, opt, pad, elems)
