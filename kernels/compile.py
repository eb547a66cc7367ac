"""Compile the kernels ahead of time for a CUDA target, with no GPU present.

`compile_for` gives the same binary the runtime would build for 16-byte-aligned buffers, so tests
can assert on the PTX (vector widths, no spills) and benchmarks/README can quote register counts
without a device. It needs only Triton's bundled `ptxas` (and `cuobjdump` for `resource_usage`);
nothing here runs a kernel. Triton must have been imported without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedzero.kernels import adamw as _adamw
from fusedzero.kernels import modes as _modes
from fusedzero.kernels import sum_of_squares as _sumsq
from fusedzero.kernels._launch import ENABLE_FP_FUSION, GRAD_DTYPES

KERNELS = ("adamw", "sumsq")

_TRITON_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                 torch.int32: "i32", torch.int64: "i64", torch.bool: "i1", torch.int8: "i8",
                 torch.uint8: "u8"}

# Int arguments the launcher passes as sizes, strides and bases. The runtime marks an int divisible
# by 16 ("tt.divisibility") when it is; fusedzero/layout.py makes every bucket a multiple of
# world_size * 128 elements, so shards, strides and bases always are. Without it the compiler
# cannot prove `ptr + bucket * stride + base + offs` 16-byte aligned and falls back to scalar
# accesses (without these attrs the 128-bit checks in tests/test_compile.py fail).
_ADAMW_INTS = ("shard_numel", "master_stride", "master_base", "grad_stride", "grad_base",
               "out_stride", "out_base", "sr_offset")
_SUMSQ_INTS = ("shard_numel", "stride", "base")


def _jit_fn(module: Any, name: str) -> triton.runtime.JITFunction:
    fn = getattr(module, name)
    if not isinstance(fn, triton.runtime.JITFunction):
        # triton.jit decides at decoration time, and triton.language's own helpers (tl.sum, ...)
        # were decorated when triton was imported: nothing in this process can be compiled.
        raise RuntimeError(f"{name} was built for the Triton interpreter (TRITON_INTERPRET=1 when "
                           "triton was imported); compile in a process without it, e.g. "
                           "`TRITON_INTERPRET=0 python -m fusedzero.kernels.compile`")
    return fn


def compile_for(kernel_name: str, capability: int, grad_dtype: torch.dtype,
                out_dtype: torch.dtype | None = None, *, maximize: bool = False,
                int_dtype: str = "i32", step_dtype: torch.dtype = torch.float32,
                skip_dtype: torch.dtype = torch.int32, master_mode: str = "fp32",
                states: str = "fp32") -> Any:
    """Compile `kernel_name` ("adamw" or "sumsq") for `sm_{capability}`; returns Triton's
    CompiledKernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`).

    `grad_dtype` is the grad (adamw) or input (sumsq) dtype; `out_dtype` the adamw low-precision
    output, None for none. Every pointer and every size/stride/base is declared divisible by 16,
    as the runtime specialises them for our 16-aligned buffers. `int_dtype` is "i32" for shards
    under 2**31 elements (what the runtime picks), "i64" above. lr and grad_scale are fp32 tensors;
    `step_dtype`/`skip_dtype` only change the scalar prologue, not the streams. `master_mode` and
    `states` pick the memory-mode variant (kernels/modes.py); the SR seed is int64.
    """
    if kernel_name not in KERNELS:
        raise ValueError(f"kernel_name={kernel_name!r}, expected one of {KERNELS}")
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype {grad_dtype}, expected one of {GRAD_DTYPES}")
    g = _TRITON_DTYPE[grad_dtype]
    if kernel_name == "adamw":
        if out_dtype is not None and out_dtype not in _adamw.OUT_DTYPES:
            raise ValueError(f"out_dtype {out_dtype}, expected None or one of {_adamw.OUT_DTYPES}")
        _modes.check_modes(master_mode, states)
        if out_dtype is not None and master_mode != "fp32":
            raise ValueError(f"master_mode={master_mode!r} has no out; pass out_dtype=None")
        fn = _jit_fn(_adamw, "_adamw_kernel")
        m_dt, v_dt = (_TRITON_DTYPE[d] for d in _modes.STATE_DTYPES[states])
        ptrs = {"master_ptr": "*fp32" if master_mode == "fp32" else "*bf16", "grad_ptr": f"*{g}",
                "exp_avg_ptr": f"*{m_dt}", "exp_avg_sq_ptr": f"*{v_dt}",
                # Buffers a mode does not use get a dummy pointer, as the launcher passes them.
                "comp_ptr": "*bf16", "seed_ptr": "*i64", "exp_avg_scale_ptr": "*fp32",
                "exp_avg_sq_scale_ptr": "*fp32",
                # Without an output the launcher passes master as a never-written dummy.
                "out_ptr": f"*{_TRITON_DTYPE[out_dtype]}" if out_dtype is not None else "*fp32",
                "lr_ptr": "*fp32", "step_ptr": f"*{_TRITON_DTYPE[step_dtype]}",
                "scale_ptr": "*fp32", "skip_ptr": f"*{_TRITON_DTYPE[skip_dtype]}"}
        ints = _ADAMW_INTS
        constexprs = {"HAS_OUT": out_dtype is not None, "OUT_BF16": out_dtype == torch.bfloat16,
                      "MAXIMIZE": maximize, "BLOCK": _adamw.BLOCK,
                      "MASTER_MODE": _modes.MASTER_CODE[master_mode],
                      "STATE_MODE": _modes.STATE_CODE[states]}
        num_warps = _adamw.NUM_WARPS
    else:
        if out_dtype is not None:
            raise ValueError("sumsq has no output dtype; pass out_dtype=None")
        fn = _jit_fn(_sumsq, "_sumsq_kernel")
        ptrs = {"x_ptr": f"*{g}", "partial_ptr": "*fp32"}
        ints = _SUMSQ_INTS
        constexprs = {"BLOCK": _sumsq.BLOCK}
        num_warps = _sumsq.NUM_WARPS
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ptrs:
            signature[name] = ptrs[name]
        elif name in ints:
            signature[name] = int_dtype
        else:  # Python float scalars arrive as fp32
            signature[name] = "fp32"
    aligned = set(ptrs) | set(ints)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    # The launchers' options, so the PTX here is what runs (no FMA contraction: see adamw.py).
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps,
                                   "enable_fp_fusion": ENABLE_FP_FUSION})


def resource_usage(compiled: Any) -> dict[str, int]:
    """Registers, spill stack and local memory of a compiled kernel, read from its cubin with the
    `cuobjdump` Triton bundles (CompiledKernel only learns n_regs/n_spills when loaded on a GPU).
    Keys: REG, STACK, SHARED, LOCAL (bytes except REG)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def memory_accesses(ptx: str) -> Counter[str]:
    """Count of each global/shared/local load and store form in PTX, e.g. "ld.global.v4.b32"."""
    pattern = r"\b((?:ld|st)\.(?:global|shared|local)\S*)\s"
    return Counter(m.group(1) for m in re.finditer(pattern, ptx))


Variant = tuple[str, torch.dtype, "torch.dtype | None", str, str]


def variants() -> list[Variant]:
    """(kernel, grad dtype, out dtype, master mode, states): every grad/out combination of the
    default mode, and every memory mode (kernels/modes.py) with bf16 grads (the grad load is
    the same code in every mode) and, for the fp32 master, a bf16 out."""
    out: list[Variant] = []
    for g in GRAD_DTYPES:
        out += [("adamw", g, o, "fp32", "fp32") for o in (None, *_adamw.OUT_DTYPES)]
        out.append(("sumsq", g, None, "fp32", "fp32"))
    for m in _modes.MASTER_MODES:
        for st in _modes.STATE_MODES:
            if (m, st) != ("fp32", "fp32"):
                o = torch.bfloat16 if m == "fp32" else None
                out.append(("adamw", torch.bfloat16, o, m, st))
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m fusedzero.kernels.compile [--capability 80 90] [--json PATH]`: compile every
    variant offline and print registers, spills and global access widths (JSON with PTX to PATH)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--capability", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--json", type=Path, help="write every variant's facts and PTX here")
    args = ap.parse_args(argv)
    rows = []
    for cap in args.capability:
        for kernel, g, o, mm, st in variants():
            k = compile_for(kernel, cap, g, o, master_mode=mm, states=st)
            ptx = k.asm["ptx"]
            rows.append({"kernel": kernel, "capability": cap, "grad_dtype": str(g),
                         "out_dtype": str(o), "master_mode": mm, "states": st,
                         "usage": resource_usage(k),
                         "shared_bytes": k.metadata.shared,
                         "accesses": dict(memory_accesses(ptx)), "ptx": ptx})
            acc = {a: n for a, n in memory_accesses(ptx).items() if ".global" in a}
            print(f"sm_{cap} {kernel:5s} grad={g} out={o} master={mm} states={st}: regs={rows[-1]['usage']['REG']} "
                  f"local={rows[-1]['usage']['LOCAL']}B shared={k.metadata.shared}B {acc}",
                  file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
