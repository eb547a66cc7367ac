"""Convert a checkpoint of format version 1 or 2 into version 3 (shard headers bound to it).

    fusedzero ckpt upgrade OLD NEW_ROOT        # writes NEW_ROOT/step-N and NEW_ROOT/latest

Versions 1 and 2 are refused by every load, because their shard headers do not record what their
bytes mean (`_binding.py`). The converter checks what those versions could promise -- the
manifest's schema, every shard's size, header rows, tensor names, dtypes and shapes, and every
sha256 -- then rewrites each shard with the same tensors (one tensor in memory at a time) and a
version-3 header, and writes the manifest last, as `save` does. The old checkpoint is not touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open

from fusedzero.checkpoint._binding import shard_metadata
from fusedzero.checkpoint._catalog import file_problems, read_manifest, resolve
from fusedzero.checkpoint._format import (
    LATEST,
    MANIFEST,
    ST_DTYPE,
    SafetensorsWriter,
    check_replaceable,
    fsync_dir,
    named,
    remove,
    step_dir_name,
    write_text_atomic,
)
from fusedzero.checkpoint._manifest import VERSION, CheckpointError, manifest_modes

_TORCH_DTYPE = {code: dt for dt, code in ST_DTYPE.items()}


def upgrade(src: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write checkpoint `src` (a folder or a root with `latest`, format 1 or 2) as a version-3
    checkpoint in root `out`; returns the new step folder. CheckpointError if `src` does not
    verify or is already version 3."""
    d = resolve(src)
    m = read_manifest(d)
    if m["version"] >= VERSION:
        raise CheckpointError(f"{d} is already format version {m['version']}; nothing to do")
    bad = file_problems(d, m, None, checksums=True, legacy=True)
    if bad:
        raise CheckpointError(
            f"checkpoint {d} failed verification, so it is not converted:\n  " + "\n  ".join(bad)
        )
    root = Path(out)
    name = step_dir_name(m["step"])
    final = root / name
    if final.exists() or final.is_symlink():
        raise CheckpointError(f"{final} exists; convert into an empty root")
    check_replaceable(root / LATEST, "upgrade output")
    new = dict(m, version=VERSION, modes=manifest_modes(m).to_json())
    staging = root / f".{name}.tmp"
    root.mkdir(parents=True, exist_ok=True)
    remove(staging)
    staging.mkdir()
    try:
        for e in new["files"]:
            e["bytes"], e["sha256"] = _rewrite(
                d / e["name"], staging / e["name"], shard_metadata(new, e)
            )
        write_text_atomic(staging / MANIFEST, json.dumps(new, indent=1))
        os.replace(staging, final)
    except BaseException:
        remove(staging, quiet=True)
        raise
    fsync_dir(root)
    write_text_atomic(root / LATEST, name + "\n")
    return final


def _rewrite(src: Path, dst: Path, meta: dict[str, str]) -> tuple[int, str]:
    """The tensors of `src`, in its order, into `dst` with header `meta`: (bytes, sha256)."""
    with safe_open(src, framework="pt") as f:
        keys = list(f.keys())
        specs = [
            (k, _TORCH_DTYPE[f.get_slice(k).get_dtype()], tuple(f.get_slice(k).get_shape()))
            for k in keys
        ]
        try:
            w = SafetensorsWriter(dst, specs, meta)
        except OSError as e:
            raise named(e, dst) from e
        try:
            for k in keys:
                w.write(k, f.get_tensor(k))
            return w.close()
        except BaseException:
            w.abort()
            raise
