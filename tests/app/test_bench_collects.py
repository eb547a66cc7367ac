"""The benchmark suites are not part of the default run; make sure they at least still import
and collect, so a refactor cannot silently break `pytest bench/ --benchmark-only`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns ranks or the CLI

ROOT = Path(__file__).resolve().parents[2]


def test_bench_suites_collect() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "bench", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for subject in ("bench_update.py", "bench_step.py", "bench_memory_comm.py"):
        assert subject in out.stdout, subject
