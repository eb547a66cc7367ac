"""The grouped AdamW kernel's pointer types per memory mode, for the offline compile
(`compile.compile_for`), and the memory-mode variants it compiles."""

from __future__ import annotations

import torch

from fusedzero.kernels import _memory_modes as _modes


def adamw_ptrs(
    g: str,
    out_dtype: torch.dtype | None,
    master_mode: str,
    states: str,
    triton_dtype: dict[torch.dtype, str],
    skip_dtype: torch.dtype,
) -> dict[str, str]:
    """Pointer types of `_grouped_adamw_kernel` as the launcher passes them: a stream the mode
    does not have gets the master base as a never-accessed stand-in (the seed: the skip flag)."""
    _modes.check_modes(master_mode, states)
    if out_dtype is not None and master_mode != "fp32":
        raise ValueError(f"master_mode={master_mode!r} has no out; pass out_dtype=None")
    master = "*fp32" if master_mode == "fp32" else "*bf16"
    m_dt, v_dt = (triton_dtype[d] for d in _modes.STATE_DTYPES[states])
    int8 = states == "int8"
    return {
        "master_ptr": master,
        "grad_ptr": f"*{g}",
        "exp_avg_ptr": f"*{m_dt}",
        "exp_avg_sq_ptr": f"*{v_dt}",
        # Without an output the launcher passes master as a never-written dummy.
        "out_ptr": f"*{triton_dtype[out_dtype]}" if out_dtype is not None else master,
        "piece_ptr": "*i64",
        "prog_piece_ptr": "*i32",
        "row_ptr": "*fp32",
        "skip_ptr": f"*{triton_dtype[skip_dtype]}",
        "comp_ptr": "*bf16" if master_mode == "bf16-kahan" else master,
        "exp_avg_scale_ptr": "*fp32" if int8 else master,
        "exp_avg_sq_scale_ptr": "*fp32" if int8 else master,
        "seed_ptr": "*i64" if master_mode == "bf16-sr" else f"*{triton_dtype[skip_dtype]}",
        "step_ptr": "*fp32",
    }


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
