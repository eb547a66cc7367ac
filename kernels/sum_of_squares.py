"""Sum of squares of a flat (or bucket-strided) shard, the reduction behind global-norm clipping.

A non-finite element makes the sum inf or nan, so `~isfinite(sumsq)` is also the non-finite-grad
flag: one pass gives both. The reduction is two-stage and deterministic: each program writes the
fp32 partial sum of its block, then one `sum` over the partials.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedzero.kernels._launch import (ENABLE_FP_FUSION, GRAD_DTYPES, Strided, as_strided,
                                       check_stream, count_launch, device_guard, grid_1d, pieces,
                                       shard_numel_of, use_triton)

# 4096 elements per program keeps the partials buffer small (1/4096 of the shard) while every
# thread still issues several 128-bit loads.
BLOCK = 4096
NUM_WARPS = 8
# Elements squared at a time on the torch path: 16 MiB of fp32 scratch.
_CHUNK = 1 << 22


@triton.jit
def _sumsq_kernel(
    x_ptr, partial_ptr,
    shard_numel, stride, base,
    BLOCK: tl.constexpr,
):
    # One grid axis over (bucket, block) pairs, as in the AdamW kernel (CUDA caps axes 1-2 at
    # 65535); program `prog` writes partial `prog`.
    nblocks = tl.cdiv(shard_numel, BLOCK)
    prog = tl.program_id(0).to(tl.int64)
    bucket = prog // nblocks
    pid = prog - bucket * nblocks
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < shard_numel
    x = tl.load(x_ptr + bucket * stride + base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(partial_ptr + prog, tl.sum(x * x, axis=0))


def sumsq(x: torch.Tensor | Strided, *, num_buckets: int = 1,
          shard_numel: int | None = None) -> torch.Tensor:
    """fp32 one-element tensor: sum of squares over the shard (inf/nan if any is non-finite)."""
    shard_numel = shard_numel_of(x, num_buckets, shard_numel)
    s = as_strided(x, shard_numel)
    device = s.tensor.device
    check_stream("x", s, GRAD_DTYPES, num_buckets, shard_numel, device)
    if num_buckets == 0 or shard_numel == 0:
        return torch.zeros(1, dtype=torch.float32, device=device)
    count_launch("sumsq")
    if use_triton(device):
        grid = grid_1d(num_buckets, shard_numel, BLOCK)
        partial = torch.empty(grid[0], dtype=torch.float32, device=device)
        with device_guard(device):
            _sumsq_kernel[grid](s.tensor, partial, shard_numel, s.stride, s.base,
                                BLOCK=BLOCK, num_warps=NUM_WARPS,
                                enable_fp_fusion=ENABLE_FP_FUSION)
        return partial.sum().reshape(1)
    # torch.sum, not torch.dot: MKL's sdot accumulates each SIMD lane sequentially over the
    # thread's share, an error growing with n / (lanes * threads) (5e-6 relative at 1e5 elements
    # with 2 threads), where torch's CPU sum is a cascade (tree) summation within ~log2(n) ulps
    # for any thread count, as the kernel's in-block tree then sum over partials. The squares go
    # through a bounded scratch chunk; chunk and piece sums are summed as a tree too.
    sums = [_square(c).sum() for p in pieces(s, num_buckets, shard_numel)
            for c in p.split(_CHUNK)]
    return torch.stack(sums).sum().reshape(1)


def _square(x: torch.Tensor) -> torch.Tensor:
    return x.float().square_() if x.dtype != torch.float32 else x.square()
