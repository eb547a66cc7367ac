"""Shard files are read through one descriptor (see [Note: load what was verified] in
checkpoint/_shardfile.py): a swap between the check and the read loads nothing swapped in, a
folder whose name is not valid UTF-8 verifies and loads, a shard that cannot be opened is
reported as what it is. 1-rank checkpoints of a tiny model, in this process.

About an internal: fusedzero.checkpoint._shardfile."""

from __future__ import annotations

import builtins
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedzero import checkpoint as ck
from fusedzero.app.ckpt_cli import main as cli_main

from _helpers import TINY_CKPT, tiny_ckpt_opt, tiny_train

SHARD = "rank00000-of-00001.safetensors"


def saved(root: Path) -> list[torch.Tensor]:
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    tiny_train(model, opt, 2)
    ck.save(opt, root, step=2)
    st = opt.shard_state()
    return [t.clone() for kind in ("master", "exp_avg", "exp_avg_sq") for t in getattr(st, kind)]


def loaded(opt: Any) -> list[torch.Tensor]:
    st = opt.shard_state()
    return [t.clone() for kind in ("master", "exp_avg", "exp_avg_sq") for t in getattr(st, kind)]


def _swap_after_first_open(monkeypatch: pytest.MonkeyPatch, shard: Path, evil: Path) -> list[bool]:
    """Rename `evil` over `shard` right after the first open of `shard` (by `open` or
    `os.open`), as a concurrent writer would; returns a list that holds True once done."""
    swapped: list[bool] = []

    def swap_once(p: Any) -> None:
        if not swapped and os.fsdecode(p) == str(shard):
            swapped.append(True)
            os.replace(evil, shard)

    real_open, real_os_open = builtins.open, os.open

    def hooked_open(p: Any, *a: Any, **k: Any) -> Any:
        f = real_open(p, *a, **k)
        if not isinstance(p, int):
            swap_once(p)
        return f

    def hooked_os_open(p: Any, *a: Any, **k: Any) -> int:
        fd = real_os_open(p, *a, **k)
        swap_once(p)
        return fd

    monkeypatch.setattr(builtins, "open", hooked_open)
    monkeypatch.setattr(os, "open", hooked_os_open)
    return swapped


def _tampered(shard: Path, tmp_path: Path) -> Path:
    """A copy of `shard` of the same size and header, a NaN as its first tensor's element 0."""
    data = bytearray(shard.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start : start + 4] = b"\x00\x00\xc0\x7f"
    evil = tmp_path / "evil"
    evil.write_bytes(bytes(data))
    return evil


def test_a_shard_swapped_after_it_was_opened_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A concurrent writer renames a shard of the same size and header over the one being
    loaded, right after the loader first opened it: what loads is what was hashed (before:
    hashed by one open, read by another, the tampered bytes loaded without an error)."""
    root = tmp_path / "r"
    want = saved(root)
    shard = root / "step-00000002" / SHARD
    evil = _tampered(shard, tmp_path)
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    swapped = _swap_after_first_open(monkeypatch, shard, evil)
    try:
        ck.load(opt, root)
    except ck.CheckpointError as e:  # refusing it is as good as loading the original
        assert "sha256 mismatch" in str(e), e
        return
    finally:
        monkeypatch.undo()
    assert swapped
    got = loaded(opt)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (
        "bytes swapped in after the hash were loaded"
    )


def test_a_shard_swapped_during_an_export_is_not_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "r"
    saved(root)
    ck.export(root, tmp_path / "want.safetensors")
    shard = root / "step-00000002" / SHARD
    evil = _tampered(shard, tmp_path)
    out = tmp_path / "out.safetensors"
    swapped = _swap_after_first_open(monkeypatch, shard, evil)
    try:
        ck.export(root, out)
    except ck.CheckpointError as e:
        assert "sha256 mismatch" in str(e) and not out.exists(), e
        return
    finally:
        monkeypatch.undo()
    assert swapped
    assert out.read_bytes() == (tmp_path / "want.safetensors").read_bytes(), (
        "bytes swapped in after the hash were exported"
    )


def test_a_folder_whose_name_is_not_utf8_saves_verifies_loads_and_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / os.fsdecode(b"ck-\xff\xfe")
    want = saved(root)
    ck.verify(root)
    assert ck.find_latest(root).path == root / "step-00000002"
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    ck.load(opt, root)
    assert all(torch.equal(a, b) for a, b in zip(loaded(opt), want, strict=True))
    assert cli_main(["ckpt", "verify", str(root)]) == 0
    assert cli_main(["ckpt", "inspect", str(root)]) == 0
    out = root / "model.safetensors"
    assert cli_main(["ckpt", "export", str(root / "step-00000002"), str(out)]) == 0, (
        capsys.readouterr().err
    )
    cap = capsys.readouterr()
    assert "ok: " in cap.out and "ck-\\xff\\xfe" in cap.out and not cap.err, cap
    assert out.stat().st_size > 0


def test_an_unreadable_shard_is_permission_denied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode-000 shard (simulated: tests may run as root, which reads anything)."""
    root = tmp_path / "r"
    saved(root)
    shard = root / "step-00000002" / SHARD
    real = os.open

    def denied(p: Any, *a: Any, **k: Any) -> int:
        if os.fsdecode(p) == str(shard):
            raise PermissionError(13, "Permission denied", os.fsdecode(p))
        return real(p, *a, **k)

    monkeypatch.setattr(os, "open", denied)
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    for call in (lambda: ck.verify(root), lambda: ck.load(opt, root)):
        with pytest.raises(ck.CheckpointError, match=f"{SHARD}: permission denied") as e:
            call()
        assert "No such file" not in str(e.value)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_shard_that_is_no_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "r"
    saved(root)
    shard = root / "step-00000002" / SHARD
    shard.unlink()
    os.mkfifo(shard) if kind == "fifo" else shard.mkdir()
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    for call in (lambda: ck.verify(root), lambda: ck.load(opt, root)):
        with pytest.raises(
            ck.CheckpointError, match="is a FIFO" if kind == "fifo" else "is a folder"
        ):
            call()
    shutil.rmtree(root)


def test_a_symlinked_manifest_is_refused_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "r"
    saved(root)
    m = root / "step-00000002" / ck.MANIFEST
    elsewhere = tmp_path / "elsewhere.json"
    m.rename(elsewhere)
    m.symlink_to(elsewhere)
    with pytest.raises(ck.CheckpointError, match="manifest .* is a symlink"):
        ck.read_manifest(root)


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_slices_read_while_hashing_cross_chunk_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """The streamed read (a chunk of 7 bytes splits every element and the header) gives the
    same slices as direct reads and the file's sha256."""
    import hashlib

    from fusedzero.checkpoint import _shardfile as shardfile

    monkeypatch.setattr(shardfile, "_CHUNK", chunk)
    p = tmp_path / "t.safetensors"
    a = torch.arange(53, dtype=torch.float32) * 1.5
    b = torch.arange(-20, 21, dtype=torch.int64)
    c = torch.arange(37, dtype=torch.float32).to(torch.bfloat16)
    w = ck.SafetensorsWriter(
        p, [("a", a.dtype, (53,)), ("b", b.dtype, (41,)), ("c", c.dtype, (37,))], {"k": "v"}
    )
    for name, t in (("a", a), ("b", b), ("c", c)):
        w.write(name, t)
    w.close()
    want = [("a", 0, 53), ("a", 17, 5), ("b", 3, 30), ("c", 36, 1), ("c", 0, 0), ("b", 40, 1)]
    src = {"a": a, "b": b, "c": c}
    for hashed in (True, False):
        dsts = [torch.empty(n, dtype=src[k].dtype) for k, _, n in want]
        with shardfile.ShardFile(p) as f:
            assert f.header().meta == {"k": "v"}
            got = f.read_slices(
                [shardfile.Slice(k, s, d) for (k, s, _), d in zip(want, dsts)], hashed=hashed
            )
        assert got == (hashlib.sha256(p.read_bytes()).hexdigest() if hashed else "")
        for (k, s, n), d in zip(want, dsts):
            assert torch.equal(d, src[k][s : s + n]), (hashed, k, s, n)
