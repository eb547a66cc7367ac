"""Memory modes of the fused AdamW (kernels/_memory_modes.py) against the float64 reference of the
same algorithm, on the Triton interpreter and the torch path.

Tolerances. The kernel computes the update in fp32 (within ULPS fp32 ulps of exact, see
tests/kernels/test_kernels.py) and then rounds what it stores exactly as the reference does on the
exact value. A stored bf16 value therefore equals the reference's unless the exact and the fp32
value straddle a bf16 rounding boundary: then it is 1 bf16 ulp off. That happens with probability
about 2 * ULPS * 2**-24 / 2**-8 = 2**-12 per element, so we allow 1 ulp everywhere and count the off
ones (< 1%, ~40x the expectation; a wrong rounding mode is off on ~50%). Likewise an int8 code is
the reference's or one off, and off codes are < 1%.

About an internal: fusedzero.kernels._adamw.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fusedzero.kernels import (
    MASTER_MODES,
    QBLOCK,
    STATE_MODES,
    Strided,
    adamw_reference_mode,
    adamw_step,
    dequantize_blockwise,
    quantize_blockwise,
)
from fusedzero.kernels._adamw import BLOCK

from _helpers import fast_only

BACKENDS = ("triton", "torch")
HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR, SCALE = float(torch.tensor(3e-3)), float(torch.tensor(0.37))
U32 = 2.0**-24
ULPS = 8  # fp32 ulps of the update, as in tests/kernels/test_kernels.py
MAX_OFF = 0.01  # fraction of stored values allowed 1 bf16 ulp / 1 code off (module docstring)
# Two full programs and a third with 2 of its 8 quantization blocks: ragged, masked whole blocks.
N = 2 * BLOCK + 2 * QBLOCK
COMBOS = list(itertools.product(MASTER_MODES, STATE_MODES))
# The fast tier's combos: every master mode and every state mode at least once.
FAST_COMBOS = {("fp32", "int8"), ("bf16-kahan", "bf16"), ("bf16-sr", "int8"), ("bf16", "fp32")}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FUSEDZERO_BACKEND", request.param)
    return request.param


def make_state(n: int, master_mode: str, states: str, seed: int) -> dict[str, torch.Tensor]:
    """Random, never-zero state stored as the modes store it (the kernel's own quantization)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    # exp_avg_sq over 6 decades inside a block: the small values are the ones int8 must keep.
    v = 10.0 ** (torch.rand(n, generator=gen) * 6 - 8)
    s = {
        "master": p if master_mode == "fp32" else p.bfloat16(),
        "grad": (torch.randn(n, generator=gen) * 2).bfloat16(),
    }
    if states == "int8":
        s["exp_avg"], s["exp_avg_scale"] = quantize_blockwise(m, signed=True)
        s["exp_avg_sq"], s["exp_avg_sq_scale"] = quantize_blockwise(v, signed=False)
    else:
        dt = torch.float32 if states == "fp32" else torch.bfloat16
        s["exp_avg"], s["exp_avg_sq"] = m.to(dt), v.to(dt)
    if master_mode == "bf16-kahan":
        s["kahan"] = (p - p.bfloat16().float()).bfloat16()
    if master_mode == "bf16-sr":
        s["seed"] = torch.tensor([0x1234_5678_9ABC], dtype=torch.int64)
    return s


def run(
    s: dict[str, torch.Tensor],
    master_mode: str,
    states: str,
    step: int,
    *,
    skip: int = 0,
    sr_offset: int = 0,
    **layout,
) -> None:
    bufs = {k: v for k, v in s.items() if k not in ("master", "grad", "exp_avg", "exp_avg_sq")}
    adamw_step(
        layout.pop("master", s["master"]),
        layout.pop("grad", s["grad"]),
        s["exp_avg"],
        s["exp_avg_sq"],
        lr=torch.tensor([LR]),
        step=torch.tensor([float(step)]),
        grad_scale=torch.tensor([SCALE]),
        skip=torch.tensor([skip], dtype=torch.int32),
        **HP,
        master_mode=master_mode,
        states=states,
        sr_offset=sr_offset,
        **bufs,
        **layout,
    )


def reference(
    s: dict[str, torch.Tensor], master_mode: str, states: str, step: int, sr_offset: int = 0
) -> dict[str, torch.Tensor]:
    extra = {k: v for k, v in s.items() if k not in ("master", "grad", "exp_avg", "exp_avg_sq")}
    return adamw_reference_mode(
        s["master"],
        s["grad"],
        s["exp_avg"],
        s["exp_avg_sq"],
        lr=LR,
        step=step,
        grad_scale=SCALE,
        **HP,
        master_mode=master_mode,
        states=states,
        sr_offset=sr_offset,
        **extra,
    )


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 8)


def check_bf16(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1 bf16 ulp of the reference's rounding everywhere, and equal on all but MAX_OFF."""
    err = (got.double() - want).abs()
    ulp = _bf16_ulp(want.abs().maximum(got.double().abs()))
    assert (err <= ulp).all(), f"{name}: {int((err > ulp).sum())} values > 1 bf16 ulp off"
    off = int((err > 0).sum())
    assert off <= MAX_OFF * got.numel(), f"{name}: {off}/{got.numel()} values 1 ulp off"


def check_codes(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.to(torch.int64) - want).abs()
    assert int(diff.max()) <= 1, f"{name}: a code {int(diff.max())} off the reference's"
    off = int((diff > 0).sum())
    assert off <= MAX_OFF * got.numel(), f"{name}: {off}/{got.numel()} codes off by one"


def check_step(s0: dict, s: dict, ref: dict, master_mode: str, states: str, step: int) -> None:
    # Magnitudes the fp32 errors are relative to (see tests/kernels/test_kernels.py `_magnitudes`).
    m_mag = s0_m_mag(s0, states)
    denom = ref["v_exact"].sqrt() / math.sqrt(1 - HP["beta2"] ** step) + HP["eps"]
    p_mag = ref["p_exact"].abs() + LR / (1 - HP["beta1"] ** step) * m_mag / denom
    tol_p = ULPS * U32 * p_mag
    if master_mode == "fp32":
        assert ((s["master"].double() - ref["master"]).abs() <= tol_p).all(), "fp32 master"
    else:
        check_bf16("master", s["master"], ref["master"])
    if master_mode == "bf16-kahan":
        # p + comp carries the exact update up to comp's own rounding (2**-9 of |comp| <=
        # 2**-18 |p|), whichever way p rounded.
        eff = s["master"].double() + s["kahan"].double()
        bad = (eff - ref["p_exact"]).abs() > 2.0**-17 * ref["p_exact"].abs() + tol_p
        assert not bad.any(), f"param + comp off the exact master at {int(bad.sum())} elements"
    if states == "fp32":
        assert ((s["exp_avg"].double() - ref["m_exact"]).abs() <= ULPS * U32 * m_mag).all()
        assert (
            (s["exp_avg_sq"].double() - ref["v_exact"]).abs() <= ULPS * U32 * ref["v_exact"]
        ).all()
    elif states == "bf16":
        check_bf16("exp_avg", s["exp_avg"], ref["exp_avg"])
        check_bf16("exp_avg_sq", s["exp_avg_sq"], ref["exp_avg_sq"])
    else:
        check_codes("exp_avg", s["exp_avg"], ref["exp_avg"])
        check_codes("exp_avg_sq", s["exp_avg_sq"], ref["exp_avg_sq"])
        # A scale is one element's fp32 value (the block's absmax): within its fp32 error.
        blk_m = m_mag.view(-1, QBLOCK).amax(dim=1)
        assert (
            (s["exp_avg_scale"].double() - ref["exp_avg_scale"]).abs() <= ULPS * U32 * blk_m
        ).all(), "exp_avg scales"
        assert (
            (s["exp_avg_sq_scale"].double() - ref["exp_avg_sq_scale"]).abs()
            <= ULPS * U32 * ref["exp_avg_sq_scale"]
        ).all(), "exp_avg_sq scales"


def s0_m_mag(s0: dict, states: str) -> torch.Tensor:
    m = (
        dequantize_blockwise(s0["exp_avg"], s0["exp_avg_scale"], signed=True)
        if states == "int8"
        else s0["exp_avg"].float()
    )
    return m.double().abs() + s0["grad"].double().abs() * SCALE


@pytest.mark.parametrize(
    "master_mode,states", fast_only(COMBOS, FAST_COMBOS.__contains__), ids=lambda x: x
)
def test_mode_matches_float64_reference_over_steps(backend, master_mode, states):
    s = make_state(N, master_mode, states, seed=len(master_mode) * 7 + len(states))
    gen = torch.Generator().manual_seed(99)
    for step in (1, 2, 7):  # step 1: bias corrections at their extreme
        s0 = {k: v.clone() for k, v in s.items()}
        ref = reference(s0, master_mode, states, step)
        run(s, master_mode, states, step)
        check_step(s0, s, ref, master_mode, states, step)
        s["grad"] = (torch.randn(N, generator=gen) * 2).bfloat16()


# fp32/fp32 is torch._fused_adamw_ on CPU, within ulps of the interpreter
# (tests/kernels/test_kernels.py).
@pytest.mark.interpreter
@pytest.mark.parametrize(
    "master_mode,states",
    fast_only([c for c in COMBOS if c != ("fp32", "fp32")], FAST_COMBOS.__contains__),
    ids=lambda x: x,
)
def test_torch_path_is_bitwise_the_interpreter(monkeypatch, master_mode, states):
    results = {}
    for b in BACKENDS:
        monkeypatch.setenv("FUSEDZERO_BACKEND", b)
        s = make_state(N, master_mode, states, seed=4)
        run(s, master_mode, states, step=3, sr_offset=77)
        results[b] = s
    for k, t in results["triton"].items():
        c = results["torch"][k]
        same = t.view(torch.uint8) == c.view(torch.uint8)
        assert same.all(), f"{k}: {int((~same).sum())} bytes differ between the two paths"


LAYOUT_CASES = [("bf16-kahan", "int8"), ("bf16-sr", "bf16"), ("fp32", "int8"), ("bf16", "fp32")]


@pytest.mark.parametrize("master_mode,states", LAYOUT_CASES, ids=lambda x: x)
def test_bucketed_strided_layout_matches_contiguous(backend, master_mode, states):
    # The param and grad as a rank's pieces of 3 buckets of full buffers (different strides and
    # bases); the local streams (states, scales, comp) and the SR index are the local layout.
    num_buckets, world, rank, shard = 3, 4, 1, 2 * QBLOCK
    bucket, g_stride, g_base = world * shard, world * shard + 16, rank * shard + 8
    s = make_state(num_buckets * shard, master_mode, states, seed=21)
    want = {k: v.clone() for k, v in s.items()}
    run(want, master_mode, states, step=4, sr_offset=3)
    p_buf = torch.full((num_buckets * bucket,), math.nan, dtype=s["master"].dtype)
    g_buf = torch.full((num_buckets * g_stride,), math.nan, dtype=torch.bfloat16)
    for k in range(num_buckets):
        piece = slice(k * shard, (k + 1) * shard)
        p_buf[k * bucket + rank * shard :][:shard] = s["master"][piece]
        g_buf[k * g_stride + g_base :][:shard] = s["grad"][piece]
    run(
        s,
        master_mode,
        states,
        step=4,
        sr_offset=3,
        master=Strided(p_buf, bucket, rank * shard),
        grad=Strided(g_buf, g_stride, g_base),
        num_buckets=num_buckets,
        shard_numel=shard,
    )
    got = torch.cat([p_buf[k * bucket + rank * shard :][:shard] for k in range(num_buckets)])
    assert torch.equal(got, want["master"]), "strided master pieces differ from contiguous"
    for k in want:
        if k not in ("master", "grad"):
            assert torch.equal(s[k], want[k]), f"{k} differs from the contiguous update"
    assert p_buf.isnan().sum() == num_buckets * (bucket - shard), "written outside the pieces"


@pytest.mark.parametrize(
    "master_mode,states",
    [("bf16-kahan", "int8"), ("bf16-sr", "bf16"), ("fp32", "int8")],
    ids=lambda x: x,
)
def test_skip_leaves_everything_bitwise_unchanged(backend, master_mode, states):
    s = make_state(N, master_mode, states, seed=8)
    s["grad"][5] = math.inf
    s0 = {k: v.clone() for k, v in s.items()}
    run(s, master_mode, states, step=2, skip=1)
    for k, v in s0.items():
        assert torch.equal(s[k].view(torch.uint8), v.view(torch.uint8)), f"{k} changed on skip"
