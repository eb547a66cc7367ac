"""DDP-exact semantics: ZeroAdamW at every stage, world size and micro-batch count, with or
without `no_sync`, equals single-process `torch.optim.AdamW` on the same global batch.

One spawn per world size runs every case (process start-up dominates; W=4 on 2 cores is slow),
each case twice in the same process to show the result is deterministic, not just close.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

GLOBAL_BATCH = 12  # divides by W * micro for W in (1, 2, 4) and micro in (1, 3)
STEPS = 4
LR = 1e-3
# fp32 tolerance, as in test_zero.py: ranks average per-rank mean losses where the reference
# takes one mean over the global batch, so grads differ by summation order (~1e-7 relative);
# Adam's division by sqrt(v) amplifies that in near-zero-grad elements by at most lr times the
# relative noise per step: 1e-6 relative plus 1e-6 absolute (1e-3 of lr) bounds it.
RTOL, ATOL = 1e-6, 1e-6


class Mlp(nn.Module):
    """Params used in registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 19)
        self.b = nn.Linear(19, 11)
        self.c = nn.Linear(11, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Reordered(Mlp):
    """Registered a, b, c; used c-shaped input first: order of use differs from registration
    (so buckets complete in an order the launch order does not predict)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.c = nn.Linear(11, 3)
        self.a = nn.Linear(7, 19)
        self.b = nn.Linear(19, 11)


class WithUnused(Mlp):
    """One Linear is never called: its params get no grad in any step."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(5, 5)


MODELS = {"mlp": Mlp, "reordered": Reordered, "unused": WithUnused}


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def local(t: torch.Tensor, rank: int, world: int, micro: int, accum: int) -> torch.Tensor:
    n = t.shape[0] // (world * accum)
    i = rank * accum + micro
    return t[i * n:(i + 1) * n]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def reference(kind: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Single process, whole global batch at once. A param without a grad gets a zero grad:
    ZeroAdamW's documented rule (decoupled weight decay still applies to it)."""
    model = make(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(steps):
        loss_fn(model, *global_batch(step)).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank: int, world: int, case: dict) -> dict[str, torch.Tensor]:
    model = make(case["model"])
    opt = ZeroAdamW(model.parameters(), lr=LR, weight_decay=0.1, stage=case["stage"],
                    module=model, bucket_numel=case.get("bucket", 64),
                    unit_policy=nn.Linear)
    accum = case["accum"]
    for step in range(case.get("steps", STEPS)):
        x, y = global_batch(step)
        for m in range(accum):
            quiet = case["no_sync"] and m < accum - 1
            with opt.no_sync() if quiet else _null():
                (loss_fn(model, local(x, rank, world, m, accum),
                         local(y, rank, world, m, accum)) / accum).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return out


def _null():
    import contextlib
    return contextlib.nullcontext()


def parity_cases() -> list[dict]:
    cases = []
    for stage in (0, 1, 2, 3):
        cases.append({"model": "mlp", "stage": stage, "accum": 1, "no_sync": False})
        for no_sync in (True, False):
            cases.append({"model": "mlp", "stage": stage, "accum": 3, "no_sync": no_sync})
        for kind in ("reordered", "unused"):
            cases.append({"model": kind, "stage": stage, "accum": 3, "no_sync": False})
    return cases


def run_parity(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Worker: every case twice (determinism within a run), plus the extra per-W checks."""
    return [{"first": train(rank, world, c), "second": train(rank, world, c)} for c in cases]


@functools.cache
def parity_results(world: int) -> list[list[dict]]:
    return run_ranks(run_parity, world, parity_cases())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_with_torch_adamw_every_stage_micro_batch_and_no_sync(world: int) -> None:
    refs = {kind: reference(kind) for kind in MODELS}
    outs = parity_results(world)
    for i, case in enumerate(parity_cases()):
        ref = refs[case["model"]]
        for r, o in enumerate(outs):
            got, again = o[i]["first"], o[i]["second"]
            for n, want in ref.items():
                where = f"{case} rank {r}/{world} param {n}"
                assert torch.equal(got[n], again[n]), f"not deterministic: {where}"
                assert torch.equal(got[n], outs[0][i]["first"][n]), f"replicas differ: {where}"
                d = (got[n] - want).abs()
                assert torch.allclose(got[n], want, rtol=RTOL, atol=ATOL), \
                    f"{where}: max abs diff {d.max():.3g} (max rel {(d / want.abs()).max():.3g})"
