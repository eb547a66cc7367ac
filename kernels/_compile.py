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

from fusedzero.kernels import _adamw as _adamw, _sum_of_squares as _sumsq
from fusedzero.kernels._compile_memory_modes import adamw_ptrs, mode_variants
from fusedzero.kernels._launch import ENABLE_FP_FUSION, GRAD_DTYPES
from fusedzero.kernels._memory_modes import MASTER_CODE, STATE_CODE

KERNELS = ("adamw", "sumsq")

_TRITON_DTYPE = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
    torch.int8: "i8",
    torch.uint8: "u8",
}

# The grouped kernels take only pointers (sizes and offsets come from the piece table). The
# runtime marks a pointer argument divisible by 16 ("tt.divisibility") when its address is:
# every base is a tensor's start (CUDA caching-allocator blocks are 512-byte aligned). The table's
# offsets and lengths are declared multiples of 16 elements in the kernel (ALIGNED, checked by
# the launcher); without both the compiler falls back to scalar accesses
# (tests/kernels/test_compile.py).


def _jit_fn(module: Any, name: str) -> triton.runtime.JITFunction:
    fn = getattr(module, name)
    if not isinstance(fn, triton.runtime.JITFunction):
        # triton.jit decides at decoration time, and triton.language's own helpers (tl.sum, ...)
        # were decorated when triton was imported: nothing in this process can be compiled.
        raise RuntimeError(
            f"{name} was built for the Triton interpreter (TRITON_INTERPRET=1 when "
            "triton was imported); compile in a process without it, e.g. "
            "`TRITON_INTERPRET=0 python -m fusedzero.kernels._compile`"
        )
    return fn


def compile_for(
    kernel_name: str,
    capability: int,
    grad_dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
    *,
    skip_dtype: torch.dtype = torch.float32,
    master_mode: str = "fp32",
    states: str = "fp32",
) -> Any:
    """Compile `kernel_name` ("adamw" or "sumsq", the grouped kernels) for `sm_{capability}`;
    returns Triton's CompiledKernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`).

    `grad_dtype` is the grad (adamw) or input (sumsq) dtype; `out_dtype` the adamw output, None
    for none. Every pointer is declared 16-byte aligned, as the runtime specialises it for our
    buffers, and the table ALIGNED, as the optimizer's launches are. The rows are fp32; the skip
    flag is fp32 as `fusedzero._scalars` keeps it (`skip_dtype` changes only one scalar load).
    A memory mode (`master_mode`, `states`) compiles the same grouped kernel's variant.
    """
    if kernel_name not in KERNELS:
        raise ValueError(f"kernel_name={kernel_name!r}, expected one of {KERNELS}")
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype {grad_dtype}, expected one of {GRAD_DTYPES}")
    g = _TRITON_DTYPE[grad_dtype]
    if kernel_name == "adamw":
        if out_dtype is not None and out_dtype not in _adamw.OUT_DTYPES:
            raise ValueError(f"out_dtype {out_dtype}, expected None or one of {_adamw.OUT_DTYPES}")
        fn = _jit_fn(_adamw, "_grouped_adamw_kernel")
        ptrs = adamw_ptrs(g, out_dtype, master_mode, states, _TRITON_DTYPE, skip_dtype)
        constexprs = {
            "HAS_OUT": out_dtype is not None,
            "OUT_BF16": out_dtype == torch.bfloat16,
            "ALIGNED": True,
            "BLOCK": _adamw.BLOCK,
            "MASTER_MODE": MASTER_CODE[master_mode],
            "STATE_MODE": STATE_CODE[states],
        }
        num_warps = _adamw.NUM_WARPS
    else:
        if out_dtype is not None:
            raise ValueError("sumsq has no output dtype; pass out_dtype=None")
        fn = _jit_fn(_sumsq, "_grouped_sumsq_kernel")
        ptrs = {
            "x_ptr": f"*{g}",
            "piece_ptr": "*i64",
            "prog_piece_ptr": "*i32",
            "partial_ptr": "*fp32",
        }
        constexprs = {"ALIGNED": True, "BLOCK": _sumsq.BLOCK}
        num_warps = _sumsq.NUM_WARPS
    signature = {name: "constexpr" if name in constexprs else ptrs[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in ptrs}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    # The launchers' options, so the PTX here is what runs (no FMA contraction: see _adamw.py).
    return triton.compile(
        src,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": num_warps, "enable_fp_fusion": ENABLE_FP_FUSION},
    )


def resource_usage(compiled: Any) -> dict[str, int]:
    """Registers, spill stack and local memory of a compiled kernel, read from its cubin with the
    `cuobjdump` Triton bundles (CompiledKernel only learns n_regs/n_spills when loaded on a GPU).
    Keys: REG, STACK, SHARED, LOCAL (bytes except REG)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], check=True, capture_output=True, text=True
        ).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def memory_accesses(ptx: str) -> Counter[str]:
    """Count of each global/shared/local load and store form in PTX, e.g. "ld.global.v4.b32"."""
    pattern = r"\b((?:ld|st)\.(?:global|shared|local)\S*)\s"
    return Counter(m.group(1) for m in re.finditer(pattern, ptx))


Variant = tuple[str, torch.dtype, "torch.dtype | None", str, str]


def variants() -> list[Variant]:
    """(kernel, grad dtype, out dtype, master mode, states): every grouped variant the launchers
    can produce (default mode), then the memory modes' variants of the grouped AdamW kernel."""
    out: list[Variant] = []
    for g in GRAD_DTYPES:
        out += [("adamw", g, o, "fp32", "fp32") for o in (None, *_adamw.OUT_DTYPES)]
        out.append(("sumsq", g, None, "fp32", "fp32"))
    return out + mode_variants()


def main(argv: list[str] | None = None) -> None:
    """`python -m fusedzero.kernels._compile [--capability 80 90] [--json PATH]`: compile every
    variant offline and print registers, spills, shared-memory accesses, fp64 instructions and
    global access widths (JSON with PTX to PATH)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--capability", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--json", type=Path, help="write every variant's facts and PTX here")
    args = ap.parse_args(argv)
    rows = []
    for cap in args.capability:
        for kernel, g, o, mm, st in variants():
            k = compile_for(kernel, cap, g, o, master_mode=mm, states=st)
            ptx = k.asm["ptx"]
            f64 = len(re.findall(r"\.f64\b", ptx))
            rows.append(
                {
                    "kernel": kernel,
                    "capability": cap,
                    "grad_dtype": str(g),
                    "out_dtype": str(o),
                    "master_mode": mm,
                    "states": st,
                    "usage": resource_usage(k),
                    "shared_bytes": k.metadata.shared,
                    "f64_instructions": f64,
                    "accesses": dict(memory_accesses(ptx)),
                    "ptx": ptx,
                }
            )
            acc = {a: n for a, n in memory_accesses(ptx).items() if ".global" in a}
            shared = sum(n for a, n in memory_accesses(ptx).items() if ".shared" in a)
            print(
                f"sm_{cap} {kernel:5s} grad={g} out={o} {mm}/{st}: "
                f"regs={rows[-1]['usage']['REG']} "
                f"spill={rows[-1]['usage']['LOCAL']}B shared accesses={shared} f64={f64} "
                f"{acc}",
                file=sys.stderr,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
