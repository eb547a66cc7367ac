"""Stage 3 when ranks run different units: a mixture-of-experts layer whose experts are units,
each rank routing its own tokens (differently per rank and per step), gives the params of
single-process AdamW on the global batch (DDP with find_unused_parameters=True: a param with no
grad on a rank counts as a zero grad), on 2 and 4 gloo ranks, with a short process-group timeout
so a mismatch of collectives fails in seconds instead of hanging. The collectives this costs are
counted: every unit gathered once in forward and once in backward (the root once), whatever the
routing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedzero import Sharding, ZeroAdamW
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks

D = 8
N_EXPERTS = 4
TOKENS = 24  # global tokens per step: divides by W = 2 and 4
STEPS = 3
LR = 1e-3
# fp32, as tests/zero/test_parity.py: ranks average per-rank mean losses where the reference
# takes one mean over the global batch, so grads differ by summation order (~1e-7 relative);
# Adam's division by sqrt(v) amplifies that by at most lr times the relative noise per step.
# A unit paired with another unit's all-gather moves params by ~lr per step (1e-3), far above.
RTOL, ATOL = 1e-6, 1e-6
PG_TIMEOUT = 20.0  # seconds: a mismatched collective ends the run, never hangs it


class Moe(nn.Module):
    """Root-owned input layer, router and head; four expert units (an nn.ModuleList) and a dense
    block unit after them (none with `dense=False`: the experts are the only units). A token
    routed to -1 is dropped (capacity overflow); an expert with no token is skipped, or, with
    `call_empty`, called on an empty batch."""

    def __init__(
        self, call_empty: bool = False, dense: bool = True, ckpt: str = "", experts: int = N_EXPERTS
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.router = nn.Linear(D, experts)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))
        self.dense = nn.ModuleList([nn.Linear(D, D)] if dense else [])
        self.head = nn.Linear(D, 3)
        self.call_empty = call_empty
        self.ckpt = ckpt  # "reentrant", "plain": each expert call activation-checkpointed

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        gate = torch.softmax(self.router(h), dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(1)
            if idx.numel() == 0 and not self.call_empty:
                continue
            if self.ckpt:
                y = checkpoint(expert, h[idx], use_reentrant=self.ckpt == "reentrant")
            else:
                y = expert(h[idx])
            out = out.index_add(0, idx, y * gate[idx, e : e + 1])
        h = h + out
        for block in self.dense:
            h = torch.tanh(block(h))
        return self.head(h)


def routes(case: str, step: int, world: int) -> list[torch.Tensor]:
    """Each rank's per-token expert (-1: dropped) at `step` ("case+ckpt": as case)."""
    case = case.partition("+")[0]
    n = TOKENS // world
    g = torch.Generator().manual_seed(1000 * step + 7)
    out = []
    for r in range(world):
        if case == "single":  # each rank all its tokens to one expert, another per rank and step
            t = torch.full((n,), (r + step) % N_EXPERTS)
        elif case == "pair":  # two experts, the only units: rank r all its tokens to expert r % 2
            t = torch.full((n,), r % 2)
        elif case == "nested":  # rank 0 {0, 1}, rank 1 {0, 1, 2}, ...: a prefix, shifted per step
            k = min(r + 2, N_EXPERTS)
            t = (torch.arange(n) % k + step) % N_EXPERTS
        elif case == "dropped":  # expert 3 used by no rank; some tokens dropped
            t = torch.randint(-1, 3, (n,), generator=g)
        elif case == "capacity":  # random routing, at most 2 tokens per expert per rank
            t = torch.randint(0, N_EXPERTS, (n,), generator=g)
            for e in range(N_EXPERTS):
                t[(t == e).nonzero().squeeze(1)[2:]] = -1
        elif case == "empty_call":  # expert (step % 4) called on an empty batch on rank 0
            t = torch.randint(0, N_EXPERTS, (n,), generator=g)
            if r == 0:
                t[t == step % N_EXPERTS] = -1
        else:
            raise ValueError(case)
        out.append(t)
    return out


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(TOKENS, D, generator=g), torch.randn(TOKENS, 3, generator=g)


def make(case: str) -> Moe:
    torch.manual_seed(0)
    base, _, ckpt = case.partition("+")
    pair = base == "pair"
    return Moe(call_empty=base == "empty_call", dense=not pair, ckpt=ckpt, experts=2 if pair else 4)


def reference(case: str, world: int, accum: int = 1) -> dict[str, torch.Tensor]:
    """Single process, each global micro-batch at once (their losses averaged over a step); a
    param without a grad gets a zero grad."""
    model = make(case)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        for k in range(step * accum, (step + 1) * accum):
            x, y = batch(k)
            out = model(x, torch.cat(routes(case, k, world)))
            ((out - y).square().mean() / accum).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank: int, world: int, case: str, reshard: bool, accum: int = 1) -> dict:
    """STEPS steps of `accum` micro-batches (all but the last in no_sync), an eval forward
    routed another way before each update: the params, and each micro-batch's collectives
    beside the formula's."""
    model = make(case)
    opt = ZeroAdamW(
        model.parameters(),
        lr=LR,
        weight_decay=0.1,
        stage=3,
        module=model,
        sharding=Sharding(reshard_after_forward=reshard),
    )
    n = TOKENS // world
    comm = []
    for step in range(STEPS):
        for k in range(step * accum, (step + 1) * accum):
            x, y = batch(k)
            xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
            before = opt.comm.snapshot()
            with opt.no_sync() if k < (step + 1) * accum - 1 else contextlib.nullcontext():
                out = model(xs, routes(case, k, world)[rank])
                ((out - ys).square().mean() / accum).backward()
            after = opt.comm.snapshot()
            comm.append(
                {
                    kind: {key: after[key][kind] - before[key][kind] for key in after}
                    for kind in ("all_gather", "reduce_scatter")
                }
            )
        with torch.no_grad():  # an eval forward, routed differently, with no backward
            model(xs, routes("single", step + 1, world)[rank] % len(model.experts))
        opt.step()
        opt.zero_grad()
    z = opt.zero3
    assert z is not None
    # The formula: the root once (kept gathered into backward), each other unit once in forward
    # and once in backward (with reshard_after_forward=False every unit once); per unit, one
    # all-gather per bucket of its buffers. Every bucket of every unit reduce-scattered once.
    calls = [sum(b.layout.num_buckets for b in unit.buffers) for unit in z.units]
    elems = [unit.numel for unit in z.units]
    twice = 2 if reshard else 1
    expect = {
        "all_gather": (calls[0] + twice * sum(calls[1:]), elems[0] + twice * sum(elems[1:])),
        "reduce_scatter": (sum(calls), sum(elems)),
    }
    with opt.gathered_params():
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt.close()
    return {"params": params, "comm": comm, "expect": expect}


CASES = ["pair", "single", "nested", "dropped", "capacity", "empty_call"]


@pytest.mark.parametrize("world", [2, 4])
def test_routing_differs_per_rank(world: int) -> None:
    """Every routing case, reshard_after_forward=True (and False for "single" and "nested"; two
    micro-batches per step for "capacity"; each expert call activation-checkpointed, reentrant
    or not), gives the reference's params, and each micro-batch's all-gathers and
    reduce-scatters are the formula's, on every rank."""
    runs = [(c, True, 1) for c in CASES] + [
        ("single", False, 1),
        ("nested", False, 1),
        ("capacity", True, 2),
        ("nested+reentrant", True, 1),
        ("capacity+plain", True, 1),
    ]
    for case, reshard, accum in runs:
        want = reference(case, world, accum)
        outs = run_ranks(train, world, case, reshard, accum, pg_timeout=PG_TIMEOUT, timeout=300)
        for r, out in enumerate(outs):
            where = (case, reshard, accum, r)
            for name, p in want.items():
                torch.testing.assert_close(
                    out["params"][name],
                    p,
                    rtol=RTOL,
                    atol=ATOL,
                    msg=lambda m, c=(*where, name): f"{c}: {m}",
                )
            for k, got in enumerate(out["comm"]):
                for kind, (calls, numel) in out["expect"].items():
                    assert got[kind]["calls"] == calls, (where, k, kind, got)
                    assert got[kind]["numel"] == numel, (where, k, kind, got)
                    assert got[kind]["bytes"] == numel * 4 * (world - 1) // world, (where, k)
