"""Checks at the optimizer's boundary: hyper-parameters, params, and the model they belong to.
Each error names the offending value and the fix."""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusedzero._dtypes import FLOAT_DTYPES
from fusedzero.memory_modes import MemoryModes, check_param_dtype
from fusedzero.stage import Stage

# Attribute a param carries while a live ZeroAdamW owns it: a weak reference to that optimizer.
OWNER_ATTR = "_fusedzero_owner"


# The update runs in fp32 (lr an fp32 tensor, eps and weight decay in the kernel's fp32 rows of
# hyper-parameters): a value above fp32's largest is inf there, and an eps below its smallest
# normal is 0 or a denormal (which fast-math GPU code may flush to 0).
_FP32 = torch.finfo(torch.float32)


def check_stage(stage: Any, where: str = "ZeroAdamW") -> Stage:
    """`stage` as a `Stage`: an int 0-3 or a Stage. A bool or float is refused even where
    `Stage(...)` would take it (True == 1, 2.0 == 2): a flag or a computed number passed as the
    stage is a mistake to name, not a stage to guess."""
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(
            f"{where}(stage={stage!r}): expected an int 0, 1, 2 or 3 (a fusedzero.Stage)"
        )
    try:
        return Stage(stage)
    except ValueError:
        raise ValueError(f"{where}(stage={stage!r}): expected 0, 1, 2 or 3") from None


def check_max_grad_norm(value: Any, where: str = "ZeroAdamW") -> None:
    """None (no clipping) or a positive number finite in fp32 (the clip runs in fp32)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}(max_grad_norm={value!r}): expected a positive number or None (no clipping)"
        )
    if not 0.0 < value <= _FP32.max:
        raise ValueError(
            f"{where}(max_grad_norm={value!r}): expected a positive number finite in fp32 "
            f"(at most {_FP32.max:.4g}) or None (no clipping)"
        )


def check_module(module: Any) -> None:
    """`module=` is the model (an nn.Module) or None."""
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(
            f"ZeroAdamW(module={type(module).__name__} object): expected the model "
            "(a torch.nn.Module) or None"
        )


def trainable(params: Any) -> list[Any]:
    """Params or param-group dicts with frozen params left out."""
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    if isinstance(params[0], dict):
        out = []
        for g in params:
            g = dict(g)
            ps = g["params"]
            g["params"] = [
                p for p in ([ps] if isinstance(ps, torch.Tensor) else ps) if p.requires_grad
            ]
            out.append(g)
        return out
    return [p for p in params if p.requires_grad]


def check_groups(
    param_groups: list[dict[str, Any]], check_group: Callable[[dict[str, Any]], None]
) -> list[nn.Parameter]:
    """Every group's hyper-parameters by the rule's `check_group`, every param once; returns
    them in optimizer order."""
    for g in param_groups:
        check_group(g)
    for gi, g in enumerate(param_groups):
        if len({id(p) for p in g["params"]}) != len(g["params"]):
            raise ValueError(f"param group {gi} lists a parameter twice; list each parameter once")
    all_params = [p for g in param_groups for p in g["params"]]
    if len({id(p) for p in all_params}) != len(all_params):
        raise ValueError("a parameter appears in more than one param group")
    return all_params


def indexed_device(device: torch.device | str) -> torch.device:
    """`device` with its index: an accelerator named without one ("cuda") is the current device
    of its type, where torch puts a tensor created on it, and every tensor reports its device
    with that index ("cuda:0"); cpu and meta stay as they are (their tensors carry no index).
    Every device the optimizer holds or compares goes through here once, at construction."""
    d = torch.device(device)
    if d.index is not None or d.type in ("cpu", "meta"):
        return d
    current = getattr(getattr(torch, d.type, None), "current_device", None)
    if current is None:
        raise ValueError(
            f"device {d} has no index and torch.{d.type}.current_device() does not "
            f"exist to choose one; pass an indexed device, e.g. '{d.type}:0'"
        )
    return torch.device(d.type, current())


def resolve_device(
    params: list[nn.Parameter],
    module: nn.Module | None,
    shards_params: bool,
    device: torch.device | str | None,
) -> torch.device:
    """The one device of the params, indexed; for params on the meta device (stage 3 only),
    where they are materialised: `device`, else the current CUDA device if there is one."""
    devices = {indexed_device(p.device) for p in params}
    if len(devices) > 1:
        raise ValueError(f"all params must be on one device, got {sorted(map(str, devices))}")
    found = devices.pop() if devices else torch.device("cpu")
    if found.type == "meta":
        if device is not None and torch.device(device).type == "meta":
            return torch.device("meta")  # a dry build: shapes and byte counts, no storage
        if not shards_params:
            raise ValueError(
                "params on the meta device need stage=3, which materialises "
                "them unit by unit; other stages hold the full model anyway"
            )
        if module is not None and any(
            p.is_meta for p in module.parameters() if not p.requires_grad
        ):
            raise ValueError(
                "frozen params on the meta device are not supported: "
                "materialise them before building the optimizer"
            )
        return indexed_device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
    if device is not None and indexed_device(device) != found:
        raise ValueError(
            f"device={device} (that is {indexed_device(device)}) but the params "
            f"are on {found}; pass device={str(found)!r} or leave it out"
        )
    return found


def check_params(module: nn.Module | None, params: list[nn.Parameter], names: list[str]) -> None:
    for p, n in zip(params, names):
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"param {n} has layout {p.layout}; only dense params are supported")
        if p.dtype not in FLOAT_DTYPES:
            raise ValueError(f"param {n} has dtype {p.dtype}; expected one of {FLOAT_DTYPES}")
    if module is not None:
        for n, m in module.named_modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                raise ValueError(
                    f"module {n or type(m).__name__} has sparse=True: sparse "
                    "gradients are not supported; build it with sparse=False"
                )


def check_modes(
    modes: MemoryModes,
    params: list[nn.Parameter],
    names: list[str],
    param_dtype: torch.dtype | None,
) -> None:
    """bf16 master modes need bf16 params: with `param_dtype` given, that; else every param."""
    if param_dtype is not None:
        check_param_dtype(modes, param_dtype, "param_dtype")
        return
    for p, n in zip(params, names):
        check_param_dtype(modes, p.dtype, f"param {n}'s dtype")


def check_not_owned(module: nn.Module | None, params: list[nn.Parameter], names: list[str]) -> None:
    """Two optimizers on one model would both hook every grad and both rewrite the params."""
    tensors = list(zip(params, names))
    if module is not None:
        tensors += list(module.named_parameters())
    for p, n in tensors:
        ref = getattr(p, OWNER_ATTR, None)
        owner = ref() if ref is not None else None
        if owner is not None and not owner.closed:
            raise ValueError(
                f"param {n} already belongs to a live ZeroAdamW (stage "
                f"{int(owner.stage)}); call close() on that optimizer before "
                "building another one on the same model"
            )


def param_names(module: nn.Module | None, params: list[nn.Parameter]) -> list[str]:
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


def check_not_frozen(params: list[nn.Parameter], names: list[str]) -> None:
    """A param frozen after construction still sits in a flat buffer the fused kernel
    updates as a whole: momentum and weight decay would keep moving it. Refuse, naming it
    (a Python attribute read per param: no host sync)."""
    frozen = [n for n, p in zip(names, params) if not p.requires_grad]
    if frozen:
        raise RuntimeError(
            f"params {frozen} were set requires_grad=False after ZeroAdamW was built; the "
            "fused update would keep moving them (momentum, weight decay). Freeze params "
            "before building the optimizer (frozen params are left out), or unfreeze them; "
            "to change the set mid-run: checkpoint.save, close(), build a new ZeroAdamW"
        )


def replicated(params: list[nn.Parameter], module: nn.Module | None) -> list[torch.Tensor]:
    """Every tensor replicas must agree on, once each: the optimizer's params, and the module's
    params (frozen ones too) and buffers."""
    out = list(params)
    if module is not None:
        out += list(module.parameters()) + list(module.buffers())
    return list({id(t): t for t in out}.values())


def claim(owner: object, tensors: list[torch.Tensor]) -> None:
    """Mark `tensors` as owned by the live optimizer `owner` (see `check_not_owned`)."""
    for t in tensors:
        setattr(t, OWNER_ATTR, weakref.ref(owner))


def release(owner: object, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        ref = getattr(t, OWNER_ATTR, None)
        if ref is not None and ref() is owner:
            delattr(t, OWNER_ATTR)
