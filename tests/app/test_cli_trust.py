"""Hostile and careless input to the `fusedzero` CLI, in-process and cheap: no write
goes through a link, no read waits on a FIFO or reads a device, flags out of range are refused
up front (one line naming the flag, exit 2) instead of failing on the ranks.

Every case here fails before the ranks start: nothing is spawned.

About an internal: fusedzero._safe_paths.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from fusedzero import _safe_paths as safe_paths
from fusedzero.app import cli  # the CLI proper: no fork server for ranks that never start
from fusedzero.app.watch import MetricsLog

T = [
    "train",
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--eval-seqs",
    "2",
    "--no-progress",
    "--sample-tokens",
    "0",
    "--device",
    "cpu",
    "--steps",
    "2",
]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The CLI's one error line for `argv` (exit 2)."""
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusedzero: error: "), lines
    return lines[0]


# -- outputs: See [Note: no write through a link] ------------------------------------------------
@pytest.mark.parametrize("flag", ["--out-json", "--log-jsonl", "--plot"])
def test_output_through_a_symlink_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str
) -> None:
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


def test_output_that_is_a_fifo_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
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


def test_replace_file_replaces_a_link_planted_after_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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


# -- inputs: See [Note: no read from a FIFO or device] --------------------------------------------
def _corpus_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("some text to train on\n" * 40)
    return folder


@pytest.mark.timeout(60)  # before the fix: the read of the FIFO waited forever
def test_data_folder_holding_a_fifo_or_a_device_link_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: a FIFO in a --data folder hung the launcher; a `*.txt -> /dev/zero` link read
    until MemoryError. Both are one line naming --data and the file (exit 2)."""
    folder = _corpus_folder(tmp_path)
    os.mkfifo(folder / "b.txt")
    line = _error(capsys, [*T, "--data", str(folder)])
    assert "--data" in line and "b.txt" in line and "is a FIFO" in line, line
    (folder / "b.txt").unlink()
    os.symlink("/dev/zero", folder / "b.txt")
    line = _error(capsys, [*T, "--data", str(folder)])
    assert "--data" in line and "b.txt" in line and "is a character device" in line, line


@pytest.mark.timeout(60)
def test_hf_config_fifo_is_refused_by_plan_and_export(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`ckpt export ... --hf-config FIFO` hung; `plan --hf-config FIFO` said "no config.json
    there". Both name --hf-config and the FIFO, before any checkpoint is read."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    for argv in (
        ["plan", "-W", "2", "--hf-config", str(fifo)],
        ["plan", "-W", "2", "--hf-config", str(tmp_path)],  # the folder holding it
        ["ckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--hf-config", str(fifo)],
    ):
        line = _error(capsys, argv)
        assert "--hf-config" in line and "is a FIFO" in line, line


def test_read_bytes_refuses_sockets_and_files_over_the_limit(tmp_path: Path) -> None:
    import socket

    sock_path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        for read in (
            lambda: safe_paths.read_bytes(sock_path, "--data"),
            lambda: safe_paths.check_input(sock_path, "--data"),
        ):
            with pytest.raises(safe_paths.UnsafePath, match=r"--data .*is a socket"):
                read()
    f = tmp_path / "f.json"
    f.write_bytes(b"[1]" + b" " * 97)
    assert safe_paths.read_json(f, "--hf-config", limit=100) == [1]
    with pytest.raises(safe_paths.UnsafePath, match=r"holds more than 99 bytes"):
        safe_paths.read_bytes(f, "--hf-config", limit=99)


def test_deeply_nested_json_is_one_line_naming_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """100000-deep JSON in --hf-config or in an existing --log-jsonl raised RecursionError (exit
    1, no file named); now one line naming the file (plan: exit 2; the log: a ValueError, which
    rank 0 reports as a usage error)."""
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "config.json").write_text(deep)
    line = _error(capsys, ["plan", "-W", "2", "--hf-config", str(tmp_path / "config.json")])
    assert "--hf-config" in line and "config.json" in line and "nested too deeply" in line, line
    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "x": ' + deep + "}\n")
    with pytest.raises(ValueError, match=r"--log-jsonl .*m\.jsonl.*line 2: JSON nested too "):
        MetricsLog(log)
    assert log.read_text().endswith("}\n")  # left as it was


# -- flags out of range: refused up front, naming the flag -----------------------------------------
@pytest.mark.parametrize("value", ["1e10", "0.0004", "1e-9", "1e30", "inf", "nan", "0"])
def test_timeout_out_of_range_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """Before: 1e10, 0.0004 and 1e-9 failed on the ranks with 30 lines of C++ frames or "timed
    out after 0ms"; 1e30 with an OverflowError naming no flag."""
    line = _error(capsys, [*T, "--timeout", value])
    assert "--timeout must be in [1, 1e+09] seconds" in line, line


def test_timeout_range_is_in_the_help() -> None:
    from fusedzero.app.config import ArgParser, add_arguments

    p = ArgParser(prog="fusedzero train")
    add_arguments(p)
    timeout = next(a for a in p._actions if "--timeout" in a.option_strings)  # noqa: SLF001
    assert "1 to 1e+09" in (timeout.help or "")


@pytest.mark.parametrize(
    "flag, value, words",
    [
        # Before: checked on the ranks (exit 1) or not at all.
        ("--seed", "100000000000000000000000", "--seed must be in [0, 4294967295]"),
        ("--seed", "-1", "--seed must be in [0, 4294967295]"),
        ("--weight-decay", "inf", "--weight-decay must be in [0, 3.403e+38]"),
        ("--weight-decay", "1e39", "--weight-decay must be in [0, 3.403e+38]"),
        ("--lr", "1e39", "--lr must be in [1.175e-38, 3.403e+38], a normal fp32 number"),
        (
            "--lr",
            "1e-46",
            "--lr must be in [1.175e-38, 3.403e+38], a normal fp32 number",
        ),  # 0 in fp32
        ("--clip", "1e39", "--clip must be >= 0 (0 disables) and within fp32's range"),
        # Before: refused after the whole run, when the sample was drawn.
        ("--temperature", "1e-300", "--temperature must be 0 (greedy) or in [0.001, 1000]"),
    ],
)
def test_hyper_parameters_out_of_range_are_refused_up_front(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, words: str
) -> None:
    line = _error(capsys, [*T, flag, value])
    assert words in line, line


def test_edges_of_the_ranges_are_accepted() -> None:
    from fusedzero.app.config import FP32, SEED_MAX, TrainConfig

    for kw in (
        dict(lr=FP32.tiny),
        dict(lr=FP32.max),
        dict(seed=SEED_MAX),
        dict(seed=0),
        dict(weight_decay=FP32.max),
        dict(clip=math.inf),
        dict(temperature=0.0),
        dict(temperature=1e-3),
        dict(temperature=1e3),
        dict(timeout=1.0),
        dict(timeout=1e9),
    ):
        TrainConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "var, value",
    [
        ("WORLD_SIZE", "abc"),
        ("WORLD_SIZE", "0"),
        ("RANK", "x"),
        ("RANK", "2"),
        ("LOCAL_RANK", "-1"),
        ("LOCAL_WORLD_SIZE", "1.5"),
    ],
)
def test_bad_torchrun_variable_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    """Before: WORLD_SIZE=abc gave a bare "ValueError: invalid literal for int()" (exit 1)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", var: value}.items():
        monkeypatch.setenv(k, v)
    line = _error(capsys, T)
    assert f"environment variable {var}={value!r}" in line or f"{var}={value}" in line, line


@pytest.mark.parametrize("value", ["1e30", "1e19", "9.2e18"])
def test_plan_params_too_large_is_one_line(capsys: pytest.CaptureFixture[str], value: str) -> None:
    """Before: a TypeError or RuntimeError from torch with C++ frame text (exit 1)."""
    line = _error(capsys, ["plan", "--params", value, "-W", "2"])
    assert "--params must be at most 1e+18" in line and "frame" not in line, line
    assert cli.main(["plan", "--params", "1e18", "-W", "2", "--json"]) == 0
