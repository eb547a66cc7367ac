"""Reduce-scatter, all-gather and all-reduce through shared memory, for gloo ranks on one host.

[Note: shared-memory collectives] Ranks on one host share its memory, but gloo moves every byte
through a loopback TCP socket: a copy into the kernel on one side, a copy out on the other, a
system call per chunk, and (fusedzero/direct.py) a send/receive pair to post per peer. Here each
rank owns an anonymous memory file (memfd) that every rank of the group maps (NCCL's intra-node transport on
GPUs works the same way). A collective is one memory pass on each side:

- post (the caller's thread): copy what the peers need (reduce-scatter and all-reduce: their
  slices of the input; all-gather: this rank's slice) into a region of this rank's arena,
  publish where it is in the op's slot, and wake the peers (a futex in the mapped header);
- complete (one progress thread per group, in the order the ops were posted): wait until every
  peer published the op, check it is the same op (kind and size: ranks that diverged fail at
  once, naming both), then sum the peers' slices for this rank into `out` (reduce-scatter), or
  copy their slices into place (all-gather). An all-reduce is a reduce-scatter whose reduced
  slice is published again and gathered, so every rank holds the same bits.
- A region is reused once every rank has completed the op (each rank publishes the last op it
  completed); a post that finds no room waits for that. Completion never waits on the peer's
  caller, only on its progress thread, so a rank blocked elsewhere cannot deadlock the others.

Bytes copied out of each rank = the ring formulas `CommCounter` counts ((W-1)/W n for
reduce-scatter and all-gather, twice that for all-reduce). Sums run in a fixed order (this
rank's slice, then the peers from rank + 1 on), so a run repeats bit for bit. Memory: the arena
is a sparse file reserved as far as regions have reached (the most bytes in flight at once);
`resident_bytes()` says how much. An op larger than the arena (FUSEDZERO_SHM_MB, default 256 per
rank) goes through direct sends instead, the same choice on every rank.

Where it runs: Linux on x86-64 (the futex call and x86's store order, which makes a slot's
published state visible only after the data written before it), CPU tensors, gloo groups whose
ranks can all map each other's files (checked by the handshake in fusedzero/shm_setup.py;
otherwise fusedzero/direct.py). `FUSEDZERO_GLOO_COLLECTIVES=direct|torch` chooses the others.
"""
from __future__ import annotations

import collections
import ctypes
import datetime
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable

import torch

HEADER = 1 << 16  # bytes before the arena: control words + slots
N_SLOTS = 1024  # ops in flight per group at most (a post waits for a free slot)
_SLOT0, _SLOT_WORDS = 8, 4  # int64 words: slot i at _SLOT0 + 4 i: state, what, offset, -
_MAGIC, _DONE, _EVENTS = 0, 1, 2  # int64 words of the header
_ALIGN = 64
RS, AG, AR = 1, 2, 3
_KIND = {RS: "reduce-scatter", AG: "all-gather", AR: "all-reduce"}


# -- futex on a word of a shared mapping (cross-process: not FUTEX_PRIVATE) ---------------------
class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1
_syscall = None


def _futex(addr: int, op: int, val: int, timeout_s: float | None = None) -> None:
    global _syscall
    if _syscall is None:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
        _syscall.restype = ctypes.c_long
    ts = None
    if timeout_s is not None:
        ts = ctypes.byref(_Timespec(int(timeout_s), int(timeout_s % 1 * 1e9)))
    # ctypes drops the GIL for the call: the caller's other threads run while this one sleeps.
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(op),
             ctypes.c_int(val), ts, None, ctypes.c_int(0))


def _what(kind: int, t: torch.Tensor) -> int:
    """An op's identity as peers must see it: kind, elements, element size."""
    return (kind << 56) | (t.element_size() << 48) | t.numel()


def _describe(what: int) -> str:
    return f"{_KIND.get(what >> 56, '?')} of {what & ((1 << 48) - 1)} x {(what >> 48) & 255} B"


class CollectiveMismatch(RuntimeError):
    """Ranks posted different collectives at the same place in the group's sequence."""


class ShmWork:
    """Handle of one shared-memory collective; `wait` as `torch.distributed.Work.wait`."""

    def __init__(self, channel: Channel, seq: int) -> None:
        self._channel, self._seq = channel, seq

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._channel.wait_for(self._seq, None if timeout is None else timeout.total_seconds())
        return True

    def is_completed(self) -> bool:
        return self._channel.completed >= self._seq


class Channel:
    """The shared-memory transport of one group on this rank: its own arena and header, every
    peer's mapped, the ops posted and not yet completed, and the thread that completes them."""

    def __init__(self, rank: int, world: int, fd: int, maps: list[mmap.mmap], cap: int) -> None:
        self.rank, self.world, self.cap, self._fd = rank, world, cap, fd
        self._maps = maps
        self._hdr = [memoryview(m)[:HEADER].cast("q") for m in maps]
        self._arena = [torch.frombuffer(m, dtype=torch.uint8, offset=HEADER, count=cap)
                       for m in maps]
        base = [torch.frombuffer(m, dtype=torch.uint8, count=64).data_ptr() for m in maps]
        self._events_addr = [b + 8 * _EVENTS for b in base]
        self._peers = [(rank + i) % world for i in range(1, world)]
        self._seq = itertools.count()
        self._live: collections.deque[tuple[int, int, int]] = collections.deque()  # seq, lo, hi
        self._reserved = 0  # bytes of the arena backed so far (fallocate)
        self._pending: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._cv = threading.Condition()
        self._publishing = threading.Lock()  # the caller's thread and the progress thread publish
        self._closed = False
        self.completed = -1
        self.bytes_in = 0  # bytes read out of peers' arenas: the ring formulas, exactly
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._progress, daemon=True,
                                        name=f"fusedzero-shm-{rank}")
        self._thread.start()

    # -- header words --------------------------------------------------------------------------
    def _publish(self, word: int, value: int) -> None:
        hdr = self._hdr[self.rank]
        with self._publishing:  # one event per change: a lost increment could lose a wake-up
            hdr[word] = value
            hdr[_EVENTS] = (hdr[_EVENTS] + 1) & 0x7FFFFFFF
        _futex(self._events_addr[self.rank], _FUTEX_WAKE, 0x7FFFFFFF)

    def _await(self, peer: int, ready: Callable[[], bool], what: str) -> None:
        """Sleep on `peer`'s event word until `ready()`; an error set meanwhile ends the wait."""
        hdr = self._hdr[peer]
        while True:
            ev = hdr[_EVENTS] & 0x7FFFFFFF
            if ready():
                return
            if self._error is not None:
                raise RuntimeError(f"shared-memory channel failed while waiting for {what}")
            _futex(self._events_addr[peer], _FUTEX_WAIT, ev, 0.05)

    def _await_done(self, seq: int, what: str) -> None:
        """Until every rank has completed op `seq`: each rank's own word wakes its own wait."""
        for r in range(self.world):
            self._await(r, lambda r=r: self._hdr[r][_DONE] >= seq, f"{what} (rank {r}, op {seq})")

    def min_done(self) -> int:
        return min(h[_DONE] for h in self._hdr)

    # -- posting (caller's thread) ---------------------------------------------------------------
    def _alloc(self, seq: int, nbytes: int) -> int:
        """Offset of a free region of `nbytes` in this rank's arena, waiting for peers to finish
        with old ones if needed. Regions are reused in the order they were taken."""
        need = -(-nbytes // _ALIGN) * _ALIGN
        while True:
            done = self.min_done()
            while self._live and self._live[0][0] <= done:
                self._live.popleft()
            lo = self._fit(need)
            if lo is not None:
                break
            self._await_done(self._live[0][0], "room in the shared-memory arena")
        if lo + need > self._reserved:
            try:
                os.posix_fallocate(self._fd, HEADER + self._reserved, lo + need - self._reserved)
            except OSError as e:
                raise RuntimeError(
                    f"rank {self.rank}: no memory for {lo + need} B of shared collective "
                    f"buffers ({e}); set FUSEDZERO_SHM_MB lower or "
                    "FUSEDZERO_GLOO_COLLECTIVES=direct") from e
            self._reserved = lo + need
        self._live.append((seq, lo, lo + need))
        return lo

    def _fit(self, need: int) -> int | None:
        """Where `need` bytes fit after the newest live region, else from 0 up to the oldest."""
        if not self._live:
            return 0 if need <= self.cap else None
        first, last = self._live[0][1], self._live[-1][2]
        if self._live[-1][1] >= first:  # not wrapped: live regions run from `first` to `last`
            if last + need <= self.cap:
                return last
            return 0 if need <= first else None
        return last if last + need <= first else None  # wrapped: room between newest and oldest

    def _post(self, kind: int, t: torch.Tensor, nbytes: int,
              fill: Callable[[torch.Tensor], None], complete: Callable[[int], None]) -> ShmWork:
        if self._error is not None:  # surfaced by the wait, which names what was waited for
            return ShmWork(self, -1)
        seq = next(self._seq)
        if seq >= N_SLOTS:  # the slot's previous op must be complete on every rank
            self._await_done(seq - N_SLOTS, "a free collective slot")
        lo = self._alloc(seq, nbytes)
        fill(self._arena[self.rank][lo:lo + nbytes])
        hdr = self._hdr[self.rank]
        s = _SLOT0 + _SLOT_WORDS * (seq % N_SLOTS)
        hdr[s + 1], hdr[s + 2] = _what(kind, t), lo
        self._publish(s, 4 * seq + 1)  # x86 stores are seen in order: data, then this state
        with self._cv:
            self._pending.append((seq, lambda: complete(seq)))
            self._cv.notify_all()
        return ShmWork(self, seq)

    # -- completing (progress thread) ------------------------------------------------------------
    def _peer_region(self, peer: int, seq: int, phase: int, what: int) -> torch.Tensor:
        """The arena of `peer`, from the region it published for op `seq` (after `phase`)."""
        s = _SLOT0 + _SLOT_WORDS * (seq % N_SLOTS)
        hdr = self._hdr[peer]
        self._await(peer, lambda: hdr[s] >= 4 * seq + phase,
                    f"rank {peer}'s part of collective #{seq}")
        if hdr[s + 1] != what:
            raise CollectiveMismatch(
                f"ranks issued different collectives: #{seq} is a {_describe(what)} on rank "
                f"{self.rank} but a {_describe(hdr[s + 1])} on rank {peer} (rank-dependent "
                "control flow, e.g. a module run on some ranks only)")
        return self._arena[peer][hdr[s + 2]:]

    def _progress(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._pending) or self._closed)
                if not self._pending:
                    return
                seq, run = self._pending[0]
            try:
                if self._error is None:
                    run()
            except BaseException as e:  # noqa: BLE001 - surfaced by every later wait
                self._error = e
            self._publish(_DONE, seq)
            with self._cv:
                self._pending.popleft()
                self.completed = seq
                self._cv.notify_all()

    def wait_for(self, seq: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.completed < seq:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError(f"rank {self.rank}: timed out waiting for shared-memory "
                                       f"collective #{seq}")
                self._cv.wait(left)
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error

    def close(self) -> None:
        """Stop the progress thread once it has completed what was posted (its group is gone)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            # Let it end before the caller goes on: a thread still unwinding while the process
            # exits makes the C++ runtime abort ("terminate called without an active exception").
            self._thread.join(timeout=1.0)

    def fits(self, nbytes: int) -> bool:
        """Whether an op whose region is `nbytes` can go through the arena at all."""
        return nbytes <= self.cap

    def resident_bytes(self) -> int:
        """Bytes of this rank's arena backed by memory (the most in flight so far)."""
        return self._reserved + HEADER

    # -- the collectives ---------------------------------------------------------------------
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> ShmWork:
        """Sum `inp` (W equal slices) over the group; slice `rank` of the sum into `out` (which
        may alias that slice of `inp`). Peers' slices leave in post; `inp`'s own slice is read
        at completion, so the caller keeps `inp` until the wait (as for any collective)."""
        S, es, W, r = out.numel(), inp.element_size(), self.world, self.rank
        if inp.numel() != W * S:
            raise ValueError(f"reduce-scatter of {inp.numel()} elements into {S} x {W} ranks")
        what = _what(RS, inp)
        flat = inp.view(W, S)

        def fill(region: torch.Tensor) -> None:  # peers' slices, in rank order without ours
            dst = region.view(inp.dtype).view(W - 1, S)
            if r > 0:
                dst[:r].copy_(flat[:r])
            if r < W - 1:
                dst[r:].copy_(flat[r + 1:])

        def complete(seq: int) -> None:
            self._sum_into(out, flat[r], seq, what, S, es, lambda p: (r if r < p else r - 1))
        return self._post(RS, inp, (W - 1) * S * es, fill, complete)

    def _sum_into(self, out: torch.Tensor, own: torch.Tensor, seq: int, what: int, S: int,
                  es: int, index_at: Callable[[int], int]) -> None:
        """out = own + each peer's slice for this rank (peers from rank + 1 on)."""
        acc = own
        for p in self._peers:
            i = index_at(p)
            theirs = self._peer_region(p, seq, 1, what)[i * S * es:(i + 1) * S * es]
            torch.add(acc, theirs.view(out.dtype), out=out)
            self.bytes_in += S * es
            acc = out

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> ShmWork:
        """Every rank's `inp` into its slice of `out`; `inp` may be this rank's slice."""
        S, es, r = inp.numel(), inp.element_size(), self.rank
        what = _what(AG, out)
        mine = out[r * S:(r + 1) * S]
        if mine.data_ptr() != inp.data_ptr():
            mine.copy_(inp)

        def complete(seq: int) -> None:
            for p in self._peers:
                out[p * S:(p + 1) * S].copy_(
                    self._peer_region(p, seq, 1, what)[:S * es].view(out.dtype))
                self.bytes_in += S * es
        return self._post(AG, out, S * es, lambda region: region.view(inp.dtype).copy_(inp),
                          complete)

    def all_reduce(self, t: torch.Tensor) -> ShmWork:
        """Sum `t` over the group in place: each rank reduces one piece, then all gather them."""
        n, es, W, r = t.numel(), t.element_size(), self.world, self.rank
        what = _what(AR, t)
        bounds = [q * n // W for q in range(W + 1)]
        flat = t.view(-1)

        def piece(q: int) -> slice:
            return slice(bounds[q], bounds[q + 1])

        def fill(region: torch.Tensor) -> None:  # the whole layout; our own piece comes later
            dst = region.view(t.dtype)
            for q in self._peers:
                dst[piece(q)].copy_(flat[piece(q)])

        def complete(seq: int) -> None:
            own = flat[piece(r)]
            for p in self._peers:
                theirs = self._peer_region(p, seq, 1, what).view(t.dtype)[piece(r)]
                own.add_(theirs)
                self.bytes_in += theirs.numel() * es
            lo = self._hdr[r][_SLOT0 + _SLOT_WORDS * (seq % N_SLOTS) + 2]
            self._arena[r][lo:lo + n * es].view(t.dtype)[piece(r)].copy_(own)
            self._publish(_SLOT0 + _SLOT_WORDS * (seq % N_SLOTS), 4 * seq + 2)
            for p in self._peers:
                flat[piece(p)].copy_(self._peer_region(p, seq, 2, what).view(t.dtype)[piece(p)])
                self.bytes_in += (bounds[p + 1] - bounds[p]) * es
        return self._post(AR, t, n * es, fill, complete)
