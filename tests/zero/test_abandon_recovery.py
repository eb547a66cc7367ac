"""Recovery after `abandon()`: a run that raised mid-forward abandons its optimizer (no
collective), then the same model gets a new ZeroAdamW, at the same stage or another, and a
checkpoint is loaded into it. The params are then exactly the checkpointed ones, and the next
step equals the step the run took from there. Stage 3 included, where this rank held only its
shard when it abandoned: see [Note: params after abandon] in fusedzero/_zero3.py. One rank in
the fast tier, two gloo ranks in the slow one. (The Lightning refit after a failed fit:
tests/integrations/test_lightning_strategy.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fusedzero import Sharding, ZeroAdamW, checkpoint
from fusedzero.testing import run_ranks

LR = 1e-2
# A step from the same checkpoint at another stage reduces the grads in another order (gloo's
# all-reduce vs reduce-scatter: ~1e-7 relative); Adam's 1/sqrt(v) can amplify that in elements
# with tiny grads to ~lr * 1e-6, so weights are held to 1e-3 of lr (tests/zero/test_zero.py's
# bound). The same stage repeats the step bit for bit.
ATOL = 1e-3 * LR


class Gain(nn.Module):
    """A param and no `reset_parameters` (the default meta-device init refuses such a module:
    recovery must not depend on the model's init)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class Net(nn.Module):
    """Three stage-3 units (the ModuleList children, the last a `Gain`) and a root-owned head;
    forward raises before block `fail_at` (None: never)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16), Gain(16)])
        self.head = nn.Linear(16, 5)
        self.fail_at: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            if i == self.fail_at:
                raise RuntimeError("boom")
            x = torch.tanh(b(x))
        return self.head(x)


def build(m: nn.Module, stage: int) -> ZeroAdamW:
    # Small buckets: params cross bucket and shard edges.
    return ZeroAdamW(
        m.parameters(), lr=LR, stage=stage, module=m, sharding=Sharding(bucket_numel=128)
    )


def train_step(m: Net, opt: ZeroAdamW, step: int, rank: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * rank + step))
    m(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full(m: nn.Module, opt: ZeroAdamW) -> dict[str, torch.Tensor]:
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in m.named_parameters()}


def recover(rank: int, stage: int, new_stage: int, root: str) -> dict[str, object]:
    """Train 2 steps, save, train a third, fail in the fourth's forward (stage 3: the root
    gathered, block 1's all-gather issued and never waited for), abandon, then a new optimizer
    at `new_stage` loads the checkpoint and repeats the third step."""
    torch.manual_seed(0)
    m = Net()
    opt = build(m, stage)
    for step in (0, 1):
        train_step(m, opt, step, rank)
    checkpoint.save(opt, root, step=2)
    saved = full(m, opt)
    train_step(m, opt, 2, rank)
    third = full(m, opt)
    m.fail_at = 1
    with pytest.raises(RuntimeError, match="boom"):
        train_step(m, opt, 3, rank)
    calls = dict(opt.comm.calls)
    opt.abandon()
    out: dict[str, object] = {
        "collectives in abandon": {k: n - calls.get(k, 0) for k, n in opt.comm.calls.items()},
        "shapes": {n: tuple(p.shape) for n, p in m.named_parameters()},
    }
    m.fail_at = None
    opt2 = build(m, new_stage)
    checkpoint.load(opt2, root)
    out["loaded"], out["saved"] = full(m, opt2), saved
    train_step(m, opt2, 2, rank)
    out["third"], out["want_third"] = full(m, opt2), third
    opt2.close()
    return out


def check(got: dict[str, object], same_stage: bool) -> None:
    assert set(got["collectives in abandon"].values()) <= {0}, got["collectives in abandon"]
    saved, loaded = got["saved"], got["loaded"]
    assert got["shapes"] == {n: tuple(t.shape) for n, t in saved.items()}, got["shapes"]
    for n, want in saved.items():
        assert torch.equal(loaded[n], want), (n, (loaded[n] - want).abs().max())
    for n, want in got["want_third"].items():
        have = got["third"][n]
        if same_stage:
            assert torch.equal(have, want), (n, (have - want).abs().max())
        else:
            torch.testing.assert_close(
                have, want, rtol=0, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}"
            )


@pytest.mark.parametrize("stage, new_stage", [(3, 3), (3, 1)])
def test_abandoned_model_takes_a_new_optimizer_and_a_checkpoint(
    stage: int, new_stage: int, tmp_path: Path
) -> None:
    """One rank: after abandon() at stage 3 the params have their full shapes again, so a new
    optimizer (stage 3 or 1) loads the checkpoint: exactly its params, and the step from it
    repeats the run's own."""
    check(recover(0, stage, new_stage, str(tmp_path)), same_stage=stage == new_stage)


CASES = [(3, 3), (3, 0), (2, 3), (1, 2)]


def recover_on_ranks(rank: int, world: int, root: str) -> dict[tuple[int, int], dict]:
    return {(a, b): recover(rank, a, b, f"{root}/{a}-{b}") for a, b in CASES}


@pytest.mark.slow  # spawns ranks
def test_abandoned_model_recovers_from_a_checkpoint_on_2_ranks(tmp_path: Path) -> None:
    """Two gloo ranks, stages 0-3 on either side: abandon() runs no collective, and a new
    optimizer over the model loads the checkpoint exactly, whatever stage each side runs."""
    for r, got in enumerate(run_ranks(recover_on_ranks, 2, str(tmp_path))):
        for (a, b), case in got.items():
            try:
                check(case, same_stage=a == b)
            except AssertionError as e:
                raise AssertionError(f"rank {r}, stage {a} -> {b}: {e}") from e
