"""`fusedzero train` end to end on 2 gloo ranks: stages agree, bytes follow the ZeRO formulas,
resume is exact, and bad input gives one line, not a traceback.

Each run spawns 2 ranks (start-up dominates: a few seconds each), so the stage runs are shared by
a module fixture and the model is tiny.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fusedzero import cli
from fusedzero.app.config import MIN_LR_RATIO, UsageError
from fusedzero.app.launch import run

from _helpers import cli_error

# Tests that spawn ranks or the CLI are marked slow one by one; flag and path errors are fast.


W = 2
STEPS = 4
# Tiny model, 2 ranks x 4 sequences; warmup 1 so the 4 steps see warmup and cosine decay.
# --device cpu: gloo ranks on the CPU whatever GPUs are visible (auto would take one per GPU).
TINY = [
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "32",
    "--batch-size",
    "8",
    "--steps",
    str(STEPS),
    "--warmup",
    "1",
    "--lr",
    "3e-3",
    "--eval-seqs",
    "8",
    "--device",
    "cpu",
    "--nproc",
    str(W),
    "--no-progress",
]
STAGES = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real text file (reading the 7 MB default corpus costs ~2 s per run)."""
    path = tmp_path_factory.mktemp("data") / "argparse.py"
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py", path)
    return path


@pytest.fixture(scope="module")
def stage_runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """One 4-step run per stage, read back from --out-json."""
    out = {}
    for stage in (0, 1, 2, 3):
        path = tmp_path_factory.mktemp("runs") / f"stage{stage}.json"
        summary = run(
            TINY + ["--stage", str(stage), "--data", str(corpus), "--out-json", str(path)]
        )
        out[stage] = json.loads(path.read_text())
        assert out[stage]["steps"] == summary["steps"]
    return out


def losses(summary: dict) -> list[float]:
    return [s["loss"] for s in summary["steps"]]


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_json_has_every_field(stage_runs: dict[int, dict], stage: int) -> None:
    s = stage_runs[stage]
    assert (s["stage"], s["world_size"]) == (stage, W)
    assert [x["step"] for x in s["steps"]] == list(range(1, STEPS + 1))
    for x in s["steps"]:
        assert set(x) == {"step", "loss", "grad_norm", "lr"}
        assert all(
            isinstance(x[k], float) and math.isfinite(x[k]) for k in ("loss", "grad_norm", "lr")
        )
    assert set(s["resident_bytes"]) == {"params", "grads", "optimizer"}
    assert set(s["comm_bytes_per_step"]) == {
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "all_to_all",
    }
    assert s["dtypes"] == {
        "param": "float32",
        "master": "float32",
        "states": "fp32",
        "grad_reduce": "float32",
        "wire": None,
        "param_wire": None,
    }
    assert s["params"] <= s["padded_params"]
    assert s["tokens_per_s"] > 0
    # MFU: model FLOPs per token counted, no bf16 peak claimed for a CPU
    assert s["flops_per_token"] > 0 and s["mfu"] is None and s["device"] == "cpu"
    # Counted over a step: fp32 params (their own master) and fp32 grads are one combination.
    assert s["kernel_launches_per_step"] == {"adamw": 1, "sumsq": 1}
    # Learning: 4 steps at lr 3e-3 move the loss well below the first step's.
    assert s["val_loss"] < s["val"][0]["val_loss"] - 0.1
    assert s["steps"][-1]["loss"] < s["steps"][0]["loss"] - 0.1


@pytest.mark.slow
def test_stages_give_the_same_losses(stage_runs: dict[int, dict]) -> None:
    """Same seed and global batch, so the same data; stages differ only in where sums happen.

    With 2 ranks every reduction of grads is a single a+b (commutative, so exact and equal in
    all stages); what differs is the summation order of the grad-norm sum of squares (one local
    sum over the whole buffer in stage 0, two shard sums plus an all-reduce otherwise). That moves
    the clip coefficient by a few fp32 ulps, and Adam's update m/sqrt(v) is invariant to a
    common scale of the grads except through eps (1e-8 against sqrt(v) ~ 1e-2 .. 1e-4), so
    the losses agree to ~1e-7 relative. 1e-6 relative leaves room without hiding a real error
    (a wrong shard or a missing 1/W changes the second loss by more than 1e-3).
    """
    ref = losses(stage_runs[0])
    for stage, s in stage_runs.items():
        assert losses(s)[0] == ref[0], f"stage {stage}: step 1 sees the same params and data"
        assert losses(s) == pytest.approx(ref, rel=1e-6, abs=0), f"stage {stage}"
        norms = [x["grad_norm"] for x in s["steps"]]
        assert norms == pytest.approx([x["grad_norm"] for x in stage_runs[0]["steps"]], rel=1e-5)


@pytest.mark.slow
def test_resident_bytes_follow_zero_formulas(stage_runs: dict[int, dict]) -> None:
    """fp32 params (their own master) and fp32 grads: Psi_pad = padded elements of the stage's
    layout. Stage 0: 4+4+8 bytes/elem; 1: optimizer /W; 2: grads /W too; 3: params /W too."""
    expect = {0: (4, 4, 8), 1: (4, 4, 8 / W), 2: (4, 4 / W, 8 / W), 3: (4 / W, 4 / W, 8 / W)}
    for stage, s in stage_runs.items():
        psi = s["padded_params"]
        got = s["resident_bytes"]
        p, g, o = expect[stage]
        assert (got["params"], got["grads"], got["optimizer"]) == (p * psi, g * psi, o * psi), (
            f"stage {stage} with Psi_pad={psi}"
        )
        # Plain DDP holds Psi (unpadded) * (4 + 4 + 8) bytes.
        assert s["ddp_resident_bytes"] == {
            "params": 4 * s["params"],
            "grads": 4 * s["params"],
            "optimizer": 8 * s["params"],
        }
    totals = [sum(stage_runs[k]["resident_bytes"].values()) for k in sorted(stage_runs)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)


@pytest.mark.slow
def test_comm_bytes_match_ring_formulas(stage_runs: dict[int, dict]) -> None:
    """Per rank and step (ring): all-reduce 2(W-1)/W n b, reduce-scatter and all-gather
    (W-1)/W n b, with n = Psi_pad. Stages 1+ also all-reduce the fp32 grad-norm scalar; stage 0
    needs no scalar all-reduce (its reduced grads are replicated)."""
    scalar = 2 * (W - 1) * 4 // W
    for stage, s in stage_runs.items():
        psi = s["padded_params"]
        c = s["comm_bytes_per_step"]
        if stage == 0:
            want = {"all_reduce": 2 * (W - 1) * psi * 4 // W, "reduce_scatter": 0, "all_gather": 0}
        elif stage in (1, 2):
            want = {
                "all_reduce": scalar,
                "reduce_scatter": (W - 1) * psi * 4 // W,
                "all_gather": (W - 1) * psi * 4 // W,
            }
        else:  # ZeRO-3: params all-gathered in forward and again in backward, but the root's
            root = s["padded_root_params"]  # kept gathered from its forward into its backward
            assert 0 < root < psi
            want = {
                "all_reduce": scalar,
                "reduce_scatter": (W - 1) * psi * 4 // W,
                "all_gather": (W - 1) * (2 * psi - root) * 4 // W,
            }
        assert c == {**want, "all_to_all": 0}, f"stage {stage} with Psi_pad={psi}"


@pytest.mark.slow
def test_lr_follows_warmup_then_cosine(stage_runs: dict[int, dict]) -> None:
    lr, warmup = 3e-3, 1
    for i, x in enumerate(stage_runs[0]["steps"]):
        if i < warmup:
            want = lr * (i + 1) / warmup
        else:
            t = (i - warmup) / (STEPS - warmup)
            want = lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * t)))
        assert x["lr"] == pytest.approx(want, rel=1e-12), i


@pytest.mark.slow
def test_resume_after_stop_is_bitwise_and_reshards(
    stage_runs: dict[int, dict], corpus: Path, tmp_path: Path
) -> None:
    """--stop-at 2 then --resume gives the uninterrupted run's losses bit for bit (same world
    size and stage); the same checkpoint resumed on 1 rank at stage 1 continues closely (only
    the grouping of the batch mean changes: fp32 rounding)."""
    base = TINY + ["--stage", "2", "--data", str(corpus)]
    ckpt = tmp_path / "ckpt"
    stopped = run(base + ["--ckpt-dir", str(ckpt), "--stop-at", "2"])
    assert [x["step"] for x in stopped["steps"]] == [1, 2]
    assert losses(stopped) == losses(stage_runs[2])[:2]
    other = tmp_path / "ckpt_copy"
    shutil.copytree(ckpt, other)  # the resumed run saves step 4 into ckpt

    resumed = run(base + ["--ckpt-dir", str(ckpt), "--resume"])
    assert [x["step"] for x in resumed["steps"]] == list(range(1, STEPS + 1))
    assert resumed["steps"] == stage_runs[2]["steps"]  # bitwise: loss, grad norm and lr
    assert resumed["val_loss"] == stage_runs[2]["val_loss"]

    one = TINY[:-3] + ["--nproc", "1", "--no-progress", "--stage", "1", "--data", str(corpus)]
    resharded = run(one + ["--ckpt-dir", str(other), "--resume"])
    assert resharded["world_size"] == 1
    assert losses(resharded)[:2] == losses(stage_runs[2])[:2]  # history from the checkpoint
    assert losses(resharded)[2:] == pytest.approx(losses(stage_runs[2])[2:], rel=1e-5)


# -- errors: one line, exit code 2 ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "--stage", "4"], "invalid choice: 4"),
        (["train", "--steps", "0"], "--steps must be >= 1"),
        (["train", "--lr", "abc"], "invalid float value"),
        (["train", "--bogus"], "unrecognized arguments: --bogus"),
        (["train", "--n-embd", "30", "--n-head", "4"], "not divisible by --n-head 4"),
        (
            ["train", "--batch-size", "6", "--nproc", "4", "--device", "cpu"],
            "not divisible by data-parallel ranks*grad_accum",
        ),
        (["train", "--resume"], "--resume needs --ckpt-dir"),
        (["train", "--stop-at", "9", "--steps", "5", "--ckpt-dir", "x"], "--stop-at must be in"),
        (["nope"], "invalid choice: 'nope'"),
    ],
)
def test_bad_flags_give_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    assert words in cli_error(capsys, argv)


def test_bad_data_paths_give_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "tiny.txt").write_text("too short")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.bin").write_bytes(b"\0" * 1000)
    for path, words in [
        (tmp_path / "missing.txt", "does not exist"),
        (tmp_path / "empty", "no text files"),
        (tmp_path / "bin", "no text files"),
        (tmp_path / "tiny.txt", "fewer than 2*block_size+2"),
        (Path("/dev/null"), "is a character device; refusing to read it"),
    ]:
        line = cli_error(capsys, ["train", "--data", str(path), "--nproc", "1", "--device", "cpu"])
        assert "--data" in line and words in line, line
    with pytest.raises(UsageError, match="no complete checkpoint"):
        run(["--ckpt-dir", str(tmp_path / "empty"), "--resume", "--nproc", "1", "--device", "cpu"])


@pytest.mark.slow
def test_console_script_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    """The real entry point in a fresh interpreter (a fresh one costs seconds: one case, an
    error found after parsing; argparse's own errors are checked in process): exit code 2, one
    line on stderr."""
    argv = ["train", "--device", "cpu", "--data", str(tmp_path / "nope")]
    p = subprocess.run(
        [sys.executable, "-m", "fusedzero.cli", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith("fusedzero: error: ")


# -- the run folder: pre-flight checks, lock, new run vs resume vs overwrite -----------------------
def test_unwritable_paths_fail_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each fails at once with one line and rc 2 (before: after the whole run, or at the first
    save with a traceback). /proc stands for a read-only mount: refused even for root, where
    permission bits are not."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for argv, words in [
        (["--ckpt-dir", str(a_file)], "is a file, not a folder"),
        (["--ckpt-dir", "/proc/fusedzero-ckpt"], "cannot write in"),
        (["--ckpt-dir", "/proc"], "cannot write in"),
        (["--out-json", str(tmp_path)], "is a folder"),
        (["--out-json", str(a_file / "run.json")], "is a file, not a folder"),
        (["--out-json", "/proc/run.json"], "cannot write in"),
    ]:
        line = cli_error(capsys, ["train", *TINY, *argv])
        assert argv[0] in line and words in line, line


def _checkpoint_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_locked_folder_is_refused_naming_the_holder_and_stale_lock_is_taken_over(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, corpus: Path
) -> None:
    """A live process holding --ckpt-dir (another run) is named in the error; once it is killed
    (SIGKILL: no cleanup), its lock is stale and the next user takes it over."""
    from fusedzero.app.runlock import RunLock

    ckpt = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from fusedzero.app.runlock import RunLock; "
            f"RunLock({str(ckpt)!r}).acquire(); print('locked', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = cli_error(capsys, ["train", *TINY, "--data", str(corpus), "--ckpt-dir", str(ckpt)])
        assert "is in use by another run" in line and f"pid {holder.pid} " in line, line
    finally:
        holder.kill()
        holder.wait(timeout=60)
        holder.stdout.close()
    with RunLock(ckpt) as lock:
        assert lock.took_over is not None and f"pid {holder.pid} " in lock.took_over
    assert not (ckpt / ".fusedzero.lock").exists()  # released on exit


@pytest.mark.slow
@pytest.mark.timeout(900)  # includes the 4 runs of stage_runs on a busy machine
def test_new_run_resume_flags_and_overwrite(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, corpus: Path, stage_runs: dict[int, dict]
) -> None:
    """One folder through its life: a run stops at step 2; a new run into it is refused; a
    resume with changed --lr/--beta2/--weight-decay says so in one line and runs (and records)
    the new values; --overwrite starts over and, after its first save, the old steps are gone."""
    base = TINY + ["--stage", "2", "--data", str(corpus)]
    ckpt = tmp_path / "ckpt"
    run(base + ["--ckpt-dir", str(ckpt), "--stop-at", "2"])
    assert _checkpoint_names(ckpt) == ["step-00000002"]
    capfd.readouterr()

    assert cli.main(["train", *base, "--ckpt-dir", str(ckpt)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "already holds 1 checkpoint(s) (newest step-00000002)" in err[0]
        and "--resume" in err[0]
        and "--overwrite" in err[0]
    ), err

    out_json = tmp_path / "resumed.json"
    changed = ["--lr", "1e-3", "--beta2", "0.99", "--weight-decay", "0.2"]
    resumed = run(
        base + changed + ["--ckpt-dir", str(ckpt), "--resume", "--out-json", str(out_json)]
    )
    lines = [x for x in capfd.readouterr().out.splitlines() if "override the checkpoint" in x]
    assert len(lines) == 1, lines
    for words in (
        "--lr 0.001 (checkpoint: 0.003)",
        "--beta2 0.99 (checkpoint: 0.95)",
        "--weight-decay 0.2 (checkpoint: 0.1)",
    ):
        assert words in lines[0], lines
    assert "--beta1" not in lines[0] and "--clip" not in lines[0]
    # Steps 1-2 come from the checkpoint; steps 3-4 ran at the new peak lr on the same schedule.
    ref = stage_runs[2]["steps"]
    assert resumed["steps"][:2] == ref[:2]
    for new, old in zip(resumed["steps"][2:], ref[2:], strict=True):
        assert new["lr"] == pytest.approx(old["lr"] / 3, rel=1e-12)
    assert resumed["steps"][3]["loss"] != ref[3]["loss"]  # the step-3 update differed
    recorded = json.loads(out_json.read_text())["config"]
    assert (recorded["lr"], recorded["beta2"], recorded["weight_decay"]) == (1e-3, 0.99, 0.2)
    assert _checkpoint_names(ckpt) == ["step-00000002", "step-00000004"]

    run(base + ["--ckpt-dir", str(ckpt), "--overwrite", "--stop-at", "1"])
    assert _checkpoint_names(ckpt) == ["step-00000001"]
    assert (ckpt / "latest").read_text().strip() == "step-00000001"


@pytest.mark.slow
def test_watch_flags_write_jsonl_plot_and_print_a_sample(
    capfd: pytest.CaptureFixture[str], corpus: Path, tmp_path: Path
) -> None:
    """--log-jsonl gets one line per step (plus val lines), --plot a PNG, and the run ends with
    a text sample; at stage 3, where every rank must run the sample's forwards."""
    jsonl, png = tmp_path / "m" / "metrics.jsonl", tmp_path / "loss.png"
    summary = run(
        TINY
        + [
            "--stage",
            "3",
            "--data",
            str(corpus),
            "--eval-every",
            "2",
            "--log-jsonl",
            str(jsonl),
            "--plot",
            str(png),
            "--sample-tokens",
            "16",
        ]
    )
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    train = [x for x in lines if x["loss"] is not None]
    assert [x["step"] for x in train] == list(range(1, STEPS + 1))
    assert [x["loss"] for x in train] == pytest.approx(losses(summary), rel=1e-6)
    assert all(x["skipped"] is False and x["lr"] > 0 for x in train)
    assert train[0]["step_ms"] is None  # the first step is warm-up, untimed
    assert all(x["step_ms"] > 0 and x["tokens_per_s"] > 0 for x in train[1:])
    assert [x["step"] for x in lines if x["val_loss"] is not None] == [0, 2, STEPS]
    assert len({x["run_id"] for x in lines}) == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        "sample (16 bytes, temperature 0.8, top-k 40, after a newline):" in capfd.readouterr().out
    )
