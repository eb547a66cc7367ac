"""Sum of squares of a flat (or bucket-strided) shard, the reduction behind global-norm clipping.

A non-finite element makes the sum inf or nan, so `~isfinite(sumsq)` is also the non-finite-grad
flag: one pass gives both. The reduction is two-stage and deterministic: each program writes the
fp32 partial sum of its block, then one `sum` over the partials.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedzero.kernels._dispatch import count_launch, use_triton
from fusedzero.kernels.adamw import GRAD_DTYPES, Strided, _as_strided, _check, _pieces

# 4096 elements per program keeps the partials buffer small (1/4096 of the shard) while every
# thread still issues several 128-bit loads.
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _sumsq_kernel(
    x_ptr, partial_ptr,
    shard_numel, stride, base,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    bucket = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < shard_numel
    x = tl.load(x_ptr + bucket * stride + base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(partial_ptr + bucket * tl.num_programs(0) + pid, tl.sum(x * x, axis=0))


def sumsq(x: torch.Tensor | Strided, *, num_buckets: int = 1,
          shard_numel: int | None = None) -> torch.Tensor:
    """fp32 one-element tensor: sum of squares over the shard (inf/nan if any is non-finite)."""
    if shard_numel is None:
        if num_buckets != 1:
            raise ValueError("shard_numel is required when num_buckets != 1")
        shard_numel = (x.tensor if isinstance(x, Strided) else x).numel()
    s = _as_strided(x, shard_numel)
    _check("x", s, GRAD_DTYPES, num_buckets, shard_numel, s.tensor.device)
    device = s.tensor.device
    if num_buckets == 0 or shard_numel == 0:
        return torch.zeros(1, dtype=torch.float32, device=device)
    count_launch("sumsq")
    if use_triton(device):
        nblocks = triton.cdiv(shard_numel, BLOCK)
        partial = torch.empty(num_buckets * nblocks, dtype=torch.float32, device=device)
        _sumsq_kernel[(nblocks, num_buckets)](s.tensor, partial, shard_numel, s.stride, s.base,
                                             BLOCK=BLOCK, num_warps=NUM_WARPS)
        return partial.sum().reshape(1)
    pieces = _pieces(s, num_buckets, shard_numel)
    # torch's CPU reductions are pairwise in fp32 accumulation order: deterministic for a shape.
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for p in pieces:
        pf = p if p.dtype == torch.float32 else p.float()
        total += torch.dot(pf, pf) if pf.numel() else 0.0
    return total
