"""HSDP (shard over 2 ranks, replicate over 2) on 4 gloo ranks: each bucket's replica all-reduce
starts as soon as its shard reduction is complete, inside backward, not in `step()`; with an
unused branch (the ranks agree which bucket waits), or a branch only the first shard group uses
(the replicas must still agree, their all-reduces following the launch order), two
micro-batches with and without `no_sync`; results equal single-process torch.optim.AdamW on the
global batch.

The trace records "replica_reduce" when a bucket's replica all-reduce is issued and
"backward_end" when backward's callback is done: every replica all-reduce of a step is issued
before its last backward ends (none is left for `step()` but the ones `no_sync` deferred).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from fusedzero import Groups, Sharding, ZeroAdamW
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns 4 ranks

RTOL, ATOL = 1e-6, 1e-6  # fp32; see tests/zero/test_parity.py for the derivation
GLOBAL, STEPS, ACCUM = 8, 3, 2


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use:  # the "unused" branch, taken by some ranks only
            h = h + self.unused(h)
        return self.c(torch.tanh(self.b(h)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL, 16, generator=g), torch.randn(GLOBAL, 4, generator=g)


def uses(rank: int, cond: bool) -> bool:
    return cond and rank // 2 == 0  # the first shard group's ranks (0, 1)


def reference(cond: bool) -> dict[str, torch.Tensor]:
    """The global batch at once: the mean of every rank's micro-batch losses (equal sizes)."""
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    n = GLOBAL // (4 * ACCUM)
    for step in range(STEPS):
        x, y = batch(step)
        losses = [
            nn.functional.mse_loss(
                model(x[i * n : (i + 1) * n], uses(i // ACCUM, cond)), y[i * n : (i + 1) * n]
            )
            for i in range(4 * ACCUM)
        ]
        (sum(losses) / len(losses)).backward()
        for p in model.parameters():  # no grad is a zero grad (ZeroAdamW's documented rule)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank: int, world: int, stage: int, quiet: bool, cond: bool) -> dict:
    import torch.distributed as dist

    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    rep = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    torch.manual_seed(0)
    model = Branchy()
    opt = ZeroAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        stage=stage,
        module=model,
        trace=True,
        groups=Groups(shard=shard, replicate=rep),
        sharding=Sharding(bucket_numel=256, units=nn.Linear),
    )
    n = GLOBAL // (world * ACCUM)
    events = []
    for step in range(STEPS):
        x, y = batch(step)
        for m in range(ACCUM):
            lo = (rank * ACCUM + m) * n
            with opt.no_sync() if quiet and m < ACCUM - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(
                    model(x[lo : lo + n], uses(rank, cond)), y[lo : lo + n]
                )
                (loss / ACCUM).backward()
        assert opt.trace is not None
        events.append([e for e, _ in opt.trace if e in ("replica_reduce", "backward_end")])
        opt.trace.clear()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt.close()
    return {"params": params, "events": events}


CASES = [(s, q, False) for s in (1, 2, 3) for q in (False, True)] + [
    (2, False, True),
    (3, True, True),
]


def train_all(rank: int, world: int) -> dict:
    return {case: train(rank, world, *case) for case in CASES}


def test_hsdp_replica_reduce_in_backward_on_4_ranks() -> None:
    refs = {cond: reference(cond) for cond in (False, True)}
    outs = run_ranks(train_all, 4, timeout=900)
    for r, out in enumerate(outs):
        for (stage, quiet, cond), o in out.items():
            where = f"stage {stage} no_sync={quiet} branch on group 0 only={cond} rank {r}"
            for k, v in refs[cond].items():
                torch.testing.assert_close(
                    o["params"][k], v, rtol=RTOL, atol=ATOL, msg=f"{where}: {k}"
                )
            for events in o["events"]:
                assert "replica_reduce" in events, where
                # Every replica all-reduce was issued before the last backward ended.
                last = len(events) - 1 - events[::-1].index("backward_end")
                assert "replica_reduce" not in events[last:], (where, events)
                if stage > 1 and quiet:
                    # stages 2-3 still reduce the shard inside no_sync, but not over replicas.
                    first = events.index("backward_end")
                    assert "replica_reduce" not in events[:first], (where, events)
