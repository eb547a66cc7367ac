"""The one place that decides whether a kernel runs in Triton or through the torch path.

CUDA tensors run the compiled Triton kernels. CPU tensors run the torch path (fast, vectorised),
unless `FUSEDZERO_BACKEND=triton` asks for Triton, which on CPU needs `TRITON_INTERPRET=1` set
before the kernels are imported (tests do this to prove the kernel code). `FUSEDZERO_BACKEND=torch`
forces the torch path everywhere.
"""
from __future__ import annotations

import collections
import os

import torch

LAUNCHES: collections.Counter[str] = collections.Counter()
"""Fused-kernel launches by kernel name; tests count them (one AdamW per group and dtype)."""

_VALID = ("auto", "triton", "torch")


def backend() -> str:
    b = os.environ.get("FUSEDZERO_BACKEND", "auto").lower()
    if b not in _VALID:
        raise ValueError(f"FUSEDZERO_BACKEND={b!r}, expected one of {_VALID}")
    return b


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device) -> bool:
    b = backend()
    if b == "torch":
        return False
    if device.type == "cuda":
        return True
    if b == "triton":
        if not interpreting():
            raise RuntimeError("FUSEDZERO_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                               "set before fusedzero.kernels is imported")
        return True
    return False


def count_launch(name: str) -> None:
    LAUNCHES[name] += 1
