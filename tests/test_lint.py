"""The tree passes `ruff check` and `ruff format --check`: the rules and their
exceptions are in pyproject.toml's [tool.ruff] (line length 100, pyflakes, pycodestyle, import
order, pyupgrade, bugbear). ruff is pinned in the dev extra, so CI and contributors run the same
rules."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed (pip install -e '.[dev]')",
)
def test_ruff_check_passes() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--output-format",
            "concise",
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed (pip install -e '.[dev]')",
)
def test_ruff_format_leaves_the_tree_as_it_is() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, (
        out.stdout[-4000:] + out.stderr[-2000:] + "\nrun `ruff format .` and commit"
    )
