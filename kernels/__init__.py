"""Fused kernels over flat shard buffers (installed as `fusedzero.kernels`).

Knows nothing of torch.distributed. One file per kernel (`adamw.py`, `sum_of_squares.py`), each
a `@triton.jit` kernel, its torch path for CPU tensors and a launcher; what the launchers share
(argument checks, the backend choice `_launch.use_triton`, grid, device guard) is `_launch.py`.
"""
from fusedzero.kernels._launch import LAUNCHES, Strided, backend, use_triton
from fusedzero.kernels.adamw import adamw_reference, adamw_step
from fusedzero.kernels.modes import (MASTER_MODES, QBLOCK, STATE_MODES, bytes_per_param,
                                     dequantize_blockwise, quantize_blockwise)
from fusedzero.kernels.modes_reference import adamw_reference_mode
from fusedzero.kernels.sum_of_squares import sumsq

__all__ = ["LAUNCHES", "MASTER_MODES", "QBLOCK", "STATE_MODES", "Strided", "adamw_reference",
           "adamw_reference_mode", "adamw_step", "backend", "bytes_per_param",
           "dequantize_blockwise", "quantize_blockwise", "sumsq", "use_triton"]
