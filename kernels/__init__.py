"""Fused kernels over flat shard buffers (installed as `fusedzero.kernels`).

Knows nothing of torch.distributed. Each op dispatches in one place (`_dispatch.use_triton`):
compiled Triton on CUDA, torch on CPU, the Triton interpreter when asked.
"""
from fusedzero.kernels._dispatch import LAUNCHES, backend, use_triton
from fusedzero.kernels.adamw import Strided, adamw_reference, adamw_step
from fusedzero.kernels.reduce import sumsq

__all__ = ["LAUNCHES", "Strided", "adamw_reference", "adamw_step", "backend", "sumsq",
           "use_triton"]
