"""`fusedzero ckpt` on odd but possible inputs: one clear line or a sane listing, never a
Python error or raw bytes on the terminal. 1-rank checkpoints of a tiny model, in-process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from fusedzero import checkpoint as ck
from fusedzero.app.ckpt_cli import main as cli_main
from fusedzero.app.runlock import RunLock

from _helpers import TINY_CKPT, tiny_ckpt_opt

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one")
    _, opt = tiny_ckpt_opt(TINY_CKPT)
    ck.save(opt, root, step=0)
    return root / "step-00000000"


def edited(src: Path, tmp_path: Path, edit: object) -> Path:
    d = tmp_path / src.name
    shutil.copytree(src, d)
    m = json.loads((d / ck.MANIFEST).read_text())
    edit(m)  # type: ignore[operator]
    (d / ck.MANIFEST).write_text(json.dumps(m))
    return d


def test_inspect_of_a_checkpoint_without_params(
    one: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_params(m: dict) -> None:
        m["params"] = []
        for g in m["param_groups"]:
            g["param_names"] = []
        m["files"][0]["groups"] = []

    d = edited(one, tmp_path, no_params)
    cli_main(["ckpt", "inspect", str(d)])
    cap = capsys.readouterr()
    assert "holds no parameters" in cap.out and "Traceback" not in cap.err + cap.out, cap
    assert "max()" not in cap.err, cap.err


def test_inspect_escapes_param_names(
    one: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = "wte.weight\x1b]0;pwned\x07\x1b[2J"

    def rename(m: dict) -> None:
        old = m["params"][0]["name"]
        m["params"][0]["name"] = evil
        for g in m["param_groups"]:
            g["param_names"] = [evil if n == old else n for n in g["param_names"]]

    d = edited(one, tmp_path, rename)
    cli_main(["ckpt", "inspect", str(d)])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, out
    assert "'wte.weight\\x1b]0;pwned\\x07\\x1b[2J'" in out, out


def test_a_tensor_parallel_record_that_is_not_utf8_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tensor_parallel.json").write_bytes(b'{"tp": \xff\xfe}')
    assert cli_main(["ckpt", "verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tensor_parallel.json: unreadable" in err, err


def test_upgrade_takes_the_run_lock_of_its_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live run holds its root's lock: `ckpt upgrade` into that root is refused (its
    keep-last could delete what the conversion writes); free, the conversion runs."""
    out = tmp_path / "out"
    src = FIXTURES / "ckpt_v1" / "root"
    with RunLock(out):
        assert cli_main(["ckpt", "upgrade", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert "is in use by another run" in err, err
    assert not ck.list_checkpoints(out)
    assert cli_main(["ckpt", "upgrade", str(src), str(out)]) == 0
    assert len(ck.list_checkpoints(out)) == 1


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: os.mkfifo(p), "is a FIFO"),  # before: export waited on it for ever
        (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    ],
)
def test_export_hf_config_that_is_a_fifo_or_too_deep_is_one_line(
    one: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, words: str
) -> None:
    cfg = tmp_path / "config.json"
    make(cfg)  # type: ignore[operator]
    assert (
        cli_main(["ckpt", "export", str(one), str(tmp_path / "out"), "--hf-config", str(cfg)]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "out").exists()
