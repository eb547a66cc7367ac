"""Save: every rank writes its shard, rank 0 the manifest last (format in `_format.py`).

`save` is collective and gathers what rank 0 needs (each writer's segment tables, every rank's
packed caller and RNG state) before anything is written, so a bad caller_state or a root that is
itself a checkpoint fails on every rank at once. An async save copies the shards off the live
buffers first and needs no collective off the main thread (see the sidecar note in `format`).

[Note: the phases of a save] `save` runs as `_SaveRun`'s phases, in this order on every rank (so
the collectives match). Its collectives are gathers to rank 0 and up to three agreements
(`agree`: rank 0's error, or None, broadcast; every rank raises it or none does):
1. prepare (local): this tp rank's folder, the previous async save's outcome, this rank's packed
   caller and RNG state.
2. replicas (the replicate group's gather, 2-D mesh only): each replica's state to its
   first-replica peer; the other replicas return here.
3. copy the shard (local): the state tensors to the host, the segment tables.
4. open (a gather to rank 0, agreement 1): rank 0 checks what every rank sent and the root,
   builds the manifest less its files and makes an empty staging folder `.step-N.tmp`.
5. write and publish. Sync: each writer writes its shard into staging; a gather of the files'
   sizes and hashes; agreement 2 (every rank has stopped writing); rank 0 `_finalize`s: the
   manifest last, the folder renamed into place, then `latest`, then rotation; agreement 3 (every
   rank learns the outcome). Async: the same in a thread, with `<shard>.json` / `.error` files in
   staging in place of the gather and the agreements, the outcome in the handle.
Nothing is lost on failure: until `_finalize` renames the staging folder into place, what a
reader sees is unchanged (an existing checkpoint of the same step is moved aside to
`.step-N.old` just before, and removed only once `latest` names the new one). A failure in
phases 1-4 raises on every rank at agreement 1, before a staging folder is made; a failure in
phase 5 (any rank's write, the manifest, the rename) makes rank 0 remove the staging folder. Once
`latest` is written the save has succeeded: removing the old folder and rotation cannot fail it.

[Note: a failure before the first gather] What fails on some ranks only before the first collective
(the previous async save's error, which only its failing ranks hold; this tp rank's folder; the
host copies of the shard) is carried by that gather, and rank 0 raises it for every rank through
`agree`: a rank that raised here alone would leave the others waiting in the gather until the
group's timeout.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fusedzero import _dtypes as dtypes
from fusedzero._comm import group_timeout
from fusedzero.checkpoint._binding import shard_metadata
from fusedzero.checkpoint._collectives import agree, gather_to_first
from fusedzero.checkpoint._format import (
    LATEST,
    MANIFEST,
    SafetensorsWriter,
    fsync_dir,
    named,
    remove,
    shard_file_name,
    step_dir_name,
    write_text_atomic,
)
from fusedzero.checkpoint._manifest import (
    FORMAT,
    MAX_MANIFEST,
    STEP_DIR,
    VERSION,
    CheckpointError,
    rule_names,
)
from fusedzero.checkpoint._optview import aliases, hyperparams
from fusedzero.checkpoint._placements import tp_directory, tp_origin
from fusedzero.checkpoint._rank_state import pack, rng_state, unpack

if TYPE_CHECKING:
    from fusedzero.optim import ZeroAdamW
    from fusedzero.state import ShardState


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


_pending: weakref.WeakKeyDictionary[ZeroAdamW, SaveHandle] = weakref.WeakKeyDictionary()


def wait_pending(opt: ZeroAdamW) -> None:
    """Wait for the optimizer's previous asynchronous save, if any (re-raises its error)."""
    h = _pending.pop(opt, None)
    if h is not None and not h._reported:
        h.wait()


def save(
    opt: ZeroAdamW,
    directory: str | os.PathLike[str],
    *,
    step: int,
    caller_state: Any = None,
    keep_last: int | None = None,
    async_: bool = False,
    timeout: float | None = None,
) -> SaveHandle:
    """Save a sharded checkpoint of `opt` (a `ZeroAdamW`) as `directory/step-{step:08d}`.

    Collective: every rank of the optimizer's process group calls it with the same arguments
    (with `Groups(replicate=)`, only the first replica writes; the others return at once)
    except `caller_state`, which is per rank (e.g. lr scheduler state, data position); each rank's
    RNG states (torch CPU[, CUDA], python `random`[, numpy]) are saved with it.

    Args:
        step: the caller's step (names the directory; returned by `load`).
        keep_last: after this save, delete all but the newest `keep_last` checkpoints.
        async_: copy the shards off the training buffers now and write them in a background
            thread; the returned handle's `wait()` reports completion. The next save or load
            waits for the previous save first.
        timeout: async only: how long rank 0 waits for the other ranks' shards (None: the
            process group's timeout, see `fusedzero._comm.group_timeout`). It bounds the save
            thread, which the interpreter waits for at exit: a dead peer ends it with an error.

    See [Note: the phases of a save].
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    run = _SaveRun.prepare(opt, directory, step, caller_state, keep_last)
    if timeout is None:
        timeout = group_timeout(run.group)
    states = run.gather_replica_states()
    if opt.replica_rank != 0:
        if run.failed is not None:  # (after the replicate group's gather, which it took part in)
            raise CheckpointError(run.failed)
        return SaveHandle(run.root / run.name)
    assert states is not None
    run.copy_shard(async_)
    run.open_staging(states)
    run.describe_shard()
    if not async_:
        run.finish_sync()
        return SaveHandle(run.root / run.name)
    return run.finish_async(timeout)


class _SaveRun:
    """One call of `save` on one rank: what each phase leaves for the next (See [Note: the
    phases of a save]). Every rank runs the phases in the same order, so their collectives
    match; a phase that fails on some ranks only carries its failure into the next collective
    instead of raising (See [Note: a failure before the first gather])."""

    def __init__(
        self, opt: ZeroAdamW, root: Path, step: int, keep_last: int | None, failed: str | None
    ) -> None:
        self.opt = opt
        self.W, self.rank, self.group = opt.world_size, opt.rank, opt.process_group
        self.root = root
        self.step = step
        self.keep_last = keep_last
        self.name = step_dir_name(step)
        self.staging = root / f".{self.name}.tmp"
        self.fname = shard_file_name(self.rank, self.W)
        self.failed = failed  # this rank's failure so far, carried to rank 0 by the gather
        self.packed, self.bad_state = "", None
        # Filled by copy_shard, open_staging and describe_shard in turn.
        self.writer = False
        self.st: ShardState | None = None
        self.step_count = 0.0
        self.tensors: dict[str, torch.Tensor] = {}
        self.groups_meta: list[dict[str, Any]] = []
        self.everyone: list[dict[str, Any]] | None = None  # rank 0: every rank's `local`
        self.base: dict[str, Any] | None = None  # rank 0: the manifest less its files
        self.meta: dict[str, str] = {}  # this shard's header

    # -- 1. prepare: local, no collective ---------------------------------------------------
    @classmethod
    def prepare(
        cls,
        opt: ZeroAdamW,
        directory: str | os.PathLike[str],
        step: int,
        caller_state: Any,
        keep_last: int | None,
    ) -> _SaveRun:
        """This tp rank's folder, the previous async save's outcome and this rank's packed
        caller and RNG state, each failure kept for the gather."""
        # See [Note: a failure before the first gather].
        failed: str | None = None
        try:
            directory = tp_directory(opt, directory, saving=True)  # tp: this tp rank's folder
            wait_pending(opt)
        except Exception as e:  # noqa: BLE001
            failed = f"rank {opt.rank}: {type(e).__name__}: {' '.join(str(e).split())}"
        run = cls(opt, Path(directory), step, keep_last, failed)
        try:
            run.packed = pack({"caller": caller_state, "rng": rng_state()})
            unpack(run.packed)  # fail now, not at resume time
        except Exception as e:  # noqa: BLE001
            run.bad_state = (
                f"rank {opt.rank}: caller_state must be loadable by torch.load("
                f"weights_only=True) (tensors, numbers, strings, lists, tuples, dicts): {e}"
            )
        return run

    # -- 2. replicas: the replicate group's gather -------------------------------------------
    def gather_replica_states(self) -> list[tuple[str, str | None]] | None:
        """2-D mesh: replicas hold the same shards and the first replica's shard group writes
        them, but RNG and caller state differ per replica (dropout on other data): each
        replica's goes to its first-replica peer, which writes them all into the manifest.
        None on the other replicas, which return after this."""
        opt, mine = self.opt, (self.packed, self.bad_state)
        if opt.replicas > 1:
            return gather_to_first(mine, opt.replicate_group, opt.replicas, opt.replica_rank)
        return [mine]

    # -- 3. copy the shard to the host: local ------------------------------------------------
    def copy_shard(self, async_: bool) -> None:
        """This rank's state tensors on the host (async: private copies, so training may go on
        updating the live buffers) and its segment tables; a failure is carried."""
        opt, rank = self.opt, self.rank
        infos = opt.shard_infos()
        self.writer = all(info.shard_rank == rank for info in infos)
        # Rank 0 always writes (stage 0: it alone); it also needs the state for the manifest.
        self.st = opt.shard_state() if self.writer else None
        self.step_count = float(opt.step_count.reshape(-1)[0])  # a host sync; once per save
        if self.st is None or self.failed is not None:
            return
        try:
            for i, info in enumerate(infos):
                # Each state in its own dtype (fusedzero/memory_modes.py), int8 codes with
                # their scales.
                for kind, t in self.st.tensors(i).items():
                    t = t.detach()
                    t = t.to("cpu", copy=True) if async_ else t.cpu()
                    self.tensors[f"fg{i}.{kind}"] = t.reshape(-1).contiguous()
                self.groups_meta.append(
                    {
                        "key": f"fg{i}",
                        "group_index": info.group_index,
                        "dtype": dtypes.name(info.dtype),
                        "unit": info.unit,
                        "local_numel": info.local_numel,
                        "segments": [
                            [s.param, s.start, s.length, s.local] for s in info.segments()
                        ],
                    }
                )
        except Exception as e:  # noqa: BLE001 - see [Note: a failure before the first gather]
            self.tensors.clear()
            self.failed = f"rank {rank}: copying its shard to the host: {type(e).__name__}: {e}"

    # -- 4. open: the first gather and agreement ---------------------------------------------
    def open_staging(self, states: list[tuple[str, str | None]]) -> None:
        """Everything rank 0 needs gathered to it; rank 0 raises any rank's failure, a bad
        caller_state or a root that is itself a checkpoint, builds the manifest's base and makes
        an empty staging folder. Then every rank agrees: all go on, or all raise."""
        replicas, rank = self.opt.replicas, self.rank
        errors = [
            f"replica {k} {b}" if replicas > 1 else b
            for k, (_, b) in enumerate(states)
            if b is not None
        ]
        local = {
            "rank": rank,
            "writer": self.writer,
            "groups": self.groups_meta,
            "states": [packed for packed, _ in states],
            "error": "\n".join(errors) or None,
            "failed": self.failed,
        }
        self.everyone = gather_to_first(local, self.group, self.W, rank)
        err: BaseException | None = None
        if rank == 0:
            assert self.everyone is not None
            try:
                self.base = self._checked_base(self.everyone)
                self.root.mkdir(parents=True, exist_ok=True)
                remove(self.staging)  # left by a killed save of the same step (or planted: a link)
                self.staging.mkdir()  # fails rather than follow anything created since
            except Exception as e:  # noqa: BLE001 - every rank must learn of it
                err = e
        agree(err, self.group, self.W, "save")  # also the barrier: the staging directory exists now

    def _checked_base(self, everyone: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0: raise what any rank failed at, then the manifest less its files."""
        failures = [e["failed"] for e in everyone if e["failed"] is not None]
        if failures:
            raise CheckpointError("\n".join(failures))
        bad = [e["error"] for e in everyone if e["error"] is not None]
        if bad:
            raise ValueError("\n".join(bad))
        if (self.root / MANIFEST).is_file():
            raise CheckpointError(
                f"{self.root} is a checkpoint (it has {MANIFEST}); save into "
                f"its root {self.root.parent} (see `save_root`)"
            )
        assert self.st is not None
        return _manifest_base(self.opt, self.step, self.step_count, everyone, self.st)

    def describe_shard(self) -> None:
        """What this shard's bytes mean, in its own header (_binding.py): the manifest rank 0
        writes must agree with it row by row, or nothing loads."""
        if not self.writer:
            return
        opt, st = self.opt, self.st
        self.meta = shard_metadata(
            {
                "world_size": self.W,
                "stage": int(opt.stage),
                "step": self.step,
                "step_count": self.step_count,
                "modes": st.modes.to_json() if st is not None else None,
                "params": param_entries(opt),
                **tp_origin(opt),
            },
            {"rank": self.rank, "groups": self.groups_meta},
        )

    # -- 5a. write and publish, synchronously: two more agreements ----------------------------
    def finish_sync(self) -> None:
        """Each writer writes its shard into staging; rank 0 learns every file's size and hash
        (a gather), every rank agrees that all have stopped writing, rank 0 publishes
        (`_finalize`), and every rank agrees on the outcome. Whatever fails, rank 0 removes the
        staging folder."""
        W, rank, group = self.W, self.rank, self.group
        info, err = None, None
        if self.writer:
            try:
                info = _write_shard(self.staging / self.fname, self.tensors, self.meta)
            except Exception as e:  # noqa: BLE001
                err = e
        written = gather_to_first((rank, info), group, W, rank)
        try:
            agree(err, group, W, "save")  # every rank has stopped writing into staging
            if rank == 0:
                assert self.base is not None and written is not None
                assert self.everyone is not None
                try:
                    _finalize(
                        self.root,
                        self.staging,
                        self.name,
                        self.base,
                        {r: i for r, i in written if i is not None},
                        self.everyone,
                        self.keep_last,
                    )
                except Exception as e:  # noqa: BLE001
                    err = e
            agree(err, group, W, "save")
        except BaseException:
            if rank == 0:  # a failed save leaves nothing behind (disk full: free the space)
                remove(self.staging, quiet=True)
            raise

    # -- 5b. write and publish, asynchronously: no collective ---------------------------------
    def finish_async(self, timeout: float) -> SaveHandle:
        """The same in a background thread, with files in staging for collectives: each writer
        leaves `<shard>.json` (or `.error`) beside its shard, rank 0 waits for them all
        (`_collect_sidecars`, bounded by `timeout`), then publishes. Errors reach the caller
        through the handle's `wait()`, or the next save or load."""
        # The thread holds what it writes, not this run (nor, through it, the optimizer).
        root, staging, name, fname, W = self.root, self.staging, self.name, self.fname, self.W
        rank, writer, keep_last = self.rank, self.writer, self.keep_last
        tensors, meta, base, everyone = self.tensors, self.meta, self.base, self.everyone
        writers = [e["rank"] for e in everyone if e["writer"]] if everyone is not None else []
        handle = SaveHandle(root / name)

        def job() -> None:
            try:
                if writer:
                    try:
                        info = _write_shard(staging / fname, tensors, meta)
                    except BaseException as e:
                        write_text_atomic(staging / (fname + ".error"), repr(e))
                        raise
                    write_text_atomic(staging / (fname + ".json"), json.dumps(info))
                if rank == 0:
                    assert base is not None and everyone is not None
                    done = _collect_sidecars(staging, writers, W, timeout)
                    _finalize(root, staging, name, base, done, everyone, keep_last)
            except BaseException as e:  # noqa: BLE001 - surfaced by handle.wait()
                handle.error = e
                if rank == 0:
                    remove(staging, quiet=True)
            finally:
                tensors.clear()

        # Not a daemon thread: the interpreter waits for an async save at exit.
        thread = threading.Thread(target=job, name=f"fusedzero-save-{name}")
        handle._thread = thread
        _pending[self.opt] = handle
        thread.start()
        return handle


def _write_shard(
    path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> dict[str, Any]:
    try:
        w = SafetensorsWriter(
            path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], meta
        )
    except OSError as e:
        raise named(e, path) from e
    try:
        for k, t in tensors.items():
            w.write(k, t)
        size, sha = w.close()
    except OSError as e:
        w.abort()
        raise named(e, path, w.size) from e
    except BaseException:
        w.abort()
        raise
    return {"name": path.name, "bytes": size, "sha256": sha}


def _collect_sidecars(
    staging: Path, writers: list[int], W: int, timeout: float
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
                raise CheckpointError(
                    f"ranks {missing} did not finish their shards in {timeout}s ({staging})"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    for r in writers:
        (staging / (shard_file_name(r, W) + ".json")).unlink()
    return out


def param_entries(opt: ZeroAdamW) -> list[dict[str, Any]]:
    """The manifest's `params` table (every rank can build it: shard headers record theirs)."""
    names = aliases(opt)
    return [
        {
            "index": p.index,
            "name": p.name,
            "shape": list(p.shape),
            "dtype": dtypes.name(p.dtype),
            "group": p.group_index,
            "aliases": [a for a in names.get(id(opt.params[p.index]), []) if a != p.name],
        }
        for p in opt.param_infos()
    ]


def _manifest_base(
    opt: ZeroAdamW, step: int, step_count: float, everyone: list[dict[str, Any]], st: ShardState
) -> dict[str, Any]:
    params = param_entries(opt)
    scaler = None
    if st.scaler is not None:
        scaler = {"scale": st.scaler["scale"], "growth_tracker": int(st.scaler["growth_tracker"])}
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": opt.world_size,
        "stage": int(opt.stage),
        "step": step,
        "step_count": step_count,
        "bucket_numel": opt.bucket_numel,
        "param_dtype": dtypes.name(opt.param_dtype) if opt.param_dtype is not None else None,
        "modes": st.modes.to_json(),
        **rule_names(opt.group_rules),
        "seed": opt.seed,
        "params": params,
        "param_groups": hyperparams(opt),
        "scaler": scaler,
        **tp_origin(opt),
        # One entry per rank; with a replicate_group one per (rank, replica), "replica" added.
        "ranks": [
            {"rank": e["rank"], "state": packed}
            if len(e["states"]) == 1
            else {"rank": e["rank"], "replica": k, "state": packed}
            for e in everyone
            for k, packed in enumerate(e["states"])
        ],
    }


def _finalize(
    root: Path,
    staging: Path,
    name: str,
    base: dict[str, Any],
    infos: dict[int, dict[str, Any]],
    everyone: list[dict[str, Any]],
    keep_last: int | None,
) -> None:
    """Rank 0: manifest last, rename the directory into place, then `latest`, then rotate."""
    files = []
    for e in everyone:
        if not e["writer"]:
            continue
        info = infos[e["rank"]]
        files.append(
            {
                "name": info["name"],
                "rank": e["rank"],
                "bytes": info["bytes"],
                "sha256": info["sha256"],
                "groups": e["groups"],
            }
        )
    manifest = dict(base, files=files, created=time.time())
    text = json.dumps(manifest, indent=1)
    if len(text) > MAX_MANIFEST:
        states = max(len(r["state"]) for r in manifest["ranks"])
        raise CheckpointError(
            f"the manifest would be {len(text)} bytes, more than the "
            f"{MAX_MANIFEST} a reader accepts (the largest rank state is "
            f"{states} bytes): save a smaller caller_state"
        )
    write_text_atomic(staging / MANIFEST, text)
    final = root / name
    old = root / f".{name}.old"
    if final.exists() or final.is_symlink():
        remove(old)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(root)
    write_text_atomic(root / LATEST, name + "\n")
    # The save is complete from here on: cleaning up must not turn it into a failure.
    remove(old, quiet=True)
    if keep_last is not None:
        _rotate(root, keep_last, name)


def _rotate(root: Path, keep_last: int, current: str) -> None:
    """Keep the newest `keep_last` checkpoints up to `current` (the one `latest` now names,
    always kept). Newer step folders belong to another branch (this run resumed from an older
    step; see [Note: latest decides] in _catalog.py): they are left alone, and this run replaces
    each when it saves that step."""
    upto = int(STEP_DIR.match(current).group(1))  # type: ignore[union-attr]
    done = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        try:
            if (
                m
                and p.name.isascii()
                and int(m.group(1)) <= upto
                and p.is_dir()
                and (p / MANIFEST).is_file()
            ):
                done.append((int(m.group(1)), p))
        except OSError:  # cannot be looked into (mode 000): not counted, not removed
            continue
    done.sort()
    for _, p in done[:-keep_last]:
        if p.name == current:
            continue
        try:
            remove(p)  # a symlinked step folder: the link goes, what it points to stays
        except OSError as e:
            warnings.warn(f"keep_last: could not remove old checkpoint {p}: {e}", stacklevel=3)
