"""Fused kernels over flat shard buffers (installed as `fusedzero.kernels`).

Knows nothing of torch.distributed. One file per kernel (`_adamw.py`, `_sum_of_squares.py`), each
a `@triton.jit` kernel over a piece table (`_table.py`: every buffer of a rank in one launch),
its torch path for CPU tensors (`_adamw_torch.py` for AdamW) and a grouped launcher; what the
launchers share (argument checks, the backend choice `_launch.use_triton`, device guard) is
`_launch.py`. The memory modes (`_memory_modes.py`: bf16 masters, bf16/int8 states) are constexpr
variants of the same grouped AdamW kernel (torch path: `_memory_modes_torch.py`); `_adamw_single.py`
updates one buffer through it (`AdamWPlan`: planned once, launched per call). The step's scalars
(norm, clip, skip, grad scale, step count: `_step_scalars.py`) and the update's per-group rows
(`_rows.py`) are one small launch together (the rows alone: a launch of their own). Muon's
element-wise launches (momentum before Newton-Schulz, the update after) and Newton-Schulz batched
per shape are `_muon.py`.
"""

from fusedzero.kernels._adamw import AdamWBuffer, GroupedAdamW, Hyper
from fusedzero.kernels._adamw_single import AdamWPlan, adamw_reference, adamw_step
from fusedzero.kernels._launch import LAUNCHES, Strided, backend, use_triton
from fusedzero.kernels._memory_modes import (
    MASTER_MODES,
    QBLOCK,
    STATE_MODES,
    bytes_per_param,
    dequantize_blockwise,
    quantize_blockwise,
)
from fusedzero.kernels._memory_modes_reference import adamw_reference_mode
from fusedzero.kernels._muon import (
    MomentumPiece,
    MuonPlan,
    MuonRow,
    UpdatePiece,
    adjust_lr,
    lr_ratio,
    newton_schulz,
    ns_flops,
)
from fusedzero.kernels._sum_of_squares import GroupedSumsq, SumsqView, sumsq

__all__ = [
    "LAUNCHES",
    "MASTER_MODES",
    "QBLOCK",
    "STATE_MODES",
    "AdamWBuffer",
    "AdamWPlan",
    "GroupedAdamW",
    "GroupedSumsq",
    "Hyper",
    "MomentumPiece",
    "MuonPlan",
    "MuonRow",
    "Strided",
    "SumsqView",
    "UpdatePiece",
    "adamw_reference",
    "adamw_reference_mode",
    "adamw_step",
    "adjust_lr",
    "backend",
    "bytes_per_param",
    "dequantize_blockwise",
    "lr_ratio",
    "newton_schulz",
    "ns_flops",
    "quantize_blockwise",
    "sumsq",
    "use_triton",
]
