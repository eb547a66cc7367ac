"""Hostile and careless input to the `fusedzero` CLI (issue 44), in-process and cheap: no write
goes through a link, no read waits on a FIFO or reads a device, flags out of range are refused
up front (one line naming the flag, exit 2) instead of failing on the ranks.

Every case here fails before the ranks start: nothing is spawned.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusedzero import cli, safe_paths
from fusedzero.app.watch import MetricsLog

T = ["train", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
     "--batch-size", "4", "--eval-seqs", "2", "--no-progress", "--sample-tokens", "0",
     "--device", "cpu", "--steps", "2"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The CLI's one error line for `argv` (exit 2)."""
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusedzero: error: "), lines
    return lines[0]


# -- outputs: See [Note: no write through a link] ------------------------------------------------
@pytest.mark.parametrize("flag", ["--out-json", "--log-jsonl", "--plot"])
def test_output_through_a_symlink_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             flag: str) -> None:
    """Before: a symlinked --out-json replaced its target; a dangling --log-jsonl link created
    its target. Both links, to a file and dangling, are refused; nothing is written."""
    target = tmp_path / "target"
    target.write_text("secret\n")
    for link, points_to in (("to-file", target), ("dangling", tmp_path / "made")):
        os.symlink(points_to, tmp_path / link)
        line = _error(capsys, [*T, flag, str(tmp_path / link)])
        assert flag in line and "is a symlink" in line and link in line, line
    assert target.read_text() == "secret\n"
    assert not (tmp_path / "made").exists()


def test_output_that_is_a_fifo_is_refused(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    """An open of a FIFO for writing waits for a reader: refused, never opened."""
    os.mkfifo(tmp_path / "fifo")
    for flag in ("--out-json", "--log-jsonl"):
        line = _error(capsys, [*T, flag, str(tmp_path / "fifo")])
        assert flag in line and "is a FIFO" in line, line


def test_metrics_log_never_follows_a_link(tmp_path: Path) -> None:
    """The rank-side open of --log-jsonl: a link is refused there too (planted after the
    launcher's check), to a log or dangling; the target is neither read nor created."""
    real = tmp_path / "real.jsonl"
    real.write_text('{"step": 1}\n')
    for name, to in (("a.jsonl", real), ("b.jsonl", tmp_path / "made.jsonl")):
        os.symlink(to, tmp_path / name)
        with pytest.raises(safe_paths.UnsafePath, match=r"--log-jsonl .*is a symlink"):
            MetricsLog(tmp_path / name)
    assert real.read_text() == '{"step": 1}\n' and not (tmp_path / "made.jsonl").exists()


def test_replace_file_replaces_a_link_planted_after_the_check(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The rename replaces the name: a link that appears between the check and the write is
    replaced itself, its target untouched."""
    target, out = tmp_path / "target", tmp_path / "out.json"
    target.write_text("keep")
    monkeypatch.setattr(safe_paths, "check_output", lambda path, what: None)  # the race
    os.symlink(target, out)
    safe_paths.replace_file(out, lambda f: f.write(b"new"), "--out-json")
    assert target.read_text() == "keep" and not out.is_symlink() and out.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "target"]  # no temp left
    out.unlink()
    os.symlink(target, out)
    with pytest.raises(safe_paths.UnsafePath, match="is a symlink"):  # O_NOFOLLOW
        safe_paths.open_append(out, "--log-jsonl")
    assert target.read_text() == "keep"
