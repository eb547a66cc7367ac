"""Shared test setup: where Triton's interpreter is on, and which tests run where.

The Triton interpreter is for CPU tensors only. It copies each argument's storage to the host
and back, and our kernels reach every buffer of a grouped launch through element offsets from
one base tensor (`kernels/_table.py`): offsets between two CUDA allocations point into arbitrary
host memory there. So `TRITON_INTERPRET=1` is set (before anything imports `fusedzero.kernels`:
`triton.jit` reads it at decoration time) only where torch sees no CUDA device; an explicit value
in the environment is kept. With the interpreter off, the launchers refuse it for CUDA tensors
anyway (`kernels/_launch.py`).

Which tests run:
- `cuda`-marked tests need a GPU and the compiled kernels: skipped without a CUDA device, or where
  TRITON_INTERPRET=1 is set.
- Tests that prove the kernel code on CPU tensors through the interpreter (marked `interpreter`,
  parametrized with `backend="triton"`, or using a `triton_interpreter` fixture) are skipped where
  the interpreter is off (a GPU is visible); `CUDA_VISIBLE_DEVICES= pytest -m interpreter` runs them
  on the same machine. See docs/gpu_suite.md.
- Everything else states its device: CPU tensors and gloo ranks, whatever GPUs are visible.

`--check-modules` (tests/_module_check.py) fails a run that ran no code of some module of the
package; CI runs the fast tier with it.
"""

import os

# One intra-op thread (set before anything imports torch; ranks and CLIs the tests spawn
# inherit it): the tests' tensors are small, and on a loaded machine OpenMP's spinning workers
# cost far more than they save (a 10k-param GPT forward measured 100 ms of CPU with 2 threads
# under load, 3 ms with one). Tests that need several threads set them themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import _module_check  # noqa: E402 (tests/ is on sys.path: this file's folder)

pytest_addoption = _module_check.pytest_addoption
pytest_runtestloop = _module_check.pytest_runtestloop
pytest_runtest_logfinish = _module_check.pytest_runtest_logfinish
pytest_sessionfinish = _module_check.pytest_sessionfinish

CUDA_VISIBLE = torch.cuda.is_available()
if not CUDA_VISIBLE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Multi-rank tests keep their gloo ranks up between runs of the same world size (starting W
# ranks costs seconds, most test bodies milliseconds): fusedzero/testing.py, `reuse_ranks`.
from fusedzero.testing import reuse_ranks  # noqa: E402

reuse_ranks(True)

_NO_INTERPRETER = pytest.mark.skip(
    reason="runs Triton kernel code on CPU tensors through the interpreter, which is off here "
    "(a GPU is visible); run it with CUDA_VISIBLE_DEVICES= pytest -m interpreter"
)
_NO_GPU = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
_INTERPRETED_GPU = pytest.mark.skip(
    reason="TRITON_INTERPRET=1 is set: cuda tests run the compiled kernels; unset it"
)


def needs_interpreter(item: pytest.Item) -> bool:
    """Does this test run the Triton kernel code on CPU tensors?"""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    return (
        item.get_closest_marker("interpreter") is not None
        or params.get("backend") == "triton"
        or "triton_interpreter" in getattr(item, "fixturenames", ())
    )


# First: `-m cuda` / `-m interpreter` deselect on the markers added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            if not CUDA_VISIBLE:
                item.add_marker(_NO_GPU)
            elif INTERPRETING:
                item.add_marker(_INTERPRETED_GPU)
        elif needs_interpreter(item):
            # Not in the `cuda` tier: the marker lets `-m interpreter` select them all.
            item.add_marker(pytest.mark.interpreter)
            if not INTERPRETING:
                item.add_marker(_NO_INTERPRETER)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU faked visible to the CLI's device logic (torch.cuda.is_available and
    device_count monkeypatched), on any machine. Nothing real may touch CUDA under it: use it
    for code that stops before a rank starts or a tensor is placed (`fusedzero.app.launch`'s
    device choice and what runs before it). tests/app/test_device_choice.py,
    tests/app/test_suite_devices.py."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
