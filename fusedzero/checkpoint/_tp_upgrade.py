"""Convert a tensor-parallel root of record version 1 into the current version (each tp folder
bound to the record, fusedzero/checkpoint/_placements.py).

    fusedzero ckpt upgrade OLD_TP_ROOT NEW_ROOT

Loads and exports refuse a version-1 root: its tp folders are not bound to its
`tensor_parallel.json`, so an edit of the record that keeps every local shape (a placement
`S(0)` changed to `SS(0,2)`) cannot be told from the record that was saved. The converter checks
what such a root can promise -- the record's schema, that every tp folder's newest checkpoint
verifies (sizes, headers, sha256), holds exactly the params and local shapes the record's
placements give, and that the folders agree on the step count -- and then takes the record as it
is: convert only a root whose record you trust. As `_upgrade.py`, it writes a new root and leaves
the old one untouched: each tp folder's newest checkpoint copied into `NEW_ROOT/tp{t}of{T}`
(format 1 or 2 converted on the way) and bound, `tensor_parallel.json` written last.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from fusedzero.checkpoint import _catalog as catalog
from fusedzero.checkpoint._format import (
    LATEST,
    MANIFEST,
    fsync_dir,
    remove,
    step_dir_name,
    write_text_atomic,
)
from fusedzero.checkpoint._manifest import VERSION, CheckpointError
from fusedzero.checkpoint._placements import (
    TP_FILE,
    TP_VERSION,
    check_folder,
    folder,
    read,
    write_binding,
)
from fusedzero.checkpoint._upgrade import upgrade


def upgrade_tp(
    src: str | os.PathLike[str], out: str | os.PathLike[str], *, allowed: Collection[str] = ()
) -> Path:
    """Write tensor-parallel root `src` (record version 1) as a current one in the empty root
    `out` (empty but for the names in `allowed`: the run lock its caller holds); returns
    `out`. CheckpointError if a check fails or `src` is already current."""
    src, out = Path(src), Path(out)
    rec = read(src)
    if rec is None:
        raise CheckpointError(f"{src}: no {TP_FILE}: not a tensor-parallel checkpoint root")
    if rec["version"] >= TP_VERSION:
        raise CheckpointError(
            f"{src / TP_FILE} is already record version {rec['version']}; nothing to do"
        )
    if out.exists() and (not out.is_dir() or any(p.name not in allowed for p in out.iterdir())):
        raise CheckpointError(
            f"{out} exists and is not an empty folder; convert into an empty root"
        )
    T = rec["tp"]
    found: list[tuple[Path, dict[str, Any]]] = []
    for t in range(T):
        d = catalog.resolve(folder(src, t, T))
        m = catalog.read_manifest(d)
        if m["version"] >= VERSION:  # older formats are verified by `upgrade` itself
            catalog.verify(d, checksums=True)
        check_folder(d, m, rec, t)
        if found and m["step_count"] != found[0][1]["step_count"]:
            raise CheckpointError(
                f"{d}: step count {m['step_count']}, tp folder 0 has {found[0][1]['step_count']}"
            )
        found.append((d, m))
    rec = dict(rec, version=TP_VERSION)
    for t, (d, m) in enumerate(found):
        dest = folder(out, t, T)
        write_binding(out, rec, t)  # before the checkpoint, as `save` does
        if m["version"] < VERSION:
            upgrade(d, dest)
        else:
            _copy(d, m, dest)
        catalog.verify(dest, checksums=True)
    write_text_atomic(out / TP_FILE, json.dumps(rec, indent=1))
    return out


def _copy(d: Path, m: dict[str, Any], root: Path) -> None:
    """Checkpoint `d` (verified; manifest `m`) into `root` as its only step, then `latest`."""
    name = step_dir_name(m["step"])
    staging = root / f".{name}.tmp"
    staging.mkdir()
    try:
        for f in [*(e["name"] for e in m["files"]), MANIFEST]:  # names checked by the schema
            shutil.copyfile(d / f, staging / f)
        os.replace(staging, root / name)
    except BaseException:
        remove(staging, quiet=True)
        raise
    fsync_dir(root)
    write_text_atomic(root / LATEST, name + "\n")
