"""`LocalParam`: a stage-3 param's full shape over the runs of it this rank holds, whose
in-place ops (fills, pointwise ops, `copy_`, random draws) land on those runs only; what
fusedzero/_shard_init.py runs a model's init and `load_state_dict` against (See [Note:
local-shard init] in fusedzero/_shard_init.py). Also the loads that write a rank's runs
directly (`write_runs`).

[Note: init random stream]
A random fill of param `name` draws its element i (of the flattened param) as element
`i % BLOCK` of block `i // BLOCK`, a block being `torch.<op>_` of `min(BLOCK, numel - start)`
fp32 elements (fp64 for fp64 params) on the CPU from a `torch.Generator` seeded with
blake2b(seed, name, draw, block) (64 bits). `seed` is rank 0's `torch.initial_seed()` (what
`torch.manual_seed` set), broadcast once; `draw` counts the random fills of that param so far
(0 for the first). A rank draws the blocks its pieces overlap and keeps its elements, so the
values depend on (seed, name, numel, the init's code) alone: the same at any world size, bucket
size, device or param dtype (drawn in fp32, then cast), and on every replica. They are not the
values an eager build draws from torch's global generator (`FullUnitInit` gives those). A
`generator=` passed to an init op is not used.

[Note: a LocalParam passes for its param]
An init often asks what it was given: `isinstance(m.logit_scale, nn.Parameter)` (transformers'
Aimv2 `_init_weights`), `if p.requires_grad`. The LocalParam standing in for a whole param
answers as the param does: `_is_param = True` (what `nn.Parameter`'s metaclass
`__instancecheck__` honours) and `requires_grad=True` (the init runs under `torch.no_grad()`,
so no graph is recorded). Its views (`w.data`, `w[0]`) are plain tensors, as a param's are.

[Note: init writes the fp32 master]
Where a separate fp32 master exists (bf16 params, `Precision(param_dtype=torch.bfloat16)` with
an fp32 master), an init's writes and arithmetic go to the master's runs, in fp32, and the
param shard is set from it at the end (`param.copy_(master)`), as an eager fp32 build cast to
bf16 would be. Computing in bf16 instead would round each step: timm's `trunc_normal_`
(`uniform_(-1, 1)` in bf16 can give exactly +-1, and `erfinv_(1)` is inf, clamped to +-2)
puts ~0.2% of the weights at +-2. Without a master (the bf16 master modes) the param shard is
written, in its dtype.

[Note: the trunc_normal_ patch is process-wide]
An init reaches `trunc_normal_` by name at call time (`nn.init.trunc_normal_`, transformers'
`TORCH_INIT_FUNCTIONS` table), and torch offers no hook to scope it: `nn.init.trunc_normal_`
does not dispatch `__torch_function__` (unlike `uniform_` or `normal_`), and its rejection loop
(`while mask.any()`) needs the whole tensor, which no LocalParam has. So the names are patched
for the init's duration, process-wide. What that costs another thread, or a module outside the
init, is nothing observable: the patched function hands every tensor that is not a LocalParam to
the function that was there on entry, with the same arguments. Entries nest (a counter) and a
lock orders concurrent ones; the exit restores what the first entry found, not torch's own
function, so a patch someone else made before us survives.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import math
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fusedzero._flat import FlatBuffer

aten = torch.ops.aten

# Elements per random block: a rank draws whole blocks, so this bounds both the scratch (16 KiB
# of fp32) and the elements drawn in excess (< 2 blocks per run of a param this rank holds).
# 4096 keeps a 70B model at W=1024 (69M local elements, 17K blocks) well under a second of
# seeding; torch's vectorised normal_ needs >= 16.
BLOCK = 4096
# A strided view (a column, `w[:, :k]`, `w.t()`) is written run by run, each a Python step; past
# this many runs it is refused (a transposed 8192 x 128256 head is 1G runs of one element).
MAX_RUNS = 1 << 16

_RANDOM = {
    aten.uniform_,
    aten.normal_,
    aten.bernoulli_,
    aten.exponential_,
    aten.log_normal_,
    aten.cauchy_,
    aten.geometric_,
}
_FILL = {aten.fill_, aten.zero_}


@dataclass(slots=True)
class Piece:
    """One run of a param's elements that this rank holds."""

    start: int  # first element within the flattened param
    length: int
    param: torch.Tensor  # the param shard's run (what the next gather reads)
    master: torch.Tensor | None  # the separate fp32 master's run, if there is one
    comp: torch.Tensor | None  # bf16-kahan: the compensation's run


@dataclass(slots=True)
class ParamTarget:
    """Where one sharded param's elements live on this rank."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    pieces: list[Piece] = field(default_factory=list)
    draws: int = 0  # random fills so far (See [Note: init random stream])


@dataclass(slots=True)
class LocalInitStats:
    """What a local init or load did, counted (tests assert them exactly)."""

    seed: int = 0
    blocks_drawn: int = 0
    scratch_peak: int = 0  # most scratch elements alive at once (one random block)
    ops: int = 0  # in-place ops applied


@dataclass(slots=True)
class _Run:
    """The part of a piece a view covers: `piece.param[a:b]`, at `pos` in the view's order."""

    piece: Piece
    a: int
    b: int
    pos: int


@dataclass(slots=True)
class InitContext:
    """What one local init or load shares: its mode, counts and the random block drawn last."""

    load: bool  # copy_ writes master from the source (a load) or the param shard (an init)
    stats: LocalInitStats
    gen: torch.Generator = field(default_factory=torch.Generator)
    last_key: tuple[int, int, int] | None = None  # the random block drawn last, kept
    last_block: torch.Tensor | None = None


def targets_of(buffers: list[FlatBuffer]) -> dict[int, ParamTarget]:
    """id(param) -> its target, for every param of these (stage-3) buffers."""
    out: dict[int, ParamTarget] = {}
    for buf in buffers:
        assert buf.param_shard is not None, "stage-3 buffers only"
        slots = {s.index: (s, p) for s, p in zip(buf.layout.params, buf.params)}
        for s, p in slots.values():
            out[id(p)] = ParamTarget(s.name, torch.Size(s.shape), buf.dtype, buf.device)
        for seg in buf.layout.segments(buf.shard_rank):
            lo, hi = seg.local, seg.local + seg.length
            out[id(slots[seg.param][1])].pieces.append(
                Piece(
                    seg.start,
                    seg.length,
                    buf.param_shard[lo:hi],
                    None if buf.master is None else buf.master[lo:hi],
                    None if buf.comp is None else buf.comp[lo:hi],
                )
            )
    for t in out.values():
        t.pieces.sort(key=lambda p: p.start)  # (`_runs` bisects them)
    return out


class LocalParam(torch.Tensor):
    """A param's full shape over the runs this rank holds (See [Note: local-shard init] in
    fusedzero/_shard_init.py)."""

    _target: ParamTarget
    _geom: torch.Tensor  # meta: this view's size, stride and offset over the flattened param
    _ctx: InitContext

    @staticmethod
    def __new__(
        cls, target: ParamTarget, geom: torch.Tensor, ctx: InitContext, param: bool = False
    ) -> LocalParam:
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            geom.shape,
            strides=geom.stride(),
            storage_offset=geom.storage_offset(),
            dtype=target.dtype,
            device=target.device,
            requires_grad=param,
        )
        t._target, t._geom, t._ctx = target, geom, ctx
        if param:  # See [Note: a LocalParam passes for its param]
            t._is_param = True
        return t

    @staticmethod
    def of(target: ParamTarget, ctx: InitContext) -> LocalParam:
        """The stand-in for a whole param (its views are plain LocalParams)."""
        return LocalParam(target, torch.empty(target.shape, device="meta"), ctx, param=True)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # never dispatched: there are no values to print
        return f"LocalParam({self._target.name}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(
        cls, func: torch._ops.OpOverload, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})


def _unsupported(func: torch._ops.OpOverload, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{func} {what} on a stage-3 param initialised on this rank's elements only; pass "
        "sharding=Sharding(param_init_fn=fusedzero.FullUnitInit(fn)) to build each unit in full "
        "instead"
    )


def _dispatch(func: torch._ops.OpOverload, args: Any, kwargs: dict[str, Any]) -> Any:
    self = args[0]
    if func.is_view and isinstance(self, LocalParam):
        geom = func(self._geom, *args[1:], **kwargs)
        return tree_map(
            lambda m: LocalParam(self._target, m, self._ctx) if isinstance(m, torch.Tensor) else m,
            geom,
        )
    packet = func.overloadpacket
    inplace = (
        isinstance(self, LocalParam)
        and func._schema.name.endswith("_")
        and not any(isinstance(a, LocalParam) for a in list(args[1:]) + list(kwargs.values()))
    )
    if not inplace:
        return _refuse(func, args, kwargs)
    runs = _runs(self, func)
    ctx = self._ctx
    ctx.stats.ops += 1
    if packet in _RANDOM:
        if any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args[1:]):
            raise _unsupported(func, "draws with per-element parameters")
        _random(func, self, runs, args[1:], kwargs)
    elif packet is aten.copy_:
        _copy(self, _bounded(runs, args[1:], self.shape), args[1], ctx.load)
    elif packet in _FILL or torch.Tag.pointwise in func.tags:
        for r in _bounded(runs, args[1:], self.shape):
            rest = [_same_run(a, self, r, func) for a in args[1:]]
            func(_dst(r.piece)[r.a : r.b], *rest, **kwargs)
    else:
        raise _unsupported(func, "is not an element-wise in-place op")
    return self


def _dst(p: Piece) -> torch.Tensor:
    """Where an init writes a piece: See [Note: init writes the fp32 master]."""
    return p.param if p.master is None else p.master


def _refuse(func: torch._ops.OpOverload, args: Any, kwargs: dict[str, Any]) -> Any:
    if func is aten.copy_.default and not isinstance(args[0], LocalParam):
        raise _unsupported(func, "reads a param's values (copy out of it)")
    raise _unsupported(func, "reads a param's values or makes a new tensor of it")


def _runs(view: LocalParam, func: torch._ops.OpOverload) -> list[_Run]:
    """This rank's part of a view, in the view's (row-major) order: the view is cut into runs
    of the param (its innermost dims that are contiguous), each run into the pieces it meets."""
    g = view._geom
    if g.numel() == 0:
        return []
    dims = [(n, st) for n, st in zip(g.shape, g.stride()) if n != 1]
    inner, k = 1, len(dims)
    while k > 0 and dims[k - 1][1] == inner:
        inner *= dims[k - 1][0]
        k -= 1
    outer = dims[:k]
    where = f"a view (shape {tuple(g.shape)}, stride {g.stride()}) of {view._target.name}"
    if any(st == 0 for _, st in outer):
        raise _unsupported(func, f"writes {where} whose elements overlap")
    n_runs = math.prod(n for n, _ in outer)
    if n_runs > MAX_RUNS:
        raise _unsupported(func, f"writes {where} in {n_runs} runs (more than {MAX_RUNS})")
    pieces = view._target.pieces
    first = [p.start for p in pieces]
    out = []
    for j, idx in enumerate(itertools.product(*(range(n) for n, _ in outer))):
        lo = g.storage_offset() + sum(i * st for i, (_, st) in zip(idx, outer))
        hi = lo + inner
        i = max(0, bisect.bisect_right(first, lo) - 1)
        while i < len(pieces) and pieces[i].start < hi:
            p = pieces[i]
            a, b = max(lo, p.start), min(hi, p.start + p.length)
            if a < b:
                out.append(_Run(p, a - p.start, b - p.start, j * inner + a - lo))
            i += 1
    return out


def _same_run(arg: Any, view: LocalParam, r: _Run, func: torch._ops.OpOverload) -> Any:
    """An argument as the run needs it: scalars and 0-dim tensors as they are, a tensor that
    broadcasts to the view as its elements at the run."""
    if not isinstance(arg, torch.Tensor) or arg.dim() == 0:
        return arg.to(view.device) if isinstance(arg, torch.Tensor) else arg
    try:
        torch.broadcast_shapes(arg.shape, view.shape)
    except RuntimeError:
        raise _unsupported(
            func,
            f"takes a tensor of shape {tuple(arg.shape)}, which does not "
            f"broadcast to {tuple(view.shape)}",
        ) from None
    return _elements(arg, view.shape, r.pos, r.b - r.a).to(view.device)


def _elements(t: torch.Tensor, shape: torch.Size, pos: int, n: int) -> torch.Tensor:
    """Elements [pos, pos + n) of `t` broadcast to `shape`, in row-major order, without making
    the broadcast (or a non-contiguous `t`) whole: n indices (`_bounded` keeps n <= BLOCK)."""
    ex = t.detach().expand(shape)
    if ex.is_contiguous():
        return ex.reshape(-1)[pos : pos + n]
    idx = torch.arange(pos, pos + n, device=t.device)
    off = torch.full((n,), ex.storage_offset(), dtype=torch.int64, device=t.device)
    for size, stride in reversed(list(zip(ex.shape, ex.stride()))):
        off += (idx % size) * stride
        idx = idx // size
    return ex.as_strided((ex.untyped_storage().nbytes() // ex.element_size(),), (1,), 0)[off]


def _bounded(runs: list[_Run], args: Any, shape: torch.Size) -> list[_Run]:
    """The runs cut to at most BLOCK elements where an argument is read by gathered indices
    (`_elements`: broadcast or non-contiguous), so its scratch stays one block."""

    def direct(t: Any) -> bool:  # read as a slice, or refused by `_same_run`
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return True
        try:
            return t.expand(shape).is_contiguous()
        except RuntimeError:
            return True

    if all(direct(t) for t in args):
        return runs
    return [
        _Run(r.piece, a, min(a + BLOCK, r.b), r.pos + a - r.a)
        for r in runs
        for a in range(r.a, r.b, BLOCK)
    ]


def _copy(view: LocalParam, runs: list[_Run], src: torch.Tensor, load: bool) -> None:
    for r in runs:
        values = _elements(src, view.shape, r.pos, r.b - r.a)
        if load:
            _load_run(r.piece, r.a, r.b, values)
        else:
            _dst(r.piece)[r.a : r.b].copy_(values)


def _load_run(p: Piece, a: int, b: int, values: torch.Tensor) -> None:
    """Loaded values of `p.param[a:b]`: the master from them, the param as the master's cast,
    the Kahan compensation zero (what `FlatBuffer.write_master` does to a whole buffer)."""
    if p.master is not None:
        p.master[a:b].copy_(values)
        p.param[a:b].copy_(p.master[a:b])
    else:
        p.param[a:b].copy_(values)
    if p.comp is not None:
        p.comp[a:b].zero_()


def write_runs(
    buffers: list[FlatBuffer],
    params: list[nn.Parameter],
    read: Callable[[int, int, int], torch.Tensor],
) -> None:
    """Load every run this rank holds of every param: `read(i, a, b)` gives elements [a, b) of
    the flattened full value of `params[i]`. One run is read (and held) at a time."""
    targets = targets_of(buffers)
    with torch.no_grad():
        for i, p in enumerate(params):
            for piece in targets[id(p)].pieces:
                _load_run(piece, 0, piece.length, read(i, piece.start, piece.start + piece.length))


def block_seed(seed: int, name: str, draw: int, block: int) -> int:
    """The generator seed of one random block (See [Note: init random stream])."""
    h = hashlib.blake2b(struct.pack("<qqq", seed, draw, block) + name.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1  # manual_seed takes up to 2^63 - 1


def _random(
    func: torch._ops.OpOverload,
    view: LocalParam,
    runs: list[_Run],
    rest: Any,
    kwargs: dict[str, Any],
) -> None:
    _draw(view, runs, lambda block, gen: func(block, *rest, **{**kwargs, "generator": gen}))


def _draw(
    view: LocalParam, runs: list[_Run], fill: Callable[[torch.Tensor, torch.Generator], Any]
) -> None:
    """`fill(block, generator)` block by block over the runs (See [Note: init random stream])."""
    t, ctx = view._target, view._ctx
    draw = t.draws
    t.draws += 1
    numel = t.shape.numel()
    dt = torch.float64 if t.dtype == torch.float64 else torch.float32
    for r in runs:
        start = r.piece.start + r.a  # in the flattened param
        end = r.piece.start + r.b
        for k in range(start // BLOCK, (end - 1) // BLOCK + 1):
            b0 = k * BLOCK
            n = min(BLOCK, numel - b0)
            key = (id(t), draw, k)
            if ctx.last_key != key:  # runs of one param in a row often share a block
                ctx.last_block = None  # (freed before the next is made: one block alive)
                ctx.gen.manual_seed(block_seed(ctx.stats.seed, t.name, draw, k))
                ctx.last_block = torch.empty(n, dtype=dt)
                fill(ctx.last_block, ctx.gen)
                ctx.last_key = key
                ctx.stats.blocks_drawn += 1
                ctx.stats.scratch_peak = max(ctx.stats.scratch_peak, n)
            block = ctx.last_block
            assert block is not None
            a, b = max(start, b0), min(end, b0 + n)
            off = r.piece.start
            _dst(r.piece)[a - off : b - off].copy_(block[a - b0 : b - b0])


_TORCH_TRUNC_NORMAL = nn.init.trunc_normal_
# What `nn.init.trunc_normal_` was when the patch went in: non-LocalParam tensors go there.
_entry_trunc_normal: Callable[..., torch.Tensor] = _TORCH_TRUNC_NORMAL


def _trunc_normal_(
    tensor: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`nn.init.trunc_normal_` while a local init runs: torch's samples by rejection over the
    whole tensor (a re-draw of every element while any one is out of range), which no rank can
    follow alone; a LocalParam gets torch's on each random block instead."""
    if not isinstance(tensor, LocalParam):
        return _entry_trunc_normal(tensor, mean, std, a, b, generator=generator)
    tensor._ctx.stats.ops += 1
    _draw(
        tensor,
        _runs(tensor, aten.normal_.default),
        lambda block, gen: _TORCH_TRUNC_NORMAL(block, mean, std, a, b, generator=gen),
    )
    return tensor


_patch_lock = threading.Lock()
_patch_depth = 0
_patched_from: dict[str, Any] = {}


@contextlib.contextmanager
def local_trunc_normal() -> Iterator[None]:
    """`_trunc_normal_` in place of torch's wherever an init finds it: `nn.init`'s attribute,
    and transformers' own reference (`transformers.initialization.TORCH_INIT_FUNCTIONS`, which
    its `trunc_normal_` calls: ViT, DINOv2, Swin, SigLIP), if transformers is imported. See
    [Note: the trunc_normal_ patch is process-wide]."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            _install_trunc_normal()
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                _uninstall_trunc_normal()


def _hf_init_table() -> dict[str, Any] | None:
    hf = sys.modules.get("transformers.initialization")
    table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
    return table if isinstance(table, dict) and "trunc_normal_" in table else None


def _install_trunc_normal() -> None:
    global _entry_trunc_normal
    _patched_from.clear()
    _patched_from["nn.init"] = nn.init.trunc_normal_
    _entry_trunc_normal = nn.init.trunc_normal_
    nn.init.trunc_normal_ = _trunc_normal_
    table = _hf_init_table()
    if table is not None:
        _patched_from["transformers"] = table["trunc_normal_"]
        table["trunc_normal_"] = _trunc_normal_


def _uninstall_trunc_normal() -> None:
    global _entry_trunc_normal
    nn.init.trunc_normal_ = _patched_from.pop("nn.init")
    table = _hf_init_table()
    if table is not None and "transformers" in _patched_from:
        table["trunc_normal_"] = _patched_from.pop("transformers")
    _patched_from.clear()
    _entry_trunc_normal = _TORCH_TRUNC_NORMAL
