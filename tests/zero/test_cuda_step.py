"""ZeroAdamW at world size 1 on a CUDA GPU against torch.optim.AdamW (skipped without a GPU).

Runs the compiled kernels (tests/conftest.py leaves TRITON_INTERPRET unset where a GPU is
visible) through the whole step: flat buffers, grad hooks, clipping, the fused update.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedzero.kernels import LAUNCHES
from fusedzero.optim import ZeroAdamW

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(17, 33), nn.Tanh(), nn.Linear(33, 5)).to(device)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_step_on_cuda_matches_torch_adamw(stage: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    ref_m, m = _model(0, dev), _model(0, dev)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.05)
    opt = ZeroAdamW(m.parameters(), lr=1e-2, weight_decay=0.05, stage=stage, module=m,
                    bucket_numel=256, unit_policy=nn.Linear, max_grad_norm=0.5)
    launches = LAUNCHES["adamw"]
    for step in range(10):
        x = torch.randn(8, 17, generator=torch.Generator().manual_seed(step)).to(dev)
        for model, o in ((ref_m, ref), (m, opt)):
            model(x).square().mean().backward()
            if o is ref:
                nn.utils.clip_grad_norm_(ref_m.parameters(), 0.5)
            o.step()
            o.zero_grad()
    assert LAUNCHES["adamw"] - launches == 10  # one fused launch per step
    with opt.gathered_params():
        for (name, p), q in zip(m.named_parameters(), ref_m.parameters()):
            assert p.device == dev
            # fp32 on both sides; the two differ in operation order (fused kernel vs torch's
            # foreach), a few ulps per step over 10 steps.
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
