"""What the step bench counts inside a rank: bytes of every torch.distributed collective called
from Python (by kind, with the dtypes seen), resident tensor bytes reachable from a system's
objects, RSS. See [Note: what is counted] in bench_step.py."""

from __future__ import annotations

import functools
import gc
import resource
import types
from typing import Any

import torch
import torch.distributed as dist

# -- counting collectives -----------------------------------------------------------------------
_COUNT: dict[str, int] = {}
# Counting runs in the warm-up steps only: timed steps pay one flag test per collective, not the
# argument binding (which would bill the peers, counted this way, for our bookkeeping).
COUNTING = [True]
# collective kind -> dtypes of the tensors it was called with (which dtype a system reduces in)
DTYPES: dict[str, set[str]] = {}
# function name -> (kind, how to get the full element count from the bound arguments)
_WRAPPED = {
    "all_reduce": ("all_reduce", lambda a: _numel(a["tensor"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _numel(a["input"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _numel(a["input"])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: _numel(a["input"])),
    "reduce_scatter": ("reduce_scatter", lambda a: sum(_numel(t) for t in a["input_list"])),
    "all_gather_into_tensor": ("all_gather", lambda a: _numel(a["output_tensor"])),
    "all_gather_single": ("all_gather", lambda a: _numel(a["output_tensor"])),
    "_all_gather_base": ("all_gather", lambda a: _numel(a["output_tensor"])),
    "all_gather": ("all_gather", lambda a: sum(_numel(t) for t in a["tensor_list"])),
    "broadcast": ("broadcast", lambda a: _numel(a["tensor"])),
    "reduce": ("reduce", lambda a: _numel(a["tensor"])),
    "all_to_all_single": ("all_to_all", lambda a: _numel(a["input"])),
    "all_gather_into_tensor_coalesced": (
        "all_gather",
        lambda a: sum(_numel(t) for t in a["output_tensors"]),
    ),
    "reduce_scatter_tensor_coalesced": (
        "reduce_scatter",
        lambda a: sum(_numel(t) for t in a["inputs"]),
    ),
    "all_reduce_coalesced": ("all_reduce", lambda a: sum(_numel(t) for t in a["tensors"])),
}


def _numel(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # bytes, despite the name: n*b of the ring formulas


def _dtypes(bound: dict[str, Any]) -> set[str]:
    out = set()
    for v in bound.values():
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, torch.Tensor):
                out.add(str(t.dtype).removeprefix("torch."))
    return out


def counted() -> dict[str, int]:
    return dict(_COUNT)


def dtypes_seen() -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in DTYPES.items()}


def reset_counts() -> None:
    _COUNT.clear()
    DTYPES.clear()


def install_counters(world: int) -> None:
    import inspect

    for fname, (kind, nbytes) in _WRAPPED.items():
        fn = getattr(dist, fname, None)
        if fn is None or getattr(fn, "_bench_wrapped", False):
            continue
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(
            *args: Any, __fn=fn, __sig=sig, __kind=kind, __nbytes=nbytes, **kwargs: Any
        ) -> Any:
            if not COUNTING[0]:
                return __fn(*args, **kwargs)
            try:
                b = __sig.bind(*args, **kwargs).arguments
                n = __nbytes(b)
                factor = 2 if __kind == "all_reduce" else 1
                DTYPES.setdefault(__kind, set()).update(_dtypes(b))
                _COUNT[__kind] = _COUNT.get(__kind, 0) + factor * (world - 1) * n // world
            except Exception:  # noqa: BLE001 - counting must never break the collective
                _COUNT["uncounted_calls"] = _COUNT.get("uncounted_calls", 0) + 1
            return __fn(*args, **kwargs)

        wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        setattr(dist, fname, wrapper)


# -- counting resident tensors ------------------------------------------------------------------
_SKIP = (
    types.ModuleType,
    type,
    str,
    bytes,
    int,
    float,
    bool,
    types.CodeType,
    types.BuiltinFunctionType,
)


def reachable_tensor_bytes(roots: list[Any], limit: int = 3_000_000) -> tuple[int, int]:
    """Bytes of distinct storages of tensors reachable from `roots`, and the objects visited.

    Walks Python references (gc.get_referents), not module globals: functions contribute their
    closures and defaults only, so the walk stays inside the system's own objects.
    """
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if isinstance(o, DTensor):
                stack.append(o._local_tensor)
            elif o.device.type != "meta":
                try:
                    st = o.untyped_storage()
                    if st.data_ptr() != 0:
                        storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
                except (RuntimeError, NotImplementedError):
                    pass
            if o.grad is not None:
                stack.append(o.grad)
            if hasattr(o, "__dict__"):
                stack.extend(vars(o).values())
            continue
        if isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in (o.__closure__ or ()) if _cell_ok(c))
            stack.extend(o.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(o))
    return sum(storages.values()), len(seen)


def _cell_ok(c: Any) -> bool:
    try:
        c.cell_contents  # noqa: B018
        return True
    except ValueError:  # empty cell
        return False


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def storage_bytes(ts: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in ts:
        st = t.untyped_storage()
        if st.data_ptr():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
