"""Shared test setup.

TRITON_INTERPRET must be set before anything imports `fusedzero.kernels`: `triton.jit` reads it at
decoration time. Setting it is harmless for everything else, because CPU tensors still take the
torch path unless a test asks for `FUSEDZERO_BACKEND=triton`; CUDA tensors are unaffected by the
dispatch choice but would run interpreted, so a GPU run of the suite should set TRITON_INTERPRET=0
explicitly (setdefault keeps an explicit value).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
