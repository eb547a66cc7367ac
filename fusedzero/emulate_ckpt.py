"""Checkpoints at large W, one emulated rank at a time (see fusedzero/emulate.py).

`save_emulated` writes a real checkpoint of W ranks (W shard files and the manifest) from one
process: each rank's `ZeroAdamW` is built on the fake process group, and `fusedzero.checkpoint`
's two object collectives (`gather_to_first`, `agree`) are served in process, since the fake
backend moves no data. Everything else is the library's own save: the async path, whose writers
need no collective after the first gather, lets rank 0 wait for the others' shards in its writer
thread while they are saved one after the other. `load_emulated` loads it into one rank of
another world size the same way (its one collective, `agree`, served in process).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from fusedzero.checkpoint import _loading as loading, _saving as saving
from fusedzero.emulate import fake_group, rss_bytes

__all__ = ["SavedEmulated", "emulated_rank", "save_emulated"]

MakeOpt = Callable[[], Any]  # builds this rank's ZeroAdamW under the current (fake) group


class _Deferred(Exception):
    """Ends a rank's first pass: its record is in, its shard is written in the second pass."""


def _agree(err: BaseException | None, *args: Any) -> None:
    if err is not None:
        raise err


@dataclass(frozen=True, kw_only=True)
class SavedEmulated:
    path: Path
    seconds: float
    manifest_bytes: int
    shard_files: int
    peak_rss_bytes: int


def save_emulated(
    make_opt: MakeOpt,
    world_size: int,
    root: Path,
    *,
    step: int = 1,
    prepare: Callable[[Any], None] | None = None,
) -> SavedEmulated:
    """Save a `world_size`-rank checkpoint under `root`, building and saving rank by rank.
    `prepare(opt)` runs on each rank's optimizer before it is saved (e.g. to set its state)."""
    W = world_size
    records: dict[int, Any] = {}
    opts: dict[int, Any] = {}
    phase = "collect"

    def gather(obj: Any, group: Any, n: int, rank: int) -> list[Any] | None:
        if phase == "collect":
            records[rank] = obj
            return None
        if rank == 0 and "rank" in obj:  # the records, gathered: everyone's
            return [obj] + [records[r] for r in range(1, W)]
        return None

    def agree_collect(err: BaseException | None, *args: Any) -> None:
        _agree(err)
        if phase == "collect":
            raise _Deferred

    t0 = time.perf_counter()
    peak = rss_bytes()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(saving, "gather_to_first", gather))
        stack.enter_context(mock.patch.object(saving, "agree", agree_collect))
        for r in range(1, W):  # first pass: each rank's record for rank 0's manifest
            with fake_group(r, W):
                opt = make_opt()
            if prepare is not None:
                prepare(opt)
            opts[r] = opt
            with fake_group(r, W), contextlib.suppress(_Deferred):
                saving.save(opt, root, step=step, async_=True)
        phase = "write"
        with fake_group(0, W):
            opt0 = make_opt()
            if prepare is not None:
                prepare(opt0)
            # Rank 0 gathers, creates the staging folder, and its writer thread waits for
            # every other rank's shard before it writes the manifest.
            first = saving.save(opt0, root, step=step, async_=True)
        for r in range(1, W):
            with fake_group(r, W):
                saving.save(opts.pop(r), root, step=step, async_=True).wait()
            peak = max(peak, rss_bytes())
        path = first.wait()
    return SavedEmulated(
        path=path,
        seconds=time.perf_counter() - t0,
        manifest_bytes=(path / "manifest.json").stat().st_size,
        shard_files=len(list(path.glob("*.safetensors"))),
        peak_rss_bytes=max(peak, rss_bytes()),
    )


@contextlib.contextmanager
def emulated_rank(rank: int, world_size: int) -> Iterator[None]:
    """The fake group as `rank` of `world_size`, with checkpoint loading's `agree` in process."""
    with fake_group(rank, world_size), mock.patch.object(loading, "agree", _agree):
        yield
