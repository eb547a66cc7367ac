"""Offline compile of the per-step scalar kernels (`_step_scalars.py`, `_rows.py`) for a CUDA
target, no GPU needed: `python -m fusedzero.kernels._compile_scalars [--capability 80 90]
[--json PATH]` prints registers and the arithmetic forms per variant (tests/kernels/
test_step_scalars.py reads the JSON: the fp32 ops must be IEEE round-to-nearest, as the torch
path and the interpreter compute them).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedzero.kernels import _rows as _rows, _step_scalars as _scalars
from fusedzero.kernels._compile import _jit_fn, resource_usage
from fusedzero.kernels._launch import ENABLE_FP_FUSION

# (NORM, SCALED, CLIP, SKIP_NONFINITE, ROWS) variants of the scalar kernel: none, the clip
# alone, all (the last with the update's rows, as `ZeroAdamW.step` launches it).
SCALAR_FLAGS = (
    (False, False, False, False, False),
    (True, False, True, False, False),
    (True, True, True, True, True),
)


def compile_step_scalars(capability: int, flags: tuple[bool, ...]) -> Any:
    fn = _jit_fn(_scalars, "_step_scalars_kernel")
    constexprs = dict(zip(("NORM", "SCALED", "CLIP", "SKIP_NONFINITE", "ROWS"), flags))
    constexprs.update(_rows.row_constexprs(16))
    types = {"c64_ptr": "*fp64", "n_rows": "i32"}
    signature = {a: "constexpr" if a in constexprs else types.get(a, "*fp32") for a in fn.arg_names}
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": 1, "enable_fp_fusion": ENABLE_FP_FUSION},
    )


def compile_rows(capability: int) -> Any:
    fn = _jit_fn(_rows, "_adamw_rows_kernel")
    constexprs = _rows.row_constexprs(16)
    types = {
        "lr_ptr": "*fp32",
        "c64_ptr": "*fp64",
        "step_ptr": "*fp32",
        "grad_scale_ptr": "*fp32",
        "rows_ptr": "*fp32",
        "n": "i32",
    }
    signature = {a: "constexpr" if a in constexprs else types[a] for a in fn.arg_names}
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": 1, "enable_fp_fusion": ENABLE_FP_FUSION},
    )


def arithmetic(ptx: str) -> dict[str, int]:
    """Counts of the PTX division, square root, reciprocal and fused multiply-add forms (e.g.
    "div.rn.f32", "sqrt.approx.f32", "fma.rn.f64")."""
    pattern = r"\b((?:div|sqrt|rcp|fma|ex2|lg2)\.[a-z0-9.]+)\s"
    return dict(Counter(m.group(1) for m in re.finditer(pattern, ptx)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capability", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for cap in args.capability:
        built = [("step_scalars", list(f), compile_step_scalars(cap, f)) for f in SCALAR_FLAGS]
        built.append(("rows", [], compile_rows(cap)))
        for name, flags, k in built:
            ptx = k.asm["ptx"]
            rows.append(
                {
                    "kernel": name,
                    "capability": cap,
                    "flags": flags,
                    "usage": resource_usage(k),
                    "arithmetic": arithmetic(ptx),
                }
            )
            print(
                f"sm_{cap} {name} {flags}: regs={rows[-1]['usage']['REG']} "
                f"{rows[-1]['arithmetic']}",
                file=sys.stderr,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
