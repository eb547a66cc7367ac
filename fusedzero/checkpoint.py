"""Sharded safetensors checkpoints: atomic, verified, reshardable, exportable (DESIGN.md, C).

    h = checkpoint.save(opt, "ckpt", step=step, caller_state={"sched": sched.state_dict()},
                        keep_last=3, async_=True)      # collective; h.wait() when you must know
    got = checkpoint.load(opt, "ckpt")                 # collective; any world size or stage
    sched.load_state_dict(got.caller_state["sched"])
    checkpoint.export("ckpt", "model.safetensors", dtype=torch.bfloat16)   # offline
    checkpoint.import_weights(opt, "model.safetensors")                    # collective

Format (version 1) -- a contract: readers of other versions must refuse, not guess
=================================================================================

A checkpoint *root* holds one directory per saved step and a pointer to the newest complete one::

    root/
      latest                      text: a complete checkpoint's name, e.g. "step-00000120"
      step-00000100/              a complete checkpoint (it has manifest.json)
      step-00000120/
        manifest.json
        rank00000-of-00004.safetensors
        ...
        rank00003-of-00004.safetensors
      .step-00000140.tmp/         a save in progress, or one that was killed: never read

Shard files. The rank whose local shard is written (every rank for stages 1-3; rank 0 alone for
stage 0, where every rank holds the same state) writes `rank{r:05d}-of-{W:05d}.safetensors` with,
for the i-th flat group of the optimizer (`opt.flat_groups[i]`), three 1-D float32 tensors of
`local_numel` elements each, indexed by `Segment.local`:

    fg{i}.master      fp32 master values (fp32 params without a separate master: the params)
    fg{i}.exp_avg     Adam first moment
    fg{i}.exp_avg_sq  Adam second moment

Elements no segment covers are padding and are zero. The safetensors `__metadata__` holds
`format`, `version`, `rank`, `world_size`, `stage`, `step` and (since it was added, checked when
present) `step_count` (strings), so a shard copied into the wrong directory, or a manifest whose
step count was edited, is caught even without checksums.

manifest.json (written last, after every shard is fsynced and renamed into place):

    format, version          "fusedzero-checkpoint", 1
    world_size, stage, step  the saving run; step is the caller's step, step_count the optimizer's
    step_count               float: optimizer steps taken (skipped steps excluded)
    bucket_numel, param_dtype
    params                   [{index, name, shape, dtype, group, aliases}] in optimizer order;
                             aliases: other names of the same Parameter (tied weights)
    param_groups             [{hyper-parameters..., "param_names": [...]}] (JSON-able values only)
    scaler                   null or {"scale": float, "growth_tracker": int}
    files                    [{name, rank, bytes, sha256,
                               groups: [{key, group_index, dtype, unit, local_numel,
                                         segments: [[param, start, length, local], ...]}]}]
    ranks                    [{rank[, replica], state}]: state is base64 of torch.save({"caller":
                             caller_state, "rng": {torch, python[, cuda][, numpy]}}), read with
                             weights_only=True; with a replicate_group one entry per (rank,
                             replica), "replica" present (older readers take replica 0's)

The manifest is untrusted input: `fusedzero.ckpt_manifest.validate` checks all of it (types,
ranges, finiteness, shard names `rank{r:05d}-of-{W:05d}.safetensors`, segments inside their
tensors, every param element covered exactly once) before anything reads it.

A segment `[param, start, length, local]` says: elements `[start, start+length)` of the flattened
param `param` are elements `[local, local+length)` of that file's `fg{i}.*` tensors. Loading at any
world size or stage intersects these with the new optimizer's segments and reads only the
overlapping slices (`safe_open(...).get_slice`).

Atomicity. Every file is written under a temporary name, fsynced and renamed. A save writes into
`.step-N.tmp/`; rank 0 writes the manifest there last, renames the directory to `step-N`, and
only then rewrites `latest` (temporary name + rename). So `latest` always names a directory with
a manifest whose files were complete, and a save killed at any point leaves the previous
checkpoint in place. An async save needs no collective off the main thread: each writer drops
`<shard>.json` (size, sha256) or `<shard>.error` into the staging directory, and rank 0's writer
thread waits for them before the manifest; they are deleted before the rename. (Re-saving an
existing step swaps the old directory out just before the new one is renamed in; a crash between
the two renames leaves `latest` naming a missing directory, which `load` reports as such.)
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import io
import json
import math
import os
import random
import secrets
import shutil
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from safetensors import safe_open

from fusedzero.ckpt_manifest import FORMAT, VERSION, CheckpointError, plain_name
from fusedzero.ckpt_manifest import STEP_DIR as _STEP_DIR
from fusedzero.ckpt_manifest import parse as _parse_manifest
from fusedzero.layout import Segment, intersect

SHARD_FORMAT = "fusedzero-shard"
MANIFEST = "manifest.json"
LATEST = "latest"
KINDS = ("master", "exp_avg", "exp_avg_sq")
# Bytes per write()/hash update: big enough that syscalls cost nothing, small enough that the
# hash never holds a second copy of a large tensor.
_CHUNK = 16 << 20

_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Test hook: called as _write_hook(path, bytes_written) after every chunk written to a shard or
# export file (lets a test kill a save part-way through a write).
_write_hook: Callable[[Path, int], None] | None = None


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def step_dir_name(step: int) -> str:
    # 8 digits keep lexicographic order = step order up to 10**8 steps; rotation parses anyway.
    return f"step-{step:08d}"


# ---------------------------------------------------------------------------------------------
# Streaming safetensors writer
# ---------------------------------------------------------------------------------------------

def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (keep `t` alive while in use)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class SafetensorsWriter:
    """Write a safetensors file one tensor at a time, in the order given up front.

    The header (names, dtypes, shapes, offsets) is fixed at construction, so memory is bounded by
    the tensor being written. The file is written under a fresh temporary name (`_create_temp`:
    never through a planted link), fsynced on `close()` and renamed to `path`; the sha256 of the
    whole file is computed on the way.
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        off = 0
        self._specs = list(specs)
        for name, dtype, shape in self._specs:
            if dtype not in _ST_DTYPE:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
            n = math.prod(shape) * _elsize(dtype)
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape),
                            "data_offsets": [off, off + n]}
            off += n
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)  # safetensors aligns the data start to 8 bytes
        self.path = Path(path)
        self._tmp, self._f = _create_temp(self.path)
        self._sha = hashlib.sha256()
        self._n = 0
        self._next = 0
        self._write(memoryview(struct.pack("<Q", len(hb)) + hb))

    def _write(self, data: memoryview) -> None:
        for i in range(0, len(data), _CHUNK):
            chunk = data[i:i + _CHUNK]
            self._f.write(chunk)
            self._sha.update(chunk)
            self._n += len(chunk)
            if _write_hook is not None:
                _write_hook(self.path, self._n)

    def write(self, name: str, t: torch.Tensor) -> None:
        """Write the next tensor; `name`, dtype and shape must match the next spec."""
        if self._next >= len(self._specs):
            raise ValueError(f"{self.path.name}: unexpected extra tensor {name}")
        want = self._specs[self._next]
        if (name, t.dtype, tuple(t.shape)) != (want[0], want[1], tuple(want[2])):
            raise ValueError(f"{self.path.name}: got tensor {name} {t.dtype} {tuple(t.shape)}, "
                             f"expected {want[0]} {want[1]} {tuple(want[2])}")
        t = t.detach().contiguous().cpu()
        self._write(_raw_bytes(t))
        self._next += 1

    def close(self) -> tuple[int, str]:
        """Flush, fsync, rename into place; return (size in bytes, sha256 hex)."""
        if self._next != len(self._specs):
            self.abort()
            raise ValueError(f"{self.path.name}: {len(self._specs) - self._next} tensors "
                             "were never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)
        _fsync_dir(self.path.parent)
        return self._n, self._sha.hexdigest()

    def abort(self) -> None:
        self._f.close()
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _create_temp(path: Path) -> tuple[Path, io.BufferedWriter]:
    """A new file beside `path`, opened for writing, under a fresh random name.

    O_CREAT|O_EXCL|O_NOFOLLOW: the name is created here and now or the open fails, so a file
    or symlink planted in advance (say `latest.tmp` -> /etc/passwd) is never written through.
    The final `os.replace` then swaps in the new file for `path` itself (a link at `path` is
    replaced, its target untouched)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:  # 2**-64 per try; loop rather than reason about it
            continue
        return tmp, os.fdopen(fd, "wb")
    raise FileExistsError(f"{path.parent}: could not create a fresh temporary file")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp, f = _create_temp(path)
    try:
        with f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise _named(e, path) from e
        raise
    _fsync_dir(path.parent)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(4 << 20)  # one reused 4 MiB buffer: hashing a file allocates nothing more
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class _Peak:
    """Bytes of the staging buffers this module allocates (exact, from the tensors): the live
    total and its peak. Mapped file pages (safetensors reads through mmap) are not counted."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.largest = 0

    def add(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        self.largest = max(self.largest, n)
        return t

    def sub(self, t: torch.Tensor) -> None:
        self.live -= t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# Manifest and verification
# ---------------------------------------------------------------------------------------------

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
        raw = latest.read_bytes()[:4096]
        name = raw.decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest}: unreadable ({e})") from None
    plain_name(name, f"the content of {latest.name}", latest)
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{latest}: names {name!r}; it must name a step folder "
                              "('step-N') inside the checkpoint root")
    return name


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse the manifest of checkpoint directory `path` (or of its `latest`) and validate all
    of it against the format's schema (`fusedzero.ckpt_manifest`): CheckpointError naming the
    first malformed field."""
    d = resolve(path)
    f = d / MANIFEST
    try:
        # A manifest is kilobytes to a few MB; a huge one is not ours (and would sit in memory).
        with open(f, "rb") as fh:
            raw = fh.read(_MAX_MANIFEST + 1)
    except OSError as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from None
    if len(raw) > _MAX_MANIFEST:
        raise CheckpointError(f"{f}: larger than {_MAX_MANIFEST} bytes; not a manifest")
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from None
    return _parse_manifest(text, f)


# Upper bound of a manifest's size: ~200 bytes per segment; 1 GiB is millions of params.
_MAX_MANIFEST = 1 << 30


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
        return Latest(_verify(p, checksums), p.parent, [])
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
            return Latest(_verify(d, checksums), p, skipped)
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
    m = _STEP_DIR.match(d.name)
    return int(m.group(1)) if m else -1


def _file_problems(d: Path, manifest: dict[str, Any], names: list[str] | None,
                   checksums: bool) -> list[str]:
    """Problems with the shard files `names` (all if None): missing, size, header, sha256."""
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
            with safe_open(p, framework="pt") as f:
                meta = f.metadata() or {}
                keys = set(f.keys())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            out.append(f"{p}: unreadable safetensors header ({e})")
            continue
        want_meta = {"format": SHARD_FORMAT, "rank": str(entry["rank"]),
                     "world_size": str(manifest["world_size"]), "step": str(manifest["step"])}
        if "step_count" in meta:  # shards written since the manifest was validated
            want_meta["step_count"] = _count_str(manifest["step_count"])
        bad = {k: (meta.get(k), v) for k, v in want_meta.items() if meta.get(k) != v}
        if bad:
            out.append(f"{p}: header metadata does not match the manifest "
                       f"(got, expected): {bad}")
            continue
        want_keys = {f"{g['key']}.{k}" for g in entry["groups"] for k in KINDS}
        if keys != want_keys:
            out.append(f"{p}: tensors {sorted(keys ^ want_keys)} differ from the manifest")
            continue
        if checksums:
            got = _sha256_file(p)
            if got != entry["sha256"]:
                out.append(f"{p}: sha256 mismatch (expected {entry['sha256']}, got {got})")
    return out


def _count_str(step_count: float) -> str:
    return str(int(step_count))


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> Path:
    """Check every shard file of a checkpoint against its manifest (existence, size, safetensors
    header and, with `checksums`, sha256). Returns the checkpoint directory; raises
    CheckpointError listing every problem."""
    return _verify(path, checksums)


def problems(path: str | os.PathLike[str], *, checksums: bool = True) -> list[str]:
    """Every problem of a checkpoint's shard files, one line each (empty: all good). Raises
    CheckpointError only when `path` is no readable checkpoint at all."""
    d = resolve(path)
    return _file_problems(d, read_manifest(d), None, checksums)


def _verify(path: str | os.PathLike[str], checksums: bool) -> Path:
    d = resolve(path)
    problems = _file_problems(d, read_manifest(d), None, checksums)
    if problems:
        raise CheckpointError(f"checkpoint {d} failed verification:\n  " + "\n  ".join(problems))
    return d


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


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------

class SaveHandle:
    """The result of `save`: done at once for a synchronous save; for `async_=True`, done when
    this rank's shard (and, on rank 0, the manifest and `latest`) are written."""

    def __init__(self, path: Path, thread: threading.Thread | None = None) -> None:
        self.path = path
        self._thread = thread
        self.error: BaseException | None = None
        self._reported = False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until done; re-raise the writer's error; return the checkpoint directory."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"save of {self.path} not done after {timeout}s")
        if self.error is not None:
            self._reported = True
            raise CheckpointError(f"save of {self.path} failed: {self.error}") from self.error
        return self.path


_pending: weakref.WeakKeyDictionary[Any, SaveHandle] = weakref.WeakKeyDictionary()


def wait_pending(opt: Any) -> None:
    """Wait for the optimizer's previous asynchronous save, if any (re-raises its error)."""
    h = _pending.pop(opt, None)
    if h is not None and not h._reported:
        h.wait()


def save(opt: Any, directory: str | os.PathLike[str], *, step: int,
         caller_state: Any = None, keep_last: int | None = None, async_: bool = False,
         timeout: float | None = None) -> SaveHandle:
    """Save a sharded checkpoint of `opt` (a `ZeroAdamW`) as `directory/step-{step:08d}`.

    Collective: every rank of the optimizer's process group calls it with the same arguments
    (with a `replicate_group`, only the first replica writes; the others return at once)
    except `caller_state`, which is per rank (e.g. lr scheduler state, data position); each rank's
    RNG states (torch CPU[, CUDA], python `random`[, numpy]) are saved with it.

    Args:
        step: the caller's step (names the directory; returned by `load`).
        keep_last: after this save, delete all but the newest `keep_last` checkpoints.
        async_: copy the shards off the training buffers now and write them in a background
            thread; the returned handle's `wait()` reports completion. The next save or load
            waits for the previous save first.
        timeout: async only: how long rank 0 waits for the other ranks' shards (None: the
            process group's timeout, see `fusedzero.comm.group_timeout`). It bounds the save
            thread, which the interpreter waits for at exit: a dead peer ends it with an error.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    wait_pending(opt)
    root = Path(directory)
    W, rank, group = opt.world_size, opt.rank, opt.process_group
    if timeout is None:
        from fusedzero.comm import group_timeout

        timeout = group_timeout(group)
    name = step_dir_name(step)
    replicas, replica = getattr(opt, "replicas", 1), getattr(opt, "replica_rank", 0)
    packed, bad_state = "", None
    try:
        packed = _pack({"caller": caller_state, "rng": _rng_state()})
        _unpack(packed)  # fail now, not at resume time
    except Exception as e:  # noqa: BLE001
        bad_state = (f"rank {rank}: caller_state must be loadable by torch.load("
                     f"weights_only=True) (tensors, numbers, strings, lists, tuples, dicts): {e}")
    # 2-D mesh: replicas hold the same shards and the first replica's shard group writes them,
    # but RNG and caller state differ per replica (dropout on other data): each replica's goes
    # to its first-replica peer, which writes them all into the manifest.
    states = [(packed, bad_state)]
    if replicas > 1:
        states = _gather_to_first((packed, bad_state), opt.replicate_group, replicas, replica)
    if replica != 0:
        return SaveHandle(root / name)
    assert states is not None
    staging = root / f".{name}.tmp"
    writer = all(fg.shard_rank == rank for fg in opt.flat_groups)

    tensors: dict[str, torch.Tensor] = {}
    groups_meta: list[dict[str, Any]] = []
    if writer:
        for i, fg in enumerate(opt.flat_groups):
            for kind, t in zip(KINDS, (opt.master_shard(fg), fg.exp_avg, fg.exp_avg_sq)):
                t = t.detach()
                # Async: a private copy, so training may go on updating the live buffers.
                t = t.to("cpu", copy=True) if async_ else t.cpu()
                tensors[f"fg{i}.{kind}"] = t.reshape(-1).contiguous()
            groups_meta.append({
                "key": f"fg{i}", "group_index": fg.group_index,
                "dtype": _dtype_name(fg.dtype), "unit": fg.unit,
                "local_numel": fg.layout.local_numel,
                "segments": [[s.param, s.start, s.length, s.local]
                             for s in fg.layout.segments(fg.shard_rank)]})
    errors = [f"replica {k} {b}" if replicas > 1 else b for k, (_, b) in enumerate(states)
              if b is not None]
    local = {"rank": rank, "writer": writer, "groups": groups_meta,
             "states": [st for st, _ in states], "error": "\n".join(errors) or None}
    everyone = _gather_to_first(local, group, W, rank)

    base: dict[str, Any] | None = None
    err: BaseException | None = None
    if rank == 0:
        assert everyone is not None
        try:
            bad = [e["error"] for e in everyone if e["error"] is not None]
            if bad:
                raise ValueError("\n".join(bad))
            if (root / MANIFEST).is_file():
                raise CheckpointError(f"{root} is a checkpoint (it has {MANIFEST}); save into "
                                      f"its root {root.parent} (see `save_root`)")
            base = _manifest_base(opt, step, everyone)
            root.mkdir(parents=True, exist_ok=True)
            _remove(staging)  # left by a killed save of the same step (or planted: a link)
            staging.mkdir()  # fails rather than follow anything created since
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            err = e
    _agree(err, group, W, "save")  # also the barrier: the staging directory exists now

    meta = {"format": SHARD_FORMAT, "version": str(VERSION), "rank": str(rank),
            "world_size": str(W), "stage": str(int(opt.stage)), "step": str(step),
            # In every shard header too: an edited manifest step_count fails verification.
            "step_count": _count_str(float(opt.step_count.reshape(-1)[0]))}
    fname = shard_file_name(rank, W)
    writers = [e["rank"] for e in everyone if e["writer"]] if everyone is not None else []
    handle = SaveHandle(root / name)

    if not async_:
        info, err = None, None
        if writer:
            try:
                info = _write_shard(staging / fname, tensors, meta)
            except Exception as e:  # noqa: BLE001
                err = e
        infos = _gather_to_first((rank, info), group, W, rank)
        try:
            _agree(err, group, W, "save")  # every rank has stopped writing into staging
            if rank == 0:
                assert base is not None and infos is not None
                try:
                    _finalize(root, staging, name, base,
                              {r: i for r, i in infos if i is not None}, everyone, keep_last)
                except Exception as e:  # noqa: BLE001
                    err = e
            _agree(err, group, W, "save")
        except BaseException:
            if rank == 0:  # a failed save leaves nothing behind (disk full: free the space)
                _remove(staging, quiet=True)
            raise
        return handle

    def job() -> None:
        try:
            if writer:
                try:
                    info = _write_shard(staging / fname, tensors, meta)
                except BaseException as e:
                    _write_text_atomic(staging / (fname + ".error"), repr(e))
                    raise
                _write_text_atomic(staging / (fname + ".json"), json.dumps(info))
            if rank == 0:
                assert base is not None and everyone is not None
                infos = _collect_sidecars(staging, writers, W, timeout)
                _finalize(root, staging, name, base, infos, everyone, keep_last)
        except BaseException as e:  # noqa: BLE001 - surfaced by handle.wait()
            handle.error = e
            if rank == 0:
                _remove(staging, quiet=True)
        finally:
            tensors.clear()

    # Not a daemon thread: the interpreter waits for an async save at exit.
    thread = threading.Thread(target=job, name=f"fusedzero-save-{name}")
    handle._thread = thread
    _pending[opt] = handle
    thread.start()
    return handle


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]
                 ) -> dict[str, Any]:
    try:
        w = SafetensorsWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()],
                              meta)
    except OSError as e:
        raise _named(e, path) from e
    try:
        for k, t in tensors.items():
            w.write(k, t)
        size, sha = w.close()
    except OSError as e:
        w.abort()
        raise _named(e, path) from e
    except BaseException:
        w.abort()
        raise
    return {"name": path.name, "bytes": size, "sha256": sha}


def _named(e: OSError, path: Path) -> OSError:
    """`e` with `path` in its message: os.write's "[Errno 28] No space left on device" names
    no file, and the user must know which disk filled up."""
    if e.filename is not None:
        return e
    return type(e)(e.errno, f"{e.strerror or e} (writing {path})", str(path))


def _remove(p: Path, quiet: bool = False) -> None:
    """Delete a file, a folder tree or a symlink (the link only: never what it points to)."""
    try:
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.exists():
            shutil.rmtree(p)
    except OSError:
        if not quiet:
            raise


def _collect_sidecars(staging: Path, writers: list[int], W: int, timeout: float
                      ) -> dict[int, dict[str, Any]]:
    """Async save, rank 0: wait for every writer's `<shard>.json` (or `.error`)."""
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    delay = 0.005
    while len(out) < len(writers):
        for r in writers:
            if r in out:
                continue
            f = staging / (shard_file_name(r, W) + ".json")
            e = staging / (shard_file_name(r, W) + ".error")
            if e.exists():
                raise CheckpointError(f"rank {r} failed to write its shard: {e.read_text()}")
            if f.exists():
                out[r] = json.loads(f.read_text())
        if len(out) < len(writers):
            if time.monotonic() > deadline:
                missing = [r for r in writers if r not in out]
                raise CheckpointError(f"ranks {missing} did not finish their shards in "
                                      f"{timeout}s ({staging})")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    for r in writers:
        (staging / (shard_file_name(r, W) + ".json")).unlink()
    return out


def _manifest_base(opt: Any, step: int, everyone: list[dict[str, Any]]) -> dict[str, Any]:
    aliases: dict[int, list[str]] = {}
    if getattr(opt, "module", None) is not None:
        for n, p in opt.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(n)
    slots = {}
    for fg in opt.flat_groups:
        for s in fg.layout.params:
            slots[s.index] = (s, fg)
    params = []
    for i, p in enumerate(opt.params):
        s, fg = slots[i]
        params.append({"index": i, "name": s.name, "shape": list(s.shape),
                       "dtype": _dtype_name(fg.dtype), "group": fg.group_index,
                       "aliases": [a for a in aliases.get(id(p), []) if a != s.name]})
    groups = []
    for g, names in zip(opt.param_groups, _group_names(opt)):
        d = {k: _jsonable(v) for k, v in g.items() if k != "params"}
        d = {k: v for k, v in d.items() if v is not _SKIP}
        d["param_names"] = names
        groups.append(d)
    scaler = None
    if opt.scaler is not None:
        sd = opt.scaler.state_dict()
        scaler = {"scale": float(sd["scale"].reshape(-1)[0]),
                  "growth_tracker": int(sd["growth_tracker"].reshape(-1)[0])}
    return {
        "format": FORMAT, "version": VERSION, "world_size": opt.world_size,
        "stage": int(opt.stage), "step": step,
        "step_count": float(opt.step_count.reshape(-1)[0]),  # a host sync; once per save
        "bucket_numel": getattr(opt, "bucket_numel", None),
        "param_dtype": _dtype_name(opt.param_dtype) if opt.param_dtype is not None else None,
        "params": params, "param_groups": groups, "scaler": scaler,
        # One entry per rank; with a replicate_group one per (rank, replica), "replica" added.
        "ranks": [{"rank": e["rank"], "state": st} if len(e["states"]) == 1 else
                  {"rank": e["rank"], "replica": k, "state": st}
                  for e in everyone for k, st in enumerate(e["states"])],
    }


def _finalize(root: Path, staging: Path, name: str, base: dict[str, Any],
              infos: dict[int, dict[str, Any]], everyone: list[dict[str, Any]],
              keep_last: int | None) -> None:
    """Rank 0: manifest last, rename the directory into place, then `latest`, then rotate."""
    files = []
    for e in everyone:
        if not e["writer"]:
            continue
        info = infos[e["rank"]]
        files.append({"name": info["name"], "rank": e["rank"], "bytes": info["bytes"],
                      "sha256": info["sha256"], "groups": e["groups"]})
    manifest = dict(base, files=files, created=time.time())
    _write_text_atomic(staging / MANIFEST, json.dumps(manifest, indent=1))
    final = root / name
    old = root / f".{name}.old"
    if final.exists() or final.is_symlink():
        _remove(old)
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(root)
    _write_text_atomic(root / LATEST, name + "\n")
    # The save is complete from here on: cleaning up must not turn it into a failure.
    _remove(old, quiet=True)
    if keep_last is not None:
        _rotate(root, keep_last, name)


def _rotate(root: Path, keep_last: int, current: str) -> None:
    done = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            done.append((int(m.group(1)), p))
    done.sort()
    for _, p in done[:-keep_last]:
        if p.name == current:
            continue
        try:
            _remove(p)  # a symlinked step folder: the link goes, what it points to stays
        except OSError as e:
            warnings.warn(f"keep_last: could not remove old checkpoint {p}: {e}", stacklevel=3)


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint directories under `root`, oldest step first."""
    out = []
    for p in Path(root).iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return [p for _, p in sorted(out)]


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------

class Loaded(NamedTuple):
    """What `load` restored besides the optimizer."""

    path: Path  # the checkpoint directory read
    step: int  # the caller's step passed to save
    caller_state: Any  # this rank's caller_state (None when the saving run had no such rank)
    rng_restored: bool  # this rank's RNG states were restored
    peak_buffer_bytes: int  # peak bytes of staging buffers (see _Peak), this rank


def load(opt: Any, path: str | os.PathLike[str], *, verify: bool = True,
         restore_rng: bool = True, load_hyperparams: bool = True) -> Loaded:
    """Load a checkpoint into `opt` at any world size and stage. Collective and transactional.

    `path` is a checkpoint directory or a root with `latest` (`find_latest` picks the newest
    verified one). The manifest is validated against the format's schema first. The saved param
    table must match the optimizer's (by name and shape) or ValueError lists the differences.
    Each rank opens only the shard files that hold its new segments, verifies them (size and
    header always; sha256 with `verify`), and reads only the overlapping slices.

    [Note: transactional load] Every rank first reads all it needs (master, exp_avg,
    exp_avg_sq, its caller and RNG state, the hyper-parameters) into staging buffers on the
    host, then the ranks agree on success in one collective, and only then is the optimizer
    written. So a read error on any rank (a corrupt slice, a file gone after planning) raises
    the same error on every rank, nobody is left waiting in a later collective, and the
    optimizer is untouched everywhere. The cost: this rank's three fp32 shard buffers are held
    on the host at once (`peak_buffer_bytes` reports it).

    Restores master (and the params), exp_avg, exp_avg_sq, the step count, the loss scaler, and
    (with `load_hyperparams`, when the param groups hold the same params) the hyper-parameters;
    with `restore_rng`, this rank's saved RNG states if the saving run had this rank (with a
    `replicate_group`, this rank of this replica).
    """
    wait_pending(opt)
    W, rank, group = opt.world_size, opt.rank, opt.process_group
    err: BaseException | None = None
    d = Path(path)
    manifest: dict[str, Any] = {}
    staged: list[tuple[torch.Tensor, ...]] = []
    groups: list[dict[str, Any]] | None = None
    state: dict[str, Any] | None = None
    peak = _Peak()
    try:
        d = resolve(path)
        manifest = read_manifest(d)
        mapping = _match_params(manifest, _opt_param_table(opt), d)
        plan = _plan(opt, manifest, mapping)
        needed = sorted({r[0] for reads in plan for r in reads})
        problems = _file_problems(d, manifest, needed, checksums=verify)
        if problems:
            raise CheckpointError(f"checkpoint {d}:\n  " + "\n  ".join(problems))
        staged = _read_staged(d, opt, plan, peak)
        if load_hyperparams:
            groups = _staged_groups(opt, manifest["param_groups"], d)
        state = _staged_state(manifest, rank, getattr(opt, "replica_rank", 0), d, restore_rng)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        err = e
    # The collective that decides: commit or raise. With a replicate_group the replicas agree
    # too, so no replica commits while another raises (they would no longer hold the same).
    try:
        _agree(err, group, W, "load")
        err = None
    except Exception as e:  # noqa: BLE001
        err = e
    replicas = getattr(opt, "replicas", 1)
    if replicas > 1:
        _agree(err, opt.replicate_group, replicas, "load (across replicas)")
    elif err is not None:
        raise err

    with torch.no_grad():
        for fg, (master, exp_avg, exp_avg_sq) in zip(opt.flat_groups, staged, strict=True):
            fg.exp_avg.copy_(exp_avg)
            fg.exp_avg_sq.copy_(exp_avg_sq)
            opt.set_master_shard(fg, master)  # collective at stages 1-3 (gathers the params)
        opt._step.fill_(manifest["step_count"])
        if opt.scaler is not None and manifest.get("scaler") is not None:
            s = manifest["scaler"]
            opt.scaler.load_state_dict({
                "scale": torch.tensor([s["scale"]], dtype=torch.float32),
                "growth_tracker": torch.tensor([s["growth_tracker"]], dtype=torch.int32)})
    if groups is not None:
        for g, new in zip(opt.param_groups, groups):
            for k, v in new.items():
                if isinstance(g.get(k), torch.Tensor):
                    g[k].fill_(v)
                else:
                    g[k] = v
    caller, restored = None, False
    if state is not None:
        caller = state.get("caller")
        if restore_rng and "rng" in state:
            _set_rng_state(state["rng"])
            restored = True
    return Loaded(d, manifest["step"], caller, restored, peak.peak)


def _read_staged(d: Path, opt: Any, plan: list[list[tuple[str, str, int, int, int]]],
                 peak: _Peak) -> list[tuple[torch.Tensor, ...]]:
    """Every flat group's master, exp_avg, exp_avg_sq from the shard files, on the host."""
    out = []
    with _Readers(d) as readers, torch.no_grad():
        for fg, reads in zip(opt.flat_groups, plan, strict=True):
            bufs = tuple(peak.add(torch.zeros(fg.layout.local_numel, dtype=torch.float32))
                         for _ in KINDS)
            for kind, dst in zip(KINDS, bufs):
                for fname, key, src, dl, n in reads:
                    try:
                        piece = peak.add(readers.slice(fname, f"{key}.{kind}", src, src + n))
                    except CheckpointError:
                        raise
                    except Exception as e:  # noqa: BLE001 - safetensors / OS errors
                        raise CheckpointError(f"{d / fname}: cannot read {key}.{kind}"
                                              f"[{src}:{src + n}] ({e})") from None
                    if piece.numel() != n:
                        raise CheckpointError(f"{d / fname}: {key}.{kind}[{src}:{src + n}] "
                                              f"has {piece.numel()} elements, expected {n}")
                    dst[dl:dl + n].copy_(piece)
                    peak.sub(piece)
            out.append(bufs)
    return out


def _staged_state(manifest: dict[str, Any], rank: int, replica: int, d: Path,
                  check_rng: bool) -> dict[str, Any] | None:
    """This rank's saved caller and RNG state (this replica's with a replicate_group), decoded
    and checked; None when the saving run had no such rank."""
    ranks = manifest["ranks"]
    entry = next((e for e in ranks if e["rank"] == rank and e.get("replica", 0) == replica),
                 None)
    if entry is None:
        return None
    where = f"{d / MANIFEST}: ranks[{ranks.index(entry)}].state"
    state = _unpack(entry["state"], where)
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} is a {type(state).__name__}, expected a dict")
    if check_rng and "rng" in state:
        _check_rng_state(state["rng"], where)
    return state


def _check_rng_state(st: Any, where: str) -> None:
    """Apply the saved RNG states to scratch generators: a malformed one fails here, before
    anything was changed, not half-way through the commit."""
    try:
        torch.Generator().set_state(st["torch"])
        py = st["python"]
        random.Random().setstate((py[0], tuple(py[1]), py[2]))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{where}: RNG state is malformed ({type(e).__name__}: {e})"
                              ) from None


def _staged_groups(opt: Any, saved: list[dict[str, Any]], d: Path
                   ) -> list[dict[str, Any]] | None:
    """The saved hyper-parameters, typed like the optimizer's own, or None when the saved
    groups hold other params. CheckpointError when a value does not fit (e.g. a string lr)."""
    if [g.get("param_names") for g in saved] != _group_names(opt):
        return None
    out = []
    for i, (g, s) in enumerate(zip(opt.param_groups, saved)):
        new: dict[str, Any] = {}
        for k, v in s.items():
            if k == "param_names" or k not in g:
                continue
            cur = g[k]
            field = f"{d / MANIFEST}: param_groups[{i}].{k}"
            if isinstance(cur, (torch.Tensor, float)) or (isinstance(cur, int)
                                                          and not isinstance(cur, bool)):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise CheckpointError(f"{field} is {v!r}, expected a number")
                new[k] = v
            elif isinstance(cur, bool):
                if not isinstance(v, bool):
                    raise CheckpointError(f"{field} is {v!r}, expected true or false")
                new[k] = v
            elif isinstance(cur, tuple):
                if (not isinstance(v, list) or len(v) != len(cur) or any(
                        isinstance(x, bool) or not isinstance(x, (int, float)) for x in v)):
                    raise CheckpointError(f"{field} is {v!r}, expected {len(cur)} numbers")
                new[k] = tuple(v)
            else:
                new[k] = v
        out.append(new)
    return out


class _Readers:
    """Open safetensors files and slice handles, opened on first use, closed together."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        self._slices: dict[tuple[str, str], Any] = {}

    def __enter__(self) -> _Readers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def file(self, fname: str) -> Any:
        f = self._files.get(fname)
        if f is None:
            try:
                f = self._stack.enter_context(safe_open(self.d / fname, framework="pt"))
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{self.d / fname}: cannot open ({e})") from None
            self._files[fname] = f
        return f

    def slice(self, fname: str, tensor: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of a 1-D tensor: only those bytes are read."""
        key = (fname, tensor)
        s = self._slices.get(key)
        if s is None:
            s = self._slices[key] = self.file(fname).get_slice(tensor)
        return s[a:b]


def _opt_param_table(opt: Any) -> dict[int, tuple[str, tuple[int, ...]]]:
    table = {}
    for fg in opt.flat_groups:
        for s in fg.layout.params:
            table[s.index] = (s.name, tuple(s.shape))
    return table


def _match_params(manifest: dict[str, Any], table: dict[int, tuple[str, tuple[int, ...]]],
                  d: Path) -> dict[int, int]:
    """saved param index -> new param index, matched by name; ValueError lists differences."""
    saved = {p["name"]: (p["index"], tuple(p["shape"])) for p in manifest["params"]}
    new = {name: (i, shape) for i, (name, shape) in table.items()}
    diffs = []
    only_model = [n for n in new if n not in saved]
    only_ckpt = [n for n in saved if n not in new]
    if only_model:
        diffs.append(f"in the model, not in the checkpoint: {only_model}")
    if only_ckpt:
        diffs.append(f"in the checkpoint, not in the model: {only_ckpt}")
    for n, (_, shape) in new.items():
        if n in saved and saved[n][1] != shape:
            diffs.append(f"{n}: shape {list(saved[n][1])} in the checkpoint, {list(shape)} in "
                         "the model")
    if diffs:
        raise ValueError(f"checkpoint {d} does not match this model's parameters:\n  "
                         + "\n  ".join(diffs))
    return {saved[n][0]: new[n][0] for n in new}


def _plan(opt: Any, manifest: dict[str, Any], mapping: dict[int, int]
          ) -> list[list[tuple[str, str, int, int, int]]]:
    """Per flat group: reads (file, tensor key, src local, dst local, length) covering exactly
    every element of this rank's new segments."""
    sources: list[tuple[str, str]] = []
    saved: list[Segment] = []
    for e in manifest["files"]:
        for g in e["groups"]:
            sid = len(sources)
            sources.append((e["name"], g["key"]))
            for p, start, length, local in g["segments"]:
                saved.append(Segment(mapping[p], start, length, sid, local))
    names = _opt_param_table(opt)
    out = []
    for fg in opt.flat_groups:
        segs = fg.layout.segments(fg.shard_rank)
        covered = dict.fromkeys(range(len(segs)), 0)
        pos = {id(s): i for i, s in enumerate(segs)}
        reads = []
        for sa, sb, start, length in intersect(segs, saved):
            fname, key = sources[sb.rank]
            reads.append((fname, key, sb.local + start - sb.start, sa.local + start - sa.start,
                          length))
            covered[pos[id(sa)]] += length
        for i, s in enumerate(segs):
            if covered[i] != s.length:
                raise CheckpointError(
                    f"the checkpoint's segment tables cover {covered[i]} of the {s.length} "
                    f"elements [{s.start}, {s.start + s.length}) of {names[s.param][0]}")
        out.append(_merge(reads))
    return out


def _merge(reads: list[tuple[str, str, int, int, int]]) -> list[tuple[str, str, int, int, int]]:
    """Join reads that continue each other in both source and destination (fewer slices)."""
    out: list[tuple[str, str, int, int, int]] = []
    for r in sorted(reads, key=lambda r: (r[0], r[1], r[2])):
        if out:
            f, k, s, dl, n = out[-1]
            if (f, k) == r[:2] and s + n == r[2] and dl + n == r[3]:
                out[-1] = (f, k, s, dl, n + r[4])
                continue
        out.append(r)
    return out


# ---------------------------------------------------------------------------------------------
# Export / import
# ---------------------------------------------------------------------------------------------

class Exported(NamedTuple):
    files: list[Path]  # the safetensors file(s) written
    index: Path | None  # model.safetensors.index.json when sharded
    bytes: int  # tensor bytes written
    peak_buffer_bytes: int  # peak bytes of staging buffers (one param at a time)


def export(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
           dtype: torch.dtype = torch.float32, max_shard_bytes: int | None = None,
           verify: bool = True) -> Exported:
    """Write the model's params from checkpoint `src` as safetensors with the model's own names.

    Offline (no process group). Param by param: each param's pieces are read from the shard
    files (slices only), assembled in one buffer, cast to `dtype` and streamed out, so memory is
    bounded by the largest param, not the model. Tied weights are written under every name, so
    `model.load_state_dict(safetensors.torch.load_file(out))` works. With `max_shard_bytes` and a
    bigger model, writes HF-style `stem-0000k-of-0000n.safetensors` beside `out` plus
    `out.index.json` (e.g. model.safetensors.index.json).
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype} not in {EXPORT_DTYPES}")
    d = _verify(src, verify)
    m = read_manifest(d)
    out = Path(out)
    _refuse_inside_checkpoint(out, d)
    pieces: dict[int, list[tuple[str, str, int, int, int]]] = {}
    for e in m["files"]:
        for g in e["groups"]:
            for p, start, length, local in g["segments"]:
                pieces.setdefault(p, []).append((e["name"], g["key"], local, start, length))
    units = []  # (param entry, names, bytes per name)
    for p in m["params"]:
        numel = math.prod(p["shape"])
        got = sum(x[4] for x in pieces.get(p["index"], ()))
        if got != numel:
            raise CheckpointError(f"{d}: the segment tables cover {got} of the {numel} elements "
                                  f"of {p['name']}")
        units.append((p, [p["name"], *p.get("aliases", [])], numel * _elsize(dtype)))
    shards: list[list[Any]] = [[]]
    size = 0
    for u in units:
        ub = u[2] * len(u[1])
        if max_shard_bytes is not None and shards[-1] and size + ub > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += ub
    n = len(shards)
    if n == 1:
        paths = [out]
    else:
        stem = out.name.removesuffix(".safetensors")
        paths = [out.with_name(f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors") for k in range(n)]
    out.parent.mkdir(parents=True, exist_ok=True)
    peak = _Peak()
    total = 0
    weight_map = {}
    with _Readers(d) as readers, torch.no_grad():
        for path, shard in zip(paths, shards):
            specs = [(name, dtype, tuple(p["shape"])) for p, names, _ in shard for name in names]
            w = SafetensorsWriter(path, specs, {"format": "pt"})
            try:
                for p, names, nbytes in shard:
                    numel = math.prod(p["shape"])
                    buf = peak.add(torch.empty(numel, dtype=torch.float32))
                    for fname, key, local, start, length in pieces[p["index"]]:
                        piece = peak.add(readers.slice(fname, f"{key}.master", local,
                                                       local + length))
                        buf[start:start + length].copy_(piece)
                        peak.sub(piece)
                    t = buf if dtype == torch.float32 else peak.add(buf.to(dtype))
                    t = t.view(p["shape"])
                    for name in names:
                        w.write(name, t)
                        weight_map[name] = path.name
                        total += nbytes
                    if dtype != torch.float32:
                        peak.sub(t)
                    peak.sub(buf)
                    del buf, t
            except BaseException:
                w.abort()
                raise
            w.close()
    index = None
    if n > 1:
        index = out.with_name(out.name + ".index.json")
        _write_text_atomic(index, json.dumps({"metadata": {"total_size": total},
                                              "weight_map": weight_map}, indent=1))
    return Exported(paths, index, total, peak.peak)


def _refuse_inside_checkpoint(out: Path, d: Path) -> None:
    """Export writes `out` and files beside it (shards, index): never inside a checkpoint (it
    would replace shard files or the manifest it is reading), nor over a root's `latest` or
    step folders. Links are resolved first. Beside the step folders, in the root, is fine."""
    target = out.resolve()
    for a in target.parents:
        if a == d.resolve() or (a / MANIFEST).is_file() or _STEP_DIR.match(a.name) \
                or (a.name.startswith(".step-") and a.name.endswith(".tmp")):
            raise CheckpointError(f"export output {out} lies inside the checkpoint {a}; "
                                  "write it outside any checkpoint folder")
    if (target.parent / LATEST).is_file() and (
            target.name == LATEST or _STEP_DIR.match(target.name)):
        raise CheckpointError(f"export output {out} would replace a checkpoint root's "
                              f"{target.name!r}; choose another name")


class _WeightSource:
    """Full (unsharded) tensors by name, from a dict or safetensors file(s); reads flat ranges."""

    def __init__(self, source: str | os.PathLike[str] | Mapping[str, torch.Tensor]) -> None:
        self._stack = contextlib.ExitStack()
        self.tensors: Mapping[str, torch.Tensor] | None = None
        self.where: dict[str, Any] = {}  # name -> open safe_open handle
        if isinstance(source, Mapping):
            self.tensors = source
            self.shapes = {k: tuple(v.shape) for k, v in source.items()}
            return
        p = Path(source)
        files = _weight_files(p)
        self.shapes = {}
        for f in files:
            try:
                h = self._stack.enter_context(safe_open(f, framework="pt"))
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
            for k in h.keys():
                self.where[k] = h
                self.shapes[k] = tuple(h.get_slice(k).get_shape())

    def close(self) -> None:
        self._stack.close()

    def read_flat(self, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the flattened tensor; from files, only the rows covering them."""
        if self.tensors is not None:
            return self.tensors[name].detach().reshape(-1)[a:b]
        shape = self.shapes[name]
        h = self.where[name]
        if len(shape) == 0:
            return h.get_tensor(name).reshape(-1)[a:b]
        row = math.prod(shape[1:])
        r0, r1 = a // row, -(-b // row)
        rows = h.get_slice(name)[r0:r1]
        return rows.reshape(-1)[a - r0 * row:b - r0 * row]


def _weight_files(p: Path) -> list[Path]:
    if p.is_dir():
        idx = sorted(p.glob("*.safetensors.index.json"))
        if len(idx) == 1:
            p = idx[0]
        elif (p / "model.safetensors").is_file():
            return [p / "model.safetensors"]
        else:
            raise CheckpointError(f"{p}: no model.safetensors or single *.safetensors.index.json")
    if p.name.endswith(".index.json"):
        try:
            wm = json.loads(p.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{p}: not a safetensors index ({e})") from None
        return [p.parent / f for f in sorted(set(wm.values()))]
    if not p.is_file():
        raise CheckpointError(f"{p}: no such file")
    return [p]


def import_weights(opt: Any, source: str | os.PathLike[str] | Mapping[str, torch.Tensor], *,
                   strict: bool = True) -> None:
    """Set the params (fp32 master and model params) of a sharded optimizer from full weights.

    Collective. `source` is a state dict, a safetensors file, an HF-style `*.index.json`, or a
    directory holding `model.safetensors` or one index. Each rank reads only the slices of its
    own segments. Names are the model's (a tied param may be found under any of its names).
    With `strict`, tensors in the source that are no param of the model are an error. Optimizer
    moments and the step count are left as they are (start of fine-tuning: zero).
    """
    W, group = opt.world_size, opt.process_group
    err: BaseException | None = None
    src: _WeightSource | None = None
    found: dict[int, str] = {}
    try:
        src = _WeightSource(source)
        found = _match_weights(opt, src, strict, str(source) if not isinstance(source, Mapping)
                               else "state dict")
    except Exception as e:  # noqa: BLE001
        err = e
    try:
        _agree(err, group, W, "import_weights")
        assert src is not None
        with torch.no_grad():
            for fg in opt.flat_groups:
                buf = torch.zeros(fg.layout.local_numel, dtype=torch.float32)
                for s in fg.layout.segments(fg.shard_rank):
                    buf[s.local:s.local + s.length].copy_(
                        src.read_flat(found[s.param], s.start, s.start + s.length))
                opt.set_master_shard(fg, buf)
    finally:
        if src is not None:
            src.close()


def _match_weights(opt: Any, src: _WeightSource, strict: bool, what: str) -> dict[int, str]:
    aliases: dict[int, list[str]] = {}
    if getattr(opt, "module", None) is not None:
        for n, p in opt.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(n)
    table = _opt_param_table(opt)
    found, diffs, used = {}, [], set()
    for i, (name, shape) in sorted(table.items()):
        names = [name] + [a for a in aliases.get(id(opt.params[i]), []) if a != name]
        used.update(names)
        hit = next((n for n in names if n in src.shapes), None)
        if hit is None:
            diffs.append(f"missing: {name}")
        elif src.shapes[hit] != shape:
            diffs.append(f"{hit}: shape {list(src.shapes[hit])} in {what}, {list(shape)} in the "
                         "model")
        else:
            found[i] = hit
    extra = [n for n in src.shapes if n not in used]
    if extra and strict:
        diffs.append(f"not params of the model: {extra}")
    if diffs:
        raise ValueError(f"{what} does not match this model's parameters:\n  " + "\n  ".join(diffs))
    return found


# ---------------------------------------------------------------------------------------------
# Small helpers: collectives, RNG, JSON
# ---------------------------------------------------------------------------------------------

def _gather_to_first(obj: Any, group: Any, W: int, rank: int) -> list[Any] | None:
    """Every rank's `obj` on group rank 0 (None elsewhere)."""
    if W == 1:
        return [obj]
    out: list[Any] | None = [None] * W if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def _agree(err: BaseException | None, group: Any, W: int, what: str) -> None:
    """Collective: raise on every rank if any rank failed (so none hangs in a later collective).
    The exception type is the failing ranks' (ValueError stays ValueError)."""
    if W == 1:
        if err is not None:
            raise err
        return
    mine = None if err is None else (type(err).__name__, str(err))
    allerr: list[Any] = [None] * W
    dist.all_gather_object(allerr, mine, group=group)
    bad = [(r, e) for r, e in enumerate(allerr) if e is not None]
    if not bad:
        return
    kinds = {e[0] for _, e in bad}
    msgs = {}
    for r, (_, m) in bad:
        msgs.setdefault(m, []).append(r)
    text = "\n".join(f"ranks {rs}: {m}" if len(rs) > 1 else f"rank {rs[0]}: {m}"
                     for m, rs in msgs.items())
    cls: type[Exception] = ValueError if kinds == {"ValueError"} else CheckpointError
    # The same error on every rank, failing or not: callers may compare or log any rank's.
    raise cls(f"{what} failed:\n{text}") from err


def _rng_state() -> dict[str, Any]:
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        st["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in st and np is not None:
        name, keys, pos, has_gauss, cached = st["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _pack(obj: Any) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _unpack(s: str, what: str = "state") -> Any:
    # weights_only: a manifest is data, it must not run code when read.
    try:
        return torch.load(io.BytesIO(base64.b64decode(s, validate=True)), weights_only=True)
    except Exception as e:  # noqa: BLE001 - binascii, pickle and torch all raise their own
        # Not torch's own text: it suggests weights_only=False, i.e. running the payload.
        why = next((ln.strip() for ln in str(e).splitlines()
                    if "GLOBAL" in ln or "Unsupported" in ln), type(e).__name__)
        raise CheckpointError(
            f"{what} is refused: only tensors, numbers, strings, lists, tuples and dicts are "
            f"loaded from a checkpoint, never objects that would run code ({why[:200]})"
        ) from None


_SKIP = object()


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v.reshape(-1)[0])
    if isinstance(v, tuple):
        v = list(v)
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return _SKIP
    return v


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _group_names(opt: Any) -> list[list[str]]:
    index = {id(p): i for i, p in enumerate(opt.params)}
    return [[opt.param_names[index[id(p)]] for p in g["params"]] for g in opt.param_groups]


__all__ = ["CheckpointError", "Exported", "Latest", "Loaded", "SafetensorsWriter", "SaveHandle",
           "export", "find_latest", "import_weights", "inspect", "list_checkpoints", "load",
           "problems", "read_manifest", "resolve", "save", "save_root", "verify",
           "wait_pending"]
