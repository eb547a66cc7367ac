"""The one table of floating dtypes fusedzero handles: short names (CLI, plan), safetensors /
manifest names, and element sizes. Parse strings here, at the boundary; inside, torch dtypes."""

from __future__ import annotations

import torch

# Params, grads, reductions and exports: the dtypes every part of the library accepts.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

# CLI flags (--param-dtype bf16) and plan tables.
SHORT_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

# Checkpoint manifests and safetensors headers spell dtypes as torch does ("bfloat16").
# float64 is accepted when reading (weights exported by other tools), never written by us.
_LONG_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
_BY_LONG_NAME: dict[str, torch.dtype] = {v: k for k, v in _LONG_NAMES.items()}
READABLE_NAMES: tuple[str, ...] = tuple(_LONG_NAMES.values())


def name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (manifests, HF configs)."""
    try:
        return _LONG_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not one of {list(_LONG_NAMES)}") from None


def short_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16" (CLI, tables)."""
    for k, v in SHORT_NAMES.items():
        if v == dtype:
            return k
    raise ValueError(f"dtype {dtype} is not one of {list(SHORT_NAMES.values())}")


def from_name(s: str) -> torch.dtype:
    """ "bf16", "bfloat16" or "torch.bfloat16" -> torch.bfloat16; a ValueError naming the
    accepted spellings otherwise."""
    key = s.removeprefix("torch.")
    if key in SHORT_NAMES:
        return SHORT_NAMES[key]
    if key in _BY_LONG_NAME:
        return _BY_LONG_NAME[key]
    raise ValueError(
        f"unknown dtype {s!r}; expected one of {list(SHORT_NAMES)} or {list(_BY_LONG_NAME)}"
    )


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return dtype.itemsize
