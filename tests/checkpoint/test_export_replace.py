"""A re-export replaces the old export whole (see [Note: an export replaces the old one whole] in
checkpoint/_weights.py): interrupted at any point, the folder holds the old export or no index,
never an index over shards of two checkpoints; a failed write leaves no temporary behind; and
`import_weights` refuses an index over another export's shards. 1-rank tiny model, in-process.

About an internal: fusedzero.checkpoint._format.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusedzero import checkpoint as ck
from fusedzero.checkpoint import _format as ckformat

from _helpers import TINY_CKPT, tiny_ckpt_opt, tiny_train

SHARD_BYTES = 2000  # the tiny model's params in several shards


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """step-2 and step-4 of a trained tiny model (different params)."""
    r = tmp_path_factory.mktemp("exp")
    model, opt = tiny_ckpt_opt(TINY_CKPT)
    tiny_train(model, opt, 2)
    ck.save(opt, r, step=2)
    tiny_train(model, opt, 2, seed=3)
    ck.save(opt, r, step=4)
    return r


def weights(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor the folder's index names, read file by file."""
    opt_model, opt = tiny_ckpt_opt(TINY_CKPT)
    ck.import_weights(opt, out)  # the library's reader: checks the index against the shards
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.parent.glob("model-*.safetensors")):
        got.update(load_file(f))
    return got


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def exported(root: Path, step: int, out: Path) -> dict[str, torch.Tensor]:
    r = ck.export(root / ck.step_dir_name(step), out, max_shard_bytes=SHARD_BYTES)
    assert r.index is not None and len(r.files) >= 3, r
    return weights(r.index)


def test_a_re_export_that_fails_after_some_shards_leaves_the_old_one(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "hf" / "model.safetensors"
    old = exported(root, 2, out)
    writes: list[Path] = []

    def full_after_two(path: Path, n: int) -> None:
        if path not in writes:
            writes.append(path)
        if len(writes) > 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckformat, "_write_hook", full_after_two)
    with pytest.raises(OSError, match="No space left"):
        ck.export(root / "step-00000004", out, max_shard_bytes=SHARD_BYTES)
    monkeypatch.setattr(ckformat, "_write_hook", None)
    assert same(weights(out.with_name(out.name + ".index.json")), old)  # step 2, whole
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]


def test_a_re_export_killed_among_the_renames_leaves_no_index(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "hf" / "model.safetensors"
    exported(root, 2, out)
    real = os.replace
    moved: list[str] = []

    def killed(a: os.PathLike[str], b: os.PathLike[str]) -> None:
        if Path(b).parent == out.parent and Path(b).name.startswith("model-"):
            moved.append(Path(b).name)
            if len(moved) == 2:
                raise KeyboardInterrupt  # as a kill would stop it, half-way through
        real(a, b)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        ck.export(root / "step-00000004", out, max_shard_bytes=SHARD_BYTES)
    monkeypatch.undo()
    index = out.with_name(out.name + ".index.json")
    assert not index.exists(), "an index over shards of two checkpoints"
    _, opt = tiny_ckpt_opt(TINY_CKPT)
    with pytest.raises(ck.CheckpointError, match="no model.safetensors or single"):
        ck.import_weights(opt, out.parent)


def test_an_index_over_another_exports_shards_is_refused(root: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors"
    exported(root, 2, a)
    exported(root, 4, b)
    name = sorted(p.name for p in a.parent.glob("model-*.safetensors"))[1]
    shutil.copy(b.parent / name, a.parent / name)  # copied together by hand
    _, opt = tiny_ckpt_opt(TINY_CKPT)
    with pytest.raises(
        ck.CheckpointError,
        match=f"{name}: a shard of export .* but its index is of export .*mixes two exports",
    ):
        ck.import_weights(opt, a.with_name(a.name + ".index.json"))


def test_a_failed_first_write_leaves_no_temporary(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, n: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckformat, "_write_hook", full)
    for shard in (None, SHARD_BYTES):
        out = tmp_path / f"x{shard}" / "model.safetensors"
        with pytest.raises(OSError, match="No space left"):
            ck.export(root, out, max_shard_bytes=shard)
        assert list(out.parent.iterdir()) == [], list(out.parent.iterdir())


def test_a_single_file_export_removes_the_index_of_an_earlier_sharded_one(
    root: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hf" / "model.safetensors"
    exported(root, 2, out)
    ck.export(root / "step-00000004", out)
    assert not out.with_name(out.name + ".index.json").exists()
    _, opt = tiny_ckpt_opt(TINY_CKPT)
    ck.import_weights(opt, out.parent)  # model.safetensors: step 4's, alone
