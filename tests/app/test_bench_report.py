"""bench/REPORT.md is a function of the committed raw results; the README links to it.

The numbers are measured (bench/, never asserted here); what is asserted is provenance: the
committed report regenerates identically from the committed JSON by the one command the report
names, and no bench script writes the README."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _report_module():
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_report_regenerates_from_committed_results(tmp_path: Path) -> None:
    report = _report_module()
    results = ROOT / "bench" / "results"
    assert sorted(p.name for p in results.glob("*.json")), "no committed results in bench/results"
    text = report.render(Path("bench/results"), tmp_path / "REPORT.md", plots=False, root=ROOT)
    committed = (ROOT / "bench" / "REPORT.md").read_text()
    assert text == committed, (
        f"bench/REPORT.md differs from what `{report.COMMAND}` makes of bench/results: "
        "run that command and commit the result"
    )


def test_bench_never_rewrites_the_readme() -> None:
    """The README links to the reports for tables; no bench script writes into it."""
    report = _report_module()
    with pytest.raises(SystemExit):
        report.main(["bench/results", "--readme", "README.md"])  # no such option
    readme = (ROOT / "README.md").read_text()
    assert "(bench/REPORT.md)" in readme and "headline:begin" not in readme


def test_quality_table_regenerates_from_committed_runs_and_is_in_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench/quality/quality.md (the memory modes' val losses) is what bench/quality_modes.py
    makes of the committed run summaries, and bench/REPORT.md carries it."""
    spec = importlib.util.spec_from_file_location(
        "quality_modes", ROOT / "bench" / "quality_modes.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(ROOT / "bench" / "quality" / "raw", tmp_path)
    capsys.readouterr()
    committed = ROOT / "bench" / "quality"
    for name in ("quality.md", "quality.json"):
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (
            f"bench/quality/{name} differs from `python bench/quality_modes.py "
            "bench/quality/raw`: run it and commit the result"
        )
    table = (committed / "quality.md").read_text()
    assert "bf16-kahan | int8" in table
    assert table.rstrip("\n") in (ROOT / "bench" / "REPORT.md").read_text()


def test_stage3_is_compared_at_equal_regather_policy() -> None:
    """Our stage 3 that re-gathers in backward is compared with peers that reshard,
    the one that keeps params gathered with peers that keep (DeepSpeed's default keeps)."""
    report = _report_module()

    def row(system: str, family: str, regather: str, overhead: float, stages=(3,)) -> dict:
        return {
            "system": system,
            "family": family,
            "precision": "fp32",
            "stages": list(stages),
            "reduce": "fp32",
            "regather": regather,
            "overhead_median": overhead,
        }

    e = [
        row("fusedzero-3", "fusedzero", "reshard", 100.0),
        row("fusedzero-3-keep", "fusedzero", "keep", 60.0),
        row("fsdp2-keep", "torch", "keep", 90.0, stages=(2, 3)),
        row("fsdp2-reshard", "torch", "reshard", 140.0),
        row("deepspeed-3", "deepspeed", "default", 80.0),
        row("deepspeed-3-reshard", "deepspeed", "reshard", 160.0),
    ]
    assert {p["system"] for p in report._peers_of(e[0], e)} == {
        "fsdp2-reshard",
        "deepspeed-3-reshard",
    }
    assert {p["system"] for p in report._peers_of(e[1], e)} == {"fsdp2-keep", "deepspeed-3"}
    stage2 = row("fusedzero-2", "fusedzero", "", 50.0, stages=(2,))
    assert [p["system"] for p in report._peers_of(stage2, e + [stage2])] == ["fsdp2-keep"]


def test_peer_clipping_runs_every_step_from_a_parameters_generator(monkeypatch) -> None:
    """FSDP2's bench step clips `model.parameters()`: a generator, which once held as is was
    empty from the second step on, so the peer skipped the clip its overhead should include."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import _systems

    model = torch.nn.Linear(3, 2)
    seen: list[int] = []
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: seen.append(len(list(params)))
    )

    class Opt:
        def step(self) -> None: ...
        def zero_grad(self) -> None: ...

    model_step = _systems._train_step(
        lambda x, y: (None, model(x).sum()), Opt(), model.parameters()
    )
    for _ in range(3):
        model_step(torch.randn(4, 3), None)
    assert seen == [2, 2, 2]


def _gpu_report_module():
    spec = importlib.util.spec_from_file_location(
        "bench_gpu_report", ROOT / "bench" / "gpu" / "report.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_report_regenerates_from_committed_results() -> None:
    """bench/gpu/REPORT.md (measured on a lent GPU) is a function of bench/gpu/results; the
    README links to it and quotes the update's figures in prose."""
    gpu = _gpu_report_module()
    folder = ROOT / "bench" / "gpu" / "results"
    assert gpu.render(folder) == (ROOT / "bench" / "gpu" / "REPORT.md").read_text()
    assert gpu.headline(folder) in gpu.render(folder)
    readme = (ROOT / "README.md").read_text()
    assert "(bench/gpu/REPORT.md)" in readme and "0.490 ms" in gpu.render(folder)
    # Earlier leases (bench/gpu/archive/README.md): each report is a function of its folder.
    archived = sorted(p.parent for p in (ROOT / "bench" / "gpu" / "archive").glob("*/meta.json"))
    assert len(archived) >= 4
    for d in archived:
        assert gpu.render(d) == (d / "REPORT.md").read_text(), d
        assert f"-o bench/gpu/archive/{d.name}/REPORT.md" in gpu.render(d)
