"""Offline compile of Muon's element-wise kernels (`_muon.py`) for a CUDA target, no GPU needed:
`python -m fusedzero.kernels._compile_muon [--capability 80 90] [--json PATH]` prints registers,
spills, fp64 instructions and global access forms per variant (tests/kernels/
test_muon_compile.py reads the JSON). Every pointer is declared 16-byte aligned and the table
ALIGNED, as the runtime and the optimizer's layout give them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedzero.kernels import _muon as _muon
from fusedzero.kernels._compile import _TRITON_DTYPE, _jit_fn, memory_accesses, resource_usage
from fusedzero.kernels._launch import ENABLE_FP_FUSION, GRAD_DTYPES

# (kernel, dtypes): the momentum launch per (grad, buf, ns_in) dtype, the update launch per
# (update, out) dtype (None: no out copy).
Variant = tuple[str, tuple["torch.dtype | None", ...]]


def variants() -> list[Variant]:
    out: list[Variant] = [
        ("momentum", (g, b, n))
        for g in GRAD_DTYPES
        for b in _muon.BUF_DTYPES
        for n in _muon.NS_DTYPES
    ]
    out += [("update", (u, o)) for u in _muon.NS_DTYPES for o in (None, *_muon.OUT_DTYPES)]
    return out


def compile_muon(capability: int, kernel: str, dtypes: tuple[torch.dtype | None, ...]) -> Any:
    t = _TRITON_DTYPE
    if kernel == "momentum":
        g, b, n = dtypes
        fn = _jit_fn(_muon, "_muon_momentum_kernel")
        ptrs = {"grad_ptr": g, "buf_ptr": b, "ns_ptr": n}
        constexprs = {
            "BUF_BF16": b == torch.bfloat16,
            "NS_BF16": n == torch.bfloat16,
            "ALIGNED": True,
            "BLOCK": _muon.BLOCK,
        }
    else:
        u, o = dtypes
        fn = _jit_fn(_muon, "_muon_update_kernel")
        ptrs = {"master_ptr": torch.float32, "update_ptr": u, "out_ptr": o or torch.float32}
        constexprs = {
            "HAS_OUT": o is not None,
            "OUT_BF16": o == torch.bfloat16,
            "ALIGNED": True,
            "BLOCK": _muon.BLOCK,
        }
    types = {k: f"*{t[v]}" for k, v in ptrs.items()}
    types.update(
        piece_ptr="*i64", prog_piece_ptr="*i32", row_ptr="*fp32", skip_ptr="*fp32"
    )  # the skip flag is fp32, as fusedzero._scalars keeps it
    signature = {a: "constexpr" if a in constexprs else types[a] for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in types}
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": _muon.NUM_WARPS, "enable_fp_fusion": ENABLE_FP_FUSION},
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capability", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for cap in args.capability:
        for kernel, dtypes in variants():
            k = compile_muon(cap, kernel, dtypes)
            ptx = k.asm["ptx"]
            rows.append(
                {
                    "kernel": kernel,
                    "capability": cap,
                    "dtypes": [str(d) for d in dtypes],
                    "usage": resource_usage(k),
                    "shared_bytes": k.metadata.shared,
                    "f64_instructions": len(re.findall(r"\.f64\b", ptx)),
                    "fma": len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
                    "accesses": dict(memory_accesses(ptx)),
                }
            )
            r = rows[-1]
            print(
                f"sm_{cap} {kernel} {r['dtypes']}: regs={r['usage']['REG']} "
                f"spill={r['usage']['LOCAL']}B f64={r['f64_instructions']} fma={r['fma']} "
                f"{ {a: n for a, n in r['accesses'].items() if '.global' in a} }",
                file=sys.stderr,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
