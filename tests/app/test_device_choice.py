"""`fusedzero train`'s device choice with one GPU faked visible: the refusal and --device cpu.

No GPU is needed: torch.cuda.is_available / device_count are monkeypatched (the `one_gpu`
fixture, tests/conftest.py), and nothing is spawned (the checks run before any rank starts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusedzero import cli
from fusedzero.app.config import UsageError, parse_args
from fusedzero.app.launch import local_ranks


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusedzero: error: "), lines
    return lines[0]


def test_auto_takes_one_rank_per_visible_gpu(one_gpu) -> None:
    assert local_ranks(parse_args([])) == (True, 1)
    assert local_ranks(parse_args(["--device", "cuda", "--nproc", "1"])) == (True, 1)


def test_more_ranks_than_gpus_is_refused_naming_the_fix(one_gpu, capsys) -> None:
    for argv in (["train", "--nproc", "2"], ["train", "--device", "cuda", "--nproc", "2"]):
        line = _error(capsys, argv)
        assert "--nproc 2 exceeds the 1 visible GPUs" in line and "--device cpu" in line, line


def test_device_cpu_runs_gloo_ranks_whatever_gpus_are_visible(
    one_gpu, capsys, tmp_path: Path
) -> None:
    assert local_ranks(parse_args(["--device", "cpu", "--nproc", "2"])) == (False, 2)
    assert local_ranks(parse_args(["--device", "cpu"])) == (False, 2)  # the CPU default
    # The whole command gets past the device check to the next one (the data path).
    line = _error(
        capsys,
        ["train", "--device", "cpu", "--nproc", "4", "--data", str(tmp_path / "missing.txt")],
    )
    assert "--data" in line and "does not exist" in line, line


def test_device_cuda_without_a_gpu_says_use_cpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="--device cuda but torch sees no GPU; use --device cpu"):
        local_ranks(parse_args(["--device", "cuda"]))
    assert local_ranks(parse_args([])) == (False, 2)
