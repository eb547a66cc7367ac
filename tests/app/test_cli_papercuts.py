"""The first hour with the `fusedzero` CLI, in-process and cheap: help texts, doctor's checks,
plan's units, the resume lines, a closed stdout, and the model config an export loads into.

The end-to-end runs of the same fixes (a real sample, resume, JSONL, export) are in
test_first_hour_runs.py (slow tier).
"""

from __future__ import annotations

import io
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from fusedzero.app import doctor, resume
from fusedzero.app.cli import build_parser, main
from fusedzero.app.config import TrainConfig, UsageError
from fusedzero.app.model import GPTConfig
from fusedzero.plan import _gb


def _help(*argv: str) -> str:
    """The help text of a subcommand, as `fusedzero ... --help` prints it, on one line (a
    terminal 1000 wide: argparse wraps at hyphens too)."""
    parser = build_parser()
    sub = next(
        a
        for a in parser._subparsers._group_actions  # noqa: SLF001 - argparse has no API
        if a.dest == "command"
    ).choices[argv[0]]
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "1000"
    try:
        return " ".join(sub.format_help().split())
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def test_switches_show_no_default_in_help() -> None:
    """A store_false switch's default is the state without it: `--no-progress (default: True)`
    read as if the flag were on by default."""
    text = _help("train")
    assert "--no-progress no progress bar" in text, text
    assert "(default: True)" not in text and "(default: False)" not in text


def test_sample_flags_have_documented_defaults() -> None:
    text = _help("train")
    assert "--temperature T sampling temperature of that sample, 0: greedy (default 0.8)" in text
    assert "--top-k K sample among the K likeliest bytes, 0: all (default 40)" in text
    cfg = TrainConfig()
    assert (cfg.temperature, cfg.top_k) == (0.8, 40)
    for field, value, words in (
        ("temperature", -1.0, "--temperature must be 0 .greedy. or"),
        ("top_k", -2, "--top-k must be >= 0"),
    ):
        with pytest.raises(UsageError, match=words):
            TrainConfig(**{field: value})


def test_jsonl_help_says_what_the_file_gets() -> None:
    text = _help("train")
    assert "append per-step metrics as JSON lines" in text
    assert "run_id" in text and "step-0 val" in text


def test_gpt_config_defaults_are_the_train_defaults() -> None:
    """`fusedzero ckpt export` of a default run loads into GPT(GPTConfig()): same shape."""
    got = {k: getattr(GPTConfig(), k) for k in TrainConfig().model_config()}
    assert got == TrainConfig().model_config()


def test_doctor_accepts_every_listed_check(capsys: pytest.CaptureFixture[str]) -> None:
    """Each name the help lists parses; `checkpoint` runs in the process group it needs."""
    text = _help("doctor")
    listed = re.search(r"run only these \(([^;)]*)", text).group(1).split(", ")
    assert listed == list(doctor.CHECKS) and "checkpoint" in listed
    for name in (*listed, "distributed"):
        assert build_parser().parse_args(["doctor", "--checks", name]).checks == [name]
    assert main(["doctor", "--checks", "checkpoint"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[:3] for line in out.splitlines()[1:-2]]
    assert [r[:2] for r in rows] == [["process", "group"], ["checkpoint", "ok"]], out


@pytest.mark.parametrize("gpu", [False, True], ids=["no_gpu", "one_gpu_visible"])
def test_doctor_bandwidth_on_cpu_is_measured_without_a_verdict(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, gpu: bool
) -> None:
    """On CPU the update runs on the torch path: the row says what ran and what its share of a
    copy means here, with status info, not ok. The doctor measures the GPU where torch sees one:
    this test tells it there is none, as test_doctor_is_green_on_the_cpu does (before, on the
    H200: the row measured cuda:0 and had a verdict; with a GPU faked visible here, the row
    failed on the CPU build's "Torch not compiled with CUDA enabled")."""
    if gpu:
        request.getfixturevalue("one_gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "CPU_NUMEL", 1 << 16)  # the figure's meaning, not its size
    (row,) = doctor.run(("bandwidth",))
    assert row.status is doctor.Status.INFO, row
    assert row.detail.startswith("no verdict on CPU: the update ran on the torch path")
    assert "% of a device copy" in row.detail and row.data["update_gbps"] > 0
    assert doctor.format_table([row]).splitlines()[-1].startswith("ok: 1/1")


@pytest.mark.parametrize(
    "n, want",
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1 KB"),
        (445_184, "445 KB"),
        (999_500, "1 MB"),
        (1_875_000_000, "1.88 GB"),
        (120 * 10**9, "120 GB"),
        (3 * 10**15, "3,000 TB"),
    ],
)
def test_plan_unit_per_value(n: int, want: str) -> None:
    assert _gb(n) == want


def test_plan_table_of_a_small_model_has_no_tiny_gb(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "train", "-W", "2"]) == 0
    table = capsys.readouterr().out
    assert "0.000" not in table and " KB " in table and "MB" in table, table
    assert "KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12 bytes" in table


def _opt(world: int, stage: int, shapes: dict[str, list[int]]) -> SimpleNamespace:
    """What the resume messages read of a ZeroAdamW."""
    infos = [SimpleNamespace(name=n, shape=tuple(s)) for n, s in shapes.items()]
    return SimpleNamespace(world_size=world, stage=stage, param_infos=lambda: infos)


def test_resumed_line_names_step_layout_and_what_changed() -> None:
    manifest = {"world_size": 2, "stage": 2}
    assert (
        resume.resumed_line(20, manifest, _opt(2, 2, {}), [])
        == "fusedzero: resumed from step 20 (world 2, stage 2)"
    )
    line = resume.resumed_line(20, manifest, _opt(1, 3, {}), ["--lr 0.001 (checkpoint: 0.003)"])
    assert line == (
        "fusedzero: resumed from step 20 (world 2, stage 2); now world 1, stage 3 "
        "(resharded); flags override the checkpoint: --lr 0.001 (checkpoint: 0.003)"
    )


def test_shape_mismatch_is_one_short_phrase() -> None:
    """A model one flag wider differs in every param: name the first, with both shapes."""
    width = {"wte.weight": [256, 32], **{f"blocks.{i}.mlp.fc.weight": [128, 32] for i in range(40)}}
    wider = {n: [s[0] * 2 if s[0] != 256 else 256, 64] for n, s in width.items()}
    manifest = {"params": [{"name": n, "shape": s} for n, s in width.items()]}
    msg = resume.other_model(manifest, _opt(2, 2, wider))
    assert msg == (
        "wte.weight is [256, 32] there, [256, 64] in this run (41 of 41 param names differ)"
    )
    assert resume.other_model(manifest, _opt(2, 2, width)) is None
    fewer = dict(list(width.items())[:-1])
    assert (
        resume.other_model(manifest, _opt(1, 0, fewer))
        == "blocks.39.mlp.fc.weight is only in the checkpoint (1 of 41 param names differ)"
    )
    # Another model altogether: never more differing than there are (was "17 of 15").
    other = {f"h.{i}.w": [4, 4] for i in range(17)}
    msg = resume.other_model(
        {"params": [{"name": n, "shape": s} for n, s in other.items()]},
        _opt(1, 0, dict(list(width.items())[:15])),
    )
    assert msg.endswith("(32 of 32 param names differ)"), msg


def test_closed_stdout_ends_quietly_with_141(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fusedzero plan | head`, the reader gone before the first line: no BrokenPipeError
    traceback, exit status 128 + SIGPIPE, as `yes | head` gives."""
    r, w = os.pipe()
    os.close(r)
    with capsys.disabled():
        closed = io.TextIOWrapper(io.FileIO(w, "w"), write_through=True)
        monkeypatch.setattr(sys, "stdout", closed)
        rc = main(["plan", "--params", "1e6", "-W", "2"])
        monkeypatch.undo()
    assert rc == 141
    closed.write("more\n")  # the fd now goes to /dev/null: no second BrokenPipeError at exit
    closed.close()
    assert capsys.readouterr().err == ""
