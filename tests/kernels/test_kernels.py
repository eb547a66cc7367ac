"""The fused kernels against float64 references, on both CPU paths.

`FUSEDZERO_BACKEND=triton` runs the Triton kernel code in the interpreter (conftest.py sets
TRITON_INTERPRET=1 before the kernels are imported); `torch` runs the torch path. Tests whose name
says `triton_interpreter` prove the kernel code; the others run on both paths.

About internals: fusedzero.kernels._adamw, fusedzero.kernels._sum_of_squares.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedzero.kernels import (
    LAUNCHES,
    Strided,
    _adamw as adamw_mod,
    _sum_of_squares as sumsq_mod,
    adamw_reference,
    adamw_step,
    sumsq,
)

from _helpers import fast_only

BLOCK = adamw_mod.BLOCK
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32)
BACKENDS = ("triton", "torch")
# Hyper-parameters chosen so that no term vanishes: a non-power-of-two grad scale, weight decay on,
# step > 1 (bias corrections well away from 0 and 1).
HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
# lr and the scale as the fp32 values the kernels read, so the reference sees the same numbers.
LR, STEP, SCALE = float(torch.tensor(3e-3)), 7, float(torch.tensor(0.37))
U32 = 2.0**-24  # unit roundoff of fp32
# Each path computes the update in ~10 fp32 operations (scale, decay, two moment updates, sqrt,
# bias corrections, divide, multiply, subtract), each adding at most 1/2 ulp relative to its
# result; both paths measure at most ~4 ulps of the magnitudes involved (`_magnitudes`) over
# 200k random elements.
# 8 ulps is 2x that, and any change in the math (a wrong bias correction, eps inside the sqrt, a
# missing weight decay or grad scale) is off by orders of magnitude more.
ULPS = 8


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FUSEDZERO_BACKEND", request.param)
    return request.param


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEDZERO_BACKEND", "triton")


def _scalars(
    lr: float = LR,
    step: int = STEP,
    scale: float = SCALE,
    skip: int = 0,
    skip_dtype: torch.dtype = torch.int32,
) -> dict[str, torch.Tensor]:
    return dict(
        lr=torch.tensor([lr]),
        step=torch.tensor([float(step)]),
        grad_scale=torch.tensor([scale]),
        skip=torch.tensor([skip], dtype=skip_dtype),
    )


def _state(n: int, grad_dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random, never-zero state: any stream the kernel ignored or mixed up would show."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        master=torch.randn(n, generator=gen),
        grad=(torch.randn(n, generator=gen) * 2).to(grad_dtype),
        exp_avg=torch.randn(n, generator=gen) * 0.1,
        exp_avg_sq=torch.rand(n, generator=gen) * 0.02 + 1e-4,
    )


def _clone(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in s.items()}


def _step(
    s: dict[str, torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    maximize: bool = False,
    **scalars,
) -> None:
    # The torch path divides the grad in place: callers that reuse inputs pass clones.
    adamw_step(
        s["master"],
        s["grad"],
        s["exp_avg"],
        s["exp_avg_sq"],
        out,
        **_scalars(**scalars),
        **HP,
        maximize=maximize,
    )


def _reference(s0: dict[str, torch.Tensor], maximize: bool = False):
    # The reference gets the same (bf16/fp16-rounded) grads the kernel reads, upcast exactly.
    return adamw_reference(
        s0["master"],
        s0["grad"],
        s0["exp_avg"],
        s0["exp_avg_sq"],
        lr=LR,
        step=STEP,
        grad_scale=SCALE,
        maximize=maximize,
        **HP,
    )


def _assert_within_ulps(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    magnitude: torch.Tensor,
    ulps: float = ULPS,
) -> None:
    """|actual - expected| <= ulps * u32 * magnitude, elementwise; failures show the worst."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).abs()
    bound = ulps * U32 * magnitude.double()
    excess = err - bound
    bad = ~(excess <= 0)  # nan counts as bad
    if bad.any():
        i = int(torch.where(bad, excess.nan_to_num(math.inf), -math.inf).argmax())
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{actual.numel()} elements off by more than {ulps} ulps; "
            f"worst at [{i}]: got {actual[i].item()!r}, expected {expected[i].item()!r}, "
            f"error {err[i].item():.3g} > bound {bound[i].item():.3g}"
        )


def _magnitudes(s0: dict[str, torch.Tensor], v_new: torch.Tensor):
    """Scales the fp32 rounding errors are relative to: exp_avg = lerp(m, g) can cancel, so its
    error is relative to |m| + |g|, and the update, proportional to exp_avg, inherits that."""
    m_mag = s0["exp_avg"].double().abs() + s0["grad"].double().abs() * SCALE
    denom = v_new.sqrt() / math.sqrt(1 - HP["beta2"] ** STEP) + HP["eps"]
    p_mag = (
        s0["master"].double().abs() * (1 - LR * HP["weight_decay"])
        + LR / (1 - HP["beta1"] ** STEP) * m_mag / denom
    )
    return m_mag, p_mag


def _check_against_reference(s0, s, out, maximize: bool) -> None:
    p_ref, m_ref, v_ref = _reference(s0, maximize)
    m_mag, p_mag = _magnitudes(s0, v_ref)
    _assert_within_ulps("master", s["master"], p_ref, p_mag)
    _assert_within_ulps("exp_avg", s["exp_avg"], m_ref, m_mag)
    _assert_within_ulps("exp_avg_sq", s["exp_avg_sq"], v_ref, v_ref.abs())
    if out is not None:
        # The low-precision copy is this step's fp32 master rounded to nearest-even: bitwise.
        want = s["master"].to(out.dtype)
        diff = out.view(torch.int16 if out.element_size() == 2 else torch.int32) != want.view(
            torch.int16 if want.element_size() == 2 else torch.int32
        )
        assert not diff.any(), (
            f"out ({out.dtype}) differs from master.to({out.dtype}) at "
            f"{diff.nonzero().flatten()[:8].tolist()}"
        )


# ----------------------------------------------------------------------------------------- AdamW


@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.parametrize(
    "out_dtype", fast_only(OUT_DTYPES, lambda o: o in (None, torch.bfloat16)), ids=str
)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 17, BLOCK - 1, BLOCK + 1])
def test_adamw_triton_interpreter_matches_float64_reference(
    triton_interpreter, n, grad_dtype, out_dtype, maximize
):
    s0 = _state(n, grad_dtype, seed=n)
    s = _clone(s0)
    out = None if out_dtype is None else torch.full((n,), math.nan, dtype=out_dtype)
    _step(s, out, maximize=maximize)
    _check_against_reference(s0, s, out, maximize)


@pytest.mark.slow
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_adamw_triton_interpreter_matches_float64_reference_large_prime(
    triton_interpreter, grad_dtype
):
    n = 100_003  # a prime: the last block is ragged, many programs run
    s0 = _state(n, grad_dtype, seed=1)
    s = _clone(s0)
    out = torch.full((n,), math.nan, dtype=torch.bfloat16)
    _step(s, out)
    _check_against_reference(s0, s, out, maximize=False)


@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 17, BLOCK + 1, 100_003])
def test_adamw_torch_path_matches_float64_reference(monkeypatch, n, grad_dtype, maximize):
    monkeypatch.setenv("FUSEDZERO_BACKEND", "torch")
    s0 = _state(n, grad_dtype, seed=n)
    s = _clone(s0)
    out = torch.full((n,), math.nan, dtype=torch.bfloat16)
    _step(s, out, maximize=maximize)
    _check_against_reference(s0, s, out, maximize)


@pytest.mark.interpreter
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_adamw_torch_path_agrees_with_triton_interpreter(monkeypatch, grad_dtype, out_dtype):
    n = 2 * BLOCK + 5
    s0 = _state(n, grad_dtype, seed=3)
    results = {}
    for b in BACKENDS:
        monkeypatch.setenv("FUSEDZERO_BACKEND", b)
        s = _clone(s0)
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        _step(s, out)
        results[b] = s, out
    (t, t_out), (c, c_out) = results["triton"], results["torch"]
    # Both are within ULPS of the exact update (tested above), so within 2*ULPS of each other.
    m_mag, p_mag = _magnitudes(s0, t["exp_avg_sq"].double())
    _assert_within_ulps("master", c["master"], t["master"], p_mag, 2 * ULPS)
    _assert_within_ulps("exp_avg", c["exp_avg"], t["exp_avg"], m_mag, 2 * ULPS)
    _assert_within_ulps("exp_avg_sq", c["exp_avg_sq"], t["exp_avg_sq"], t["exp_avg_sq"], 2 * ULPS)
    if out_dtype is not None:
        # One ulp of the out dtype: the two masters may straddle a rounding boundary.
        torch.testing.assert_close(c_out, t_out, rtol=2 * torch.finfo(out_dtype).eps, atol=0)


def _bucketed(buf_numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((buf_numel,), math.nan, dtype=dtype)


def test_adamw_bucketed_strided_layout_matches_contiguous(backend):
    # A rank's piece of 3 buckets inside full buffers, as ZeRO sees them. The grad buffer uses a
    # different (padded) stride and base than master and out, so mixing up strides shows.
    num_buckets, world, rank, shard = 3, 4, 2, BLOCK + 3
    bucket = world * shard
    g_stride, g_base = bucket + 16, rank * shard + 5
    n = num_buckets * shard
    s_local = _state(n, torch.bfloat16, seed=11)

    master_buf = _bucketed(num_buckets * bucket + 7, torch.float32)
    grad_buf = _bucketed(num_buckets * g_stride + 3, torch.bfloat16)
    out_buf = _bucketed(num_buckets * bucket, torch.bfloat16)
    inside = {
        name: torch.zeros(t.numel(), dtype=torch.bool)
        for name, t in (("master", master_buf), ("grad", grad_buf), ("out", out_buf))
    }
    for k in range(num_buckets):
        pieces = slice(k * shard, (k + 1) * shard)
        m0, g0 = k * bucket + rank * shard, k * g_stride + g_base
        master_buf[m0 : m0 + shard] = s_local["master"][pieces]
        grad_buf[g0 : g0 + shard] = s_local["grad"][pieces]
        inside["master"][m0 : m0 + shard] = inside["out"][m0 : m0 + shard] = True
        inside["grad"][g0 : g0 + shard] = True

    exp_avg, exp_avg_sq = s_local["exp_avg"].clone(), s_local["exp_avg_sq"].clone()
    adamw_step(
        Strided(master_buf, bucket, rank * shard),
        Strided(grad_buf, g_stride, g_base),
        exp_avg,
        exp_avg_sq,
        Strided(out_buf, bucket, rank * shard),
        **_scalars(),
        **HP,
        num_buckets=num_buckets,
        shard_numel=shard,
    )

    s_ref = _clone(s_local)
    _step(s_ref)  # same backend, contiguous layout
    got = {"master": master_buf[inside["master"]], "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, want in (
        ("master", s_ref["master"]),
        ("exp_avg", s_ref["exp_avg"]),
        ("exp_avg_sq", s_ref["exp_avg_sq"]),
    ):
        if backend == "triton":  # one kernel, elementwise math: the layout cannot change a bit
            assert torch.equal(got[name], want), f"{name} pieces differ from the contiguous update"
        else:  # torch's fused CPU kernel rounds a vector's scalar tail differently (1 ulp)
            _assert_within_ulps(name, got[name], want, want.abs(), ulps=2)
    assert torch.equal(out_buf[inside["out"]], got["master"].bfloat16()), "out != master pieces"
    for name, buf in (("master", master_buf), ("out", out_buf)):
        assert buf[~inside[name]].isnan().all(), f"{name} was written outside the rank's pieces"
    if backend == "triton":  # the kernel only reads grads; the torch path consumes them in place
        assert grad_buf[~inside["grad"]].isnan().all()


@pytest.mark.parametrize("skip_dtype", [torch.int32, torch.bool], ids=str)
def test_adamw_skip_leaves_everything_bitwise_unchanged(backend, skip_dtype):
    n = BLOCK + 1
    s0 = _state(n, torch.bfloat16, seed=5)
    s0["grad"][3] = math.inf  # what a skipped step looks like
    s = _clone(s0)
    out0 = torch.randn(n).to(torch.bfloat16)
    out = out0.clone()
    _step(s, out, skip=1, skip_dtype=skip_dtype)
    for k in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(s[k], s0[k]), f"{k} changed on a skipped step"
    assert torch.equal(out, out0), "out changed on a skipped step"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_adamw_overwrites_poisoned_out(backend, out_dtype):
    n = 2 * BLOCK + 7
    s = _state(n, torch.float32, seed=6)
    out = torch.full((n,), math.nan, dtype=out_dtype)
    _step(s, out)
    assert out.isfinite().all(), f"{int((~out.isfinite()).sum())} out elements not written"
    assert torch.equal(out, s["master"].to(out_dtype))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_adamw_out_rounds_ties_to_even(backend, out_dtype):
    # Random data almost never lands on a tie, so build masters exactly halfway between adjacent
    # out-dtype values; lr=0 keeps them unchanged (p * (1 - 0) - 0 * update), so out = round(p).
    gen = torch.Generator().manual_seed(12)
    lo = (torch.randn(4096, generator=gen) * 100).to(out_dtype)
    hi = torch.nextafter(lo, torch.tensor(math.inf, dtype=out_dtype))
    s = _state(lo.numel(), torch.float32, seed=12)
    # Exact in fp32, which has 16 (bf16) or 13 (fp16) more mantissa bits than the out dtype.
    s["master"] = (lo.float() + hi.float()) / 2
    ties = s["master"].clone()
    out = torch.empty_like(lo)
    _step(s, out, lr=0.0)
    assert torch.equal(s["master"], ties), "lr=0 must leave master unchanged"
    want = ties.to(out_dtype)  # torch rounds to nearest, ties to even
    assert (want == hi).any() and (want == lo).any(), "the test needs ties rounding both ways"
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} ties rounded wrongly, e.g. {ties[bad[0]].item()!r} "
        f"-> {out[bad[0]].item()!r}, want {want[bad[0]].item()!r}"
        if bad.numel()
        else ""
    )


def test_adamw_counts_exactly_one_launch_per_call(backend):
    s = _state(BLOCK + 1, torch.bfloat16, seed=7)
    before = LAUNCHES["adamw"]
    _step(s, torch.empty(BLOCK + 1, dtype=torch.bfloat16))
    assert LAUNCHES["adamw"] == before + 1
    shard = 5
    bufs = _state(3 * shard, torch.float32, seed=8)
    adamw_step(
        Strided(bufs["master"], shard, 0),
        bufs["grad"],
        bufs["exp_avg"],
        bufs["exp_avg_sq"],
        **_scalars(),
        **HP,
        num_buckets=3,
        shard_numel=shard,
    )
    assert LAUNCHES["adamw"] == before + 2, "a bucketed step must still be one launch"


def test_adamw_empty_shard_is_a_no_op(backend):
    before = LAUNCHES["adamw"]
    s = _state(0, torch.float32, seed=0)
    _step(s)
    assert LAUNCHES["adamw"] == before


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


@pytest.mark.parametrize(
    "case,exc,match",
    [
        ("master_bf16", TypeError, r"master has dtype torch.bfloat16"),
        ("grad_int", TypeError, r"grad has dtype torch.int32"),
        ("grad_noncontiguous", ValueError, r"grad must be a flat contiguous"),
        ("master_2d", ValueError, r"master must be a flat contiguous 1-D"),
        ("exp_avg_short", ValueError, r"exp_avg has 16 elements.*need 17"),
        ("grad_strided_short", ValueError, r"grad has 40 elements.*need 41"),
        ("grad_on_meta", ValueError, r"grad is on meta"),
        ("lr_two_elements", ValueError, r"lr must be a one-element tensor"),
        ("skip_on_meta", ValueError, r"skip must be a one-element tensor on cpu"),
        ("betas", ValueError, r"betas must be in \[0, 1\)"),
        ("buckets_without_shard", ValueError, r"shard_numel is required"),
    ],
)
def test_adamw_rejects_bad_inputs_with_clear_errors(case, exc, match):
    n = 17
    s = _state(n, torch.float32, seed=9)
    args = dict(
        master=s["master"], grad=s["grad"], exp_avg=s["exp_avg"], exp_avg_sq=s["exp_avg_sq"]
    )
    kw: dict = dict(**_scalars(), **HP)
    if case == "master_bf16":
        args["master"] = s["master"].bfloat16()
    elif case == "grad_int":
        args["grad"] = torch.zeros(n, dtype=torch.int32)
    elif case == "grad_noncontiguous":
        args["grad"] = torch.randn(2 * n)[::2]
    elif case == "master_2d":
        args["master"] = s["master"].view(1, n)
    elif case == "exp_avg_short":
        args["exp_avg"] = s["exp_avg"][:16]
        kw["shard_numel"] = n
    elif case == "grad_strided_short":
        args["grad"] = Strided(torch.randn(40), 24, 0)
        kw.update(num_buckets=2, shard_numel=n)
        args["exp_avg"], args["exp_avg_sq"] = torch.randn(2 * n), torch.rand(2 * n)
        args["master"] = torch.randn(2 * n)
    elif case == "grad_on_meta":
        args["grad"] = _meta_like(s["grad"])
    elif case == "lr_two_elements":
        kw["lr"] = torch.tensor([LR, LR])
    elif case == "skip_on_meta":
        kw["skip"] = _meta_like(kw["skip"])
    elif case == "betas":
        kw["beta2"] = 1.0
    elif case == "buckets_without_shard":
        kw["num_buckets"] = 2
    before = {k: v.clone() for k, v in s.items()}
    with pytest.raises(exc, match=match):
        adamw_step(args["master"], args["grad"], args["exp_avg"], args["exp_avg_sq"], **kw)
    assert all(torch.equal(s[k], before[k]) for k in s), "a rejected call modified its inputs"


# --------------------------------------------------------------------------------- sum of squares

RBLOCK = sumsq_mod.BLOCK


def _sumsq_tolerance(n: int) -> float:
    # All terms are >= 0, so a tree summation (the kernel's in-block tl.sum, then torch's pairwise
    # sum over partials) is within ~log2(n) ulps relative; torch's CPU dot (blocked, many
    # accumulators) measures ~1 ulp at these sizes. 4x the tree bound: 21 ulps at n=17, 70 at 1e5
    # (4e-6 relative), still far below one dropped element of a ragged tail (~1/n relative).
    return 4 * (1 + math.log2(max(n, 2))) * U32


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 17, RBLOCK - 1, RBLOCK + 1, 100_003])
def test_sumsq_matches_float64(backend, n, dtype):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    got = sumsq(x)
    want = (x.double() ** 2).sum()
    assert got.shape == (1,) and got.dtype == torch.float32
    rel = abs(got.item() - want.item()) / want.item()
    assert rel <= _sumsq_tolerance(n), f"n={n} {dtype}: got {got.item()!r}, want {want.item()!r}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", fast_only(GRAD_DTYPES, lambda d: d == torch.float32), ids=str)
def test_sumsq_torch_path_is_a_tree_sum_for_any_thread_count(monkeypatch, dtype, threads):
    # The tree bound must hold whatever the thread count: a BLAS dot (per-lane sequential
    # accumulation, split by thread) measured 1-5x over it at 3M elements with 1 or 2 threads.
    monkeypatch.setenv("FUSEDZERO_BACKEND", "torch")
    n = 3_000_017
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    want = (x.double() ** 2).sum().item()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = sumsq(x).item()
    finally:
        torch.set_num_threads(old)
    assert abs(got - want) / want <= _sumsq_tolerance(n), f"{dtype}, {threads} threads: {got!r}"


def test_sumsq_bucketed_strided_layout(backend):
    num_buckets, world, rank, shard = 3, 2, 1, RBLOCK + 9
    stride = world * shard + 16
    buf = torch.full((num_buckets * stride,), math.nan, dtype=torch.bfloat16)
    pieces = []
    for k in range(num_buckets):
        p = torch.randn(shard).bfloat16()
        buf[k * stride + rank * shard : k * stride + (rank + 1) * shard] = p
        pieces.append(p)
    before = LAUNCHES["sumsq"]
    got = sumsq(Strided(buf, stride, rank * shard), num_buckets=num_buckets, shard_numel=shard)
    assert LAUNCHES["sumsq"] == before + 1
    want = (torch.cat(pieces).double() ** 2).sum()
    assert got.isfinite().all(), "read outside the rank's pieces (the rest is NaN)"
    assert abs(got.item() - want.item()) <= _sumsq_tolerance(shard * num_buckets) * want.item()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_sumsq_non_finite_anywhere_gives_non_finite(backend, dtype, where, bad):
    n = 2 * RBLOCK + 3
    x = torch.randn(n).to(dtype)
    x[{"first": 0, "middle": RBLOCK + 1, "last": n - 1}[where]] = bad
    got = sumsq(x)
    assert not got.isfinite().any(), f"sumsq with {bad} at the {where} element gave {got.item()}"


def test_sumsq_rejects_bad_inputs():
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        sumsq(torch.randn(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be a flat contiguous"):
        sumsq(torch.randn(16)[::2])
    with pytest.raises(ValueError, match="x has 10 elements"):
        sumsq(Strided(torch.randn(10), 8, 0), num_buckets=2, shard_numel=8)
