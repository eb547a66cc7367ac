"""The pieces of the memory modes on their own: the int8 maps, stochastic rounding, the bytes each
variant moves, and the launcher's argument checks (kernels/_memory_modes.py).

About internals: fusedzero.kernels._memory_modes, fusedzero.kernels._memory_modes_reference."""

from __future__ import annotations

import math

import pytest
import torch

from fusedzero.kernels import (
    QBLOCK,
    adamw_step,
    bytes_per_param,
    dequantize_blockwise,
    quantize_blockwise,
)
from fusedzero.kernels._memory_modes import sr_bits, stochastic_round_bf16_torch, stream_bytes
from fusedzero.kernels._memory_modes_reference import bf16_round_stochastic, quantize_exact

U32 = 2.0**-24


def _blocks_over_decades(n_blocks: int, seed: int, signed: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = 10.0 ** (torch.rand(n_blocks * QBLOCK, generator=gen) * 12 - 10)
    if signed:
        x = x * torch.where(torch.rand(x.numel(), generator=gen) < 0.5, -1.0, 1.0)
    x = x.float()
    x[:QBLOCK] = 0.0  # a block of zeros: scale 0, codes 0, dequantizes to 0
    return x


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_quantize_error_is_within_half_a_code_and_small_values_survive(signed):
    x = _blocks_over_decades(64, seed=1 if signed else 2, signed=signed)
    q, a = quantize_blockwise(x, signed=signed)
    assert q.dtype == (torch.int8 if signed else torch.uint8) and a.dtype == torch.float32
    assert a.numel() == x.numel() // QBLOCK and torch.equal(a, x.view(-1, QBLOCK).abs().amax(1))
    xh = dequantize_blockwise(q, a, signed=signed).double()
    assert torch.equal(xh[:QBLOCK], torch.zeros(QBLOCK, dtype=torch.float64))
    # Half a code in the companded domain t = Q * (|x|/a)**(1/k): |x^ - x| <= a*((t+.5)**k -
    # t**k)/Q**k, plus the fp32 rounding of the dequantization (a few ulps of a).
    k, qmax = (2, 127.0) if signed else (4, 255.0)
    ab = a.double().repeat_interleave(QBLOCK)
    t = (x.double().abs() / ab.clamp_min(1e-300)) ** (1 / k) * qmax
    bound = ab * ((t + 0.5) ** k - t**k) / qmax**k + 4 * U32 * ab
    err = (xh - x.double()).abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} values off by more than half a code"
    # What keeps the update finite: every value above the smallest code's half stays nonzero.
    keep = x.double().abs() > ab * (0.5 / qmax) ** k * (1 + 1e-6)
    assert (xh[keep] != 0).all(), "a value above the smallest code dequantized to 0"
    # Over 12 decades below ~a, the maps keep 4.8 (signed) and 10.8 (unsigned) decades.
    assert int(keep[QBLOCK:].sum()) > (0.3 if signed else 0.8) * (x.numel() - QBLOCK)
    # Signs are kept, and the round trip is a fixed point (codes and scales bitwise).
    assert ((xh[keep] > 0) == (x.double()[keep] > 0)).all()
    q2, a2 = quantize_blockwise(xh.float(), signed=signed)
    assert torch.equal(q2, q) and torch.equal(a2, a), "quantize(dequantize(q)) != q"


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_quantize_matches_exact_rounding_but_at_boundaries(signed):
    x = _blocks_over_decades(256, seed=3, signed=signed)
    q, a = quantize_blockwise(x, signed=signed)
    q_ref, a_ref = quantize_exact(x.double(), signed=signed)
    assert torch.equal(a.double(), a_ref), "scales are the exact absmax"
    diff = (q.to(torch.int64) - q_ref).abs()
    # fp32 and float64 can land on either side of a .5 boundary: one code, rarely.
    assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 0.001 * x.numel(), int(diff.sum())


def test_quantize_rejects_ragged_input():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_blockwise(torch.zeros(QBLOCK + 1), signed=True)
    with pytest.raises(ValueError, match="one scale per block"):
        dequantize_blockwise(torch.zeros(QBLOCK, dtype=torch.int8), torch.zeros(2), signed=True)


def test_sr_bits_are_uniform_and_depend_on_every_input():
    idx = torch.arange(1 << 16, dtype=torch.int64)
    seed, step = torch.tensor([7]), torch.tensor([3.0])
    r = sr_bits(seed, step, idx)
    assert int(r.min()) >= 0 and int(r.max()) < 1 << 16
    # Uniform on [0, 2**16): mean within 4 standard errors, every 1/16th bucket near n/16.
    se = (2**16 / math.sqrt(12)) / math.sqrt(idx.numel())
    assert abs(r.double().mean().item() - (2**16 - 1) / 2) < 4 * se
    counts = torch.bincount(r >> 12, minlength=16).double()
    assert (counts - idx.numel() / 16).abs().max() < 4 * math.sqrt(idx.numel() / 16)
    for other in (
        sr_bits(torch.tensor([8]), step, idx),
        sr_bits(seed, torch.tensor([4.0]), idx),
        sr_bits(seed, step, idx + (1 << 32)),
        sr_bits(seed, step, idx + 1),
    ):
        assert (other != r).float().mean() > 0.99, "the bits must change with every input"
    assert torch.equal(sr_bits(seed, step, idx), r), "the bits are a pure function"


def test_stochastic_rounding_is_unbiased_and_matches_the_exact_rule():
    n = 1 << 15
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(8, generator=gen) * 10.0 ** torch.arange(-3, 5).float()
    for x in values:
        xs = x.expand(n).contiguous()
        bits = sr_bits(torch.tensor([11]), torch.tensor([1.0]), torch.arange(n))
        got = stochastic_round_bf16_torch(xs, bits).double()
        lo = xs.to(torch.bfloat16).double()  # the neighbours of x in bf16
        assert set(got.unique().tolist()) <= set(lo.unique().tolist()) | {
            torch.nextafter(lo[:1].bfloat16(), torch.tensor([math.inf], dtype=torch.bfloat16))
            .double()
            .item(),
            torch.nextafter(lo[:1].bfloat16(), torch.tensor([-math.inf], dtype=torch.bfloat16))
            .double()
            .item(),
        }
        ulp = 2.0 ** (math.frexp(x.item())[1] - 8)
        f = abs(x.item() - math.trunc(x.item() / ulp) * ulp) / ulp
        se = ulp * math.sqrt(max(f * (1 - f), 1e-12) / n)
        assert abs(got.mean().item() - x.item()) <= 4 * se + 1e-12 * ulp, (x.item(), f)
        assert torch.equal(got, bf16_round_stochastic(xs.double(), bits)), "exact rule"


def test_stochastic_rounding_through_the_update_is_unbiased(monkeypatch):
    # Every element has the same inputs, so the same fp32 update x; the SR results average to x.
    monkeypatch.setenv("FUSEDZERO_BACKEND", "torch")  # bitwise the interpreter (test_modes.py)
    n = 1 << 15
    p = torch.full((n,), 1.0 + 2**-9, dtype=torch.bfloat16)
    g = torch.full((n,), 0.5, dtype=torch.bfloat16)
    m, v = torch.full((n,), 0.01), torch.full((n,), 1e-3)
    kw = dict(
        lr=torch.tensor([1e-3]),
        step=torch.tensor([5.0]),
        grad_scale=torch.tensor([1.0]),
        skip=torch.tensor([0]),
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=0.0,
    )
    x = p.double()[0] - 1e-3 / (1 - 0.9**5) * (0.01 + 0.1 * (0.5 - 0.01)) / (
        math.sqrt(1e-3 * 0.99 + 0.01 * 0.25) / math.sqrt(1 - 0.99**5) + 1e-8
    )
    adamw_step(p, g, m, v, **kw, master_mode="bf16-sr", seed=torch.tensor([3]))
    ulp = 2.0**-7
    f = (1.0 + 2**-9 - x.item()) / ulp  # x sits between 1 and 1 + ulp, below 1 + 2**-9
    assert 0.05 < f < 0.95, "the update must land strictly between two bf16 values"
    se = ulp * math.sqrt(f * (1 - f) / n)
    assert abs(p.double().mean().item() - x.item()) <= 4 * se + 2**-20
    rne = torch.tensor([x.item()]).bfloat16().double().item()
    assert abs(rne - x.item()) > 10 * se, "plain rounding would be visibly biased here"


def test_bytes_per_param_counts_each_stream():
    bf, f32 = torch.bfloat16, torch.float32
    assert bytes_per_param("fp32", "fp32", bf, bf) == 28  # read 4+2+4+4, write 4+4+4+2
    assert bytes_per_param("fp32", "fp32", f32) == 28  # no out, fp32 grads
    assert bytes_per_param("bf16-kahan", "int8", bf) == 2 + 2 + 2 + 2 + 2 + 1 + 1 + 1 + 1 + 0.125
    assert bytes_per_param("bf16-kahan", "int8", bf) == 14.125
    assert bytes_per_param("bf16-sr", "int8", bf) == 10.125
    assert bytes_per_param("bf16", "bf16", bf) == 14
    assert bytes_per_param("fp32", "bf16", bf, bf) == 20
    assert stream_bytes("bf16-kahan", "int8", bf) == {
        "master": 4.0,
        "comp": 4.0,
        "grad": 2.0,
        "exp_avg": 2.0,
        "exp_avg_sq": 2.0,
        "scales": 0.125,
    }
    with pytest.raises(ValueError, match="out must be None"):
        bytes_per_param("bf16-sr", "fp32", bf, bf)
    with pytest.raises(ValueError, match="master_mode='fp16'"):
        bytes_per_param("fp16", "fp32", bf)


def _args(n: int = QBLOCK) -> dict:
    return dict(
        lr=torch.tensor([1e-3]),
        step=torch.tensor([1.0]),
        grad_scale=torch.tensor([1.0]),
        skip=torch.tensor([0]),
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=0.0,
    )


@pytest.mark.parametrize(
    "case,match",
    [
        ("kahan_missing", "needed by, and only by, master_mode='bf16-kahan'"),
        ("seed_missing", "seed is needed"),
        ("seed_float", "seed has dtype torch.float32"),
        ("out_with_bf16", "pass out=None"),
        ("fp32_param_bf16_mode", "master has dtype torch.float32"),
        ("int8_ragged", "must be a multiple of 128"),
        ("int8_no_scales", "exp_avg_scale is needed"),
        ("int8_short_scales", "exp_avg_sq_scale has 1 elements"),
        ("bad_state_dtype", "exp_avg has dtype torch.float32"),
        ("bad_mode", "states='int4'"),
    ],
)
def test_mode_argument_errors_name_the_fix(case, match):
    n = 2 * QBLOCK
    p, g = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    m8, v8 = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    sc = dict(exp_avg_scale=torch.zeros(2), exp_avg_sq_scale=torch.zeros(2))
    f = torch.zeros(n)
    calls = {
        "kahan_missing": lambda: adamw_step(p, g, f, f, master_mode="bf16-kahan", **_args()),
        "seed_missing": lambda: adamw_step(p, g, f, f, master_mode="bf16-sr", **_args()),
        "seed_float": lambda: adamw_step(
            p, g, f, f, master_mode="bf16-sr", seed=torch.tensor([1.0]), **_args()
        ),
        "out_with_bf16": lambda: adamw_step(p, g, f, f, p.clone(), master_mode="bf16", **_args()),
        "fp32_param_bf16_mode": lambda: adamw_step(
            f.clone(), g, f, f, master_mode="bf16", **_args()
        ),
        "int8_ragged": lambda: adamw_step(
            p[:-1], g[:-1], m8[:-1], v8[:-1], states="int8", master_mode="bf16", **sc, **_args()
        ),
        "int8_no_scales": lambda: adamw_step(
            p, g, m8, v8, states="int8", master_mode="bf16", **_args()
        ),
        "int8_short_scales": lambda: adamw_step(
            p,
            g,
            m8,
            v8,
            states="int8",
            master_mode="bf16",
            exp_avg_scale=torch.zeros(2),
            exp_avg_sq_scale=torch.zeros(1),
            **_args(),
        ),
        "bad_state_dtype": lambda: adamw_step(
            p, g, f, f, states="bf16", master_mode="bf16", **_args()
        ),
        "bad_mode": lambda: adamw_step(p, g, f, f, states="int4", **_args()),
    }
    with pytest.raises((ValueError, TypeError), match=match):
        calls[case]()
