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
`format`, `version`, `rank`, `world_size`, `stage`, `step` (strings), so a shard copied into the
wrong directory is caught even without checksums.

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
    ranks                    [{rank, state}]: state is base64 of torch.save({"caller": caller_state,
                             "rng": {torch, python[, cuda][, numpy]}}), read with weights_only=True

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
import re
import shutil
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from safetensors import safe_open

from fusedzero.layout import Segment, intersect

FORMAT = "fusedzero-checkpoint"
SHARD_FORMAT = "fusedzero-shard"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
KINDS = ("master", "exp_avg", "exp_avg_sq")
_STEP_DIR = re.compile(r"^step-(\d+)$")
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


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or inconsistent with its manifest."""


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
    the tensor being written. The file is written as `path.tmp`, fsynced on `close()` and renamed
    to `path`; the sha256 of the whole file is computed on the way.
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
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
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


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
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
    `latest` file names. Raises CheckpointError otherwise."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    latest = p / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        target = p / name
        if not (target / MANIFEST).is_file():
            raise CheckpointError(f"{latest} names {name!r}, but {target} has no {MANIFEST}")
        return target
    if not p.exists():
        raise CheckpointError(f"not a checkpoint: {p} does not exist")
    raise CheckpointError(f"not a checkpoint: {p} has no {MANIFEST} (and no `{LATEST}` file "
                          "naming a checkpoint inside it)")


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse and check the manifest of checkpoint directory `path` (or of its `latest`)."""
    d = resolve(path)
    f = d / MANIFEST
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a {FORMAT} manifest (format={m.get('format')!r})"
                              if isinstance(m, dict) else f"{f}: not a JSON object")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{f}: format version {m.get('version')!r}, this fusedzero reads "
                              f"version {VERSION}")
    missing = [k for k in ("world_size", "stage", "step", "params", "files", "ranks")
               if k not in m]
    if missing:
        raise CheckpointError(f"{f}: manifest lacks {missing}")
    return m


def _file_problems(d: Path, manifest: dict[str, Any], names: list[str] | None,
                   checksums: bool) -> list[str]:
    """Problems with the shard files `names` (all if None): missing, size, header, sha256."""
    out = []
    for entry in manifest["files"]:
        name = entry["name"]
        if names is not None and name not in names:
            continue
        p = d / name
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
        size = p.stat().st_size if p.is_file() else None
        files.append({"name": e["name"], "bytes": e["bytes"], "present_bytes": size,
                      "ok": size == e["bytes"]})
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
    if getattr(opt, "replica_rank", 0) != 0:
        # 2-D mesh: replicas hold the same shards; the first replica's shard group writes.
        return SaveHandle(root / name)
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
    packed, bad_state = "", None
    try:
        packed = _pack({"caller": caller_state, "rng": _rng_state()})
        _unpack(packed)  # fail now, not at resume time
    except Exception as e:  # noqa: BLE001
        bad_state = (f"rank {rank}: caller_state must be loadable by torch.load("
                     f"weights_only=True) (tensors, numbers, strings, lists, tuples, dicts): {e}")
    local = {"rank": rank, "writer": writer, "groups": groups_meta, "state": packed,
             "error": bad_state}
    everyone = _gather_to_first(local, group, W, rank)

    base: dict[str, Any] | None = None
    err: BaseException | None = None
    if rank == 0:
        assert everyone is not None
        try:
            bad = [e["error"] for e in everyone if e["error"] is not None]
            if bad:
                raise ValueError("\n".join(bad))
            base = _manifest_base(opt, step, everyone)
            root.mkdir(parents=True, exist_ok=True)
            if staging.exists():  # left by a killed save of the same step
                shutil.rmtree(staging)
            staging.mkdir()
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            err = e
    _agree(err, group, W, "save")  # also the barrier: the staging directory exists now

    meta = {"format": SHARD_FORMAT, "version": str(VERSION), "rank": str(rank),
            "world_size": str(W), "stage": str(int(opt.stage)), "step": str(step)}
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
        _agree(err, group, W, "save")
        if rank == 0:
            assert base is not None and infos is not None
            try:
                _finalize(root, staging, name, base, {r: i for r, i in infos if i is not None},
                          everyone, keep_last)
            except Exception as e:  # noqa: BLE001
                err = e
        _agree(err, group, W, "save")
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
    w = SafetensorsWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()],
                          meta)
    try:
        for k, t in tensors.items():
            w.write(k, t)
    except BaseException:
        w.abort()
        raise
    size, sha = w.close()
    return {"name": path.name, "bytes": size, "sha256": sha}


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
        "ranks": [{"rank": e["rank"], "state": e["state"]} for e in everyone],
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
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(root)
    _write_text_atomic(root / LATEST, name + "\n")
    if old.exists():
        shutil.rmtree(old)
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
        if p.name != current:
            shutil.rmtree(p)


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
    """Load a checkpoint into `opt` at any world size and stage. Collective.

    `path` is a checkpoint directory or a root with `latest`. The saved param table must match
    the optimizer's (by name and shape) or ValueError lists the differences. Each rank opens only
    the shard files that hold its new segments, verifies them (size and header always; sha256 with
    `verify`), and reads only the overlapping slices. Every rank raises if any rank fails, before
    the optimizer is touched.

    Restores master (and the params), exp_avg, exp_avg_sq, the step count, the loss scaler, and
    (with `load_hyperparams`, when the param groups hold the same params) the hyper-parameters;
    with `restore_rng`, this rank's saved RNG states if the saving run had this rank.
    """
    wait_pending(opt)
    W, rank, group = opt.world_size, opt.rank, opt.process_group
    err: BaseException | None = None
    plan: list[list[tuple[str, str, int, int, int]]] = []
    d = Path(path)
    manifest: dict[str, Any] = {}
    try:
        d = resolve(path)
        manifest = read_manifest(d)
        mapping = _match_params(manifest, _opt_param_table(opt), d)
        plan = _plan(opt, manifest, mapping)
        needed = sorted({r[0] for reads in plan for r in reads})
        problems = _file_problems(d, manifest, needed, checksums=verify)
        if problems:
            raise CheckpointError(f"checkpoint {d}:\n  " + "\n  ".join(problems))
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        err = e
    _agree(err, group, W, "load")

    peak = _Peak()
    with _Readers(d) as readers, torch.no_grad():
        for fg, reads in zip(opt.flat_groups, plan):
            master = peak.add(torch.zeros(fg.layout.local_numel, dtype=torch.float32))
            fg.exp_avg.zero_()
            fg.exp_avg_sq.zero_()
            for kind, dst in zip(KINDS, (master, fg.exp_avg, fg.exp_avg_sq)):
                for fname, key, src, dl, n in reads:
                    piece = peak.add(readers.slice(fname, f"{key}.{kind}", src, src + n))
                    dst[dl:dl + n].copy_(piece)
                    peak.sub(piece)
            opt.set_master_shard(fg, master)
            peak.sub(master)
        opt._step.fill_(manifest["step_count"])
        if opt.scaler is not None and manifest.get("scaler") is not None:
            s = manifest["scaler"]
            opt.scaler.load_state_dict({
                "scale": torch.tensor([s["scale"]], dtype=torch.float32),
                "growth_tracker": torch.tensor([s["growth_tracker"]], dtype=torch.int32)})
    if load_hyperparams:
        _restore_groups(opt, manifest["param_groups"])

    caller, restored = None, False
    entry = next((e for e in manifest["ranks"] if e["rank"] == rank), None)
    if entry is not None:
        state = _unpack(entry["state"])
        caller = state.get("caller")
        if restore_rng:
            _set_rng_state(state["rng"])
            restored = True
    return Loaded(d, manifest["step"], caller, restored, peak.peak)


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


def _restore_groups(opt: Any, saved: list[dict[str, Any]]) -> None:
    """Hyper-parameters back into param_groups, only when the groups hold the same params."""
    if [g.get("param_names") for g in saved] != _group_names(opt):
        return
    for g, s in zip(opt.param_groups, saved):
        for k, v in s.items():
            if k == "param_names":
                continue
            cur = g.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple):
                g[k] = tuple(v)
            else:
                g[k] = v


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
    if err is not None and len(bad) == 1:
        raise err
    raise cls(f"{what} failed:\n{text}")


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


def _unpack(s: str) -> Any:
    # weights_only: a manifest is data, it must not run code when read.
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True)


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


__all__ = ["CheckpointError", "Exported", "Loaded", "SafetensorsWriter", "SaveHandle", "export",
           "import_weights", "inspect", "list_checkpoints", "load", "problems", "read_manifest",
           "resolve", "save", "verify", "wait_pending"]
