"""Weights in and out: `export` a checkpoint as one model's safetensors (the model's own names,
loadable by `model.load_state_dict`), and `import_weights` full weights into a sharded optimizer.

[Note: an export replaces the old one whole] One file is written under a temporary name and renamed
over `out` (and a sharded export's index left beside it is removed: it would name shards of another
export). Shards and their index are written into a fresh staging folder beside `out` first;
`commit` then removes the old index, renames the shards into place and the index last. Killed or
out of space before that, the old export is intact (its index names its own shards); killed during
the renames, there is no index, so no reader can take a mix of two exports for one. Every shard's
header and the index carry the export's random id (`EXPORT_ID`; a single file carries none: its
bytes depend on the weights alone): `import_weights` refuses an index over shards of another export
(files copied together by hand).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from safetensors import safe_open

from fusedzero import _dtypes as dtypes
from fusedzero.checkpoint import _catalog as catalog
from fusedzero.checkpoint._catalog import read_manifest
from fusedzero.checkpoint._collectives import agree
from fusedzero.checkpoint._format import (
    LATEST,
    MANIFEST,
    Peak,
    SafetensorsWriter,
    check_replaceable,
    fsync_dir,
    remove,
    write_text_atomic,
)
from fusedzero.checkpoint._manifest import STEP_DIR, CheckpointError, snippet
from fusedzero.checkpoint._optview import aliases, param_table
from fusedzero.checkpoint._placements import tp_source
from fusedzero.checkpoint._shardfile import ShardReaders, digests
from fusedzero.state import ShardState

if TYPE_CHECKING:
    from fusedzero.optim import ZeroAdamW


# The metadata key, in every file of an export and in its index, of the export's random id.
EXPORT_ID = "fusedzero_export"


class Exported(NamedTuple):
    files: list[Path]  # the safetensors file(s) written
    index: Path | None  # model.safetensors.index.json when sharded
    bytes: int  # tensor bytes written
    peak_buffer_bytes: int  # peak bytes of staging buffers (one param at a time)


def export(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    verify: bool = True,
) -> Exported:
    """Write the model's params from checkpoint `src` as safetensors with the model's own names.

    Offline (no process group). Param by param: each param's pieces are read from the shard
    files (slices only), assembled in one buffer, cast to `dtype` and streamed out, so memory is
    bounded by the largest param, not the model. Tied weights are written under every name, so
    `model.load_state_dict(safetensors.torch.load_file(out))` works. With `max_shard_bytes` and a
    bigger model, writes HF-style `stem-0000k-of-0000n.safetensors` beside `out` plus
    `out.index.json` (e.g. model.safetensors.index.json).
    """
    if dtype not in dtypes.FLOAT_DTYPES:
        raise ValueError(f"export dtype {dtype} not in {dtypes.FLOAT_DTYPES}")
    # sha256 below, of the bytes read (see [Note: load what was verified] in _shardfile.py)
    d = catalog.verify(src, checksums=False)
    m = read_manifest(d)
    out = Path(out)
    _refuse_inside_checkpoint(out, d)
    pieces = param_pieces(m, d)
    units = []  # (param entry, names, bytes per name)
    for p in m["params"]:
        numel = math.prod(p["shape"])
        units.append((p, [p["name"], *p.get("aliases", [])], numel * dtypes.itemsize(dtype)))
    peak = Peak()

    def tensors(shard: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
        for p, names, _ in (units[i] for i in shard):
            buf = read_param(readers, pieces, p, "master", peak)
            t = buf if dtype == torch.float32 else peak.add(buf.to(dtype))
            for name in names:
                yield name, t.view(p["shape"])
            if dtype != torch.float32:
                peak.sub(t)
            peak.sub(buf)
            del buf, t

    with (
        export_files(out, [u[2] * len(u[1]) for u in units], max_shard_bytes) as ex,
        ShardReaders(d, digests(m) if verify else None) as readers,
        torch.no_grad(),
    ):
        for k, c in enumerate(ex.cut):
            ex.write(
                k,
                [(name, dtype, tuple(units[i][0]["shape"])) for i in c for name in units[i][1]],
                tensors(c),
            )
        ex.commit()
    return Exported(ex.paths, ex.index, ex.total, peak.peak)


class ExportFiles:
    """The files of one export and how they replace an earlier one (`export_files`); a
    context manager that removes its staging folder unless `commit` ran. See [Note: an export
    replaces the old one whole]."""

    def __init__(self, cut: list[list[int]], paths: list[Path], index: Path | None) -> None:
        self.cut, self.paths, self.index = cut, paths, index
        self.id = secrets.token_hex(8)
        self.total = 0  # tensor bytes written
        self.weight_map: dict[str, str] = {}  # tensor name -> file name
        self.stage: Path | None = None
        if index is not None:
            self.stage = index.with_name(f".{index.name}.{self.id}.tmp")
            self.stage.mkdir()

    def __enter__(self) -> ExportFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.stage is not None:
            remove(self.stage, quiet=True)

    def write(
        self,
        k: int,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        tensors: Iterable[tuple[str, torch.Tensor]],
    ) -> None:
        """Write file `k` (into the staging folder when sharded): `tensors` in the order of
        `specs`; a failure leaves no temporary behind."""
        p = self.paths[k] if self.stage is None else self.stage / self.paths[k].name
        # One file has no index to mix it up with: its bytes depend on the weights alone.
        meta = {"format": "pt"} if self.stage is None else {"format": "pt", EXPORT_ID: self.id}
        w = SafetensorsWriter(p, specs, meta)
        try:
            for name, t in tensors:
                w.write(name, t)
                self.weight_map[name] = self.paths[k].name
                self.total += t.numel() * t.element_size()
        except BaseException:
            w.abort()
            raise
        w.close()

    def commit(self) -> None:
        """Put the written export in place of the old one (see the Note above)."""
        out = self.paths[0]
        if self.stage is None:
            stale = out.with_name(out.name + ".index.json")
            if stale.is_file() and not stale.is_symlink():
                stale.unlink()
            return
        assert self.index is not None
        write_text_atomic(
            self.stage / self.index.name,
            json.dumps(
                {
                    "metadata": {"total_size": self.total, EXPORT_ID: self.id},
                    "weight_map": self.weight_map,
                },
                indent=1,
            ),
        )
        if self.index.is_file():
            self.index.unlink()  # from here until the last rename: no index, nothing mixed
            fsync_dir(self.index.parent)
        for p in [*self.paths, self.index]:
            os.replace(self.stage / p.name, p)
        fsync_dir(self.index.parent)
        remove(self.stage)
        self.stage = None


def export_files(out: Path, sizes: list[int], max_shard_bytes: int | None) -> ExportFiles:
    """Where an export of items of `sizes` bytes (in order) goes: each shard's item indices (a
    shard is closed before the item that would take it past `max_shard_bytes`), its file (`out`
    alone, or HF-style `stem-0000k-of-0000n.safetensors` beside it) and the index file (None for
    one file). Refuses outputs that are not replaceable files, then makes `out`'s folder."""
    cut: list[list[int]] = [[]]
    size = 0
    for i, b in enumerate(sizes):
        if max_shard_bytes is not None and cut[-1] and size + b > max_shard_bytes:
            cut.append([])
            size = 0
        cut[-1].append(i)
        size += b
    n = len(cut)
    stem = out.name.removesuffix(".safetensors")
    paths = (
        [out]
        if n == 1
        else [out.with_name(f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors") for k in range(n)]
    )
    index = out.with_name(out.name + ".index.json")
    for p in [*paths, index]:
        check_replaceable(p, "export output")
    out.parent.mkdir(parents=True, exist_ok=True)
    return ExportFiles(cut, paths, index if n > 1 else None)


Piece = tuple[str, str, int, int, int]  # (file, tensor key, local, start, length)


def param_pieces(m: dict[str, Any], d: Path) -> dict[int, list[Piece]]:
    """param index -> where its elements lie in the shard files of a validated manifest;
    CheckpointError when the segment tables do not cover a param exactly once in total."""
    pieces: dict[int, list[Piece]] = {}
    for e in m["files"]:
        for g in e["groups"]:
            for p, start, length, local in g["segments"]:
                pieces.setdefault(p, []).append((e["name"], g["key"], local, start, length))
    for p in m["params"]:
        numel = math.prod(p["shape"])
        got = sum(x[4] for x in pieces.get(p["index"], ()))
        if got != numel:
            raise CheckpointError(
                f"{d}: the segment tables cover {got} of the {numel} elements of {p['name']}"
            )
    return pieces


def read_param(
    readers: ShardReaders, pieces: dict[int, list[Piece]], p: dict[str, Any], kind: str, peak: Peak
) -> torch.Tensor:
    """Manifest param `p`'s `kind` (master or a rule's state field) as one flat fp32 tensor
    (counted in `peak`: the caller subtracts it), read slice by slice."""
    buf = peak.add(torch.empty(math.prod(p["shape"]), dtype=torch.float32))
    for fname, key, local, start, length in pieces[p["index"]]:
        piece = peak.add(readers.slice(fname, f"{key}.{kind}", local, local + length))
        if piece.numel() != length:
            raise CheckpointError(
                f"{fname}: {key}.{kind}[{local}:{local + length}] has "
                f"{piece.numel()} elements, expected {length}"
            )
        buf[start : start + length].copy_(piece)
        peak.sub(piece)
    return buf


def _refuse_inside_checkpoint(out: Path, d: Path) -> None:
    """Export writes `out` and files beside it (shards, index): never inside a checkpoint (it
    would replace shard files or the manifest it is reading), nor over a root's `latest` or
    step folders. Links are resolved first. Beside the step folders, in the root, is fine."""
    target = out.resolve()
    for a in target.parents:
        if (
            a == d.resolve()
            or (a / MANIFEST).is_file()
            or STEP_DIR.match(a.name)
            or (a.name.startswith(".step-") and a.name.endswith(".tmp"))
        ):
            raise CheckpointError(
                f"export output {out} lies inside the checkpoint {a}; "
                "write it outside any checkpoint folder"
            )
    if (target.parent / LATEST).is_file() and (
        target.name == LATEST or STEP_DIR.match(target.name)
    ):
        raise CheckpointError(
            f"export output {out} would replace a checkpoint root's "
            f"{target.name!r}; choose another name"
        )


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
        files, export = _weight_files(p)
        self.shapes = {}
        for f in files:
            try:
                h = self._stack.enter_context(safe_open(f, framework="pt"))
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
            got = (h.metadata() or {}).get(EXPORT_ID)
            # see [Note: an export replaces the old one whole]
            if export is not None and got != export:
                raise CheckpointError(
                    f"{f}: a shard of export {snippet(got)}, but its index "
                    f"is of export {snippet(export)}: the folder mixes two "
                    "exports; export again"
                )
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
        return rows.reshape(-1)[a - r0 * row : b - r0 * row]


def _weight_files(p: Path) -> tuple[list[Path], str | None]:
    """The safetensors files of a weights source, and the export id its index records (None
    for one file, or an index written elsewhere)."""
    if p.is_dir():
        idx = sorted(p.glob("*.safetensors.index.json"))
        if len(idx) == 1:
            p = idx[0]
        elif (p / "model.safetensors").is_file():
            return [p / "model.safetensors"], None
        else:
            raise CheckpointError(f"{p}: no model.safetensors or single *.safetensors.index.json")
    if p.name.endswith(".index.json"):
        try:
            idx = json.loads(p.read_text())
            wm = idx["weight_map"]
            meta = idx.get("metadata") or {}
            export = meta.get(EXPORT_ID) if isinstance(meta, dict) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{p}: not a safetensors index ({type(e).__name__}: {snippet(str(e), 80)})"
            ) from None
        if not isinstance(wm, dict):
            raise CheckpointError(
                f"{p}: weight_map is {type(wm).__name__}, expected an object "
                "of tensor name -> shard file name"
            )
        for f in wm.values():
            # An index names shard files beside it: a path ("../x", "/x", "a/b") would read a
            # file outside the folder it came with.
            if (
                not isinstance(f, str)
                or f in ("", ".", "..")
                or Path(f).name != f
                or (os.altsep and os.altsep in f)
                or "\0" in f
            ):
                raise CheckpointError(
                    f"{p}: weight_map names {str(f)[:200]!r}, which is not a "
                    f"plain file name in {p.parent}; an index lists the shard "
                    "files beside it"
                )
        return [p.parent / f for f in sorted(set(wm.values()))], export
    if not p.is_file():
        raise CheckpointError(f"{p}: no such file")
    return [p], None


def import_weights(
    opt: ZeroAdamW,
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
) -> None:
    """Set the params (fp32 master and model params) of a sharded optimizer from full weights.

    Collective. `source` is a state dict, a safetensors file, an HF-style `*.index.json`, or a
    directory holding `model.safetensors` or one index. Each rank reads only the slices of its
    own segments. Names are the model's (a tied param may be found under any of its names).
    With `strict`, tensors in the source that are no param of the model are an error. Optimizer
    moments and the step count are left as they are (start of fine-tuning: zero). At stage 3
    each segment is read and written into the shards at once, nothing staged beyond it (stages
    1-2 read this rank's whole fp32 master first, then write it; a failed read leaves the
    params as they were there, partly written at stage 3).
    """
    W, group = opt.world_size, opt.process_group
    err: BaseException | None = None
    src: _WeightSource | None = None
    masters: list[torch.Tensor] = []
    # Everything that can fail on some ranks only (the source, the match, this rank's reads)
    # comes before `agree`, so no rank is left waiting in load_shard_state's collectives.
    try:
        source = tp_source(opt, source)  # tp: full tensors sliced to this rank's shards
        src = _WeightSource(source)
        found = _match_weights(
            opt, src, strict, str(source) if not isinstance(source, Mapping) else "state dict"
        )
        # Stage 3: each segment read and written into the shards at once, nothing staged. A
        # read failing on one rank still fails every rank (`agree`), with the params partly
        # written: import again.
        read = src.read_flat
        streamed = opt.write_param_runs(lambda i, a, b: read(found[i], a, b))
        with torch.no_grad():
            for info in [] if streamed else opt.shard_infos():
                buf = torch.zeros(info.local_numel, dtype=torch.float32)
                for s in info.segments():
                    buf[s.local : s.local + s.length].copy_(
                        src.read_flat(found[s.param], s.start, s.start + s.length)
                    )
                masters.append(buf)
    except Exception as e:  # noqa: BLE001
        err = e
    try:
        agree(err, group, W, "import_weights")
        opt.load_shard_state(ShardState(master=masters or None))  # collective at stages 1-2
    finally:
        if src is not None:
            src.close()


def _match_weights(opt: ZeroAdamW, src: _WeightSource, strict: bool, what: str) -> dict[int, str]:
    other_names = aliases(opt)
    table = param_table(opt)
    found, diffs, used = {}, [], set()
    for i, (name, shape) in sorted(table.items()):
        names = [name] + [a for a in other_names.get(id(opt.params[i]), []) if a != name]
        used.update(names)
        hit = next((n for n in names if n in src.shapes), None)
        if hit is None:
            diffs.append(f"missing: {name}")
        elif src.shapes[hit] != shape:
            diffs.append(
                f"{hit}: shape {list(src.shapes[hit])} in {what}, {list(shape)} in the model"
            )
        else:
            found[i] = hit
    extra = [n for n in src.shapes if n not in used]
    if extra and strict:
        diffs.append(f"not params of the model: {extra}")
    if diffs:
        raise ValueError(f"{what} does not match this model's parameters:\n  " + "\n  ".join(diffs))
    return found
