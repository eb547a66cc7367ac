"""A new user's first hour with `fusedzero train`, end to end on 2 gloo ranks: the sample at the
end reads as text, a resume says where it resumed and what changed, a finished run says so and
exits 0, the JSONL log appends under one run id from a step-0 val record, a resume into another
model's shape fails in one short line, the export loads into GPT(GPTConfig()), and a closed
stdout ends the run quietly.

One run folder is shared by the module (each launch costs seconds of start-up): the model is
`fusedzero train`'s default shape (so its export fits GPTConfig()), on a small corpus and batch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fusedzero.app.cli import main
from fusedzero.app.launch import run
from fusedzero.app.watch import read_jsonl

# Spawns ranks and the CLI; a launch takes minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS, STOP = 24, 12
SAMPLE = 300


def _base(corpus: Path, ckpt: Path) -> list[str]:
    # --device cpu: 2 gloo ranks whatever GPUs are visible (auto would take one per GPU).
    return [
        "--data",
        str(corpus),
        "--steps",
        str(STEPS),
        "--batch-size",
        "16",
        "--eval-seqs",
        "8",
        "--ckpt-dir",
        str(ckpt),
        "--device",
        "cpu",
        "--no-progress",
    ]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The first launch, as a user types it (the console script, stdout as bytes): stopped at
    step STOP, with a JSONL log and a sample."""
    d = tmp_path_factory.mktemp("first_hour")
    corpus = d / "argparse.py"
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py", corpus)
    ckpt, jsonl = d / "ckpt", d / "metrics.jsonl"
    argv = [
        *_base(corpus, ckpt),
        "--stop-at",
        str(STOP),
        "--log-jsonl",
        str(jsonl),
        "--sample-tokens",
        str(SAMPLE),
    ]
    p = subprocess.run(
        [sys.executable, "-m", "fusedzero.cli", "train", *argv],
        capture_output=True,
        timeout=900,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert p.returncode == 0, p.stderr.decode(errors="replace")[-3000:]
    return {"dir": d, "corpus": corpus, "ckpt": ckpt, "jsonl": jsonl, "stdout": p.stdout}


def test_sample_is_text_not_spaces(first: dict) -> None:
    """The sample is sampled (temperature 0.8, top-k 40), not greedy: a byte model trained
    for a few steps greedily repeats its likeliest byte, a space. What it prints is valid
    UTF-8 and mostly letters where it is not blank."""
    out = first["stdout"].decode("utf-8")  # strict: raises on invalid UTF-8
    head = f"sample ({SAMPLE} bytes, temperature 0.8, top-k 40, after a newline):\n"
    assert head in out, out
    sample = out.split(head, 1)[1].split("\nfusedzero train: done", 1)[0]
    ink = [c for c in sample if not c.isspace()]
    assert len(ink) >= SAMPLE // 4, repr(sample)
    letters = sum(c.isascii() and c.isalpha() for c in ink)
    assert letters >= 0.5 * len(ink), repr(sample)
    assert all(c.isprintable() or c in "\n\t" for c in sample), repr(sample)


def test_jsonl_starts_with_step_0_val_under_one_run_id(first: dict) -> None:
    recs = read_jsonl(first["jsonl"])
    assert recs[0]["step"] == 0 and recs[0]["val_loss"] > 5 and recs[0]["loss"] is None
    assert len({r["run_id"] for r in recs}) == 1 and recs[0]["run_id"]
    assert [r["step"] for r in recs if r["loss"] is not None] == list(range(1, STOP + 1))


@pytest.fixture(scope="module")
def resumed(first: dict) -> dict:
    """The second launch: resumed on 1 rank at stage 1 to the end, appending to the log."""
    ckpt = first["dir"] / "ckpt_resumed"
    shutil.copytree(first["ckpt"], ckpt)
    jsonl = first["dir"] / "resumed.jsonl"
    shutil.copy(first["jsonl"], jsonl)
    out = first["dir"] / "resumed.out"
    argv = [
        *_base(first["corpus"], ckpt),
        "--resume",
        "--nproc",
        "1",
        "--stage",
        "1",
        "--log-jsonl",
        str(jsonl),
        "--sample-tokens",
        "0",
    ]
    p = subprocess.run(
        [sys.executable, "-m", "fusedzero.cli", "train", *argv],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out.write_text(p.stdout)
    return {"ckpt": ckpt, "jsonl": jsonl, "stdout": p.stdout}


def test_resume_says_where_from_and_what_changed(resumed: dict) -> None:
    lines = [x for x in resumed["stdout"].splitlines() if x.startswith("fusedzero: resumed")]
    assert lines == [
        f"fusedzero: resumed from step {STOP} (world 2, stage 2); now world 1, stage 1 (resharded)"
    ], resumed["stdout"]


def test_resume_appends_to_the_log_under_the_same_run_id(first: dict, resumed: dict) -> None:
    before = read_jsonl(first["jsonl"])
    after = read_jsonl(resumed["jsonl"])
    assert after[: len(before)] == before  # appended, not rewritten
    assert {r["run_id"] for r in after} == {before[0]["run_id"]}
    assert [r["step"] for r in after if r["loss"] is not None] == list(range(1, STEPS + 1))
    assert [r["step"] for r in after if r["val_loss"] is not None][0] == 0
    assert sum(r["step"] == 0 for r in after) == 1  # no second step-0 record on resume


def test_finished_run_says_so_and_exits_0(
    first: dict, resumed: dict, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    assert main(["train", *_base(first["corpus"], resumed["ckpt"]), "--resume"]) == 0
    out = capfd.readouterr().out
    assert (
        f"is already at step {STEPS}, its last step (--steps {STEPS}): nothing to train" in out
    ), out
    assert "tokens/s" not in out and "fusedzero train: done" not in out, out
    assert len(out.strip().splitlines()) == 1, out  # no "resumed from" line before it


def test_resume_into_another_shape_is_one_short_line(
    first: dict, resumed: dict, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    argv = [*_base(first["corpus"], resumed["ckpt"]), "--resume", "--n-embd", "64"]
    assert main(["train", *argv]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    # Short beside the folder it names (the temporary path's length is the machine's).
    assert len(err) == 1 and len(err[0].replace(str(resumed["ckpt"]), "")) < 300, err
    assert "wte.weight is [256, 128] there, [256, 64] in this run" in err[0], err


def test_export_of_a_default_run_loads_into_the_documented_model(
    resumed: dict, tmp_path: Path
) -> None:
    """`fusedzero ckpt export` -> GPT(GPTConfig()).load_state_dict(load_file(...)), strict."""
    import torch
    from safetensors.torch import load_file

    from fusedzero.app.model import GPT, GPTConfig

    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(resumed["ckpt"]), str(out)]) == 0
    weights = load_file(out)
    model = GPT(GPTConfig())
    model.load_state_dict(weights)  # strict: every name and shape
    assert torch.equal(model.blocks[1].mlp.fc.weight, weights["blocks.1.mlp.fc.weight"])
    assert model.lm_head.weight is model.wte.weight  # still tied after loading


def test_closed_stdout_ends_the_run_quietly(first: dict, tmp_path: Path) -> None:
    """`fusedzero train | head` with the reader gone: rank 0's first print fails, the run ends
    with 141 (128 + SIGPIPE) and no traceback."""
    argv = [*_base(first["corpus"], tmp_path / "ckpt"), "--steps", "2", "--sample-tokens", "0"]
    p = subprocess.Popen(
        [sys.executable, "-m", "fusedzero.cli", "train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    p.stdout.close()  # the reader leaves before the first line
    err = p.stderr.read().decode(errors="replace")
    assert p.wait(timeout=600) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_summary_json_is_untouched_by_a_finished_resume(
    first: dict, resumed: dict, tmp_path: Path
) -> None:
    """A finished run's resume writes no --out-json: nothing ran that it could describe."""
    out = tmp_path / "run.json"
    out.write_text(json.dumps({"mine": 1}))
    assert (
        run([*_base(first["corpus"], resumed["ckpt"]), "--resume", "--out-json", str(out)])[
            "steps"
        ][-1]["step"]
        == STEPS
    )
    assert json.loads(out.read_text()) == {"mine": 1}
