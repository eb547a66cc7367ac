"""Checkpoints on disk: find them, read their manifest, check their files.

`resolve` turns a path into a checkpoint directory, `read_manifest` parses and validates its
manifest (`_manifest.py`), `verify` / `problems` check the shard files against it (size, header,
sha256, rank states, the folder's name), `find_latest` picks what `latest` names
(see [Note: latest decides]), `inspect` summarises one. Nothing here writes.

[Note: latest decides] A save is complete when `latest` names it (save writes it last), so
`latest`, not the step numbers in the folder names, says what resumes: a run resumed from an older
step (a branch) leaves newer folders of the abandoned branch behind, a folder may be copied in
under another step's name, and `--overwrite` killed half-way through removing the old run's folders
leaves them beside the new run's. Only when `latest` is missing or broken (not a regular file,
unreadable, naming no folder, or its checkpoint fails `verify`) does find_latest fall back, with a
reason in `skipped` that callers print as a warning: to the newest step folder that verifies, older
than the step `latest` named when it named one (newer folders belong to another branch). A folder
whose name disagrees with its manifest's step never verifies.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any, NamedTuple

from fusedzero.checkpoint._binding import header_problems, tensor_problems
from fusedzero.checkpoint._format import LATEST, MANIFEST, open_regular
from fusedzero.checkpoint._manifest import (
    MAX_LATEST,
    MAX_MANIFEST,
    STEP_DIR,
    VERSION,
    CheckpointError,
    parse,
    snippet,
)
from fusedzero.checkpoint._rank_state import decode
from fusedzero.checkpoint._shardfile import ShardFile


def resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory `path` means: itself if it has a manifest, else what its
    `latest` file names (a plain `step-N` name inside `path`). Raises CheckpointError otherwise.
    See `find_latest` for the fallback when `latest` is missing or broken."""
    p = Path(path)
    if _has_manifest(p):
        return p
    latest = p / LATEST
    if os.path.lexists(latest):
        target = p / latest_name(latest)
        if not _has_manifest(target):
            raise CheckpointError(f"{latest} names {target.name!r}, but {target} has no {MANIFEST}")
        return target
    if not p.exists():
        raise CheckpointError(f"not a checkpoint: {p} does not exist")
    raise CheckpointError(
        f"not a checkpoint: {p} has no {MANIFEST} (and no `{LATEST}` file "
        "naming a checkpoint inside it)"
    )


def _has_manifest(d: Path) -> bool:
    """Whether `d` holds a manifest file; CheckpointError where `d` cannot be looked into (a
    mode-000 folder), not a PermissionError."""
    try:
        return (d / MANIFEST).is_file()
    except OSError as e:
        raise CheckpointError(f"{d}: cannot be read ({e.strerror or e})") from None


def latest_name(latest: Path) -> str:
    """The step folder a `latest` file names; refuses anything but a regular file (never
    followed through a link: its target's content is never read or shown) holding a plain
    `step-N` name."""
    fd = open_regular(latest, "checkpoint pointer")
    try:
        # Never more than MAX_LATEST + 1 bytes: a huge `latest` is refused, not read whole.
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_LATEST + 1)
    except OSError as e:
        raise CheckpointError(f"{latest}: unreadable ({e.strerror or e})") from None
    if len(raw) > MAX_LATEST:
        raise CheckpointError(
            f"{latest}: larger than {MAX_LATEST} bytes; it must hold one step folder's name"
        )
    name = raw.decode(errors="replace").strip()
    if not (name.isascii() and STEP_DIR.match(name)):
        raise CheckpointError(
            f"{latest}: holds {snippet(name)}; it must name a step folder "
            "('step-N') inside the checkpoint root"
        )
    return name


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse the manifest of checkpoint directory `path` (or of its `latest`) and validate all
    of it against the format's schema (`_manifest.py`): CheckpointError naming the
    first malformed field."""
    d = resolve(path)
    f = d / MANIFEST
    fd = open_regular(f, "manifest")  # never through a link, never waiting on a FIFO
    try:
        # At most MAX_MANIFEST + 1 bytes are read (see its computation in _manifest.py), and no
        # buffer is sized beyond the file (read(n) allocates n bytes up front).
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            raw = fh.read(min(size, MAX_MANIFEST) + 1)
    except OSError as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from None
    if len(raw) > size:
        raise CheckpointError(f"{f}: grew while it was read; not a finished manifest")
    if len(raw) > MAX_MANIFEST:
        raise CheckpointError(
            f"{f}: larger than {MAX_MANIFEST} bytes, the largest manifest "
            "of 1024 ranks x a 70B model; not a manifest"
        )
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
    skipped: list[str]  # why `latest` was not taken, and what was passed over (callers warn)


# At most this many failed step folders are listed one by one when `latest` is broken and
# find_latest falls back (a root of 3000 bad folders makes one bounded warning, not 3000).
_MAX_LISTED = 3
# And each reason is cut to this many characters (one folder may list a problem per shard).
_MAX_REASON = 400


def find_latest(path: str | os.PathLike[str], *, checksums: bool = True) -> Latest:
    """The checkpoint to resume from under `path`: what `latest` names, verified.

    See [Note: latest decides].

    `path` is a root or one step folder; a step folder is verified and returned as it is (its
    root is its parent). Verifying checks the manifest's schema, the folder's name, the rank
    states, the shard sizes and headers, and with `checksums` every sha256. Raises
    CheckpointError when nothing verifies, naming the reasons (a bounded line).
    """
    p = Path(path)
    if _has_manifest(p):
        return Latest(verify(p, checksums=checksums), p.parent, [])
    if not p.is_dir():
        raise CheckpointError(
            f"not a checkpoint: {p} " + ("is not a folder" if p.exists() else "does not exist")
        )
    latest = p / LATEST
    skipped: list[str] = []
    below: int | None = None  # fall back only to steps older than the one `latest` named
    if os.path.lexists(latest):
        try:
            name = latest_name(latest)
            below = _step_of(p / name)
            return Latest(verify(p / name, checksums=checksums), p, [])
        except (CheckpointError, OSError) as e:
            skipped.append(_reason(e))
    candidates = [d for d in reversed(list_checkpoints(p)) if below is None or _step_of(d) < below]
    if not candidates and not skipped:
        raise CheckpointError(
            f"not a checkpoint: {p} holds no complete checkpoint "
            f"(no step-N folder with a {MANIFEST})"
        )
    failed: list[str] = []
    for d in candidates:
        try:
            found = verify(d, checksums=checksums)
        except (CheckpointError, OSError) as e:
            failed.append(_reason(e))
            continue
        if not skipped:
            skipped.append(f"{latest}: missing")
        skipped[0] += f"; took {found.name}, the newest step folder that verifies" + (
            f" older than step {below}" if below is not None else ""
        )
        return Latest(found, p, skipped + _bounded(failed))
    older = f" older than step {below}" if below is not None else ""
    raise CheckpointError(
        f"no checkpoint under {p} passes verification ("
        f"{len(candidates)} step folder(s){older} tried):\n  "
        + "\n  ".join(skipped + _bounded(failed))
    )


def _reason(e: BaseException) -> str:
    """One failure as one line of at most _MAX_REASON characters."""
    line = " ".join(str(e).split())
    return line if len(line) <= _MAX_REASON else line[: _MAX_REASON - 3] + "..."


def _bounded(failed: list[str]) -> list[str]:
    """The first _MAX_LISTED failures, then how many more there were."""
    more = len(failed) - _MAX_LISTED
    return failed[:_MAX_LISTED] + (
        [f"... and {more} more step folder(s) failed verification"] if more > 0 else []
    )


def save_root(path: str | os.PathLike[str]) -> Path:
    """Where saves go when a run was pointed at `path`: the root itself, or, for one step
    folder (resuming from a named checkpoint), the root that holds it."""
    p = Path(path)
    return p.parent if (p / MANIFEST).is_file() else p


def _step_of(d: Path) -> int:
    m = STEP_DIR.match(d.name)
    return int(m.group(1)) if m and d.name.isascii() else -1


def name_problem(d: Path, manifest: dict[str, Any]) -> str | None:
    """Why step folder `d` may not hold `manifest`: a `step-N` folder holds step N (a copy
    under another step's name would resume as the wrong step; see [Note: latest decides])."""
    n = _step_of(d)
    if n < 0 or n == manifest["step"]:
        return None
    return (
        f"{d}: the folder is named for step {n}, but its manifest is of step "
        f"{manifest['step']} (copied or renamed); a step folder must be named "
        f"step-{manifest['step']:08d}"
    )


def file_problems(
    d: Path,
    manifest: dict[str, Any],
    names: list[str] | None,
    checksums: bool,
    *,
    legacy: bool = False,
) -> list[str]:
    """Problems with the shard files `names` (all if None): missing, size, header rows bound to
    the manifest (`_binding.py`), tensor dtypes and shapes, sha256 -- in that order, so nothing
    is hashed or allocated for a file whose header already disagrees. A manifest of an older
    format version is one problem (convert it) unless `legacy` (the converter's own check)."""
    if manifest["version"] < VERSION and not legacy:
        return [
            f"{d}: written in checkpoint format version {manifest['version']}, whose shard "
            "headers do not record what their bytes mean, so edits to its manifest cannot "
            f"be detected; convert it with `fusedzero ckpt upgrade {d} NEW_ROOT` (checks "
            "every sha256, then writes version-3 shards)"
        ]
    named = name_problem(d, manifest)
    out = [named] if named is not None else []
    for entry in manifest["files"]:
        name = entry["name"]
        if names is not None and name not in names:
            continue
        p = d / name
        why = shard_problem(p, manifest, entry, checksums)
        if why is not None:
            out.append(why)
    return out


def shard_problem(
    p: Path, manifest: dict[str, Any], entry: dict[str, Any], checksums: bool
) -> str | None:
    """Why shard file `p` (manifest entry `entry`) fails verification, or None. Read through
    one descriptor (see [Note: load what was verified] in _shardfile.py)."""
    why = link_problem(p)
    if why is not None:
        return why
    try:
        with ShardFile(p) as f:
            why = open_problem(f, manifest, entry)
            if why is not None:
                return why
            got = f.sha256() if checksums else entry["sha256"]
    except CheckpointError as e:
        return str(e)
    if got != entry["sha256"]:
        return f"{p}: sha256 mismatch (expected {entry['sha256']}, got {got})"
    return None


def link_problem(p: Path) -> str | None:
    """A shard that is missing or a symlink (a link could point anywhere, e.g. /etc/shadow:
    shards are regular files here); anything else is found by opening it (`ShardFile`)."""
    try:
        if stat.S_ISLNK(os.lstat(p).st_mode):
            return f"{p}: a symlink; shard files must be regular files inside the checkpoint folder"
    except FileNotFoundError:
        return f"{p}: missing shard file"
    except OSError:
        pass  # opening it says why
    return None


def open_problem(f: ShardFile, manifest: dict[str, Any], entry: dict[str, Any]) -> str | None:
    """Why the open shard `f` does not fit its manifest entry: its size, then its header rows
    bound to the manifest (`_binding.py`), tensor dtypes and shapes; nothing is allocated for a
    file whose header already disagrees."""
    if f.size != entry["bytes"]:
        return (
            f"{f.path}: {f.size} bytes, manifest says {entry['bytes']} "
            f"({'truncated' if f.size < entry['bytes'] else 'replaced or appended'})"
        )
    head = f.header()
    why = header_problems(manifest, entry, head.meta) or tensor_problems(
        manifest, entry, head.have()
    )
    return f"{f.path}: {why}" if why else None


def state_problems(d: Path, manifest: dict[str, Any]) -> list[str]:
    """Every rank state of the manifest that `load` would refuse (not weights-only data, not a
    dict, a malformed RNG state: `rank_state.decode`), one line each."""
    out = []
    for i, e in enumerate(manifest["ranks"]):
        try:
            decode(e["state"], f"{d / MANIFEST}: ranks[{i}].state")
        except CheckpointError as err:
            out.append(str(err))
    return out


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> Path:
    """Check a checkpoint as `load` would, all of it: its folder's name, every rank state, and
    every shard file against its manifest (existence, size, safetensors header and, with
    `checksums`, sha256). Returns the checkpoint directory; raises CheckpointError listing
    every problem."""
    d = resolve(path)
    found = problems(d, checksums=checksums)
    if found:
        raise CheckpointError(f"checkpoint {d} failed verification:\n  " + "\n  ".join(found))
    return d


def problems(path: str | os.PathLike[str], *, checksums: bool = True) -> list[str]:
    """Every problem `verify` finds, one line each (empty: all good). Raises CheckpointError
    only when `path` is no readable checkpoint at all."""
    d = resolve(path)
    m = read_manifest(d)
    found = file_problems(d, m, None, checksums)
    return found + (state_problems(d, m) if m["version"] == VERSION else [])


def inspect(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary of a checkpoint (no checksums): world size, stage, step, params, files."""
    d = resolve(path)
    m = read_manifest(d)
    files = []
    for e in m["files"]:
        p = d / e["name"]
        link = p.is_symlink()  # never stat through it: it would tell the size of its target
        size = p.stat().st_size if p.is_file() and not link else None
        files.append(
            {
                "name": e["name"],
                "bytes": e["bytes"],
                "present_bytes": size,
                "symlink": link,
                "ok": size == e["bytes"],
            }
        )
    return {
        "path": str(d),
        "world_size": m["world_size"],
        "stage": m["stage"],
        "step": m["step"],
        "step_count": m.get("step_count"),
        "num_params": len(m["params"]),
        "param_elements": sum(math.prod(p["shape"]) for p in m["params"]),
        "bytes": sum(e["bytes"] for e in m["files"]),
        "files": files,
    }


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint directories under `root` (`step-N` folders with a manifest, and
    those that cannot be looked into: verifying one says why), oldest step first."""
    out = []
    for p in Path(root).iterdir():
        n = _step_of(p)
        try:
            if n < 0 or not _has_manifest(p):
                continue
        except CheckpointError:
            pass  # listed: verifying it says why it cannot be read
        out.append((n, p))
    return [p for _, p in sorted(out)]
