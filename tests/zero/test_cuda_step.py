"""ZeroAdamW at world size 1 on a CUDA GPU against torch.optim.AdamW (skipped without a GPU).

Runs the compiled kernels (tests/conftest.py leaves TRITON_INTERPRET unset where a GPU is
visible) through the whole step: flat buffers, grad hooks, clipping, the fused update.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedzero import Sharding, ZeroAdamW
from fusedzero.kernels import LAUNCHES

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(17, 33), nn.Tanh(), nn.Linear(33, 5)).to(device)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_step_on_cuda_matches_torch_adamw(stage: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    ref_m, m = _model(0, dev), _model(0, dev)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.05)
    opt = ZeroAdamW(
        m.parameters(),
        lr=1e-2,
        weight_decay=0.05,
        stage=stage,
        module=m,
        max_grad_norm=0.5,
        sharding=Sharding(bucket_numel=256, units=nn.Linear),
    )
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


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("lr", ["float", "cpu_tensor"])
def test_backward_step_and_zero_grad_make_no_host_sync(stage: int, lr: str) -> None:
    """Zero host syncs in step() (and in backward and zero_grad) once warm, with an lr that a
    scheduler changes every step, as a float or as a CPU tensor (read on the host: copying it
    into a CUDA tensor would wait for the device). torch raises on any synchronizing CUDA call
    under `set_sync_debug_mode("error")`. The first backward and step have documented one-off
    syncs (the buckets' order agreement, the first launch's setup): two warm-up steps."""
    dev = torch.device("cuda", torch.cuda.current_device())
    m = _model(0, dev)
    opt = ZeroAdamW(
        m.parameters(),
        lr=1e-2 if lr == "float" else torch.tensor(1e-2),
        weight_decay=0.05,
        stage=stage,
        module=m,
        max_grad_norm=0.5,
        sharding=Sharding(bucket_numel=256, units=nn.Linear),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    x = torch.randn(8, 17, device=dev)
    for step in range(5):
        if step >= 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            m(x).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    opt.close()
