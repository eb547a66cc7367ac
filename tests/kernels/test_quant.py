"""Wire quantize / dequantize-sum kernels (kernels/_quant.py): the Triton kernels in the
interpreter and the torch path agree bitwise, and both match a float64 reference within the
quantization bound (tests/zero/test_wire.py derives it): int8 |deq - x| <= absmax / 254 * (1 +
2^-14) per block, bf16 |deq - x| <= |x| 2^-8, fp32 exact; the fp32 sum of W chunks within
(W - 1) u of the sum of |values|, u = 2^-24, plus one rounding for the scale and the store.

About an internal: fusedzero.kernels._quant."""

from __future__ import annotations

import pytest
import torch

from fusedzero.kernels import LAUNCHES
from fusedzero.kernels._quant import (
    WBLOCK,
    WireFormat,
    chunk_bytes,
    dequant_sum_into,
    dequantize_into,
    new_packed,
    quantize_into,
    unpack,
)

from _helpers import compile_offline

U32 = 2.0**-24
FORMATS = list(WireFormat)
# (chunks, chunk_numel, numel of the input): one block, several blocks and a partial tail,
# an input of 1 element (the rest zero-padded), BLOCK - 1 and BLOCK + 1 into a chunk.
SIZES = [
    (3, 2 * WBLOCK, 3 * 2 * WBLOCK - 17),
    (4, WBLOCK, 1),
    (2, 9 * WBLOCK, WBLOCK - 1),
    (5, WBLOCK, 3 * WBLOCK + 1),
]


def _backend(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEDZERO_BACKEND", name)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= 10.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 8 - 4)  # 8 decades
    if n > 3:
        x[3] = 0.0
    return x.float()


def _run(
    fmt: WireFormat, chunks: int, S: int, n: int, out_dtype: torch.dtype, accumulate: bool
) -> dict[str, torch.Tensor]:
    x = _x(n)
    packed = new_packed(fmt, chunks, S, x.device)
    quantize_into(x, packed, fmt, chunks, S)
    out = _x(S - 5, seed=1).to(out_dtype)
    dequant_sum_into(out, packed, fmt, chunks, S, scale=1.0 / chunks, accumulate=accumulate)
    full = torch.full((chunks * S,), 7.0, dtype=out_dtype)
    dequantize_into(full, packed, fmt, chunks, S, keep=chunks - 1)
    return {"packed": packed, "out": out, "full": full}


@pytest.mark.interpreter  # FUSEDZERO_BACKEND=triton on CPU tensors
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("chunks,S,n", SIZES, ids=str)
def test_interpreted_kernels_equal_the_torch_path_bitwise(fmt, chunks, S, n, monkeypatch):
    got = {}
    for be in ("triton", "torch"):
        _backend(be, monkeypatch)
        got[be] = _run(
            fmt, chunks, S, n, torch.bfloat16 if n % 2 else torch.float32, accumulate=n % 3 == 0
        )
    for k in ("packed", "out", "full"):
        a, b = got["triton"][k], got["torch"][k]
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.uint8 else a, b), (
            k,
            (a.float() - b.float()).abs().max()
            if a.dtype != torch.uint8
            else (a != b).nonzero()[:5],
        )


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantize_and_dequant_sum_match_float64_within_the_bound(fmt, monkeypatch):
    """On the torch path; the interpreted kernels equal it bitwise (the test above)."""
    _backend("torch", monkeypatch)
    chunks, S = 4, 3 * WBLOCK
    xs = [_x(chunks * S, seed=10 + r) for r in range(chunks)]
    packs = []
    for x in xs:
        p = new_packed(fmt, chunks, S, x.device)
        quantize_into(x, p, fmt, chunks, S)
        vals, scales = unpack(p, fmt, S)
        # Decoded in float64 from the bytes, independently of the kernels.
        deq = (
            vals.double()
            if scales is None
            else (vals.double().view(chunks, -1, WBLOCK) * scales.double()[:, :, None]).reshape(
                chunks, S
            )
        )
        xd = x.double().view(chunks, S)
        if fmt is WireFormat.INT8:
            a = xd.view(chunks, -1, WBLOCK).abs().amax(-1, keepdim=True)
            bound = (a / 254 * (1 + 2.0**-14)).expand(-1, -1, WBLOCK).reshape(chunks, S)
            assert vals.abs().max() <= 127
            # The scale is absmax / 127 rounded once to fp32.
            want = (a.squeeze(-1) / 127).float().double()
            assert torch.equal(scales.double(), want)
        elif fmt is WireFormat.BF16:
            bound = xd.abs() * 2.0**-8
        else:
            bound = torch.zeros_like(xd)
        assert ((deq - xd).abs() <= bound).all(), (fmt, ((deq - xd).abs() - bound).max())
        packs.append(deq)
    # Rank r's bytes hold chunk c of its bucket; the all-to-all would hand chunk c of every
    # rank to rank c. Emulate the receive for chunk 1 and sum it.
    recv = new_packed(fmt, chunks, S, xs[0].device)
    cb = chunk_bytes(fmt, S)
    for r, x in enumerate(xs):
        p = new_packed(fmt, chunks, S, x.device)
        quantize_into(x, p, fmt, chunks, S)
        recv[r * cb : (r + 1) * cb] = p[cb : 2 * cb]
    terms = torch.stack([d[1] for d in packs])  # (chunks, S) float64
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(S, dtype=out_dtype)
        dequant_sum_into(out, recv, fmt, chunks, S, scale=1.0 / chunks)
        want = terms.sum(0) / chunks
        store = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
        tol = (
            chunks * U32 * terms.abs().sum(0) / chunks
            + want.abs() * store[out_dtype]
            + (6e-8 if out_dtype == torch.float16 else 0.0)
        )  # fp16 subnormal spacing / 2
        err = (out.double() - want).abs()
        assert (err <= tol).all(), (fmt, out_dtype, (err - tol).max())


@pytest.mark.interpreter  # both backends: the torch one is compared with the kernels' bytes
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_nan_arrives_as_nan_never_as_a_finite_value(fmt, backend, monkeypatch):
    """See [Note: a NaN on the wire]. One NaN (no inf) in a block of rank 0's chunk 1: after the
    quantize and the dequantize-sum, the NaN's place is NaN (int8: its whole block, whose scale
    is NaN) and nothing else is, on both paths, which agree. Before: the kernel's
    `tl.max` dropped the NaN (maxnum), and the block arrived finite (int8: about +absmax), which
    the step's non-finite check cannot see."""
    chunks, S = 2, 2 * WBLOCK
    x = _x(chunks * S)
    nan_at = S + WBLOCK + 5  # chunk 1, its second block
    x[nan_at] = float("nan")
    packed = {}
    for be in ("triton", "torch"):
        _backend(be, monkeypatch)
        packed[be] = new_packed(fmt, chunks, S, x.device)
        quantize_into(x, packed[be], fmt, chunks, S)
    if fmt is WireFormat.INT8:  # codes and scales bitwise (a NaN's code is 0 on both)
        assert torch.equal(packed["triton"], packed["torch"])
    else:  # values, NaN for NaN (torch's cast writes bf16 NaN as 0xFFFF, the kernel 0x7FC0)
        torch.testing.assert_close(
            unpack(packed["triton"], fmt, S)[0],
            unpack(packed["torch"], fmt, S)[0],
            rtol=0,
            atol=0,
            equal_nan=True,
        )
    _backend(backend, monkeypatch)
    recv = new_packed(fmt, chunks, S, x.device)  # chunk 1 of this rank and of a finite one
    cb = chunk_bytes(fmt, S)
    recv[:cb] = packed[backend][cb:]
    quantize_into(_x(chunks * S, seed=5), packed["torch"], fmt, chunks, S)
    recv[cb:] = packed["torch"][cb:]
    out = torch.empty(S)
    dequant_sum_into(out, recv, fmt, chunks, S, scale=0.5)
    nan = torch.zeros(S, dtype=torch.bool)
    if fmt is WireFormat.INT8:
        nan[WBLOCK : 2 * WBLOCK] = True
    else:
        nan[nan_at - S] = True
    assert torch.equal(out.isnan(), nan), out.isnan().nonzero().flatten().tolist()
    assert out[~nan].isfinite().all()


def test_accumulate_adds_into_the_shard_and_dequantize_keeps_the_own_chunk(monkeypatch):
    _backend("torch", monkeypatch)
    fmt, chunks, S = WireFormat.INT8, 2, WBLOCK
    x = _x(chunks * S)
    p = new_packed(fmt, chunks, S, x.device)
    quantize_into(x, p, fmt, chunks, S)
    base = _x(S, seed=3)
    acc = base.clone()
    dequant_sum_into(acc, p, fmt, chunks, S, scale=0.5, accumulate=True)
    fresh = torch.empty(S)
    dequant_sum_into(fresh, p, fmt, chunks, S, scale=0.5)
    assert torch.equal(acc, base + fresh)
    full = torch.full((chunks * S,), 7.0)
    dequantize_into(full, p, fmt, chunks, S, keep=0)
    assert (full[:S] == 7.0).all() and not (full[S:] == 7.0).any()


def test_one_launch_each_way_and_errors_name_the_sizes(monkeypatch):
    _backend("torch", monkeypatch)
    fmt, chunks, S = WireFormat.BF16, 3, WBLOCK
    p = new_packed(fmt, chunks, S, torch.device("cpu"))
    before = dict(LAUNCHES)
    quantize_into(_x(chunks * S), p, fmt, chunks, S)
    dequant_sum_into(torch.empty(S), p, fmt, chunks, S)
    assert LAUNCHES["wire_quantize"] - before.get("wire_quantize", 0) == 1
    assert LAUNCHES["wire_dequant_sum"] - before.get("wire_dequant_sum", 0) == 1
    with pytest.raises(ValueError, match="at most 384 elements"):
        quantize_into(torch.zeros(385), p, fmt, chunks, S)
    with pytest.raises(ValueError, match="768 bytes"):
        quantize_into(torch.zeros(4), p[:-2], fmt, chunks, S)
    with pytest.raises(ValueError, match="multiple of 128"):
        chunk_bytes(WireFormat.INT8, 100)
    with pytest.raises(TypeError, match="int32"):
        dequant_sum_into(torch.zeros(4, dtype=torch.int32), p, fmt, chunks, S)


@pytest.mark.slow  # compiles in a child process
def test_offline_compile_for_sm90_vectorises_and_never_spills(tmp_path) -> None:
    """The kernels compiled for sm_90 as the launchers build them: no spills, no fp64, no int32
    offset products, and the int8 codes and fp32 values move in 128-bit vectors."""
    rows = compile_offline("_compile_quant", tmp_path / "quant.json")
    assert {(r["kernel"], r["wire"]) for r in rows} >= {
        (k, f.value) for k in ("quantize", "dequant_sum", "dequantize") for f in WireFormat
    }
    for r in rows:
        what = (r["kernel"], r["wire"], r["out_dtype"])
        assert r["usage"]["LOCAL"] == 0 and r["usage"]["STACK"] == 0, what
        assert r["f64_instructions"] == 0, what
        # Offsets in int64: dequant_sum's chunk r at r * chunk_stride was an int32 product,
        # wrapping in a bucket of 2^31 elements or more (before: 1-2 per variant there).
        assert r["i32_multiplies"] == 0, what
        assert r["usage"]["REG"] <= 64, what
        acc = r["accesses"]
        if r["kernel"] == "dequant_sum" and r["wire"] == "fp32":
            assert any(a.startswith("ld.global") and ".v4" in a for a in acc), (what, acc)
        if r["kernel"] == "quantize" and r["wire"] == "int8":
            # 8 int8 codes per thread of a 128-wide row: packed stores, not one byte each.
            assert not any(a.startswith("st.global.b8") or a == "st.global.u8" for a in acc), (
                what,
                acc,
            )
