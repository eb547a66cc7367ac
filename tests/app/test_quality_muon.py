"""bench/quality_muon.py: which runs it makes, and how it reads them (best lr per optimizer, the
step at which the best Muon run reaches the best AdamW run's final val loss), on summaries
written here in place of the runs (a run whose summary exists is not run again)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "quality_muon", ROOT / "bench" / "quality_muon.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reads_the_sweep_and_finds_the_step_muon_reaches_adamw(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _load()
    finals = {"adamw": (2.5, 2.4, 2.6), "muon": (2.3, 2.1, 2.0)}
    for opt, lrs in mod.SWEEPS.items():
        for lr, final in zip(lrs, finals[opt]):
            # val loss falls linearly from 3.0 at step 10 to `final` at step 40
            val = [
                {"step": s, "val_loss": 3.0 - (3.0 - final) * (s - 10) / 30}
                for s in (10, 20, 30, 40)
            ]
            (tmp_path / f"{opt}-{lr:g}.json").write_text(
                json.dumps({"val_loss": final, "train_loss": final - 0.1, "val": val})
            )
    mod.main(["--out", str(tmp_path), "--steps", "40", "--eval-every", "10"])
    out = capsys.readouterr().out
    d = json.loads((tmp_path / "quality_muon.json").read_text())
    assert d["best"] == {"adamw": mod.SWEEPS["adamw"][1], "muon": mod.SWEEPS["muon"][2]}
    # best Muon: 3.0 - 1.0 * (s - 10) / 30 <= 2.4 first at step 30 (2.333; 2.667 at step 20)
    assert d["muon_reaches_adamw_final_at_step"] == 30
    assert "at step 30 of 40" in out and out.count("(best)") == 2
    assert len(d["runs"]) == 6


def test_each_run_is_train_at_its_stage_sweeping_its_own_lr_flag(tmp_path: Path) -> None:
    mod = _load()
    args = mod.argparse.Namespace(nproc=2, steps=7, eval_every=5, stage=1)
    a = mod._argv("adamw", 1e-3, args, tmp_path / "a.json")
    m = mod._argv("muon", 0.05, args, tmp_path / "m.json")
    assert a[a.index("--optimizer") + 1] == "adamw" and a[a.index("--lr") + 1] == "0.001"
    assert m[m.index("--optimizer") + 1] == "muon" and m[m.index("--muon-lr") + 1] == "0.05"
    assert "--lr" not in m
    for argv in (a, m):
        assert argv[argv.index("--stage") + 1] == "1" and argv[argv.index("--steps") + 1] == "7"
        assert "--device" in argv
