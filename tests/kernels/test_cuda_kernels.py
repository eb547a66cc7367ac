"""The compiled kernels on a CUDA GPU against float64 references (skipped without a GPU).

The same checks as tests/kernels/test_kernels.py runs on the interpreter and the torch path,
here on CUDA tensors with the kernels compiled by Triton (never the interpreter:
tests/conftest.py leaves TRITON_INTERPRET unset where a GPU is visible).

About an internal: fusedzero.kernels._adamw.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from fusedzero.kernels import LAUNCHES, _adamw as adamw_mod, adamw_reference, adamw_step, sumsq

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK = adamw_mod.BLOCK
HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR, STEP, SCALE = float(torch.tensor(3e-3)), 7, float(torch.tensor(0.37))
U32 = 2.0**-24
# As in test_kernels.py: ~10 fp32 ops of at most 1/2 ulp each; 8 ulps of the magnitudes
# involved is 2x what the paths measure, and a wrong term is off by orders of magnitude more.
ULPS = 8


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _state(n: int, grad_dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        master=torch.randn(n, generator=gen),
        grad=(torch.randn(n, generator=gen) * 2).to(grad_dtype),
        exp_avg=torch.randn(n, generator=gen) * 0.1,
        exp_avg_sq=torch.rand(n, generator=gen) * 0.02 + 1e-4,
    )


def _within_ulps(name: str, got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> None:
    err = (got.double().cpu() - want.double()).abs()
    bad = ~(err <= ULPS * U32 * mag.double())
    assert not bad.any(), (
        f"{name}: {int(bad.sum())}/{got.numel()} elements off by more than "
        f"{ULPS} ulps; first at {bad.nonzero().flatten()[:4].tolist()}"
    )


def test_kernels_are_compiled_not_interpreted() -> None:
    assert isinstance(adamw_mod._grouped_adamw_kernel, triton.runtime.JITFunction)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 17, BLOCK + 1, 100_003])
def test_compiled_adamw_matches_float64_reference(
    n: int, grad_dtype: torch.dtype, out_dtype: torch.dtype | None
) -> None:
    dev = _cuda()
    s0 = _state(n, grad_dtype, seed=n)
    s = {k: v.to(dev, copy=True) for k, v in s0.items()}
    out = None if out_dtype is None else torch.full((n,), math.nan, dtype=out_dtype, device=dev)
    f32 = dict(dtype=torch.float32, device=dev)
    before = LAUNCHES["adamw"]
    adamw_step(
        s["master"],
        s["grad"],
        s["exp_avg"],
        s["exp_avg_sq"],
        out,
        lr=torch.tensor([LR], **f32),
        step=torch.tensor([float(STEP)], **f32),
        grad_scale=torch.tensor([SCALE], **f32),
        skip=torch.zeros(1, dtype=torch.int32, device=dev),
        **HP,
    )
    torch.cuda.synchronize(dev)
    assert LAUNCHES["adamw"] - before == 1
    p, m, v = adamw_reference(
        s0["master"],
        s0["grad"],
        s0["exp_avg"],
        s0["exp_avg_sq"],
        lr=LR,
        step=STEP,
        grad_scale=SCALE,
        **HP,
    )
    m_mag = s0["exp_avg"].double().abs() + s0["grad"].double().abs() * SCALE
    denom = v.sqrt() / math.sqrt(1 - HP["beta2"] ** STEP) + HP["eps"]
    p_mag = (
        s0["master"].double().abs() * (1 - LR * HP["weight_decay"])
        + LR / (1 - HP["beta1"] ** STEP) * m_mag / denom
    )
    _within_ulps("master", s["master"], p, p_mag)
    _within_ulps("exp_avg", s["exp_avg"], m, m_mag)
    _within_ulps("exp_avg_sq", s["exp_avg_sq"], v, v.abs())
    if out is not None:  # this step's master rounded to nearest-even, bitwise
        assert torch.equal(out.view(torch.int16), s["master"].to(out_dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 4097, 3_000_017])
def test_compiled_sumsq_matches_float64(n: int, dtype: torch.dtype) -> None:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    got = float(sumsq(x.to(_cuda())))
    want = float(x.double().square().sum())
    # fp32 partial sums over blocks, then a sum of partials: log2(n)+1 roundings of 1/2 ulp.
    assert abs(got - want) <= (math.log2(n) + 2) * U32 * want, (got, want)
