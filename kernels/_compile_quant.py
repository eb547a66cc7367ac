"""Offline compile of the wire kernels (kernels/_quant.py) for a CUDA target, no GPU needed:
`python -m fusedzero.kernels._compile_quant [--capability 90] [--json PATH]` prints registers,
spills and global access forms per variant (tests/kernels/test_quant.py reads the JSON).

Arguments are declared as the launchers pass them: pointers 16-byte aligned (tensor starts) and
the sizes and chunk strides multiples of 16, as the runtime specialises int arguments that are
(the optimizer's shards are multiples of 128; an int8 chunk stride S + S/32 bytes is one when S
is a multiple of 512), see [Note: wire vector widths] in _quant.py.
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

from fusedzero.kernels import _quant as _quant
from fusedzero.kernels._compile import _TRITON_DTYPE, _jit_fn, memory_accesses, resource_usage
from fusedzero.kernels._launch import ENABLE_FP_FUSION

_VALUE = {"fp32": "*fp32", "bf16": "*bf16", "int8": "*i8"}
_FMT = {"fp32": 0, "bf16": 1, "int8": 2}
KERNELS = ("quantize", "dequant_sum", "dequantize")
_SIZES_OF_16 = ("numel", "n_out", "chunk_numel", "chunk_v")


def compile_for(
    kernel: str, wire: str, capability: int = 90, out_dtype: torch.dtype = torch.float32
) -> Any:
    """Triton's CompiledKernel of one wire kernel variant for sm_{capability}. `out_dtype` is the
    input dtype of quantize, the output dtype of the other two."""
    if kernel not in KERNELS or wire not in _FMT:
        raise ValueError(
            f"kernel={kernel!r}, wire={wire!r}: expected one of {KERNELS} and {list(_FMT)}"
        )
    name = {
        "quantize": "_quantize_kernel",
        "dequant_sum": "_dequant_sum_kernel",
        "dequantize": "_dequantize_kernel",
    }[kernel]
    fn = _jit_fn(_quant, name)
    t = "*" + _TRITON_DTYPE[out_dtype]
    scale_ptr = "*fp32" if wire == "int8" else _VALUE[wire]
    types = {"x_ptr": t, "out_ptr": t, "v_ptr": _VALUE[wire], "s_ptr": scale_ptr, "scale": "fp32"}
    constexprs = {
        "FMT": _FMT[wire],
        "ROWS": _quant.ROWS,
        "ACCUMULATE": True,
        "OUT_BF16": out_dtype == torch.bfloat16,
    }
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    aligned = {a for a in fn.arg_names if a.endswith("_ptr") or a in _SIZES_OF_16}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": _quant.NUM_WARPS, "enable_fp_fusion": ENABLE_FP_FUSION},
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capability", type=int, nargs="+", default=[90])
    ap.add_argument("--json", type=Path, help="write every variant's facts here")
    args = ap.parse_args(argv)
    rows = []
    for cap in args.capability:
        for kernel in KERNELS:
            for wire in _FMT:
                for dt in (torch.float32, torch.bfloat16):
                    k = compile_for(kernel, wire, cap, dt)
                    ptx = k.asm["ptx"]
                    acc = dict(memory_accesses(ptx))
                    rows.append(
                        {
                            "kernel": kernel,
                            "wire": wire,
                            "capability": cap,
                            "out_dtype": str(dt),
                            "usage": resource_usage(k),
                            "f64_instructions": len(re.findall(r"\.f64\b", ptx)),
                            # Scalar int32 products (offsets that wrap past 2^31).
                            "i32_multiplies": len(
                                re.findall(r"arith\.muli [^\n]*: i32\b", k.asm["ttir"])
                            ),
                            "accesses": acc,
                        }
                    )
                    print(
                        f"sm_{cap} {kernel:11s} {wire} {dt}: {rows[-1]['usage']} "
                        f"{ {a: n for a, n in acc.items() if '.global' in a} }",
                        file=sys.stderr,
                    )
    if args.json is not None:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
