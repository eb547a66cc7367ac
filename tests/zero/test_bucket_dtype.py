"""A stage 2-3 bucket is built in the reduce dtype whatever dtype its grads arrive in
(fusedzero/reduce.py `ReduceIntoShard._gather`). A DTensor param whose local tensor was cast to
`param_dtype` keeps its outer dtype (fp32 under `fusedzero train --tp` on GPUs), and autograd
casts its grad to that: before, such fp32 grads in a bf16-reduce bucket went through one `cat`,
whose type promotion made the bucket fp32, and the reduce-scatter moved twice the bytes the
plan counts."""
from __future__ import annotations

import torch
from torch import nn

from fusedzero.optim import ZeroAdamW


def test_fp32_grads_build_a_bf16_bucket_for_a_bf16_reduce() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = ZeroAdamW(model.parameters(), lr=1e-3, stage=2, param_dtype=torch.bfloat16,
                    reduce_dtype=torch.bfloat16, bucket_numel=1 << 12)
    b = opt.buckets.buckets[0]
    L = b.buf.layout
    grads = {pos: torch.randn(L.params[pos].shape) for pos in b.slots}  # fp32, as such a DTensor
    b.got.update(grads)
    out = opt.buckets.reduction._gather(b)
    assert out.dtype == torch.bfloat16 and out.numel() == L.bucket_numel
    for pos, g in grads.items():
        a, e, p = L.overlap(pos, b.k)
        assert torch.equal(out[a:e], g.reshape(-1)[p:p + e - a].to(torch.bfloat16))
    b.release()
    opt.close()
