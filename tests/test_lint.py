"""The tree passes `ruff check` and `ruff format --check`: the rules and their
exceptions are in pyproject.toml's [tool.ruff] (line length 100, pyflakes, pycodestyle, import
order, pyupgrade, bugbear). ruff is pinned in the dev extra, so CI and contributors run the same
rules. Without ruff the tests fail, not skip: CI installs the dev extra, and a skip there would
let an unlinted tree through."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail(
            "ruff is not installed: install the dev extra (pip install -e '.[dev]'), "
            "which pins the ruff CI runs"
        )
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_ruff_check_passes() -> None:
    out = _ruff("check", "--no-cache", "--output-format", "concise", str(ROOT))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_leaves_the_tree_as_it_is() -> None:
    out = _ruff("format", "--check", "--no-cache", str(ROOT))
    assert out.returncode == 0, (
        out.stdout[-4000:] + out.stderr[-2000:] + "\nrun `ruff format .` and commit"
    )


def test_a_missing_ruff_fails_naming_the_dev_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ruff the lint tests fail (CI must not pass an unlinted tree by skipping), and the
    failure says how to install it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ruff" else real(name, *a)
    )
    with pytest.raises(pytest.fail.Exception, match=r"install the dev extra \(pip install -e"):
        _ruff("--version")
