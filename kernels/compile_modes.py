"""The offline-compile spec of the memory modes' per-buffer kernel (kernels/adamw_modes.py,
[Note: memory modes are not grouped yet]); `compile.compile_for` calls it for a memory mode."""
from __future__ import annotations

from typing import Any

import torch

from fusedzero.kernels import adamw_modes as _adamw_modes
from fusedzero.kernels import modes as _modes

# Int arguments the per-buffer launcher passes as sizes, strides and bases. The runtime marks an
# int divisible by 16 ("tt.divisibility") when it is; fusedzero/layout.py makes every bucket a
# multiple of world_size * 128 elements, so shards, strides and bases always are.
INTS = ("shard_numel", "master_stride", "master_base", "grad_stride", "grad_base",
        "out_stride", "out_base", "sr_offset")


def mode_spec(g: str, out_dtype: torch.dtype | None, master_mode: str, states: str,
              triton_dtype: dict[torch.dtype, str], skip_dtype: torch.dtype,
              maximize: bool) -> tuple[Any, dict[str, str], tuple[str, ...], dict[str, Any], int]:
    """(kernel, pointer types, int args, constexprs, num_warps) of one memory-mode variant."""
    _modes.check_modes(master_mode, states)
    if out_dtype is not None and master_mode != "fp32":
        raise ValueError(f"master_mode={master_mode!r} has no out; pass out_dtype=None")
    m_dt, v_dt = (triton_dtype[d] for d in _modes.STATE_DTYPES[states])
    ptrs = {"master_ptr": "*fp32" if master_mode == "fp32" else "*bf16", "grad_ptr": f"*{g}",
            "exp_avg_ptr": f"*{m_dt}", "exp_avg_sq_ptr": f"*{v_dt}",
            # Buffers a mode does not use get a dummy pointer, as the launcher passes them.
            "comp_ptr": "*bf16", "seed_ptr": "*i64", "exp_avg_scale_ptr": "*fp32",
            "exp_avg_sq_scale_ptr": "*fp32",
            "out_ptr": f"*{triton_dtype[out_dtype]}" if out_dtype is not None else "*fp32",
            "lr_ptr": "*fp32", "step_ptr": "*fp32", "scale_ptr": "*fp32",
            "skip_ptr": f"*{triton_dtype[skip_dtype]}"}
    constexprs = {"HAS_OUT": out_dtype is not None, "OUT_BF16": out_dtype == torch.bfloat16,
                  "MAXIMIZE": maximize, "BLOCK": _adamw_modes.BLOCK,
                  "MASTER_MODE": _modes.MASTER_CODE[master_mode],
                  "STATE_MODE": _modes.STATE_CODE[states]}
    return (_adamw_modes._adamw_kernel, ptrs, INTS, constexprs, _adamw_modes.NUM_WARPS)


def mode_variants() -> list[tuple[str, torch.dtype, torch.dtype | None, str, str]]:
    """Every memory mode with bf16 grads (the grad load is the same code in every mode) and, for
    the fp32 master, a bf16 out."""
    out = []
    for m in _modes.MASTER_MODES:
        for st in _modes.STATE_MODES:
            if (m, st) != ("fp32", "fp32"):
                o = torch.bfloat16 if m == "fp32" else None
                out.append(("adamw", torch.bfloat16, o, m, st))
    return out
