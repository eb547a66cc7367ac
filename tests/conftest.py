"""Shared test setup.

TRITON_INTERPRET must be set before anything imports `fusedzero.kernels`: `triton.jit` reads it at
decoration time. Setting it is harmless for everything else, because CPU tensors still take the
torch path unless a test asks for `FUSEDZERO_BACKEND=triton`; CUDA tensors are unaffected by the
dispatch choice but would run interpreted, so a GPU run of the suite should set TRITON_INTERPRET=0
explicitly (setdefault keeps an explicit value).

`--check-modules` (tests/_module_check.py) fails a run that ran no code of some module of the
package; CI runs the fast tier with it.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread (set before anything imports torch; ranks and CLIs the tests spawn
# inherit it): the tests' tensors are small, and on a loaded machine OpenMP's spinning workers
# cost far more than they save (a 10k-param GPT forward measured 100 ms of CPU with 2 threads
# under load, 3 ms with one). Tests that need several threads set them themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import _module_check  # noqa: E402 (tests/ is on sys.path: this file's folder)

pytest_addoption = _module_check.pytest_addoption
pytest_runtestloop = _module_check.pytest_runtestloop
pytest_sessionfinish = _module_check.pytest_sessionfinish
