"""The CPU torch path's cache-blocked passes (see [Note: cache-blocked update] in
kernels/_adamw_torch.py; kernels/_sum_of_squares.py's chunks) at sizes that hit every chunk edge,
with a small chunk so that pieces straddle chunks and chunks hold several pieces: against
float64, against the unblocked pass bit for bit, and with exact call counts.

About internals: fusedzero.kernels._adamw_torch, fusedzero.kernels._sum_of_squares."""

from __future__ import annotations

import math

import pytest
import torch

from fusedzero.kernels import (
    AdamWBuffer,
    GroupedAdamW,
    GroupedSumsq,
    Hyper,
    SumsqView,
    _adamw_torch as adamw_torch,
    _sum_of_squares as sumsq_mod,
    adamw_reference,
)

U32 = 2.0**-24
CH = 64
# Piece sizes: 1, 17, a prime, CH-1, CH, CH+1, 2*CH+3, and one spanning several chunks.
SIZES = [1, 17, 31, CH - 1, CH, CH + 1, 2 * CH + 3, 5 * CH + 7]
ROWS = [(3e-3, 0.9, 0.95, 1e-8, 0.1, False), (1e-2, 0.8, 0.999, 1e-6, 0.0, True)]
STEP, SCALE = 5, float(torch.tensor(0.37))


def _hyper() -> Hyper:
    return Hyper(torch.tensor([r[0] for r in ROWS]), tuple(r[1:] for r in ROWS))


def _bufs(
    sizes: list[int], grad_dtype: torch.dtype, out_dtype: torch.dtype | None, seed: int
) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        dict(
            master=torch.randn(n, generator=gen),
            grad=(torch.randn(n, generator=gen) * 2).to(grad_dtype),
            exp_avg=torch.randn(n, generator=gen) * 0.1,
            exp_avg_sq=torch.rand(n, generator=gen) * 0.02 + 1e-4,
            out=None if out_dtype is None else torch.full((n,), math.nan, dtype=out_dtype),
            row=i % len(ROWS),
        )
        for i, n in enumerate(sizes)
    ]


def _step(bufs: list[dict]) -> None:
    plan = GroupedAdamW(
        [
            AdamWBuffer(
                b["master"],
                b["grad"],
                b["exp_avg"],
                b["exp_avg_sq"],
                b["out"],
                1,
                b["master"].numel(),
                b["row"],
            )
            for b in bufs
        ],
        torch.device("cpu"),
        len(ROWS),
    )
    plan.step(_hyper(), torch.tensor([float(STEP)]), torch.tensor([SCALE]), torch.zeros(1))


def _clone(bufs: list[dict]) -> list[dict]:
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in bufs
    ]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEDZERO_BACKEND", "torch")
    monkeypatch.setattr(adamw_torch, "CHUNK", CH)
    monkeypatch.setattr(sumsq_mod, "_CHUNK", CH)


@pytest.mark.parametrize(
    "grad_dtype,out_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, None),
    ],
    ids=str,
)
def test_blocked_update_matches_float64_at_chunk_edges(small_chunks, grad_dtype, out_dtype):
    bufs = _bufs(SIZES, grad_dtype, out_dtype, seed=0)
    before = _clone(bufs)
    calls = []
    fused = torch._fused_adamw_

    def counting(*args, **kwargs):
        calls.append(sum(t.numel() for t in args[0]))
        return fused(*args, **kwargs)

    torch._fused_adamw_ = counting
    try:
        _step(bufs)
    finally:
        torch._fused_adamw_ = fused
    # One call per chunk: each row's elements cut into ceil(total / CH) chunks of at most CH.
    want = sum(
        math.ceil(sum(n for i, n in enumerate(SIZES) if i % len(ROWS) == r) / CH)
        for r in range(len(ROWS))
    )
    assert len(calls) == want and max(calls) <= CH and sum(calls) == sum(SIZES)
    lr32 = _hyper().lr.tolist()
    for i, (b, b0) in enumerate(zip(bufs, before)):
        lr, beta1, beta2, eps, wd, maximize = ROWS[b["row"]]
        p_ref, m_ref, v_ref = adamw_reference(
            b0["master"],
            b0["grad"],
            b0["exp_avg"],
            b0["exp_avg_sq"],
            lr=lr32[b["row"]],
            step=STEP,
            grad_scale=SCALE,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=wd,
            maximize=maximize,
        )
        # Magnitudes the fp32 roundings are relative to, as tests/kernels/test_grouped.py: 16 ulps.
        m_mag = b0["exp_avg"].double().abs() + b0["grad"].double().abs() * SCALE
        denom = v_ref.sqrt() / math.sqrt(1 - beta2**STEP) + eps
        p_mag = b0["master"].double().abs() + lr32[b["row"]] / (1 - beta1**STEP) * m_mag / denom
        for name, got, want_t, mag in (
            ("master", b["master"], p_ref, p_mag),
            ("exp_avg", b["exp_avg"], m_ref, m_mag),
            ("exp_avg_sq", b["exp_avg_sq"], v_ref, v_ref),
        ):
            err = (got.double() - want_t).abs() - 16 * U32 * mag
            assert (err <= 0).all(), f"piece {i} (n={SIZES[i]}) {name}: off by {err.max()}"
        if out_dtype is not None:
            assert torch.equal(b["out"], b["master"].to(out_dtype)), f"piece {i} out"
        if grad_dtype == torch.float32:
            # fp32 grads are read in place (and consumed); others are cast, the source untouched
            continue
        assert torch.equal(b["grad"], b0["grad"]), f"piece {i}: the bf16 grad was written"


def test_blocked_update_is_bitwise_the_unblocked_one(monkeypatch):
    """Vector-aligned pieces (what the optimizer's layout makes): chunking changes only which
    elements share a call, not one bit of any result."""
    monkeypatch.setenv("FUSEDZERO_BACKEND", "torch")
    sizes = [32, 96, 3 * CH, 5 * CH + 32, 64 * 7]
    a = _bufs(sizes, torch.bfloat16, torch.bfloat16, seed=4)
    b = _clone(a)
    monkeypatch.setattr(adamw_torch, "CHUNK", CH)
    _step(a)
    monkeypatch.setattr(adamw_torch, "CHUNK", 1 << 30)
    _step(b)
    for x, y in zip(a, b):
        for k in ("master", "exp_avg", "exp_avg_sq", "out"):
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_blocked_sumsq_matches_float64_at_chunk_edges(small_chunks, dtype):
    gen = torch.Generator().manual_seed(1)
    xs = [(torch.randn(n, generator=gen) * 3).to(dtype) for n in SIZES]
    got = GroupedSumsq([SumsqView(x) for x in xs], torch.device("cpu"))
    assert len(got.chunks) == math.ceil(sum(SIZES) / CH)
    assert all(sum(t.numel() for t in c) <= CH for c in got.chunks)
    want = sum(float(x.double().square().sum()) for x in xs)
    # Squares of bf16/fp16 values are exact in fp32; the fp32 sums round ~log2(n) times.
    assert abs(float(got()) - want) <= 1e-6 * want
