"""Offline compilation for sm_80/sm_90 (no GPU needed): the PTX must move every fp32 stream in
128-bit vector accesses, never spill, and the AdamW kernel must use no shared memory and no fp64.

conftest.py imports triton in interpreter mode, where nothing can be compiled, so the variants are
compiled once in a child process (`python -m fusedzero.kernels._compile --json`) and the tests read
its output.

About internals: fusedzero.kernels._adamw, fusedzero.kernels._compile,
fusedzero.kernels._memory_modes, fusedzero.kernels._sum_of_squares.
"""

from __future__ import annotations

import pytest
import torch
import triton

from fusedzero.kernels import (
    _adamw as adamw,
    _memory_modes as modes,
    _sum_of_squares as sum_of_squares,
)
from fusedzero.kernels._compile import compile_for

from _helpers import compile_offline

CAPABILITIES = (80, 90)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUTS = (None, torch.bfloat16, torch.float16, torch.float32)
# 64 registers per thread still fit 1024 threads per SM (64K registers: 4 blocks of 8 warps);
# the kernels sit at 20-42 today. Crossing it halves the resident warps that keep loads in flight.
MAX_REGS = 64
# The memory modes (kernels/_memory_modes.py) measure 54-80: the int8 variants quantize 8 blocks per
# program and SR hashes per element. 80 registers still fit 6 blocks (24 warps) per SM; the bound
# catches a variant that starts to spill or halves occupancy again.
MAX_REGS_MODES = 80
MODE_VARIANTS = [
    (m, st) for m in modes.MASTER_MODES for st in modes.STATE_MODES if (m, st) != ("fp32", "fp32")
]
ADAMW_VARIANTS = [(g, o, cap) for g in DTYPES for o in OUTS for cap in CAPABILITIES]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict]:
    rows = compile_offline(
        "_compile",
        tmp_path_factory.mktemp("compile") / "variants.json",
        "--capability",
        *map(str, CAPABILITIES),
        timeout=240,
    )
    return {
        (
            r["kernel"],
            r["capability"],
            r["grad_dtype"],
            r["out_dtype"],
            r["master_mode"],
            r["states"],
        ): r
        for r in rows
    }


def _row(
    compiled: dict,
    kernel: str,
    cap: int,
    g: torch.dtype,
    o: torch.dtype | None,
    master_mode: str = "fp32",
    states: str = "fp32",
) -> dict:
    return compiled[(kernel, cap, str(g), str(o), master_mode, states)]


def _mode_row(compiled: dict, cap: int, master_mode: str, states: str) -> dict:
    o = torch.bfloat16 if master_mode == "fp32" else None  # the variants _compile.py builds
    return _row(compiled, "adamw", cap, torch.bfloat16, o, master_mode, states)


def _vectors_per_thread(numel: int, num_warps: int, elem_bytes: int) -> int:
    """128-bit accesses one thread needs for its share of one stream of a block."""
    per_thread_bytes = numel // (num_warps * 32) * elem_bytes
    assert per_thread_bytes % 16 == 0, "each thread's share must be whole 128-bit vectors"
    return per_thread_bytes // 16


def _global(row: dict) -> dict[str, int]:
    return {a: n for a, n in row["accesses"].items() if ".global" in a}


def _vector(dt: torch.dtype, num_warps: int, block: int) -> str:
    """The access form of one thread's share of a stream when its elements are contiguous."""
    bits = block // (num_warps * 32) * dt.itemsize * 8
    return {128: "v4.b32", 64: "v2.b32"}[bits]


@pytest.mark.slow
@pytest.mark.parametrize("g,o,cap", ADAMW_VARIANTS, ids=str)
def test_adamw_ptx_streams_are_vectors_128bit_for_fp32(compiled, g, o, cap):
    row = _row(compiled, "adamw", cap, g, o)
    f32 = torch.float32
    vec = lambda dt: _vector(dt, adamw.NUM_WARPS, adamw.BLOCK)  # noqa: E731
    assert vec(f32) == "v4.b32", "every fp32 stream in one 128-bit access per thread"
    want: dict[str, int] = {}
    # Loads: master, exp_avg, exp_avg_sq, grad. Stores: master, exp_avg, exp_avg_sq, out.
    for form, dts in (("ld", (f32, f32, f32, g)), ("st", (f32, f32, f32) + (o,) * (o is not None))):
        for dt in dts:
            key = f"{form}.global.{vec(dt)}"
            want[key] = want.get(key, 0) + 1
    # The scalars: the program's piece (int32), its table entry (int64: 4 or 5 offsets, numel,
    # first program, row), 8 of the 9 row values (beta1 itself is not used), the skip flag.
    want["ld.global.b32"] = 1 + 8 + 1
    want["ld.global.b64"] = 7 + (o is not None)
    assert _global(row) == want, (
        f"sm_{cap} grad={g} out={o}: global accesses {_global(row)}, expected {want} "
        "(every stream in one vector access per thread, fp32 ones 128-bit)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("g,o,cap", ADAMW_VARIANTS, ids=str)
def test_adamw_has_no_shared_memory_and_no_fp64(compiled, g, o, cap):
    # 4 elements per thread for every stream (BLOCK 1024, 8 warps): 16-bit streams get the fp32
    # streams' layout, so no conversion through shared memory; the per-step rows are computed
    # in fp64 before the launch (kernels/_rows.py), none in this kernel.
    row = _row(compiled, "adamw", cap, g, o)
    assert not any(".shared" in a for a in row["accesses"]), row["accesses"]
    assert row["shared_bytes"] == 0 and row["f64_instructions"] == 0, row


@pytest.mark.slow
@pytest.mark.parametrize("cap", CAPABILITIES)
@pytest.mark.parametrize("g", DTYPES, ids=str)
def test_sumsq_ptx_loads_are_128bit_vectors(compiled, g, cap):
    row = _row(compiled, "sumsq", cap, g, None)
    want = {
        "ld.global.v4.b32": _vectors_per_thread(
            sum_of_squares.BLOCK, sum_of_squares.NUM_WARPS, g.itemsize
        ),
        "st.global.b32": 1,  # the block's partial sum
        "ld.global.b32": 1,
        "ld.global.b64": 3,
    }  # its piece, then offset, numel, first
    assert row["f64_instructions"] == 0
    assert _global(row) == want, f"sm_{cap} x={g}: global accesses {_global(row)}, want {want}"


@pytest.mark.slow
@pytest.mark.parametrize("cap", CAPABILITIES)
@pytest.mark.parametrize(
    "kernel,g,o",
    [("adamw", g, o) for g in DTYPES for o in OUTS] + [("sumsq", g, None) for g in DTYPES],
    ids=str,
)
def test_no_spills_and_register_budget(compiled, kernel, g, o, cap):
    row = _row(compiled, kernel, cap, g, o)
    assert not any(".local" in a for a in row["accesses"]), f"local memory: {row['accesses']}"
    assert ".local" not in row["ptx"]
    usage = row["usage"]
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"sm_{cap} {kernel} {g}/{o} spills: {usage}"
    assert usage["REG"] <= MAX_REGS, f"sm_{cap} {kernel} {g}/{o} uses {usage['REG']} registers"


@pytest.mark.slow
@pytest.mark.parametrize("cap", CAPABILITIES)
@pytest.mark.parametrize(
    "kernel,g,o",
    [("adamw", g, o) for g in DTYPES for o in OUTS] + [("sumsq", g, None) for g in DTYPES],
    ids=str,
)
def test_fp32_math_is_ieee_round_to_nearest_as_in_the_interpreter(compiled, kernel, g, o, cap):
    # tl.sqrt is sqrt.approx.ftz and `/` is div.full (2 ulp); FMA contraction fuses a*b+c with
    # one rounding instead of two. Any of them breaks agreement with the interpreter (numpy does
    # each fp32 op with IEEE rounding); see [Note: GPU vs interpreter numerics] in _adamw.py.
    ptx = _row(compiled, kernel, cap, g, o)["ptx"]
    for form in ("sqrt.approx", "div.full", "div.approx", "rsqrt", "fma.rn.f32"):
        assert form not in ptx, f"sm_{cap} {kernel} {g}/{o}: PTX contains {form}"
    if kernel == "adamw":
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx, f"sm_{cap} {g}/{o}: no IEEE sqrt/div"


def test_compile_for_in_process_compiles_or_refuses_interpreted_kernels():
    if isinstance(adamw._grouped_adamw_kernel, triton.runtime.JITFunction):  # not interpreting
        assert "st.global.v4.b32" in compile_for("adamw", 90, torch.bfloat16).asm["ptx"]
        return
    # conftest.py imported triton with TRITON_INTERPRET=1: the error must say what to do.
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0 python -m fusedzero.kernels"):
        compile_for("adamw", 90, torch.bfloat16, torch.bfloat16)


def test_compile_for_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kernel_name"):
        compile_for("adam", 90, torch.float32)
    with pytest.raises(ValueError, match="grad_dtype"):
        compile_for("adamw", 90, torch.float64)
    with pytest.raises(ValueError, match="out_dtype"):
        compile_for("sumsq", 90, torch.float32, torch.bfloat16)


def _mode_accesses(master_mode: str, states: str) -> dict[str, int]:
    """The global accesses one thread makes in a mode variant of the grouped kernel (bf16 grads;
    bf16 out with the fp32 master), 4 elements per thread: one 128-bit vector per fp32 stream,
    64-bit per bf16 stream, 32-bit per int8 code stream; plus the scalars: the program's piece,
    8 row values and the skip flag (32-bit), the table entry (64-bit: 4 stream offsets, numel,
    first, row; out, comp, the two scale offsets, the SR offset when the mode has them), one
    32-bit scale load and store per int8 state, the SR seed (64-bit) and step (32-bit)."""
    vec = lambda dt: _vector(dt, adamw.NUM_WARPS, adamw.BLOCK)  # noqa: E731
    f32, bf16 = torch.float32, torch.bfloat16
    form = {
        torch.float32: vec(f32),
        torch.bfloat16: vec(bf16),
        torch.int8: "b32",
        torch.uint8: "b32",
    }
    master = f32 if master_mode == "fp32" else bf16
    kahan, int8, sr = master_mode == "bf16-kahan", states == "int8", master_mode == "bf16-sr"
    out = master_mode == "fp32"
    state_dts = modes.STATE_DTYPES[states]
    loads = [master, bf16, *state_dts] + [bf16] * kahan
    stores = [master, *state_dts] + [bf16] * kahan + [bf16] * out
    want: dict[str, int] = {}
    for kind, dts in (("ld", loads), ("st", stores)):
        for dt in dts:
            key = f"{kind}.global.{form[dt]}"
            want[key] = want.get(key, 0) + 1
    want["ld.global.b32"] = want.get("ld.global.b32", 0) + 1 + 8 + 1 + 2 * int8 + sr
    want["ld.global.b64"] = 7 + out + kahan + 2 * int8 + 2 * sr
    if int8:
        want["st.global.b32"] = want.get("st.global.b32", 0) + 2
    return want


@pytest.mark.slow
@pytest.mark.parametrize("cap", CAPABILITIES)
@pytest.mark.parametrize("master_mode,states", MODE_VARIANTS, ids=str)
def test_mode_variants_access_widths_and_no_spills(compiled, master_mode, states, cap):
    row = _mode_row(compiled, cap, master_mode, states)
    want = _mode_accesses(master_mode, states)
    assert _global(row) == want, (
        f"sm_{cap} {master_mode}/{states}: global accesses {_global(row)}, expected {want}"
    )
    usage = row["usage"]
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and ".local" not in row["ptx"], usage
    assert usage["REG"] <= MAX_REGS_MODES, f"sm_{cap} {master_mode}/{states}: {usage}"
    for form in ("sqrt.approx", "div.full", "div.approx", "rsqrt", "fma.rn.f32"):
        assert form not in row["ptx"], f"sm_{cap} {master_mode}/{states}: PTX contains {form}"


@pytest.mark.slow
@pytest.mark.parametrize("cap", CAPABILITIES)
def test_mode_variants_move_the_bytes_bytes_per_param_counts(compiled, cap):
    # Bytes per thread of a program's BLOCK elements from the PTX's stream accesses (the access
    # map itself is asserted above), against bytes_per_param less the scales (per QBLOCK).
    width = {"v4.b32": 16, "v2.b32": 8}
    threads = adamw.NUM_WARPS * 32
    for master_mode, states in MODE_VARIANTS:
        acc = _global(_mode_row(compiled, cap, master_mode, states))
        streams = sum(
            n * width[a.split(".", 2)[2]] for a, n in acc.items() if a.split(".", 2)[2] in width
        )
        if states == "int8":  # 2 code loads and 2 code stores of 4 bytes (b32 beside scalars)
            streams += 4 * 4
        o = torch.bfloat16 if master_mode == "fp32" else None
        want = modes.bytes_per_param(master_mode, states, torch.bfloat16, o)
        scales = modes.stream_bytes(master_mode, states, torch.bfloat16, o).get("scales", 0.0)
        assert streams * threads / adamw.BLOCK == want - scales, (master_mode, states, acc)
