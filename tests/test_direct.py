"""Direct reduce-scatter and all-gather on gloo (fusedzero/direct.py, [Note: gloo has no
reduce-scatter]): values against a float64 reference built from every rank's input, the bytes
each rank sends (exactly the ring formula, where torch's gloo emulation sends an all-reduce's),
no gloo collective used, and isolation from the user's own sends on the same group."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from fusedzero import comm
from fusedzero.comm import CollectiveKind, CommCounter
from fusedzero.direct import DirectWork
from fusedzero.testing import run_ranks

# The default on one host is the shared-memory transport (tests/test_shm.py): ask for these.
DIRECT = {"FUSEDZERO_GLOO_COLLECTIVES": "direct"}
# Per-rank slice lengths: 1 element, a prime, and one past a power of two.
SLICES = (1, 1009, 4097)


def rank_input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + n)
    return torch.randn(n, generator=g).to(dtype)


class SendCounter:
    """Counts the bytes handed to dist.isend; any collective call fails the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        real = dist.isend

        def isend(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return real(tensor, *args, **kwargs)

        def refuse(*args, **kwargs):
            raise AssertionError("a gloo collective ran where direct sends were expected")

        monkeypatch.setattr(dist, "isend", isend)
        for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
                     "reduce_scatter_single", "all_gather_single"):
            if hasattr(dist, name):
                monkeypatch.setattr(dist, name, refuse)
        monkeypatch.setattr(comm, "_reduce_scatter", refuse)
        monkeypatch.setattr(comm, "_all_gather", refuse)


@contextlib.contextmanager
def counting_sends() -> Iterator[SendCounter]:
    """Inside a spawned rank (no pytest fixture there): a SendCounter, undone on exit."""
    mp = pytest.MonkeyPatch()
    try:
        yield SendCounter(mp)
    finally:
        mp.undo()


def _rs_worker(rank: int, world: int, dtype: torch.dtype) -> dict:
    counter = CommCounter()
    out = {}
    with counting_sends() as sent:
        for S in SLICES:
            n = S * world
            inp = rank_input(rank, n, dtype)
            ref = sum(rank_input(r, n, dtype).double() for r in range(world))
            mag = sum(rank_input(r, n, dtype).double().abs() for r in range(world))
            before = sent.bytes
            # In place (stage 1: the slice aliases the input) and into another tensor.
            aliased = inp.clone()
            h1 = comm.reduce_scatter(aliased[rank * S:(rank + 1) * S], aliased, None, world,
                                     counter)
            dst = torch.full((S,), float("nan"), dtype=dtype)
            h2 = comm.reduce_scatter(dst, inp, None, world, counter)
            assert isinstance(h1, DirectWork) and isinstance(h2, DirectWork)
            comm.wait(h2, "rs into dst")
            comm.wait(h1, "rs in place")
            out[S] = {"in_place": aliased[rank * S:(rank + 1) * S].clone(), "dst": dst,
                      "ref": ref[rank * S:(rank + 1) * S],
                      "mag": mag[rank * S:(rank + 1) * S], "sent": sent.bytes - before,
                      "untouched": torch.equal(aliased[:rank * S], inp[:rank * S])}
    out["counted"] = counter.bytes[CollectiveKind.REDUCE_SCATTER.value]
    return out


DTYPES = (torch.float32, torch.bfloat16)


def _worker(rank: int, world: int) -> dict:
    return {(kind, dt): fn(rank, world, dt) for dt in DTYPES
            for kind, fn in (("rs", _rs_worker), ("ag", _ag_worker))}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"W{w}")
def collectives(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    """Both collectives in both dtypes on W ranks: one spawn per world size."""
    return request.param, run_ranks(_worker, request.param, timeout=180, env=DIRECT)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_direct(collectives: tuple[int, list[dict]], dtype: torch.dtype) -> None:
    world, all_ranks = collectives
    ranks = [r[("rs", dtype)] for r in all_ranks]
    counted = 0
    for rank, res in enumerate(ranks):
        for S in SLICES:
            r = res[S]
            # A sum of W terms in W-1 roundings (fp32 or bf16): each rounding errs by at most
            # half an ulp of a partial sum, bounded by the sum of magnitudes; W = 2 is a single
            # correctly rounded add, equal to the float64 sum rounded to the dtype.
            eps = torch.finfo(dtype).eps
            for got in (r["in_place"], r["dst"]):
                err = (got.double() - r["ref"]).abs()
                bound = (world - 1) * eps * r["mag"]
                assert bool((err <= bound).all()), (rank, S, (err - bound).max().item())
                if world == 2:
                    assert torch.equal(got, r["ref"].to(dtype)), (rank, S)
            assert torch.equal(r["in_place"], r["dst"]), (rank, S)
            assert r["untouched"], "other ranks' slices of the input must stay as they were"
            # Two reduce-scatters of n = W*S elements: each sends (W-1)/W * n elements.
            esize = torch.tensor([], dtype=dtype).element_size()
            assert r["sent"] == 2 * (world - 1) * S * esize, (rank, S, r["sent"])
            counted += 2 * (world - 1) * S * esize
        # ... which is what the counter reports (the formula), now also what is on the wire.
        assert res["counted"] == counted
        counted = 0


def _ag_worker(rank: int, world: int, dtype: torch.dtype) -> dict:
    counter = CommCounter()
    out = {}
    with counting_sends() as sent:
        for S in SLICES:
            full = torch.full((S * world,), float("nan"), dtype=dtype)
            mine = rank_input(rank, S, dtype)
            full[rank * S:(rank + 1) * S] = mine
            before = sent.bytes
            h1 = comm.all_gather(full, full[rank * S:(rank + 1) * S], None, world, counter)
            other = torch.full((S * world,), float("nan"), dtype=dtype)
            h2 = comm.all_gather(other, mine, None, world, counter)
            comm.wait(h1, "ag in place")
            comm.wait(h2, "ag")
            out[S] = {"in_place": full, "other": other, "sent": sent.bytes - before}
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_direct(collectives: tuple[int, list[dict]], dtype: torch.dtype) -> None:
    world, all_ranks = collectives
    ranks = [r[("ag", dtype)] for r in all_ranks]
    for rank, res in enumerate(ranks):
        for S in SLICES:
            want = torch.cat([rank_input(r, S, dtype) for r in range(world)])
            assert torch.equal(res[S]["in_place"], want), (rank, S)
            assert torch.equal(res[S]["other"], want), (rank, S)
            esize = torch.tensor([], dtype=dtype).element_size()
            assert res[S]["sent"] == 2 * (world - 1) * S * esize, (rank, S)


def _user_p2p_worker(rank: int, world: int) -> dict:
    """The user's own tag-0 exchange, posted around ours, gets the user's data."""
    peer = 1 - rank
    mine = torch.full((64,), float(rank + 1))
    theirs = torch.empty(64)
    user_recv = dist.irecv(theirs, src=peer)
    inp = rank_input(rank, 2 * 64, torch.float32)
    h = comm.reduce_scatter(inp[rank * 64:(rank + 1) * 64], inp, None, world, CommCounter())
    user_send = dist.isend(mine, dst=peer)
    comm.wait(h, "rs")
    user_recv.wait()
    user_send.wait()
    ref = sum(rank_input(r, 128, torch.float32) for r in range(world))[rank * 64:(rank + 1) * 64]
    return {"theirs": theirs, "rs_ok": torch.equal(inp[rank * 64:(rank + 1) * 64], ref)}


def test_user_sends_on_the_same_group_do_not_mix_with_direct_collectives() -> None:
    ranks = run_ranks(_user_p2p_worker, 2, timeout=120, env=DIRECT)
    for rank, res in enumerate(ranks):
        assert torch.equal(res["theirs"], torch.full((64,), float(2 - rank)))
        assert res["rs_ok"]


def _torch_gloo_worker(rank: int, world: int) -> bool:
    """FUSEDZERO_GLOO_COLLECTIVES=torch: torch's own gloo collectives (a dist.Work)."""
    inp = rank_input(rank, 8, torch.float32)
    h = comm.reduce_scatter(inp[rank * 4:(rank + 1) * 4], inp, None, world, CommCounter())
    comm.wait(h, "rs")
    return isinstance(h, dist.Work) and not isinstance(h, DirectWork)


def test_torch_gloo_collectives_on_request() -> None:
    assert all(run_ranks(_torch_gloo_worker, 2, timeout=120,
                         env={"FUSEDZERO_GLOO_COLLECTIVES": "torch"}))


def _dropped_worker(rank: int, world: int) -> bool:
    """A direct all-gather dropped without its wait (an optimizer discarded with its params'
    gather in flight) must not stall the next collective between the same ranks."""
    import gc
    S = 1 << 16
    full = torch.zeros(S * world)
    h = comm.all_gather(full, torch.randn(S), None, world, CommCounter())
    del h
    gc.collect()
    t = torch.ones(1)
    comm.wait(dist.all_reduce(t, async_op=True), "all-reduce after a dropped all-gather")
    return float(t) == world


def test_a_dropped_direct_collective_does_not_stall_the_next() -> None:
    assert all(run_ranks(_dropped_worker, 2, timeout=120, pg_timeout=20, env=DIRECT))
