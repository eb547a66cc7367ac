"""Muon's element-wise launches and batched Newton-Schulz against torch.optim.Muon.

`FUSEDZERO_BACKEND=triton` runs the Triton kernel code in the interpreter; `torch` runs the torch
path. The composition momentum launch -> `newton_schulz` -> update launch is checked bit for bit
against torch.optim.Muon's step; the kernels against the torch path over every dtype variant and
edge size.

About internals: fusedzero.kernels._muon, fusedzero.kernels._compile_muon.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from fusedzero.kernels import (
    LAUNCHES,
    MomentumPiece,
    MuonPlan,
    MuonRow,
    UpdatePiece,
    _muon as muon_mod,
    lr_ratio,
    newton_schulz,
    ns_flops,
)

from _helpers import compile_offline

BLOCK = muon_mod.BLOCK
SIZES = (1, 17, BLOCK - 1, BLOCK + 1, 2053)  # 2053: a prime past two blocks
CPU = torch.device("cpu")
NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
# lr values exact in fp32, so torch.optim.Muon's Python floats and our fp32 lr vector agree.
LR0, LR1 = float(torch.tensor(0.02)), float(torch.tensor(0.005))


@pytest.fixture(params=("triton", "torch"))
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FUSEDZERO_BACKEND", request.param)
    return request.param


def _scalars(scale: float = 1.0, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([scale]), torch.tensor([float(skip)])


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a.float() != b.float()).nonzero()
    if len(bad) == 0:
        return "equal"
    i = tuple(bad[0].tolist())
    return f"{len(bad)} differ, first at {i}: {a[i].item()!r} vs {b[i].item()!r}"


@pytest.mark.parametrize("adjust_lr_fn", ("original", "match_rms_adamw"))
@pytest.mark.parametrize("nesterov", (True, False))
def test_composition_is_bitwise_torch_optim_muon(backend, nesterov, adjust_lr_fn):
    """Three matrices (wide, tall, square; two param groups with their own lr and weight decay)
    in one flat fp32 master, one momentum launch, per-matrix `newton_schulz`, one update launch,
    with a grad multiplier: params, momentum buffers and the bf16 param copy equal
    torch.optim.Muon's bit for bit over four steps."""
    shapes, groups = [(64, 96), (96, 64), (48, 48)], [0, 0, 1]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in shapes]
    ref = [torch.nn.Parameter(w.clone()) for w in init]
    hp = dict(momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt = torch.optim.Muon(
        [
            {"params": ref[:2], "lr": LR0, "weight_decay": 0.1},
            {"params": ref[2:], "lr": LR1, "weight_decay": 0.05},
        ],
        **hp,
    )
    # Every matrix at a 128-element offset of one flat buffer per stream, as the layout gives.
    offs, cur = [], 0
    for s in shapes:
        offs.append(cur)
        cur += -(-s[0] * s[1] // 128) * 128
    master, grad, buf = torch.zeros(cur), torch.zeros(cur), torch.zeros(cur)
    ns_in, out = torch.zeros(cur, dtype=torch.bfloat16), torch.zeros(cur, dtype=torch.bfloat16)
    view = [lambda t, o=o, s=s: t[o : o + s[0] * s[1]].view(s) for o, s in zip(offs, shapes)]
    for v, w in zip(view, init):
        v(master).copy_(w)
    rows = [
        MuonRow(g, lr_ratio(adjust_lr_fn, *s), 0.9, nesterov, (0.1, 0.05)[g])
        for s, g in zip(shapes, groups)
    ]
    plan = MuonPlan(
        [MomentumPiece(v(grad), v(buf), v(ns_in), i) for i, v in enumerate(view)],
        [UpdatePiece(v(master), v(ns_in), v(out), i) for i, v in enumerate(view)],
        rows,
        2,
        CPU,
        require_aligned=backend == "triton",
    )
    lr = torch.tensor([LR0, LR1])
    scale = float(torch.tensor(0.37))  # averaging/clip folded in: not a power of two
    for step in range(4):
        gs = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(ref, gs):
            p.grad = g * scale  # the fp32 product the kernel forms
        opt.step()
        for v, g in zip(view, gs):
            v(grad).copy_(g)
        plan.momentum(lr, *_scalars(scale))
        for v in view:
            newton_schulz(v(ns_in), *NS, out=v(ns_in))
        plan.update(_scalars()[1])
        for i, (v, p) in enumerate(zip(view, ref)):
            assert torch.equal(v(master), p.detach()), (
                f"step {step} matrix {shapes[i]}: {_first_diff(v(master), p.detach())}"
            )
            b = opt.state[p]["momentum_buffer"]
            assert torch.equal(v(buf), b), f"step {step} buf {i}: {_first_diff(v(buf), b)}"
            assert torch.equal(v(out), p.detach().bfloat16())


def _momentum_case(n: int, g_dtype, b_dtype, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(n, generator=gen) * 3).to(g_dtype),
        (torch.randn(n, generator=gen)).to(b_dtype),
        torch.full((n,), 7.0).to(torch.bfloat16),
    )


def _run_momentum(be: str, mp: pytest.MonkeyPatch, g_dtype, b_dtype, ns_dtype, skip: int):
    """Every edge size in one launch, rows alternating nesterov on/off and momentum above and
    below 0.5 (both lerp branches); returns the bufs and NS inputs."""
    mp.setenv("FUSEDZERO_BACKEND", be)
    rows = [
        MuonRow(0, 1.0, 0.95, True, 0.0),
        MuonRow(0, 1.0, 0.3, False, 0.0),
        MuonRow(0, 1.0, 0.3, True, 0.0),
    ]
    pieces = []
    for i, n in enumerate(SIZES):
        g, b, _ = _momentum_case(n, g_dtype, b_dtype, i)
        pieces.append(MomentumPiece(g, b, torch.zeros(n, dtype=ns_dtype), i % 3))
    plan = MuonPlan(pieces, [], rows, 1, CPU)
    plan.momentum(torch.tensor([0.01]), *_scalars(float(torch.tensor(0.37)), skip))
    return [(p.buf, p.ns_in) for p in pieces]


@pytest.mark.interpreter
@pytest.mark.parametrize("ns_dtype", muon_mod.NS_DTYPES, ids=str)
@pytest.mark.parametrize("b_dtype", muon_mod.BUF_DTYPES, ids=str)
@pytest.mark.parametrize("g_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_momentum_kernel_matches_torch_path(monkeypatch, g_dtype, b_dtype, ns_dtype):
    """The momentum kernel in the interpreter equals the torch path bitwise (buffer and NS
    input) on sizes 1, 17, BLOCK-1, BLOCK+1 and a prime, for every dtype variant."""
    k = _run_momentum("triton", monkeypatch, g_dtype, b_dtype, ns_dtype, 0)
    t = _run_momentum("torch", monkeypatch, g_dtype, b_dtype, ns_dtype, 0)
    for n, (kb, kn), (tb, tn) in zip(SIZES, k, t):
        assert torch.equal(kb, tb), f"n={n} buf: {_first_diff(kb, tb)}"
        assert torch.equal(kn, tn), f"n={n} ns_in: {_first_diff(kn, tn)}"


def _run_update(be: str, mp: pytest.MonkeyPatch, u_dtype, out_dtype, skip: int):
    mp.setenv("FUSEDZERO_BACKEND", be)
    rows = [MuonRow(0, 1.5, 0.95, True, 0.1), MuonRow(1, 0.2 * 64**0.5, 0.95, True, 0.0)]
    pieces = []
    for i, n in enumerate(SIZES):
        gen = torch.Generator().manual_seed(i)
        m, u = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(u_dtype)
        o = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
        pieces.append(UpdatePiece(m, u, o, i % 2))
    plan = MuonPlan([], pieces, rows, 2, CPU)
    plan.rows.update(torch.tensor([LR0, LR1]), torch.ones(1))
    plan.update(torch.tensor([float(skip)]))
    return [(p.master, p.out) for p in pieces]


@pytest.mark.interpreter
@pytest.mark.parametrize("out_dtype", (None, *muon_mod.OUT_DTYPES), ids=str)
@pytest.mark.parametrize("u_dtype", muon_mod.NS_DTYPES, ids=str)
def test_update_kernel_matches_torch_path(monkeypatch, u_dtype, out_dtype):
    """The update kernel in the interpreter equals the torch path bitwise (master and the
    low-precision copy) on the edge sizes, for every dtype variant."""
    k = _run_update("triton", monkeypatch, u_dtype, out_dtype, 0)
    t = _run_update("torch", monkeypatch, u_dtype, out_dtype, 0)
    for n, (km, ko), (tm, to) in zip(SIZES, k, t):
        assert torch.equal(km, tm), f"n={n} master: {_first_diff(km, tm)}"
        if ko is not None:
            assert torch.equal(ko, to), f"n={n} out: {_first_diff(ko, to)}"


def test_skip_leaves_state_untouched(backend, monkeypatch):
    """skip != 0 masks every state store: momentum buffers, masters and out copies keep their
    values (the NS input, scratch, is still written)."""
    before = [_momentum_case(n, torch.float32, torch.float32, i)[1] for i, n in enumerate(SIZES)]
    after = _run_momentum(backend, monkeypatch, torch.float32, torch.float32, torch.bfloat16, 1)
    for b0, (b1, ns) in zip(before, after):
        assert torch.equal(b0, b1)
        assert not torch.equal(ns, torch.full_like(ns, 7.0))
    for i, (m, o) in enumerate(_run_update(backend, monkeypatch, torch.bfloat16, torch.float32, 1)):
        gen = torch.Generator().manual_seed(i)
        assert torch.equal(m, torch.randn(m.numel(), generator=gen))
        assert torch.equal(o, torch.zeros_like(o))


def test_one_launch_each_and_no_host_read(backend):
    """A plan over several matrices and groups is one momentum and one update launch; the
    per-step columns come from device tensors (lr changed in place takes effect)."""
    ms = [torch.randn(n) for n in (256, 384)]
    ns = [torch.zeros(n, dtype=torch.bfloat16) for n in (256, 384)]
    plan = MuonPlan(
        [
            MomentumPiece(torch.randn(m.numel()), torch.zeros_like(m), n, i)
            for i, (m, n) in enumerate(zip(ms, ns))
        ],
        [UpdatePiece(m, n, None, i) for i, (m, n) in enumerate(zip(ms, ns))],
        [MuonRow(0, 1.0, 0.95, True, 0.1), MuonRow(1, 2.0, 0.95, True, 0.1)],
        2,
        CPU,
    )
    lr = torch.tensor([0.01, 0.02])
    LAUNCHES.clear()
    plan.momentum(lr, *_scalars())
    plan.update(_scalars()[1])
    assert LAUNCHES["muon_momentum"] == 1 and LAUNCHES["muon_update"] == 1
    lr.mul_(2)  # a scheduler writes the device tensor in place
    rows = plan.rows.update(lr, torch.ones(1))
    assert rows[1, muon_mod.MuonRowCol.NEG_LR].item() == pytest.approx(-0.08)


@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (128, 128), (17, 33), (33, 17)])
def test_newton_schulz_2d_is_torch_bitwise(shape):
    """The 2-D path is torch's `_zeropower_via_newtonschulz` bit for bit (tall inputs are
    transposed, as torch does)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(newton_schulz(x.clone(), *NS), _zeropower_via_newtonschulz(x, *NS))


# (256, 768): large enough for CPU bmm's blocked path, ~4 s of bf16 matmuls: the slow tier.
@pytest.mark.parametrize(
    "shape", [(64, 96), (96, 64), pytest.param((256, 768), marks=pytest.mark.slow), (17, 33)]
)
def test_newton_schulz_batched_equals_per_matrix(shape):
    """A [B, m, n] stack orthogonalised in one batched pass equals each matrix done alone, bit
    for bit on CPU (bmm accumulates each matrix as mm does). Noise control: one matrix's input
    scaled by 1 + 2**-8 moves its output by >= 2**-9, so a difference would show."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, *shape, generator=gen)
    per = torch.stack([_zeropower_via_newtonschulz(m, *NS) for m in x])
    out = torch.empty(5, *shape, dtype=torch.bfloat16)
    got = newton_schulz(x.clone(), *NS, out=out)
    assert got is out
    assert torch.equal(got, per), _first_diff(got, per)
    nudged = _zeropower_via_newtonschulz(x[0] * (1 + 2**-8), *NS)
    assert (nudged.float() - per[0].float()).abs().max() >= 2**-9


def test_lr_ratio_and_flops():
    """adjust_lr's ratio is torch's for both functions and tall, wide and square shapes; NS
    FLOPs are 5 * (4 s^2 l + 2 s^3)."""
    for fn in (None, "original", "match_rms_adamw"):
        for r, c in ((4096, 1024), (1024, 4096), (768, 768), (14336, 4096)):
            assert lr_ratio(fn, r, c) * 0.02 == _adjust_lr(0.02, fn, torch.Size((r, c)))
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        lr_ratio("nope", 2, 2)
    assert ns_flops(1024, 4096) == 5 * (4 * 1024**2 * 4096 + 2 * 1024**3)
    assert ns_flops(4096, 1024) == ns_flops(1024, 4096)
    with pytest.raises(ValueError, match="ns_steps"):
        newton_schulz(torch.zeros(2, 2), ns_steps=100)


@pytest.mark.slow
def test_offline_compile_sm80_sm90(tmp_path):
    """Every variant of both kernels compiles for sm_80 and sm_90 with no fp64 instruction, no
    spill, no shared memory, fp32 streams in 128-bit vectors, and the fused multiply-adds
    torch's lerp and add compute (2 lerps x 2 branches, 1 add; 4 elements per thread)."""
    rows = compile_offline("_compile_muon", tmp_path / "muon.json", "--capability", "80", "90")
    assert len(rows) == 2 * (12 + 8)
    for r in rows:
        where = f"sm_{r['capability']} {r['kernel']} {r['dtypes']}"
        assert r["f64_instructions"] == 0, where
        assert r["usage"]["LOCAL"] == 0 and r["usage"]["STACK"] == 0, (where, r["usage"])
        assert r["shared_bytes"] == 0, where
        assert r["usage"]["REG"] <= 64, (where, r["usage"])
        assert r["fma"] == (16 if r["kernel"] == "momentum" else 4), where
        vec = {a for a in r["accesses"] if ".global" in a and ".v" in a}
        assert vec <= {
            "ld.global.v4.b32",
            "ld.global.v2.b32",
            "st.global.v4.b32",
            "st.global.v2.b32",
        }, (where, r["accesses"])
        # Each stream in one vector access per thread; the fp32 ones 128-bit.
        if r["kernel"] == "momentum":
            g, b, n = r["dtypes"]
            streams = [g, b, b, n]  # grad read, buf read and written, NS input written
        else:
            u, o = r["dtypes"]
            streams = ["torch.float32"] * 2 + [u] + ([o] if o != "None" else [])
        want = sum(d == "torch.float32" for d in streams)
        got = sum(n for a, n in r["accesses"].items() if a.endswith("global.v4.b32"))
        assert got == want, (where, r["accesses"])
