"""The one place that decides whether a kernel runs in Triton or through the torch path.

CUDA tensors run the compiled Triton kernels. CPU tensors run the torch path (fast, vectorised),
unless `FUSEDZERO_BACKEND=triton` asks for Triton, which on CPU needs `TRITON_INTERPRET=1` set
before the kernels are imported (tests do this to prove the kernel code). `FUSEDZERO_BACKEND=torch`
forces the torch path everywhere.
"""
from __future__ import annotations

import collections
import contextlib
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


# CUDA's grid limits: axis 0 up to 2**31 - 1 blocks, axes 1 and 2 only 65535. Our kernels use a
# 1-D grid over (bucket, block) pairs: a bucket axis of its own would cap a flat buffer at 65535
# buckets (bucket_numel=2**20 on a 70B-param group is ~67k).
MAX_GRID_X = 2**31 - 1


def grid_1d(num_buckets: int, shard_numel: int, block: int) -> tuple[int]:
    """The launch grid of a kernel that covers `num_buckets` pieces of `shard_numel` elements
    with `block` elements per program: program id = bucket * blocks_per_piece + block."""
    blocks = -(-shard_numel // block)
    n = num_buckets * blocks
    if n > MAX_GRID_X:
        raise ValueError(f"{num_buckets} buckets x {blocks} blocks of {block} = {n} programs "
                         f"exceeds CUDA's grid limit {MAX_GRID_X}; use larger buckets")
    return (n,)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Context for a Triton launch on `device`: Triton launches on the *current* CUDA device, so
    a tensor on cuda:1 while cuda:0 is current would be an illegal address without it."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
