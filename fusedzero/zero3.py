"""ZeRO-3: params sharded per unit, gathered just in time, prefetched, freed after use.

A *unit* is a module chosen by the wrapping policy (default: every child of an nn.ModuleList, i.e.
each transformer block); params in no unit, and params shared by two units (tied weights), belong
to the root unit (the whole model). Each unit's params form their own flat buffers, so a unit is
gathered by one all-gather per bucket.

[Note: buffer lifetimes]
- param_shard / master / exp_avg / exp_avg_sq / grad_shard: this rank's local shard, always alive.
- full (per flat buffer): the gathered params. Its storage is allocated by `gather` and released
  by `free` (`untyped_storage().resize_(0)`). Two tensor objects share that storage: `full` takes
  the collective's in-place write, `param_base` carries the param views, so the write does not
  bump the version counter of tensors that autograd saved in forward.
- The model's params hold their view of `param_base` only while the unit is gathered; `free`
  swaps in a zero-element tensor (`.data`, as FSDP1 does). A view of a zero-byte storage still
  claims its full shape, so `print(p)`, `p.norm()` or `p.fill_()` outside a forward read or wrote
  freed memory (a segfault); an empty param is safe and visibly not the value. Read full values
  inside `opt.gathered_params()`, or through `model.state_dict()` (gathered on demand, copied).
- Forward: the pre-hook gathers unit u (waiting on its prefetch) and issues unit u+1's gather;
  the post-hook frees u (reshard_after_forward=True) unless it runs as a recomputation inside
  backward (activation checkpointing).
- Backward: a hook on the unit's outputs re-gathers u before its backward runs and prefetches the
  unit before it; when every param of u has its grad, u's buckets are reduce-scattered (by the
  optimizer) and u is freed. Whatever is still gathered at the end of backward is freed.
"""
from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fusedzero import comm

if TYPE_CHECKING:
    from fusedzero.optim import FlatGroup, ZeroAdamW


class UnitState(enum.Enum):
    FREE = 0
    GATHERING = 1
    GATHERED = 2


def default_policy(root: nn.Module) -> list[nn.Module]:
    """Every child of an nn.ModuleList (transformer blocks, in the usual model layout)."""
    return [m for mod in root.modules() if isinstance(mod, nn.ModuleList) for m in mod]


def select_units(root: nn.Module, policy: Any) -> list[nn.Module]:
    """Units in forward (registration) order, from a policy: None (default), a module class or
    tuple of classes, a callable(module) -> bool, or an int (modules with at least that many
    param elements of their own subtree, innermost first)."""
    if policy is None:
        units = default_policy(root)
    elif isinstance(policy, type) or (isinstance(policy, tuple)
                                      and all(isinstance(c, type) for c in policy)):
        units = [m for m in root.modules() if isinstance(m, policy) and m is not root]
    elif isinstance(policy, int):
        units = []
        claimed: set[int] = set()
        for m in reversed(list(root.modules())):
            if m is root:
                continue
            own = [p for p in m.parameters() if id(p) not in claimed]
            if sum(p.numel() for p in own) >= policy:
                units.append(m)
                claimed.update(id(p) for p in own)
        order = {id(m): i for i, m in enumerate(root.modules())}
        units.sort(key=lambda m: order[id(m)])
    elif callable(policy):
        units = [m for m in root.modules() if m is not root and policy(m)]
    else:
        raise TypeError(f"unit_policy must be None, a module class, a tuple of classes, a "
                        f"callable or an int, got {policy!r}")
    # Nested units: keep the outermost (a param belongs to one unit).
    out: list[nn.Module] = []
    for m in units:
        if not any(m is not o and any(m is x for x in o.modules()) for o in units):
            out.append(m)
    return out


class Zero3:
    """The per-unit gather/free machinery of one ZeroAdamW at stage 3."""

    def __init__(self, opt: ZeroAdamW, root: nn.Module, policy: Any,
                 reshard_after_forward: bool) -> None:
        self.opt = opt
        self.root = root
        self.reshard_after_forward = reshard_after_forward
        self.modules: list[nn.Module] = [root] + select_units(root, policy)
        n = len(self.modules)
        self.fgs: list[list[FlatGroup]] = [[] for _ in range(n)]
        self.state = [UnitState.FREE] * n
        self.handles: list[list[Any]] = [[] for _ in range(n)]
        self.pending = [0] * n
        self.n_trainable = [0] * n
        self.gathered_now = 0
        self.max_gathered = 0  # units gathered at once, the root excluded
        self.max_gathered_with_root = 0
        self.materialize_peak = 0  # most full-buffer elements alive during meta-device init
        self._hooks: list[Any] = []
        self.unit_of_param: dict[int, int] = {}

    # -- construction -------------------------------------------------------------------------
    def assign(self, params: list[nn.Parameter]) -> list[int]:
        owner: dict[int, int] = {}
        for u, m in enumerate(self.modules[1:], start=1):
            for p in m.parameters():
                if id(p) in owner and owner[id(p)] != u:
                    owner[id(p)] = 0  # shared by two units: the root holds it
                else:
                    owner.setdefault(id(p), u)
        units = [owner.get(id(p), 0) for p in params]
        for p, u in zip(params, units):
            self.unit_of_param[id(p)] = u
            self.n_trainable[u] += 1
        return units

    def setup(self, fgs: list[FlatGroup], param_init_fn: Any) -> None:
        """Fill the shards from the params' current values (or, for params on the meta device,
        initialise them unit by unit), point params at the gathered buffer, release it, and
        install the hooks."""
        meta = any(p.is_meta for fg in fgs for p in fg.params)
        for fg in fgs:
            self.fgs[fg.unit].append(fg)
            _init_flat_group(fg)
        if meta:
            self._materialize(param_init_fn)
        for u, m in enumerate(self.modules):
            if not self.fgs[u]:
                continue
            self._hooks.append(m.register_forward_pre_hook(self._make_pre_forward(u)))
            self._hooks.append(m.register_forward_hook(self._make_post_forward(u)))
        # `model.state_dict()` gathers what is free, copies the full values, frees again (FSDP's
        # full state dict): a collective, so every rank calls it. Without this it held the
        # empty params, and torch.save wrote tensors that cannot be loaded back.
        self._sd_freed: list[list[int]] = []
        # (Plain functions: torch tags the hook with an attribute, which a bound method refuses.)
        self._hooks.append(self.root.register_state_dict_pre_hook(
            lambda *a: self._state_dict_pre(*a)))
        self._hooks.append(self.root.register_state_dict_post_hook(
            lambda *a: self._state_dict_post(*a)))
        self.pending = list(self.n_trainable)

    def _materialize(self, init_fn: Any) -> None:
        """Initialise meta-device params module by module, in `named_modules()` order (the order
        an eager build draws its random numbers in, so both give the same values). A unit's
        full buffer lives only while its modules are being initialised: the whole model never
        exists on one rank. Each rank computes the same full values and keeps its own shard."""
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
                for fg in self.fgs[u]:
                    st = fg.full.untyped_storage()
                    st.resize_(fg.layout.padded_numel * fg.full.element_size())
                    fg.full.zero_()
                    _point_params(fg, gathered=True)
                self.state[u] = UnitState.GATHERED
                self.materialize_peak = max(self.materialize_peak, sum(
                    fg.layout.padded_numel for v in range(len(self.modules))
                    if self.state[v] != UnitState.FREE for fg in self.fgs[v]))
            with torch.no_grad():
                init_fn(name, m)
            left[u] -= 1
            if left[u] == 0:
                for fg in self.fgs[u]:
                    # Every rank drew its own init: start every replica from rank 0's, as DDP.
                    self.opt.broadcast_from_rank0(fg.full)
                    _copy_own_shard(fg)
                for fg in self.fgs[u]:
                    fg.full.untyped_storage().resize_(0)
                    _point_params(fg, gathered=False)
                self.state[u] = UnitState.FREE

    # -- gather / free --------------------------------------------------------------------------
    def gather(self, u: int) -> None:
        """Issue unit u's all-gather (async); no-op if it is gathered or on its way."""
        if self.state[u] != UnitState.FREE or not self.fgs[u]:
            return
        opt = self.opt
        if opt.trace is not None:
            opt.trace.append(("gather", u))
        for fg in self.fgs[u]:
            L = fg.layout
            fg.full.untyped_storage().resize_(L.padded_numel * fg.full.element_size())
            _point_params(fg, gathered=True)  # values land when the handles are waited on
            for k in range(L.num_buckets):
                lo, hi = L.bucket_range(k)
                S = L.shard_numel
                h = comm.all_gather(fg.full[lo:hi], fg.param_shard[k * S:(k + 1) * S],
                                    opt.process_group, opt.world_size, opt.comm)
                self.handles[u].append(h)
        self.state[u] = UnitState.GATHERING
        if u != 0:
            self.gathered_now += 1
            self.max_gathered = max(self.max_gathered, self.gathered_now)
        live = self.gathered_now + (self.state[0] != UnitState.FREE)
        self.max_gathered_with_root = max(self.max_gathered_with_root, live)

    def wait(self, u: int) -> None:
        self.gather(u)
        if self.state[u] == UnitState.GATHERING:
            for h in self.handles[u]:
                comm.wait(h, what=f"all-gather of unit {u} params (stage 3)",
                          group=self.opt.process_group)
            self.handles[u].clear()
            self.state[u] = UnitState.GATHERED

    def free(self, u: int) -> None:
        if self.state[u] == UnitState.FREE:
            return
        for h in self.handles[u]:  # never release memory a collective is still writing
            comm.wait(h, what=f"all-gather of unit {u} params (stage 3)",
                      group=self.opt.process_group)
        self.handles[u].clear()
        for fg in self.fgs[u]:
            fg.full.untyped_storage().resize_(0)
            _point_params(fg, gathered=False)
        self.state[u] = UnitState.FREE
        if u != 0:
            self.gathered_now -= 1
        if self.opt.trace is not None:
            self.opt.trace.append(("free", u))

    def free_all(self) -> None:
        for u in range(len(self.modules)):
            self.free(u)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """All params gathered (e.g. to read or export the full model); freed on exit."""
        for u in range(len(self.modules)):
            self.wait(u)
        try:
            yield
        finally:
            self.free_all()

    # -- state dict -------------------------------------------------------------------------------
    def _state_dict_pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        free = [u for u in range(len(self.modules)) if self.state[u] == UnitState.FREE]
        self._sd_freed.append(free)
        for u in range(len(self.modules)):
            self.wait(u)

    def _state_dict_post(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: dict[str, Any]) -> None:
        storages = {fg.full.untyped_storage().data_ptr() for fgs in self.fgs for fg in fgs
                    if fg.full is not None and fg.full.untyped_storage().nbytes()}
        for k, v in state_dict.items():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in storages:
                # A copy: the gathered storage is freed below (and rewritten by every step).
                state_dict[k] = v.detach().clone()
        for u in self._sd_freed.pop():
            self.free(u)

    # -- hooks ------------------------------------------------------------------------------------
    def _next_unit(self, u: int, step: int) -> int | None:
        v = u + step
        return v if 1 <= v < len(self.modules) else None

    def _make_pre_forward(self, u: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.wait(u)
            nxt = self._next_unit(u, +1) if u else self._next_unit(0, +1)
            if nxt is not None and not _in_backward():
                self.gather(nxt)  # prefetch: overlaps this unit's compute
        return hook

    def _make_post_forward(self, u: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.opt.trace is not None:
                self.opt.trace.append(("forward_end", u))
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if torch.is_grad_enabled() and tensors:
                # Re-gather before this unit's backward: the grad of its output arrives first.
                for t in tensors:
                    t.register_hook(self._make_pre_backward(u))
            if self.reshard_after_forward and not _in_backward():
                self.free(u)
            return None
        return hook

    def _make_pre_backward(self, u: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.pending[u] == 0:
                return  # this unit's grads are already complete for this backward
            self.wait(u)
            prev = self._next_unit(u, -1) if u else self._next_unit(len(self.modules), -1)
            if prev is not None:
                self.gather(prev)
        return hook

    def grad_ready(self, u: int) -> None:
        self.pending[u] -= 1
        if self.pending[u] == 0:
            self.free(u)

    def end_backward(self) -> None:
        self.free_all()
        self.pending = list(self.n_trainable)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _init_flat_group(fg: FlatGroup) -> None:
    """Shard state of a stage-3 flat buffer, filled from the params' current full values."""
    L = fg.layout
    n_local = L.local_numel
    dev = fg.device
    fg.param_shard = torch.zeros(n_local, dtype=fg.dtype, device=dev)
    if fg.dtype != torch.float32:
        fg.master = torch.zeros(n_local, dtype=torch.float32, device=dev)
    fg.grad_shard = torch.zeros(n_local, dtype=fg.reduce_dtype, device=dev)
    # Meta-device params are skipped here and filled by Zero3._materialize.
    fg.copy_params_into(fg.param_shard)
    if fg.master is not None:
        fg.copy_params_into(fg.master)
    fg.full = torch.empty(max(L.padded_numel, 1), dtype=fg.dtype, device=dev)
    base = torch.empty(0, dtype=fg.dtype, device=dev)
    base.set_(fg.full.untyped_storage(), 0, (fg.full.numel(),))
    fg.param_base = base
    fg.param_views = []
    for p, slot in zip(fg.params, L.params):
        view = base[slot.offset:slot.offset + slot.numel].view(slot.shape)
        fg.param_views.append(view)
        if p.is_meta:
            # `.data =` cannot move a tensor off the meta device; swapping keeps the Python
            # object (the module, the optimizer and tied modules all hold this one).
            torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))
        else:
            p.data = view
    fg.param_empty = torch.empty(0, dtype=fg.dtype, device=dev)
    fg.full.untyped_storage().resize_(0)
    _point_params(fg, gathered=False)


def _point_params(fg: FlatGroup, gathered: bool) -> None:
    """The params as views of the gathered buffer, or empty while it is freed (see the note on
    buffer lifetimes). `.data` swaps keep the Parameter objects and autograd's saved leaves; views
    autograd saved in forward keep the storage itself, which `gather` refills."""
    for p, view in zip(fg.params, fg.param_views):
        p.data = view if gathered else fg.param_empty


def _copy_own_shard(fg: FlatGroup) -> None:
    """param_shard and master from this rank's pieces of the (materialised) full buffer."""
    L = fg.layout
    with torch.no_grad():
        for k in range(L.num_buckets):
            lo, hi = L.piece(k, fg.shard_rank)
            S = L.shard_numel
            fg.param_shard[k * S:(k + 1) * S].copy_(fg.full[lo:hi])
            if fg.master is not None:
                # From the full-precision init when the params are bf16: the values the
                # eager build would cast from are gone, so the master starts at the cast.
                fg.master[k * S:(k + 1) * S].copy_(fg.full[lo:hi])


def build_zero3(opt: ZeroAdamW, module: nn.Module, policy: Any,
                reshard_after_forward: bool, param_init_fn: Any = None) -> list[FlatGroup]:
    from fusedzero.optim import FlatGroup

    z = Zero3(opt, module, policy, reshard_after_forward)
    opt._zero3 = z
    units = z.assign(opt.params)
    fgs: list[FlatGroup] = []
    index = 0
    by_key: dict[tuple[int, int, torch.dtype], list[int]] = {}
    for gi, g in enumerate(opt.param_groups):
        for _ in g["params"]:
            p = opt.params[index]
            dt = opt.param_dtype or p.dtype
            by_key.setdefault((units[index], gi, dt), []).append(index)
            index += 1
    for (u, gi, dt), idx in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        fgs.append(FlatGroup(
            group_index=gi, params=[opt.params[i] for i in idx],
            names=[opt.param_names[i] for i in idx], indices=idx, dtype=dt,
            stage=opt.stage, world_size=opt.world_size, rank=opt.rank,
            bucket_numel=opt.bucket_numel, reduce_dtype=opt.reduce_dtype, device=opt.device,
            unit=u))
    z.setup(fgs, param_init_fn)
    return fgs
