"""`latest` decides what resumes (docs/checkpoints.md, "Threat model"; see [Note: latest decides]).

Every root here is built in this process from 1-rank saves of a tiny model (milliseconds each):
a branch (a run resumed from an older step), a folder copied in under another step's name, a
verifying checkpoint of another model, the old run's folders beside `--overwrite`'s new one,
and `latest` missing, broken or a link to a secret.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fusedzero import checkpoint as ck
from fusedzero.app.ckpt_cli import main as cli_main
from fusedzero.app.model import GPTConfig

from _helpers import TINY_CKPT, copy_root, tiny_ckpt_opt, tiny_train


def steps(root: Path) -> list[int]:
    return [int(p.name.removeprefix("step-")) for p in ck.list_checkpoints(root)]


@pytest.fixture(scope="module")
def branched_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 2, 4, 6, 8 of one run, then the run resumed from step 2 and saved step 4 again:
    `latest` names the branch's step 4, the old branch's 6 and 8 are still there."""
    root = tmp_path_factory.mktemp("br") / "br"
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    tiny_train(model, opt, 1)
    for step in (2, 4, 6, 8):
        ck.save(opt, root, step=step)
    ck.load(opt, root / "step-00000002")
    tiny_train(model, opt, 1, seed=40)
    ck.save(opt, root, step=4)
    return root


@pytest.fixture()
def branched(branched_once: Path, tmp_path: Path) -> Path:
    return copy_root(branched_once, tmp_path)


def test_resume_takes_what_latest_names_not_the_highest_step(branched: Path) -> None:
    assert ck.find_latest(branched) == ck.Latest(branched / "step-00000004", branched, [])
    assert ck.resolve(branched) == branched / "step-00000004"


def test_keep_last_keeps_the_step_latest_names_and_leaves_the_other_branch(branched: Path) -> None:
    """keep_last counts the steps up to the one just saved: the branch's step 6 (now `latest`)
    and nothing of it older; the abandoned branch's step 8 is left for the run to replace."""
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    ck.load(opt, branched)
    tiny_train(model, opt, 1, seed=60)
    ck.save(opt, branched, step=6, keep_last=1)
    assert steps(branched) == [6, 8]
    assert ck.find_latest(branched).path.name == "step-00000006"


def test_a_folder_copied_under_another_steps_name_is_refused(
    branched: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(branched / "step-00000002", branched / "step-00000099")
    assert ck.find_latest(branched).path.name == "step-00000004"
    with pytest.raises(
        ck.CheckpointError,
        match=r"named for step 99, but its manifest is of "
        r"step 2 \(copied or renamed\)",
    ):
        ck.verify(branched / "step-00000099")
    assert cli_main(["ckpt", "verify", str(branched / "step-00000099")]) == 1
    assert "FAILED" in capsys.readouterr().out
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    with pytest.raises(ck.CheckpointError, match="named for step 99"):
        ck.load(opt, branched / "step-00000099")


def test_a_verifying_checkpoint_of_another_model_as_a_newer_step_is_not_taken(
    branched: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    _, opt = tiny_ckpt_opt(GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=16))
    ck.save(opt, other, step=99)
    shutil.copytree(other / "step-00000099", branched / "step-00000099")
    ck.verify(branched / "step-00000099")  # a complete checkpoint, of another model
    assert ck.find_latest(branched).path.name == "step-00000004"


def test_overwrite_killed_while_removing_the_old_folders(tmp_path: Path) -> None:
    """`--overwrite` saves the new run's first step, then removes the old run's folders: killed
    between the two, `latest` (the new run's step 2) decides, not the old run's step 6."""
    root = tmp_path / "ow"
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    for step in (2, 4, 6):
        ck.save(opt, root, step=step)
    ck.save(opt, root, step=2)  # the new run's first save; the removal never happened
    assert ck.find_latest(root).path.name == "step-00000002"


def _corrupt(d: Path) -> None:
    f = d / "rank00000-of-00001.safetensors"
    f.write_bytes(f.read_bytes()[:-8])


def test_a_broken_latest_falls_back_below_the_step_it_named(branched: Path) -> None:
    _corrupt(branched / "step-00000004")
    found = ck.find_latest(branched)
    assert found.path.name == "step-00000002"  # not the other branch's 6 or 8
    assert (
        "took step-00000002, the newest step folder that verifies older than step 4"
        in found.skipped[0]
        and "truncated" in found.skipped[0]
    )


@pytest.mark.parametrize("what", ["missing", "a folder", "garbage"])
def test_a_missing_or_unreadable_latest_falls_back_to_the_newest_with_a_warning(
    branched: Path, what: str
) -> None:
    latest = branched / ck.LATEST
    latest.unlink()
    if what == "a folder":
        latest.mkdir()
    elif what == "garbage":
        latest.write_bytes(b"\x1b[2J" + b"x" * 3000)
    found = ck.find_latest(branched)
    assert found.path.name == "step-00000008" and len(found.skipped) == 1, found
    assert "took step-00000008, the newest step folder that verifies" in found.skipped[0]
    assert "\x1b" not in found.skipped[0] and len(found.skipped[0]) < 400


def test_latest_linked_to_a_secret_is_refused_without_showing_it(
    branched: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "credentials"
    secret.write_text("step-00000002\naws_secret_access_key=hunter2\n")
    (branched / ck.LATEST).unlink()
    (branched / ck.LATEST).symlink_to(secret)
    with pytest.raises(ck.CheckpointError, match="is a symlink") as e:
        ck.resolve(branched)
    assert "hunter2" not in str(e.value)
    assert cli_main(["ckpt", "verify", str(branched)]) == 2
    err = capsys.readouterr().err
    assert "is a symlink" in err and "hunter2" not in err and "step-00000002" not in err, err
    found = ck.find_latest(branched)  # resume: falls back, with the reason, not the content
    assert found.path.name == "step-00000008" and "hunter2" not in found.skipped[0]
    (branched / ck.LATEST).unlink()
    os.mkfifo(branched / ck.LATEST)  # a FIFO: refused at once, never waited on
    with pytest.raises(ck.CheckpointError, match="is a FIFO"):
        ck.resolve(branched)


def test_many_bad_step_folders_give_one_bounded_line(tmp_path: Path) -> None:
    root = tmp_path / "bad"
    for i in range(1, 301):
        (root / ck.step_dir_name(i)).mkdir(parents=True)
        (root / ck.step_dir_name(i) / ck.MANIFEST).write_text("{}")
    with pytest.raises(ck.CheckpointError) as e:
        ck.find_latest(root)
    msg = str(e.value)
    assert len(msg) < 2000 and "and 297 more step folder(s) failed verification" in msg, msg
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    ck.save(opt, tmp_path / "one", step=0)
    shutil.copytree(tmp_path / "one" / "step-00000000", root / "step-00000000")
    found = ck.find_latest(root)  # one good among them: a bounded warning
    assert found.path.name == "step-00000000"
    assert len(found.skipped) == 5 and len("".join(found.skipped)) < 2000, found.skipped


def test_an_unreadable_step_folder_is_passed_over(
    branched: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode-000 step folder (simulated: the tests may run as root, which reads anything):
    the fallback passes over it with the reason, never a PermissionError."""
    bad = branched / "step-00000008"
    real = os.stat

    def stat(p: os.PathLike[str] | str, *a: object, **k: object) -> os.stat_result:
        if str(p).startswith(str(bad)) and str(p) != str(bad):
            raise PermissionError(13, "Permission denied", str(p))
        return real(p, *a, **k)  # type: ignore[arg-type]

    (branched / ck.LATEST).write_text("step-00000008\n")
    monkeypatch.setattr(os, "stat", stat)
    found = ck.find_latest(branched)
    assert found.path.name == "step-00000006", found
    assert "Permission denied" in found.skipped[0], found.skipped


@pytest.mark.slow
def test_train_resume_follows_latest_after_a_branch(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A branched run through `fusedzero train`: a run to step 8, a branch resumed from its
    step 2 to step 4, then `--resume --keep-last 1`: resumes from the branch's step 4 (was:
    step 8), and keep-last leaves the step `latest` names."""
    from fusedzero.app.launch import run as train_run

    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    br = tmp_path / "br"
    base = [
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--block-size",
        "16",
        "--batch-size",
        "2",
        "--steps",
        "12",
        "--save-every",
        "2",
        "--eval-seqs",
        "2",
        "--nproc",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        "--sample-tokens",
        "0",
        "--data",
        str(data),
    ]
    train_run(base + ["--ckpt-dir", str(br), "--stop-at", "8"])
    train_run(
        base
        + ["--ckpt-dir", str(br / "step-00000002"), "--resume", "--stop-at", "4", "--lr", "0.001"]
    )
    assert (br / ck.LATEST).read_text().strip() == "step-00000004"
    capfd.readouterr()
    train_run(base + ["--ckpt-dir", str(br), "--resume", "--keep-last", "1", "--stop-at", "6"])
    out = capfd.readouterr().out
    assert "resumed from step 4 " in out, out
    assert (br / ck.LATEST).read_text().strip() == "step-00000006"
    assert steps(br) == [6, 8]  # the old branch's 8 waits to be replaced
