"""Stage 3 from the meta device: a model built under `torch.device("meta")` gets real storage
for its params (this rank's shard) and buffers (whole), its own init run on them, and every rank
started from rank 0's values. Called once, by `Zero3.setup`, before any hook exists.

[Note: buffers from the meta device] A model built on the meta device has its buffers there
too (a rotary embedding's `inv_freq`, BatchNorm's running stats). Buffers are not sharded: each
rank holds them in full. `materialize` gives every meta buffer storage on the optimizer's
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from fusedzero import _shard_init as shard_init
from fusedzero._flat import FlatBuffer
from fusedzero._units import FullUnitInit, ParamInitFn, ShardInit

# Overwrite a tensor with group rank 0's value (over every group replicas span).
Broadcast = Callable[[torch.Tensor], None]


class Materialized(NamedTuple):
    """What the init cost: the local-shard init's counts (None where another init ran), and the
    most full-buffer elements alive at once (0 on the local-shard path)."""

    local_stats: shard_init.LocalInitStats | None
    peak_numel: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Init:
    """The model and its units' buffers, as the init sees them."""

    root: nn.Module
    unit_buffers: list[list[FlatBuffer]]
    unit_of_param: dict[int, int]
    broadcast: Broadcast


def materialize(
    root: nn.Module,
    unit_buffers: list[list[FlatBuffer]],
    unit_of_param: dict[int, int],
    broadcast: Broadcast,
    init_fn: ParamInitFn | None,
) -> Materialized:
    """Initialise meta-device params: a `ShardInit` writes each local segment; a plain
    `fn(name, module)` or None (`reset_parameters`) runs on this rank's elements only
    (See [Note: local-shard init] in fusedzero/_shard_init.py). `FullUnitInit` goes module
    by module, in `named_modules()` order (the order an eager build draws its random
    numbers in, so both give the same values). A unit's full buffer lives only while its
    modules are being initialised: the whole model never exists on one rank. Each rank
    computes the same full values and keeps its own shard."""
    ctx = _Init(root, unit_buffers, unit_of_param, broadcast)
    if isinstance(init_fn, ShardInit):
        for bufs in unit_buffers:
            for buf in bufs:
                _init_own_shard(buf, init_fn)
        return Materialized(None, 0)
    given = init_fn  # named by the refusal of a buffer it did not write
    # -- shard_init (the default): the model's own init on this rank's elements --
    all_bufs = [buf for bufs in unit_buffers for buf in bufs]
    made = _real_buffers(ctx.root, all_bufs[0].device if all_bufs else None)
    if init_fn is None or (isinstance(init_fn, FullUnitInit) and init_fn.fn is None):
        _require_reset_parameters(ctx, made)
    # See [Note: a tied param is initialised once].
    later = _later_holders(ctx.root, set(ctx.unit_of_param))
    if not isinstance(init_fn, FullUnitInit) and shard_init.applies(all_bufs):
        stats = shard_init.init_local(root, all_bufs, init_fn, broadcast, made.owners, later)
        _same_buffers(ctx, made, given)
        return Materialized(stats, 0)
    if isinstance(init_fn, FullUnitInit):
        init_fn = init_fn.fn
    # -- end shard_init --
    if init_fn is None:

        def init_fn(name: str, m: nn.Module) -> None:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()

    todo: list[tuple[str, nn.Module, int | None]] = []
    left = [0] * len(unit_buffers)
    live: set[int] = set()  # units whose full buffers are allocated
    peak = 0
    for name, m in ctx.root.named_modules():
        owned = [p for p in m.parameters(recurse=False) if id(p) in ctx.unit_of_param]
        if owned:
            u = ctx.unit_of_param[id(owned[0])]
            todo.append((name, m, u))
            left[u] += 1
        elif id(m) in made.owners:
            todo.append((name, m, None))  # buffers only: in no unit's full buffer
    for name, m, unit in todo:
        if unit is not None and unit not in live:
            for buf in unit_buffers[unit]:
                buf.allocate_full()
                buf.full.zero_()
            live.add(unit)
            peak = max(peak, sum(buf.layout.padded_numel for v in live for buf in unit_buffers[v]))
        with torch.no_grad(), _stand_ins(m, later.get(id(m), [])):
            init_fn(name, m)
        if unit is None:
            continue
        left[unit] -= 1
        if left[unit] == 0:
            for buf in unit_buffers[unit]:
                # Every rank drew its own init: start every replica from rank 0's, as DDP.
                broadcast(buf.full)
                buf.copy_own_shard()
            for buf in unit_buffers[unit]:
                buf.release_full()
            live.discard(unit)
    _same_buffers(ctx, made, given)
    return Materialized(None, peak)


def _require_reset_parameters(ctx: _Init, made: _MetaBuffers) -> None:
    """The default init (`reset_parameters`) reaches every module it has to fill: See
    [Note: the default init needs reset_parameters]."""
    missing = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in ctx.root.named_modules()
        if not hasattr(m, "reset_parameters")
        and (
            id(m) in made.owners
            or any(id(p) in ctx.unit_of_param for p in m.parameters(recurse=False))
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


def _same_buffers(ctx: _Init, made: _MetaBuffers, init_fn: object) -> None:
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
                ctx.broadcast(b)


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
