"""One shard file read through one descriptor: its header, its sha256 and the slices a load
needs all come from the same bytes.

[Note: load what was verified] A path is a name, not a file: checked by one open and read by
another, it can be swapped in between (a concurrent writer renaming a file of the same size and
header in place). So `read_slices` opens a shard once (`open_regular`: no link followed, no FIFO
waited on), and with a checksum streams the whole file through one reused buffer, hashing every
byte and copying the requested slices out of the same chunks: the sha256 compared against the
manifest is that of the bytes staged, header included. Without a checksum it reads only the
slices, through the same descriptor. Paths reach only `os.open`, so a folder whose name is not
valid UTF-8 reads like any other (safetensors' Rust reader takes UTF-8 paths only).

The header is parsed here, not by safetensors: bounded (`MAX_HEADER`), JSON of the documented
form, every tensor's offsets inside the file and tiling the data exactly (what safetensors
checks), before anything is allocated for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from fusedzero.checkpoint._format import ST_DTYPE, open_regular, raw_bytes
from fusedzero.checkpoint._manifest import CheckpointError, snippet

# safetensors' own cap on a header (its reader refuses more): 100 MB.
MAX_HEADER = 100_000_000
# Bytes per read while hashing: one reused buffer, so hashing allocates nothing per file.
_CHUNK = 4 << 20
_ITEMSIZE = {
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


class Entry(NamedTuple):
    """One tensor of a safetensors header: its dtype code, shape, and bytes in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int  # file offset of its first byte
    nbytes: int


class Header(NamedTuple):
    meta: dict[str, str]  # __metadata__
    tensors: dict[str, Entry]
    raw: bytes  # the file's first bytes, the header (8 + its JSON), as parsed

    def have(self) -> dict[str, tuple[str, list[int]]]:
        """name -> (dtype code, shape), as binding.tensor_problems takes them."""
        return {k: (t.dtype, list(t.shape)) for k, t in self.tensors.items()}


class Slice(NamedTuple):
    """Elements [start, start + dst.numel()) of tensor `tensor`, to be read into `dst` (a
    contiguous CPU tensor of the file's dtype)."""

    tensor: str
    start: int
    dst: torch.Tensor


def _pread(fd: int, n: int, at: int, path: Path) -> bytes:
    out = b""
    while len(out) < n:
        got = os.pread(fd, n - len(out), at + len(out))
        if not got:
            raise CheckpointError(
                f"{path}: ended at byte {at + len(out)}, expected {at + n} "
                "(truncated while it was read)"
            )
        out += got
    return out


def read_header(fd: int, size: int, path: Path) -> Header:
    """The header of the safetensors file open as `fd` (`size` bytes), checked for form."""
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", _pread(fd, 8, 0, path))
    # Never more than the file or MAX_HEADER: a length field of 2**60 allocates nothing.
    if n > min(size - 8, MAX_HEADER):
        raise CheckpointError(
            f"{path}: safetensors header of {n} bytes in a file of {size}; not a safetensors file"
        )
    raw = _pread(fd, 8 + n, 0, path)
    try:
        h = json.loads(raw[8:])
    except (ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{path}: unreadable safetensors header ({type(e).__name__}: {snippet(str(e), 80)})"
        ) from None
    if not isinstance(h, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    meta = h.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: safetensors __metadata__ is not an object of strings")
    data = 8 + n
    tensors: dict[str, Entry] = {}
    spans = []
    for k, t in h.items():
        where = f"{path}: safetensors header entry {snippet(k)}"
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where} is not {{dtype, shape, data_offsets}}")
        dt, shape, off = t["dtype"], t["shape"], t["data_offsets"]
        if dt not in _ITEMSIZE:
            raise CheckpointError(f"{where}: dtype {snippet(dt)} is none of {list(_ITEMSIZE)}")
        if not (
            isinstance(shape, list)
            and all(type(s) is int and s >= 0 for s in shape)
            and isinstance(off, list)
            and len(off) == 2
            and all(type(o) is int and 0 <= o <= size - data for o in off)
        ):
            raise CheckpointError(
                f"{where}: shape {snippet(shape)} or data_offsets "
                f"{snippet(off)} malformed or outside the file"
            )
        nbytes = math.prod(shape) * _ITEMSIZE[dt]
        if off[1] - off[0] != nbytes:
            raise CheckpointError(
                f"{where}: data_offsets {off} hold {off[1] - off[0]} bytes, "
                f"its shape and dtype {nbytes}"
            )
        tensors[k] = Entry(dt, tuple(shape), data + off[0], nbytes)
        spans.append((off[0], off[1]))
    end = 0
    for a, b in sorted(spans):  # the tensors tile the data: no gap, no overlap, no tail
        if a != end:
            raise CheckpointError(
                f"{path}: safetensors tensors overlap or leave a gap at data byte {min(a, end)}"
            )
        end = b
    if end != size - data:
        raise CheckpointError(f"{path}: {size - data} data bytes, its tensors hold {end}")
    return Header(meta, tensors, raw)


class ShardFile:
    """A shard file open by descriptor (see [Note: load what was verified]); a context manager.
    CheckpointError in one line for a link, a FIFO, a missing or unreadable file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_regular(path, "shard file")
        self.size = os.fstat(self.fd).st_size
        self._header: Header | None = None

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)

    def header(self) -> Header:
        if self._header is None:
            self._header = read_header(self.fd, self.size, self.path)
        return self._header

    def sha256(self) -> str:
        """The sha256 of the whole file (as open now)."""
        return self.read_slices([], hashed=True)

    def read_slices(self, slices: list[Slice], *, hashed: bool) -> str:
        """Read every slice into its `dst`; with `hashed`, in one pass over the whole file
        that returns its sha256 (the header's bytes compared with those parsed), else only the
        slices' bytes ("" returned)."""
        head = self.header() if slices else None
        spans = []  # (file offset, bytes view of dst)
        for s in slices:
            assert head is not None
            t = head.tensors.get(s.tensor)
            if t is None:
                raise CheckpointError(f"{self.path}: no tensor {s.tensor}")
            if ST_DTYPE.get(s.dst.dtype) != t.dtype:
                raise CheckpointError(
                    f"{self.path}: {s.tensor} is {t.dtype}, read as {s.dst.dtype}"
                )
            size = s.dst.element_size()
            n = s.dst.numel()
            if not (0 <= s.start and (s.start + n) * size <= t.nbytes):
                raise CheckpointError(
                    f"{self.path}: {s.tensor}[{s.start}:{s.start + n}] lies "
                    f"outside its {t.nbytes // size} elements"
                )
            if not s.dst.is_contiguous() or s.dst.device.type != "cpu":
                raise ValueError("read_slices reads into contiguous CPU tensors")
            spans.append((t.start + s.start * size, raw_bytes(s.dst)))
        if not hashed:
            for at, view in spans:
                self._read_into(view, at)
            return ""
        return self._stream(sorted(spans, key=lambda x: x[0]), head)

    def _read_into(self, view: memoryview, at: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got == 0:
                raise CheckpointError(
                    f"{self.path}: ended at byte {at + done} (truncated while it was read)"
                )
            done += got

    def _stream(self, spans: list[tuple[int, memoryview]], head: Header | None) -> str:
        sha = hashlib.sha256()
        buf = bytearray(min(_CHUNK, max(self.size, 1)))
        view = memoryview(buf)
        first = b""  # the header's bytes, as streamed: compared with those parsed
        pos, i = 0, 0
        while pos < self.size:
            n = os.preadv(self.fd, [view[: min(len(buf), self.size - pos)]], pos)
            if n == 0:
                raise CheckpointError(
                    f"{self.path}: ended at byte {pos}, expected "
                    f"{self.size} (truncated while it was read)"
                )
            chunk = view[:n]
            sha.update(chunk)
            if head is not None and pos < len(head.raw):
                first += bytes(chunk[: len(head.raw) - pos])
            while i < len(spans) and spans[i][0] + len(spans[i][1]) <= pos:
                i += 1
            j = i
            while j < len(spans) and spans[j][0] < pos + n:  # every span overlapping the chunk
                at, dst = spans[j]
                a, b = max(at, pos), min(at + len(dst), pos + n)
                if a < b:
                    dst[a - at : b - at] = chunk[a - pos : b - pos]
                j += 1
            pos += n
        if head is not None and first != head.raw:
            raise CheckpointError(f"{self.path}: its header changed while it was read")
        return sha.hexdigest()


class ShardReaders:
    """Safetensors files of folder `d` and their slice handles, opened on first use, closed
    together. Each file is opened once by descriptor (`ShardFile`) and handed to safetensors
    as /proc/self/fd/N, the same file whatever is renamed over its path since (and a folder
    whose name is not UTF-8 reads too). With `sha256` (file name -> the manifest's digest) a
    file is hashed through that descriptor when first opened: what is read is what was
    verified (see [Note: load what was verified])."""

    def __init__(self, d: Path, sha256: dict[str, str] | None = None) -> None:
        self.d = d
        self._sha256 = sha256
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        self._slices: dict[tuple[str, str], Any] = {}

    def __enter__(self) -> ShardReaders:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def file(self, fname: str) -> Any:
        f = self._files.get(fname)
        if f is None:
            p = self.d / fname
            sf = self._stack.enter_context(ShardFile(p))
            if self._sha256 is not None:
                got = sf.sha256()
                if got != self._sha256[fname]:
                    raise CheckpointError(
                        f"{p}: sha256 mismatch (expected {self._sha256[fname]}, got {got})"
                    )
            proc = f"/proc/self/fd/{sf.fd}"
            try:
                f = self._stack.enter_context(
                    safe_open(proc if os.path.exists(proc) else p, framework="pt")
                )
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{p}: cannot open ({e})") from None
            self._files[fname] = f
        return f

    def slice(self, fname: str, tensor: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of a 1-D tensor: only those bytes are read."""
        key = (fname, tensor)
        s = self._slices.get(key)
        if s is None:
            s = self._slices[key] = self.file(fname).get_slice(tensor)
        return s[a:b]


def digests(manifest: dict[str, Any]) -> dict[str, str]:
    """File name -> sha256 of a validated manifest's shards (for `ShardReaders`)."""
    return {e["name"]: e["sha256"] for e in manifest["files"]}
