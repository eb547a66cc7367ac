"""What every kernel launcher shares: the backend choice, argument checks, grid and device guard.

Backend. CUDA tensors run the compiled Triton kernels. CPU tensors run the torch path (fast,
vectorised), unless `FUSEDZERO_BACKEND=triton` asks for Triton, which on CPU needs
`TRITON_INTERPRET=1` set before the kernels are imported (tests do this to prove the kernel
code). `FUSEDZERO_BACKEND=torch` forces the torch path everywhere. `use_triton` is the one place
that decides; nothing else in the library knows which ran.

Streams. A param group's flat buffer is cut into `num_buckets` equal buckets; a rank owns the
same `shard_numel`-element piece of every bucket. Each stream a kernel reads or writes is a
`Strided(tensor, stride, base)`: piece k lives at `tensor[k * stride + base :][:shard_numel]`.

[Note: the interpreter is for CPU tensors] It copies each argument's storage to the host, runs
there and copies it back whole; our tables address every buffer of a launch by its element offset
from one base tensor (_table.py), and an offset between two CUDA allocations lands in arbitrary host
memory in those copies: heap corruption (glibc's `free(): invalid size`), not an error.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import NamedTuple

import torch

from fusedzero import _dtypes as dtypes

LAUNCHES: collections.Counter[str] = collections.Counter()
"""Fused-kernel launches by kernel name; tests count them (one AdamW per group and dtype)."""

_VALID = ("auto", "triton", "torch")

# Grads (and anything reduced for the norm) come in every float dtype the library handles.
GRAD_DTYPES: tuple[torch.dtype, ...] = dtypes.FLOAT_DTYPES
# Compiled with FMA contraction off: free in a memory-bound kernel, and every fp32 operation is
# then one IEEE round-to-nearest op, as numpy does it in the interpreter (_adamw.py, see
# [Note: GPU vs interpreter numerics]).
ENABLE_FP_FUSION = False

# CUDA's grid limits: axis 0 up to 2**31 - 1 blocks, axes 1 and 2 only 65535. Our kernels use a
# 1-D grid over every (piece, block) pair of a launch (kernels/_table.py): a piece axis of its own
# would cap a launch at 65535 pieces (bucket_numel=2**20 on a 70B-param group is ~67k).
MAX_GRID_X = 2**31 - 1


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
        if interpreting():
            # See [Note: the interpreter is for CPU tensors].
            raise RuntimeError(
                f"tensors on {device} reached the Triton interpreter "
                "(TRITON_INTERPRET=1 is set): it runs on CPU tensors only; "
                "unset TRITON_INTERPRET (or set it to 0) before fusedzero.kernels "
                "is imported to run the compiled kernels"
            )
        return True
    if b == "triton":
        if not interpreting():
            raise RuntimeError(
                "FUSEDZERO_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                "set before fusedzero.kernels is imported"
            )
        return True
    return False


def count_launch(name: str) -> None:
    LAUNCHES[name] += 1


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Context for a Triton launch on `device`: Triton launches on the *current* CUDA device, so
    a tensor on cuda:1 while cuda:0 is current would be an illegal address without it."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class Strided(NamedTuple):
    """A rank's shard viewed inside a bucketed buffer: piece k at `k*stride + base`."""

    tensor: torch.Tensor
    stride: int
    base: int


def as_strided(x: torch.Tensor | Strided, shard_numel: int) -> Strided:
    """A plain tensor is the rank's contiguous local shard."""
    return x if isinstance(x, Strided) else Strided(x, shard_numel, 0)


def shard_numel_of(x: torch.Tensor | Strided, num_buckets: int, shard_numel: int | None) -> int:
    """`shard_numel` as given, or the whole of a single-bucket `x`."""
    if shard_numel is not None:
        return shard_numel
    if num_buckets != 1:
        raise ValueError("shard_numel is required when num_buckets != 1")
    return (x.tensor if isinstance(x, Strided) else x).numel()


class Hyper(NamedTuple):
    """Per-row hyper-parameters for one step: `lr`, a (rows,) fp32 device tensor; `consts`, per
    row (beta1, beta2, eps, weight_decay, maximize) as host values (they change rarely)."""

    lr: torch.Tensor
    consts: tuple[tuple[float, float, float, float, bool], ...]


def copy_from_host(dst: torch.Tensor, values: list) -> None:
    """Write host `values` into `dst` without a host sync: on CUDA from a freshly allocated pinned
    tensor, copied asynchronously (the caching host allocator keeps the pinned block alive until
    the copy has run; a pageable source would make the host wait for the copy)."""
    host = torch.tensor(values, dtype=dst.dtype, pin_memory=dst.is_cuda)
    dst.copy_(host, non_blocking=dst.is_cuda)


def check_stream(
    name: str,
    s: Strided,
    allowed: tuple[torch.dtype, ...],
    num_buckets: int,
    shard_numel: int,
    device: torch.device,
) -> None:
    """dtype, device, a flat contiguous buffer, and room for every piece, with the numbers."""
    t = s.tensor
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}, expected one of {allowed}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like master")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a flat contiguous 1-D buffer, got shape "
            f"{tuple(t.shape)} with strides {t.stride()}"
        )
    if s.stride < shard_numel or s.base < 0:
        raise ValueError(
            f"{name}: stride {s.stride} must be >= shard_numel {shard_numel} and base {s.base} >= 0"
        )
    need = (num_buckets - 1) * s.stride + s.base + shard_numel if num_buckets else 0
    if t.numel() < need:
        raise ValueError(
            f"{name} has {t.numel()} elements, but {num_buckets} buckets of "
            f"{shard_numel} at stride {s.stride} + base {s.base} need {need}"
        )


def check_scalar(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Per-step scalars are one-element device tensors: read on the device, no host sync."""
    if t.numel() != 1 or t.device != device:
        raise ValueError(
            f"{name} must be a one-element tensor on {device}, got "
            f"{t.numel()} elements on {t.device}"
        )
