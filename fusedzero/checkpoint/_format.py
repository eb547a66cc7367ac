"""The on-disk format of a checkpoint, and the file primitives that write and read it.

Everything that touches bytes lives here: names of files and folders, the streaming safetensors
writer, exclusive temporaries, fsync, sha256, and the slice readers. The rest of the package
decides *what* to write (`saving`), *how to map it back* (`reshard`, `loading`) and *whether it
is intact* (`catalog`); none of it opens a file in another way.

Format (version 3; versions 1-2 read only by `fusedzero ckpt upgrade`) -- a contract
======================================================================================

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
for the i-th buffer of the optimizer (`opt.shard_infos()[i]`, see fusedzero/state.py), 1-D
tensors of `local_numel` elements each, indexed by `Segment.local`, each in the dtype the
manifest's `modes` stores it in (fusedzero/memory_modes.py; version 1 and the default modes: all
fp32):

    fg{i}.master            master values: fp32 (fp32 params without a separate master: the
                            params); bf16 in the bf16 master modes (the params themselves)
    fg{i}.comp              bf16-kahan only: the bf16 compensation (effective master: master+comp)
    fg{i}.<field>           each state field of the manifest's update rule (of buffer i's
                            group's rule, with `group_rules`)
                            (`Rule.state_fields(modes)`, fusedzero/rules; AdamW's: its two
                            moments, fp32, bf16 or int8/uint8 codes, and in the int8 mode their
                            `<field>_scale` tensors: fp32, one per QBLOCK (128) elements, scale
                            k belonging to elements [128 k, 128 k + 128))

Elements no segment covers are padding and are zero. Every segment starts at a multiple of 128
local elements and of 128 elements of its param (the layout aligns params and shard pieces), so a
quantization block never holds two params and keeps its scale at any world size. The safetensors
`__metadata__` records what the bytes mean, one row per field of `binding.BOUND` (strings):
`format`, `rank`, `world_size`, `stage`, `step`, `step_count`, `modes`, `params` (the entries of
the params this file holds), `groups` (this file's segment tables, as in the manifest) and
`layout_sha256` (sha256 of the other rows), plus `version`. Every reader checks each row against
the manifest, and each tensor's dtype and shape against what the manifest implies, before it
reads tensor data: a shard in the wrong folder, or a manifest edited consistently (offsets
swapped, a dtype or shape changed, another stage), is refused even without checksums. Shards of
versions 1-2 carry only format, rank, world_size, stage, step (and step_count): loads refuse
them and name the converter.

manifest.json (written last, after every shard is fsynced and renamed into place):

    format, version          "fusedzero-checkpoint", 3 (2: headers without layout rows;
                             1: no modes, states fp32)
    modes                    {"master": "fp32"|"bf16-kahan"|"bf16-sr"|"bf16",
                              "states": "fp32"|"bf16"|"int8"} (version 2)
    rule                     the update rule whose state the shards hold, a name of
                             `_manifest.RULES` ("adamw", "muon"); absent (written before it
                             was recorded): "adamw"; "by-group" where param groups run
                             different rules, then `group_rules`
    group_rules              with rule "by-group": each param group's rule; a buffer's
                             `fg{i}.<field>` tensors are its group's rule's fields
    seed                     the saving optimizer's bf16-sr seed (version 2; informative: the
                             loading optimizer keeps its own)
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

The manifest is untrusted input: `fusedzero.checkpoint._manifest.validate` checks all of it (types,
ranges, finiteness, shard names `rank{r:05d}-of-{W:05d}.safetensors`, segments inside their
tensors, every param element covered exactly once) before anything reads it.

A segment `[param, start, length, local]` says: elements `[start, start+length)` of the flattened
param `param` are elements `[local, local+length)` of that file's `fg{i}.*` tensors. Loading at any
world size or stage intersects these with the new optimizer's segments and reads only the
overlapping slices (through one descriptor per file: `_shardfile.py`).

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

import contextlib
import ctypes
import errno
import hashlib
import io
import json
import math
import os
import secrets
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fusedzero import _dtypes as dtypes
from fusedzero.checkpoint._manifest import CheckpointError, value_kinds
from fusedzero.rules._adamw import ADAMW

SHARD_FORMAT = "fusedzero-shard"
MANIFEST = "manifest.json"
LATEST = "latest"
# The per-param values of this format's checkpoints (`manifest_rule`: AdamW's).
KINDS = value_kinds(ADAMW)
# Bytes per write()/hash update: big enough that syscalls cost nothing, small enough that the
# hash never holds a second copy of a large tensor.
_CHUNK = 16 << 20

# The safetensors spelling of each dtype (its own codes, not the manifest's names in `dtypes`).
ST_DTYPE = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

# Test hook: called as _write_hook(path, bytes_written) after every chunk written to a shard or
# export file (lets a test kill a save part-way through a write).
_write_hook: Callable[[Path, int], None] | None = None


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def step_dir_name(step: int) -> str:
    # 8 digits keep lexicographic order = step order up to 10**8 steps; rotation parses anyway.
    return f"step-{step:08d}"


def count_str(step_count: float) -> str:
    """The step count as shard headers spell it (a whole number)."""
    return str(int(step_count))


# ---------------------------------------------------------------------------------------------
# Streaming safetensors writer
# ---------------------------------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (keep `t` alive while in use)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class SafetensorsWriter:
    """Write a safetensors file one tensor at a time, in the order given up front.

    The header (names, dtypes, shapes, offsets) is fixed at construction, so memory is bounded by
    the tensor being written. The file is written under a fresh temporary name (`create_temp`:
    never through a planted link), fsynced on `close()` and renamed to `path`; the sha256 of the
    whole file is computed on the way.
    """

    def __init__(
        self,
        path: Path,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        off = 0
        self._specs = list(specs)
        for name, dtype, shape in self._specs:
            if dtype not in ST_DTYPE:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
            n = math.prod(shape) * dtypes.itemsize(dtype)
            header[name] = {
                "dtype": ST_DTYPE[dtype],
                "shape": list(shape),
                "data_offsets": [off, off + n],
            }
            off += n
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)  # safetensors aligns the data start to 8 bytes
        self.size = 8 + len(hb) + off  # bytes of the whole file
        self.path = Path(path)
        self._tmp, self._f = create_temp(self.path)
        self._sha = hashlib.sha256()
        self._n = 0
        self._next = 0
        try:  # a full disk at the first write leaves no temporary behind either
            self._write(memoryview(struct.pack("<Q", len(hb)) + hb))
        except BaseException:
            self.abort()
            raise

    def _write(self, data: memoryview) -> None:
        for i in range(0, len(data), _CHUNK):
            chunk = data[i : i + _CHUNK]
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
            raise ValueError(
                f"{self.path.name}: got tensor {name} {t.dtype} {tuple(t.shape)}, "
                f"expected {want[0]} {want[1]} {tuple(want[2])}"
            )
        t = t.detach().contiguous().cpu()
        self._write(raw_bytes(t))
        self._next += 1

    def close(self) -> tuple[int, str]:
        """Flush, fsync, rename into place; return (size in bytes, sha256 hex)."""
        if self._next != len(self._specs):
            self.abort()
            raise ValueError(
                f"{self.path.name}: {len(self._specs) - self._next} tensors were never written"
            )
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)
        return self._n, self._sha.hexdigest()

    def abort(self) -> None:
        self._f.close()
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()


def fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def create_temp(path: Path) -> tuple[Path, io.BufferedWriter]:
    """A new file beside `path`, opened for writing, under a fresh random name.

    O_CREAT|O_EXCL|O_NOFOLLOW: the name is created here and now or the open fails, so a file
    or symlink planted in advance (say `latest.tmp` -> /etc/passwd) is never written through.
    The final `os.replace` then swaps in the new file for `path` itself (a link at `path` is
    replaced, its target untouched)."""
    flags = (
        os.O_WRONLY
        | os.O_CREAT
        | os.O_EXCL
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:  # 2**-64 per try; loop rather than reason about it
            continue
        return tmp, os.fdopen(fd, "wb")
    raise FileExistsError(f"{path.parent}: could not create a fresh temporary file")


def check_replaceable(path: Path, what: str) -> None:
    """An output about to be renamed over `path`: refuse anything there but a regular file
    (a FIFO, a device node, a folder, a socket) and any symlink, before anything is written.
    The write itself goes to a fresh temporary beside it (`create_temp`), never opens `path`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CheckpointError(f"{what} {path}: cannot inspect it ({e.strerror or e})") from None
    if stat.S_ISREG(st.st_mode):
        return
    raise CheckpointError(
        f"{what} {path} exists and is {file_kind(st.st_mode)}; refusing to "
        "replace it (only a regular file is replaced): remove it or choose "
        "another path"
    )


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words ("a symlink", "a FIFO", ...)."""
    return next(
        (
            k
            for test, k in (
                (stat.S_ISLNK, "a symlink"),
                (stat.S_ISDIR, "a folder"),
                (stat.S_ISFIFO, "a FIFO"),
                (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"),
            )
            if test(mode)
        ),
        "not a regular file",
    )


def open_regular(path: Path, what: str, *, follow: bool = False) -> int:
    """A read-only descriptor of the regular file `path`, or CheckpointError in one line: a
    symlink is not followed (O_NOFOLLOW; with `follow`, a user's input such as a Hugging Face
    cache's config.json, it is), a FIFO is not waited on (O_NONBLOCK), a folder or device is
    refused (fstat of what was opened, so nothing swapped in between is read), and a missing
    file and a permission denied are told apart. Nothing of the file is read."""
    flags = (
        os.O_RDONLY
        | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise CheckpointError(
                f"{what} {path} is a symlink; it must be a regular file (refused, not followed)"
            ) from None
        why = {
            errno.ENOENT: "missing",
            errno.EACCES: "permission denied",
            errno.EPERM: "permission denied",
        }.get(e.errno or 0, e.strerror or str(e))
        raise CheckpointError(f"{what} {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{what} {path} is {file_kind(st.st_mode)}; it must be a regular file"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_text_atomic(path: Path, text: str) -> None:
    tmp, f = create_temp(path)
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
            raise named(e, path) from e
        raise
    fsync_dir(path.parent)


class Peak:
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


def named(e: OSError, path: Path, need: int | None = None) -> OSError:
    """`e` with `path` in its message: os.write's "[Errno 28] No space left on device" names
    no file, and the user must know which disk filled up; with `need` (the file's size), a full
    disk also says how many bytes the file needs and how many are free."""
    if e.filename is not None and need is None:
        return e
    what = f"writing {path}"
    if need is not None and e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f", {shutil.disk_usage(path.parent).free} bytes free"
        except OSError:
            free = ""
        what += f": the file needs {need} bytes{free}"
    return type(e)(e.errno, f"{e.strerror or e} ({what})", str(path))


def remove(p: Path, quiet: bool = False) -> None:
    """Delete a file, a folder tree or a symlink (the link only: never what it points to)."""
    try:
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.exists():
            shutil.rmtree(p)
    except OSError:
        if not quiet:
            raise
