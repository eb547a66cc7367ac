"""Checkpoints on disk: find them, read their manifest, check their files.

`resolve` turns a path into a checkpoint directory, `read_manifest` parses and validates its
manifest (`manifest.py`), `verify` / `problems` check the shard files against it (size, header,
sha256), `find_latest` picks the newest one that verifies, `inspect` summarises one. Nothing here
writes.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, NamedTuple

from safetensors import safe_open

from fusedzero.checkpoint.binding import header_problems, tensor_problems
from fusedzero.checkpoint.format import LATEST, MANIFEST, sha256_file
from fusedzero.checkpoint.manifest import (MAX_LATEST, MAX_MANIFEST, STEP_DIR, VERSION,
                                          CheckpointError, parse, plain_name)


def resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory `path` means: itself if it has a manifest, else what its
    `latest` file names (a plain `step-N` name inside `path`). Raises CheckpointError otherwise.
    See `find_latest` for the fallback to the newest verified checkpoint."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    latest = p / LATEST
    if latest.is_file():
        target = p / _latest_name(latest)
        if not (target / MANIFEST).is_file():
            raise CheckpointError(f"{latest} names {target.name!r}, but {target} has no "
                                  f"{MANIFEST}")
        return target
    if not p.exists():
        raise CheckpointError(f"not a checkpoint: {p} does not exist")
    raise CheckpointError(f"not a checkpoint: {p} has no {MANIFEST} (and no `{LATEST}` file "
                          "naming a checkpoint inside it)")


def _latest_name(latest: Path) -> str:
    """The step folder a `latest` file names; refuses anything but a plain `step-N` name."""
    try:
        # Never more than MAX_LATEST + 1 bytes: a huge `latest` is refused, not read whole.
        with open(latest, "rb") as fh:
            raw = fh.read(MAX_LATEST + 1)
        if len(raw) > MAX_LATEST:
            raise CheckpointError(f"{latest}: larger than {MAX_LATEST} bytes; it must hold "
                                  "one step folder's name")
        name = raw.decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest}: unreadable ({e})") from None
    plain_name(name, f"the content of {latest.name}", latest)
    if not STEP_DIR.match(name):
        raise CheckpointError(f"{latest}: names {name!r}; it must name a step folder "
                              "('step-N') inside the checkpoint root")
    return name


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse the manifest of checkpoint directory `path` (or of its `latest`) and validate all
    of it against the format's schema (`manifest.py`): CheckpointError naming the
    first malformed field."""
    d = resolve(path)
    f = d / MANIFEST
    try:
        # At most MAX_MANIFEST + 1 bytes are read (see its computation in manifest.py), and no
        # buffer is sized beyond the file (read(n) allocates n bytes up front).
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            raw = fh.read(min(size, MAX_MANIFEST) + 1)
    except OSError as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from None
    if len(raw) > size:
        raise CheckpointError(f"{f}: grew while it was read; not a finished manifest")
    if len(raw) > MAX_MANIFEST:
        raise CheckpointError(f"{f}: larger than {MAX_MANIFEST} bytes, the largest manifest "
                              "of 1024 ranks x a 70B model; not a manifest")
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from None
    del raw  # one copy of the text at a time: the bytes go before the parse builds objects
    return parse(text, f)


class Latest(NamedTuple):
    """What `find_latest` chose."""

    path: Path  # the checkpoint directory to load
    root: Path  # the folder that holds the step folders (where later saves go)
    skipped: list[str]  # newer checkpoints passed over, one line each: which and why


def find_latest(path: str | os.PathLike[str], *, checksums: bool = True) -> Latest:
    """The newest checkpoint under `path` that passes `verify`, for resuming.

    `path` is a root (with or without `latest`) or one step folder. A step folder is verified
    and returned as it is (its root is its parent). For a root, candidates are what `latest`
    names, then every `step-N` folder with a manifest, newest step first; the first that
    verifies (manifest schema, shard sizes and headers, and with `checksums` sha256) wins, and
    each newer one passed over is listed in `skipped` with the reason (callers warn with it).
    Raises CheckpointError when nothing verifies, listing every reason.
    """
    p = Path(path)
    if (p / MANIFEST).is_file():
        return Latest(verify(p, checksums=checksums), p.parent, [])
    if not p.is_dir():
        raise CheckpointError(f"not a checkpoint: {p} " + ("is not a folder" if p.exists()
                                                           else "does not exist"))
    candidates: list[Path] = []
    skipped: list[str] = []
    latest = p / LATEST
    if latest.is_file():
        try:
            candidates.append(resolve(p))
        except CheckpointError as e:
            skipped.append(f"{latest}: {e}")
    elif latest.exists() or latest.is_symlink():
        skipped.append(f"{latest}: not a regular file")
    for d in reversed(list_checkpoints(p)):
        if d not in candidates:
            candidates.append(d)
    # `latest` first only when it is the newest: an older `latest` (e.g. a crash between the
    # rename and the pointer update) is still a candidate in step order.
    candidates.sort(key=lambda d: -_step_of(d))
    for d in candidates:
        try:
            return Latest(verify(d, checksums=checksums), p, skipped)
        except CheckpointError as e:
            skipped.append(" ".join(str(e).split()))
    if not skipped:
        raise CheckpointError(f"not a checkpoint: {p} holds no complete checkpoint "
                              f"(no step-N folder with a {MANIFEST})")
    raise CheckpointError(f"no checkpoint under {p} passes verification:\n  "
                          + "\n  ".join(skipped))


def save_root(path: str | os.PathLike[str]) -> Path:
    """Where saves go when a run was pointed at `path`: the root itself, or, for one step
    folder (resuming from a named checkpoint), the root that holds it."""
    p = Path(path)
    return p.parent if (p / MANIFEST).is_file() else p


def _step_of(d: Path) -> int:
    m = STEP_DIR.match(d.name)
    return int(m.group(1)) if m else -1


def file_problems(d: Path, manifest: dict[str, Any], names: list[str] | None,
                  checksums: bool, *, legacy: bool = False) -> list[str]:
    """Problems with the shard files `names` (all if None): missing, size, header rows bound to
    the manifest (`binding.py`), tensor dtypes and shapes, sha256 -- in that order, so nothing
    is hashed or allocated for a file whose header already disagrees. A manifest of an older
    format version is one problem (convert it) unless `legacy` (the converter's own check)."""
    if manifest["version"] < VERSION and not legacy:
        return [f"{d}: written in checkpoint format version {manifest['version']}, whose shard "
                "headers do not record what their bytes mean, so edits to its manifest cannot "
                f"be detected; convert it with `fusedzero ckpt upgrade {d} NEW_ROOT` (checks "
                "every sha256, then writes version-3 shards)"]
    out = []
    for entry in manifest["files"]:
        name = entry["name"]
        if names is not None and name not in names:
            continue
        p = d / name
        if p.is_symlink():
            # A link could point anywhere (e.g. /etc/shadow): shards are regular files here.
            out.append(f"{p}: a symlink; shard files must be regular files inside the "
                       "checkpoint folder")
            continue
        if not p.is_file():
            out.append(f"{p}: missing shard file")
            continue
        size = p.stat().st_size
        if size != entry["bytes"]:
            out.append(f"{p}: {size} bytes, manifest says {entry['bytes']} "
                       f"({'truncated' if size < entry['bytes'] else 'replaced or appended'})")
            continue
        try:
            # The header only (safetensors checks its offsets against the file's size).
            with safe_open(p, framework="pt") as f:
                meta = f.metadata() or {}
                have = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape())
                        for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            out.append(f"{p}: unreadable safetensors header ({e})")
            continue
        why = header_problems(manifest, entry, meta) or tensor_problems(manifest, entry, have)
        if why:
            out.append(f"{p}: {why}")
            continue
        if checksums:
            got = sha256_file(p)
            if got != entry["sha256"]:
                out.append(f"{p}: sha256 mismatch (expected {entry['sha256']}, got {got})")
    return out


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> Path:
    """Check every shard file of a checkpoint against its manifest (existence, size, safetensors
    header and, with `checksums`, sha256). Returns the checkpoint directory; raises
    CheckpointError listing every problem."""
    d = resolve(path)
    found = file_problems(d, read_manifest(d), None, checksums)
    if found:
        raise CheckpointError(f"checkpoint {d} failed verification:\n  " + "\n  ".join(found))
    return d


def problems(path: str | os.PathLike[str], *, checksums: bool = True) -> list[str]:
    """Every problem of a checkpoint's shard files, one line each (empty: all good). Raises
    CheckpointError only when `path` is no readable checkpoint at all."""
    d = resolve(path)
    return file_problems(d, read_manifest(d), None, checksums)


def inspect(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary of a checkpoint (no checksums): world size, stage, step, params, files."""
    d = resolve(path)
    m = read_manifest(d)
    files = []
    for e in m["files"]:
        p = d / e["name"]
        link = p.is_symlink()  # never stat through it: it would tell the size of its target
        size = p.stat().st_size if p.is_file() and not link else None
        files.append({"name": e["name"], "bytes": e["bytes"], "present_bytes": size,
                      "symlink": link, "ok": size == e["bytes"]})
    return {"path": str(d), "world_size": m["world_size"], "stage": m["stage"],
            "step": m["step"], "step_count": m.get("step_count"),
            "num_params": len(m["params"]),
            "param_elements": sum(math.prod(p["shape"]) for p in m["params"]),
            "bytes": sum(e["bytes"] for e in m["files"]), "files": files}


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint directories under `root`, oldest step first."""
    out = []
    for p in Path(root).iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return [p for _, p in sorted(out)]
