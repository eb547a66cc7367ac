"""The Triton interpreter is for CPU tensors only: CUDA tensors reaching it are refused.

The interpreter copies each kernel argument's storage to the host; our grouped launches reach
every buffer through element offsets from one base tensor (kernels/_table.py), which in those
copies point into arbitrary host memory (reads of garbage, writes that corrupt the heap). No GPU
is needed: the launchers decide before touching a tensor.

About an internal: fusedzero.kernels._launch.
"""
from __future__ import annotations

import pytest
import torch

from fusedzero.kernels import GroupedAdamW, GroupedSumsq, _launch

CUDA = torch.device("cuda", 0)


@pytest.fixture
def interpreter_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FUSEDZERO_BACKEND", raising=False)


def test_use_triton_refuses_cuda_tensors_in_the_interpreter(interpreter_on) -> None:
    with pytest.raises(RuntimeError, match=r"cuda:0 reached the Triton interpreter .*CPU "
                                           r"tensors only; unset TRITON_INTERPRET"):
        _launch.use_triton(CUDA)


@pytest.mark.parametrize("launcher", ["adamw", "sumsq"])
def test_launchers_refuse_before_any_launch(interpreter_on, launcher: str) -> None:
    with pytest.raises(RuntimeError, match="reached the Triton interpreter"):
        if launcher == "adamw":
            GroupedAdamW([], CUDA, 1)
        else:
            GroupedSumsq([], CUDA)


def test_compiled_choice_is_unchanged_without_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("FUSEDZERO_BACKEND", raising=False)
    assert _launch.use_triton(CUDA) is True
    assert _launch.use_triton(torch.device("cpu")) is False  # CPU: the torch path
    monkeypatch.setenv("FUSEDZERO_BACKEND", "torch")
    assert _launch.use_triton(CUDA) is False
