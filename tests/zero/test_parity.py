"""DDP-exact semantics: ZeroAdamW at every stage, world size and micro-batch count, with or
without `no_sync`, equals single-process `torch.optim.AdamW` on the same global batch.

One spawn per world size runs every case (process start-up dominates; W=4 on 2 cores is slow);
the accumulation cases run twice in that process to show the result is deterministic, not just
close. Checks of the semantics contract (docs/design.md) ride in the same spawns.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedzero import Precision, Sharding, ZeroAdamW
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks or the CLI

GLOBAL_BATCH = 12  # divides by W * micro for W in (1, 2, 4) and micro in (1, 3)
STEPS = 3
LR = 1e-3
CLIP = 0.05  # below the grad norm of these models, so clipping acts
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
    """Registered c, a, b; used a, b, c: grads arrive in an order the registration order (from
    which the bucket launch order is derived) does not predict."""

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
    return t[i * n : (i + 1) * n]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def reference(kind: str, clip: float | None = None) -> dict[str, torch.Tensor]:
    """Single process, whole global batch at once. A param without a grad gets a zero grad:
    ZeroAdamW's documented rule (decoupled weight decay still applies to it)."""
    model = make(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        loss_fn(model, *global_batch(step)).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank: int, world: int, case: dict) -> dict:
    """One case on this rank: its params after STEPS steps, the reductions still in flight when
    each backward returned, or the error it raised."""
    model = make(case["model"], seed=rank if case.get("seed_rank") else 0)
    if case.get("reentrant"):  # the last layer first: its grads come from the nested backward
        for m in (model.c, model.b):
            m.forward = functools.partial(checkpoint, m.forward, use_reentrant=True)
    opt = ZeroAdamW(
        model.parameters(),
        lr=LR,
        weight_decay=0.1,
        stage=case["stage"],
        module=model,
        trace=True,
        sharding=Sharding(bucket_numel=256, units=nn.Linear),
    )
    accum = case["accum"]
    try:
        for step in range(STEPS):
            x, y = global_batch(step)
            for m in range(accum):
                quiet = case["no_sync"] and m < accum - 1
                with opt.no_sync() if quiet else contextlib.nullcontext():
                    (
                        loss_fn(
                            model, local(x, rank, world, m, accum), local(y, rank, world, m, accum)
                        )
                        / accum
                    ).backward()
            if case.get("user_clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), case["user_clip"])
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        opt.close()
        return {"error": str(e)}
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return {"params": params, "in_flight": [v for k, v in opt.trace if k == "backward_end"]}


def parity_cases() -> list[dict]:
    """The matrix: stages x {1 micro-batch; 3 with no_sync; 3 without} for the plain model, and
    3 micro-batches without no_sync (the path with the most reductions) for the model used out
    of registration order and the one with an unused param."""
    cases = []
    for stage in (0, 1, 2, 3):
        cases.append({"model": "mlp", "stage": stage, "accum": 1, "no_sync": False})
        for no_sync in (True, False):
            cases.append(
                {"model": "mlp", "stage": stage, "accum": 3, "no_sync": no_sync, "twice": True}
            )
        for kind in ("reordered", "unused"):
            cases.append({"model": kind, "stage": stage, "accum": 3, "no_sync": False})
    return cases


def extra_cases(world: int) -> list[dict]:
    """Per-item cases that ride along in the same spawn."""
    one = {"model": "mlp", "accum": 1, "no_sync": False}
    if world == 2:
        return [
            {**one, "stage": s, "item": item, **kw}
            for s in (0, 1, 2, 3)
            for item, kw in (
                ("seed_rank", {"seed_rank": True}),
                ("reentrant", {"reentrant": True}),
                ("user_clip", {"user_clip": CLIP}),
            )
        ]
    return [{"stage": s, "item": "fp16"} for s in (0, 1, 2, 3)]


# Item 7: per-rank grads near fp16's max (65504): each rank's fits, the sum of 4 does not.
FP16_GRAD = 3.0e4


def fp16_grads(world: int) -> list[torch.Tensor]:
    sign = torch.randn(300, generator=torch.Generator().manual_seed(7)).sign()
    return [FP16_GRAD * (1 + 0.1 * r) * sign for r in range(world)]


class Linear1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 300))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()  # d loss / d w = c


def train_fp16(rank: int, world: int, case: dict) -> dict:
    model = Linear1()
    opt = ZeroAdamW(
        model.parameters(),
        lr=LR,
        stage=case["stage"],
        module=model,
        precision=Precision(reduce_dtype=torch.float16),
        sharding=Sharding(units=nn.Linear),
    )
    for _ in range(2):
        model(fp16_grads(world)[rank]).backward()
        opt.step()
    with opt.gathered_params():
        w = model.w.detach().clone()
    opt.close()
    return {"w": w, "skipped": opt.skipped.item()}


def case_key(case: dict) -> str:
    """A case's name in the results: its settings, e.g. "accum=3,model=mlp,no_sync=True,..."."""
    return ",".join(f"{k}={case[k]}" for k in sorted(case))


def run_cases(rank: int, world: int, cases: list[dict]) -> dict[str, dict]:
    """Worker: every case, by `case_key`; the `twice` ones again from scratch (determinism
    within a run)."""
    out = {}
    for c in cases:
        if c.get("item") == "fp16":
            out[case_key(c)] = train_fp16(rank, world, c)
            continue
        r = train(rank, world, c)
        if c.get("twice"):
            r["again"] = train(rank, world, c)["params"]
        out[case_key(c)] = r
    return out


@functools.cache
def results(world: int) -> list[dict[str, dict]]:
    """Per rank, per case of parity_cases() + extra_cases(world): one spawn per world size."""
    return run_ranks(run_cases, world, parity_cases() + extra_cases(world))


@functools.cache
def reference_params(kind: str, clip: float | None = None) -> dict[str, torch.Tensor]:
    return reference(kind, clip=clip)


def assert_matches(got: dict, want: dict, where: str) -> None:
    for n, w in want.items():
        d = (got[n] - w).abs()
        assert torch.allclose(got[n], w, rtol=RTOL, atol=ATOL), (
            f"{where} param {n}: max abs diff {d.max():.3g} (max rel {(d / w.abs()).max():.3g})"
        )


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_with_torch_adamw_every_stage_micro_batch_and_no_sync(world: int) -> None:
    outs = results(world)
    for case in parity_cases():
        key = case_key(case)
        ref = reference_params(case["model"])
        for r, o in enumerate(outs):
            where = f"{case} rank {r}/{world}"
            got = o[key]["params"]
            assert_matches(got, ref, where)
            for n in ref:
                assert torch.equal(got[n], outs[0][key]["params"][n]), f"replicas differ: {where}"
                if case.get("twice"):
                    assert torch.equal(got[n], o[key]["again"][n]), f"not deterministic: {where}"


@pytest.mark.parametrize("world", [2, 4])
def test_reductions_complete_when_backward_returns(world: int) -> None:
    """Nothing in flight when backward() returns, at every stage, with and
    without no_sync (so reading a grad, or the next micro-batch, never races a collective)."""
    for case in parity_cases():
        for o in results(world):
            got = o[case_key(case)]["in_flight"]
            assert got and set(got) == {0}, (case, got)


def _extra(world: int, item: str) -> list[tuple[dict, list[dict]]]:
    return [
        (c, [o[case_key(c)] for o in results(world)])
        for c in extra_cases(world)
        if c["item"] == item
    ]


def test_replicas_start_from_rank0_params_at_every_stage() -> None:
    """Ranks built with `seed + rank` train exactly like rank 0's init."""
    for case, per_rank in _extra(2, "seed_rank"):
        for r, o in enumerate(per_rank):
            assert_matches(o["params"], reference_params("mlp"), f"{case} rank {r}")


def test_reentrant_activation_checkpointing_at_every_stage() -> None:
    """The end-of-backward callback is queued on the outer graph task even
    when the first grads come from a reentrant checkpoint's nested backward."""
    for case, per_rank in _extra(2, "reentrant"):
        for r, o in enumerate(per_rank):
            assert "error" not in o, o.get("error")
            assert_matches(o["params"], reference_params("mlp"), f"{case} rank {r}")


def test_user_clip_grad_norm_is_exact_at_stage_0_and_refused_elsewhere() -> None:
    """Stage 0 `.grad` holds the rank-averaged grad, so torch's own
    clip_grad_norm_ sees the global norm and clips like the single-process reference; at stages
    1-3 `.grad` is not the full reduced grad and any use of it raises, naming max_grad_norm."""
    for case, per_rank in _extra(2, "user_clip"):
        for r, o in enumerate(per_rank):
            if case["stage"] == 0:
                assert_matches(o["params"], reference_params("mlp", CLIP), f"{case} rank {r}")
            else:
                assert "max_grad_norm" in o.get("error", ""), (case, o)


def test_fp16_reduction_pre_divides_so_grads_near_fp16_max_do_not_overflow() -> None:
    """At W=4 the fp16 sum of the ranks' grads would overflow (4 x 3e4 >
    65504); pre-divided (as DDP and FSDP2), the average (3.45e4) fits. The reference gets the
    exact fp32 average. Adam's first steps with a constant grad move by lr * sign(g), so the
    fp16 rounding of g (5e-4 relative) does not show: fp32 tolerance holds."""
    model = Linear1()
    ref = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(2):
        model.w.grad = torch.stack(fp16_grads(4)).mean(0)
        ref.step()
    for case, per_rank in _extra(4, "fp16"):
        for r, o in enumerate(per_rank):
            assert o["skipped"] == 0.0, (case, r)
            torch.testing.assert_close(
                o["w"], model.w.detach(), rtol=RTOL, atol=ATOL, msg=f"{case} rank {r}"
            )
