"""The GPU proof's pieces that run anywhere: the exposed-communication measure on a synthetic
timeline (exact), and `bash bench/gpu/run.sh --dry-run` end to end on CPU (every script of the
proof runs: multi.py at W=1..2 under torchrun with gloo, fake_world.py at W=8, the step rows at
a tiny size, the report). bench/gpu/lease.sh: tests/app/test_bench_gpu_lease.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench_script(name: str) -> ModuleType:
    """bench/gpu/NAME.py as a module (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", ROOT / f"bench/gpu/{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_exposed_fraction_counts_comm_no_compute_overlaps() -> None:
    t = _bench_script("timeline")
    kernels = [
        (0.0, 10.0, "ampere_sgemm"),  # compute 0-10
        (5.0, 15.0, "ncclDevKernel_AllGather"),  # 5-10 hidden, 10-15 exposed
        (12.0, 14.0, "ncclDevKernel_ReduceScatter"),  # inside the exposed part: no double count
        (20.0, 30.0, "elementwise_kernel"),  # compute 20-30
        (28.0, 32.0, "ncclDevKernel_AllReduce"),  # 28-30 hidden, 30-32 exposed
    ]
    r = t.exposed_fraction(kernels)
    assert r["comm"] == 10.0 + 4.0
    assert r["compute"] == 20.0
    assert r["exposed"] == 5.0 + 2.0
    assert r["span"] == 32.0
    assert r["exposed_fraction"] == 7.0 / 32.0
    assert t.minus([(0, 1)], []) == 1.0 and t.minus([], [(0, 1)]) == 0.0
    assert t.union([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]


def test_run_sh_suite_steps_and_the_report_agree(tmp_path: Path) -> None:
    """run.sh's pytest runs (the dry run skips them) write what report.py reads, and none runs
    the interpreter with the GPU visible (the doctor and the cuda tests refuse that state)."""
    report = _bench_script("report")
    script = (ROOT / "bench/gpu/run.sh").read_text()
    written = script[: script.index('> "$R/pytest.json"')]
    written = written[written.rindex("printf '") :]  # the printf that writes pytest.json
    assert re.findall(r'"(\w+)": %s', written) == [k for k, _, _ in report.PYTEST_RUNS]
    for _, log, _ in report.PYTEST_RUNS:
        assert f'> "$R/{log}" 2>&1' in script, log
    pytest_lines = [ln for ln in script.replace("\\\n", " ").splitlines() if "-m pytest" in ln]
    assert len(pytest_lines) == 4  # the kernel benchmark, then the three suite runs
    for ln in pytest_lines[1:]:
        assert ("env -u TRITON_INTERPRET" in ln) != (
            "CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1" in ln
        ), ln
    (tmp_path / "pytest_suite.txt").write_text("...\n3 passed, 1 skipped in 2.00s\n")
    assert report.tests_section(tmp_path, {"cuda": 0, "suite": 1}) == [
        "- `pytest -m cuda`: exit 0: (no log)",
        "- `pytest (the whole suite, GPU visible)`: exit 1: 3 passed, 1 skipped in 2.00s",
    ]


@pytest.mark.slow
def test_run_sh_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # `python` on PATH is this interpreter (the venv), as docs/gpu.md runs it.
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "bench/gpu/run.sh"), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fusedzero from" in proc.stdout
    assert not list(out.glob("*.failed")), proc.stdout[-3000:] + proc.stderr[-6000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dry_run"] is True and meta["gpus"] == 2
    for w in (1, 2):
        d = json.loads((out / f"multi_w{w}.json").read_text())
        assert d["world_size"] == w and not d["errors"], d["errors"]
        assert len(d["parity"]) == 9
        for row in d["parity"]:
            assert "error" not in row and row["ok"], row
            assert row["control"]["loss_rel_diff"] == 0.0, row  # the reference repeats on CPU
        assert {r["system"] for r in d["timing"]["rows"]} >= {
            "bare",
            "fusedzero-2",
            "ddp+adamw_fused",
        }
        if w == 1:
            assert 0.0 <= d["exposed"]["exposed_fraction"] <= 1.0
        else:  # torch's CPU profiler crashes gloo ranks now and then (bench/gpu/multi.py)
            assert "exposed" not in d and "SIGSEGV" in d["exposed_skipped"]
    fake = json.loads((out / "fake_world.json").read_text())
    assert [r["stage"] for r in fake["rows"]] == [1, 2, 3]
    for r in fake["rows"]:
        assert r["same_on_every_rank"] and not r["errors"] and r["trace_events"] > 0, r
    numerics = json.loads((out / "numerics.json").read_text())
    assert [r["impl"] for r in numerics["update"]] == ["forloop", "foreach", "fused", "fusedzero"]
    for r in numerics["update"]:  # fp32 rounding over 5 steps, far from a wrong update (~1e-3)
        assert "error" not in r and r["worst_rel"] < 1e-4, r
    for shape in ("gpt2-124m", "llama-255m"):  # the step rows per model shape, tiny on CPU
        d = json.loads((out / f"step_{shape}.json").read_text())
        assert not d["errors"] and d["tiny"] and len(d["rows"]) == 9, d["errors"]
    phases = json.loads((out / "phases.json").read_text())
    assert set(phases["phases"]["gpt"]) >= {"bare", "fusedzero-2", "fusedzero-3"}
    assert set(phases["hooks"]) == {
        "bare",
        "fusedzero-0",
        "fusedzero-1",
        "fusedzero-2",
        "fusedzero-3",
        "bare/2",
        "fusedzero-3/2",
    }  # 4 layers: 2/unit
    assert "backward_us_per_unit" in phases["hooks"]["fusedzero-3"]
    report = (out / "REPORT.md").read_text()
    assert "Forward, backward, step and zero_grad apart" in report
    assert "Stage 3 apart (from units of 1 and " in report
    assert "Every stage at W = 1..N" in report and "Large world on one device" in report
    assert "## Step rows at W=1" in report
    # The report regenerates from the results alone (docs/gpu.md's second command).
    again = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/report.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert again.returncode == 0 and again.stdout.splitlines()[:3] == report.splitlines()[:3], (
        again.stderr[-2000:]
    )
