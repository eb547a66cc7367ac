"""Shared benchmark plumbing: collect `bench_*.py`, replay in-rank timings, dump results as JSON.

Run with `pytest bench/ --benchmark-only`. The default `pytest` run never sees this folder
(`testpaths = ["tests"]`).

Each subject file writes `bench/results/<file stem>.json` at the end of the session, in the shape
of pytest-benchmark's own `--benchmark-json` (`{"machine_info", "benchmarks": [...]}`), so
`python bench/report.py bench/results -o bench/REPORT.md` reads either.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from _common import SUMMARY

RESULTS = Path(__file__).parent / "results"


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    # pytest's default `python_files` is test_*.py; benchmark subjects are bench_*.py.
    # A file named on the command line is collected anyway: don't collect it twice.
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def machine_info() -> dict[str, Any]:
    try:
        here = Path(__file__).parent
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=here,
            check=False,
        ).stdout.strip()
        # Tracked files changed since that commit: the numbers are not that commit's alone.
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!results",
                "../fusedzero",
                "../kernels",
            ],
            capture_output=True,
            text=True,
            cwd=here,
            check=False,
        ).stdout.strip()
        commit += " (+ uncommitted changes)" if dirty else ""
    except OSError:
        commit = ""
    return {
        "node": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "commit": commit,
        "loadavg_at_end": os.getloadavg(),
        "datetime": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    bs = getattr(session.config, "_benchmarksession", None)
    if bs is None or not bs.benchmarks:
        return
    by_file: dict[str, list[dict[str, Any]]] = {}
    for b in bs.benchmarks:
        if b.has_error:
            continue
        d = b.as_dict(include_data=False)
        stem = Path(d["fullname"].split("::")[0]).stem
        by_file.setdefault(stem, []).append(d)
    RESULTS.mkdir(exist_ok=True)
    info = machine_info()
    for stem, rows in by_file.items():
        path = RESULTS / f"{stem}.json"
        path.write_text(
            json.dumps({"machine_info": info, "benchmarks": rows}, indent=1, default=str)
        )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SUMMARY:
        terminalreporter.section("fusedzero bench summary")
        for line in SUMMARY:
            terminalreporter.write_line(line)
        terminalreporter.write_line(
            f"results: {RESULTS}/*.json; report: "
            "python bench/report.py bench/results -o bench/REPORT.md"
        )
