"""Fused kernels over flat shard buffers (installed as `fusedzero.kernels`).

Knows nothing of torch.distributed. One file per kernel (`adamw.py`, `sum_of_squares.py`), each
a `@triton.jit` kernel, its torch path for CPU tensors and a launcher; what the launchers share
(argument checks, the backend choice `_launch.use_triton`, grid, device guard) is `_launch.py`.
"""
from fusedzero.kernels._launch import LAUNCHES, Strided, backend, use_triton
from fusedzero.kernels.adamw import adamw_reference, adamw_step
from fusedzero.kernels.sum_of_squares import sumsq

__all__ = ["LAUNCHES", "Strided", "adamw_reference", "adamw_step", "backend", "sumsq",
           "use_triton"]
