"""A stage 2-3 bucket is built in the reduce dtype whatever dtype its grads arrive in
(fusedzero/_reduce.py `ReduceIntoShard._gather`). A DTensor param whose local tensor was cast to
`param_dtype` keeps its outer dtype (fp32 under `fusedzero train --tp` on GPUs), and autograd
casts its grad to that: before, such fp32 grads in a bf16-reduce bucket went through one `cat`,
whose type promotion made the bucket fp32, and the reduce-scatter moved twice the bytes the
plan counts."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from fusedzero import Precision, Sharding, ZeroAdamW


def test_fp32_grads_build_a_bf16_bucket_for_a_bf16_reduce() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = ZeroAdamW(
        model.parameters(),
        lr=1e-3,
        stage=2,
        precision=Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
        sharding=Sharding(bucket_numel=1 << 12),
    )
    b = opt.buckets.buckets[0]
    L = b.buf.layout
    grads = {pos: torch.randn(L.params[pos].shape) for pos in b.slots}  # fp32, as such a DTensor
    b.got.update(grads)
    out = opt.buckets.reduction._gather(b)
    assert out.dtype == torch.bfloat16 and out.numel() == L.bucket_numel
    for pos, g in grads.items():
        a, e, p = L.overlap(pos, b.k)
        assert torch.equal(out[a:e], g.reshape(-1)[p : p + e - a].to(torch.bfloat16))
    b.release()
    opt.close()


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("no_sync", [False, True])
def test_bf16_grads_accumulate_in_fp32_over_micro_batches_and_steps(
    stage: int, no_sync: bool
) -> None:
    """Stages 0-1 with bf16 params and an fp32 grad buffer: the hook keeps each grad and a
    bucket's go in by one foreach op, a copy while the bucket is empty (the first micro-batch
    after a step or zero_grad), an add after (see [Note: grads into a bucket, per bucket]); the
    buffer holds the fp32 sum of every micro-batch's bf16 grads, step after step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = ZeroAdamW(
        model.parameters(), lr=1e-3, stage=stage, module=model, sharding=Sharding(bucket_numel=256)
    )
    xs = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(3)]
    for _ in range(2):
        ref.load_state_dict(model.state_dict())
        want = [torch.zeros(p.numel()) for p in ref.parameters()]
        for i, x in enumerate(xs):
            ref.zero_grad()
            ref(x).float().square().sum().backward()
            for w, p in zip(want, ref.parameters()):
                w += p.grad.float().reshape(-1)
            with opt.no_sync() if no_sync and i < 2 else contextlib.nullcontext():
                model(x).float().square().sum().backward()
        buf = opt.flat_groups[0]
        assert buf.grad_flat is not None
        for w, slot in zip(want, buf.layout.params):
            got = buf.grad_flat[slot.offset : slot.offset + slot.numel]
            # At W=1 the reductions change nothing: the buffer holds the sum.
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6, msg=slot.name)
        opt.step()
        opt.zero_grad()
    opt.close()
