"""Byte-level training data with no download, and a sampler whose global batch ignores the layout.

The default corpus is the Python standard library's own source, which every Python install has.
:class:`BatchSampler` draws the global batch for a step from a generator seeded by
``(seed, step)`` alone, so 1 rank x 1 micro-step, 2 ranks, or 4 ranks x 2 micro-steps all train
on the same sequences in the same order; only how the rows are dealt out differs. That is what
lets a sharded run be compared against a single-process reference step by step.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from fusedzero._safe_paths import check_input, read_bytes

# Enough text for a small model to learn from, small enough to read in well under a second.
DEFAULT_CORPUS_MAX_BYTES = 8_000_000
# Standard library folders left out of the default corpus: test suites (large, repetitive, and
# some files are deliberately malformed), third-party packages, and tools that are not library.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
# How much of a file to inspect for a NUL byte when deciding whether it is text; the same
# heuristic (and window) git uses.
_BINARY_SNIFF_BYTES = 8192
# Multiplier that spreads (seed, step) over distinct generator seeds; a prime larger than any
# realistic step count, so (seed, step) pairs do not collide.
_SEED_STRIDE = 1_000_003

Split = tuple[torch.Tensor, torch.Tensor]
"""(train, val) uint8 byte tensors."""


def default_corpus_files(max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> list[Path]:
    """Return the standard library ``.py`` files that make up the default corpus.

    Files are sorted by their path relative to the stdlib folder and taken in that order while
    their total size stays within ``max_bytes``; the selection therefore depends only on the
    Python installation. Test suites, ``site-packages``, ``idlelib`` and ``lib2to3`` are skipped.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into excluded folders.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    files: list[Path] = []
    total = 0
    for _, path in found:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return files


def _read_text_file(path: Path) -> bytes | None:
    """Return the file's bytes, or None if its first 8 KB contain a NUL byte (binary); a FIFO
    or a device (a `*.txt -> /dev/zero` link) is refused (safe_paths.UnsafePath)."""
    data = read_bytes(path, "corpus file")
    return None if b"\0" in data[:_BINARY_SNIFF_BYTES] else data


def _folder_text_files(folder: Path) -> list[Path]:
    """Files under ``folder``, recursively, sorted by relative path, hidden entries skipped."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        # Hidden folders (.git, .venv, ...) hold tooling state, not corpus text.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                path = Path(dirpath) / name
                found.append((path.relative_to(folder).as_posix(), path))
    found.sort()
    return [path for _, path in found]


def load_corpus(path: str | Path | None = None, block_size: int = 128) -> bytes:
    """Load a byte-level training corpus.

    Args:
        path: None for the default corpus (see :func:`default_corpus_files`); a file, read as
            is; or a folder, whose non-hidden text files are concatenated in sorted order of
            relative path, recursively. Files with a NUL byte in their first 8 KB are skipped
            as binary.
        block_size: the model's context length. The corpus must hold at least
            ``2 * block_size + 2`` bytes so that the train and validation splits can each
            supply one ``block_size + 1`` window.

    Raises:
        ValueError: if the path does not exist, is not a regular file or folder (or a file in
            it is a FIFO or a device: safe_paths.UnsafePath), is not readable, holds no text,
            or is too small.
    """
    if path is None:
        data = b"".join(p.read_bytes() for p in default_corpus_files())
        where = "the default corpus (Python standard library sources)"
    else:
        p = Path(path)
        where = f"corpus {str(p)!r}"
        if not p.exists():
            raise ValueError(
                f"{where} does not exist; pass an existing text file or folder, "
                f"or no path for the default corpus"
            )
        check_input(p, "corpus", folder=True)  # See [Note: no read from a FIFO or device]
        if p.is_dir():
            texts = [t for t in map(_read_text_file, _folder_text_files(p)) if t is not None]
            if not texts:
                raise ValueError(
                    f"{where} is a folder with no text files (all absent or binary); "
                    f"pass a text file or a folder of text files"
                )
            data = b"".join(texts)
        else:
            try:
                data = read_bytes(p, "corpus")
            except PermissionError:
                raise ValueError(
                    f"{where} is not readable (permission denied); pass a file you can read"
                ) from None
    need = 2 * block_size + 2
    if len(data) < need:
        raise ValueError(
            f"{where} has {len(data)} bytes, fewer than 2*block_size+2 = {need} "
            f"(block_size={block_size}); use more text or a smaller block_size"
        )
    return data


def split_corpus(
    data: bytes, val_fraction: float = 0.05, block_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``data`` into (train, val) uint8 tensors: the last ``val_fraction`` is validation.

    If ``block_size`` is given, the validation split is grown to at least ``block_size + 1``
    bytes (one full window) and the train split must keep at least that much too.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    n = len(data)
    n_val = int(n * val_fraction)
    if block_size is not None:
        window = block_size + 1
        n_val = max(n_val, window)
        if n - n_val < window:
            raise ValueError(
                f"corpus of {n} bytes cannot give train and val splits of at least "
                f"block_size+1 = {window} bytes each; need at least {2 * window} bytes"
            )
    # frombuffer shares memory with an immutable bytes object; clone so the tensors own theirs.
    all_bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return all_bytes[: n - n_val].clone(), all_bytes[n - n_val :].clone()


def _windows(
    data: torch.Tensor, starts: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather (x, y) int64 windows: x = data[s : s+T], y = data[s+1 : s+T+1] for each start s."""
    idx = starts[:, None] + torch.arange(block_size + 1)
    chunk = data[idx].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def _check_data(data: torch.Tensor, block_size: int) -> None:
    if data.dim() != 1 or data.dtype != torch.uint8:
        raise ValueError(
            f"data must be a 1-D uint8 tensor, got dim={data.dim()} dtype={data.dtype}"
        )
    if block_size < 1 or data.numel() < block_size + 1:
        raise ValueError(
            f"data has {data.numel()} bytes; block_size={block_size} needs at least "
            f"block_size+1 = {block_size + 1}"
        )


class BatchSampler:
    """Random training windows whose global batch per step does not depend on the layout.

    For each ``step`` the ``global_batch_size`` window starts come from a CPU
    ``torch.Generator`` seeded with ``seed * 1_000_003 + step``: every rank draws the same global
    batch and keeps its share. The rows are dealt out rank-major: rank ``r`` owns the contiguous
    rows ``[r * G/W, (r+1) * G/W)`` of the global batch and walks through them in ``grad_accum``
    micro-batches, so micro-step ``m`` of rank ``r`` gets chunk ``r * grad_accum + m`` of size
    ``G / (W * grad_accum)``. Concatenating ``batch(step, r, W, m, A)`` over ``r`` (outer) and
    ``m`` (inner) reproduces the global batch exactly; a rank's rows for a step do not change
    with ``grad_accum``.
    """

    def __init__(
        self, data: torch.Tensor, block_size: int, global_batch_size: int, seed: int
    ) -> None:
        _check_data(data, block_size)
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be >= 1")
        self.data = data
        self.block_size = block_size
        self.global_batch_size = global_batch_size
        self.seed = seed

    def global_starts(self, step: int) -> torch.Tensor:
        """Start offsets (int64, shape (global_batch_size,)) of the global batch for ``step``."""
        gen = torch.Generator(device="cpu").manual_seed(self.seed * _SEED_STRIDE + step)
        # high is exclusive; the last valid start leaves room for block_size + 1 bytes.
        high = self.data.numel() - self.block_size
        return torch.randint(0, high, (self.global_batch_size,), generator=gen)

    def batch(
        self, step: int, rank: int, world_size: int, micro_step: int = 0, grad_accum: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's micro-batch ``(x, y)`` for ``step``, each int64 of shape
        ``(global_batch_size // (world_size * grad_accum), block_size)``, on the CPU.

        ``y`` is ``x`` shifted by one byte (next-byte targets).
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if grad_accum < 1 or not 0 <= micro_step < grad_accum:
            raise ValueError(f"micro_step={micro_step} must be in [0, grad_accum={grad_accum})")
        parts = world_size * grad_accum
        if self.global_batch_size % parts != 0:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"world_size*grad_accum = {world_size}*{grad_accum} = {parts}; "
                f"use a global batch size that is a multiple of {parts}"
            )
        local = self.global_batch_size // parts
        chunk = rank * grad_accum + micro_step
        starts = self.global_starts(step)[chunk * local : (chunk + 1) * local]
        return _windows(self.data, starts, self.block_size)


def eval_batches(
    val: torch.Tensor, block_size: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: ``n_batches`` pairs ``(x, y)``, int64, (batch_size, block_size).

    The ``batch_size * n_batches`` windows start at evenly spaced offsets across ``val`` (no
    randomness), so every call and every rank sees the same batches and the whole split is
    covered; windows overlap only when ``val`` is shorter than they are in total.
    """
    _check_data(val, block_size)
    if batch_size < 1 or n_batches < 1:
        raise ValueError(f"batch_size={batch_size} and n_batches={n_batches} must both be >= 1")
    last_start = val.numel() - block_size - 1
    starts = torch.linspace(0, last_start, batch_size * n_batches, dtype=torch.float64).long()
    return [_windows(val, s, block_size) for s in starts.split(batch_size)]
