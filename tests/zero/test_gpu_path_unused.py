"""A param with no grad this step (an unused branch) holds back no other bucket: the buckets that
are complete are reduced during backward, the one holding the unused param at its end (stage
3, where the unused param's unit is one no forward ran: at that unit's place in the unit order,
with zero grads); the results equal single-process torch.optim.AdamW.

One rank here (the schedule is the same code at every world size; the ranks' agreement on which
buckets wait, one all-reduce, is exercised at 4 ranks in test_gpu_path_hsdp.py). The trace
records "reduce" when a bucket's reduction is issued and "flush" when backward has ended and
what is left is issued.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedzero import Sharding, ZeroAdamW

RTOL, ATOL = 1e-6, 1e-6


class Branchy(nn.Module):
    """`unused` is registered last, so its bucket comes first in the launch order (buckets go
    in reverse order of their params' registration: about the order backward produces grads)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_param_holds_back_no_other_bucket(stage: int) -> None:
    torch.manual_seed(0)
    ref_model = Branchy()
    torch.manual_seed(0)
    model = Branchy()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    # 256 elements: each weight (and the biases) in buckets of their own.
    opt = ZeroAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        stage=stage,
        module=model,
        trace=True,
        sharding=Sharding(bucket_numel=256, units=nn.Linear),
    )
    deferred: set[tuple[int, int, int]] = set()  # (unit, group, bucket), agreed at the first
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for m, o in ((model, opt), (ref_model, ref_opt)):
            nn.functional.mse_loss(m(x), y).backward()
            for p in ref_model.parameters():  # ZeroAdamW's documented rule: no grad is a zero
                if p.grad is None:  # grad (decoupled weight decay still applies)
                    p.grad = torch.zeros_like(p)
            o.step()
            o.zero_grad()
        assert opt.trace is not None
        events = [e for e, _ in opt.trace if e in ("reduce", "flush")]
        if stage == 3:
            # A unit no forward ran gets its zero grads at its place in the unit order (see
            # [Note: one gather order on every rank] in fusedzero/_zero3.py): nothing waits.
            assert ("backward_skip", 4) in opt.trace
            assert events[events.index("flush") + 1 :] == [], events
        elif step > 0:
            # After the first backward: only the unused param's buckets wait for the end.
            late = events[events.index("flush") + 1 :]
            assert deferred and len(late) == len(deferred), (events, deferred)
            assert events.count("reduce") > len(late)
        deferred |= {d for e, d in opt.trace if e == "deferred"}
        opt.trace.clear()
    with opt.gathered_params():
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=n)
    opt.close()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.spare = nn.Linear(16, 16)  # registered, never called: no grad in any backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class WithSpares(nn.Module):
    def __init__(self, checkpointing: str = "none") -> None:
        super().__init__()
        self.checkpointing = checkpointing  # each block recomputed in backward
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = (
                torch.utils.checkpoint.checkpoint(
                    b, x, use_reentrant=self.checkpointing == "reentrant"
                )
                if self.checkpointing != "none"
                else b(x)
            )
        return self.out(x)


@pytest.mark.parametrize("checkpointing", ["none", "reentrant", "non_reentrant"])
def test_stage3_unit_with_an_unused_param_is_freed_when_its_backward_is_done(
    checkpointing: str,
) -> None:
    """The first backward finds each block still gathered at its end (`spare` got no grad):
    all 4 at once. From the next backward on, each is freed when the grads of its inputs are in,
    so at most the current block and the prefetched one are gathered, and the values still
    equal torch.optim.AdamW's."""
    torch.manual_seed(0)
    ref_model = WithSpares()
    torch.manual_seed(0)
    model = WithSpares(checkpointing)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = ZeroAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=3, module=model)
    z = opt.zero3
    peaks = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        z.max_gathered = 0
        for m, o in ((model, opt), (ref_model, ref_opt)):
            nn.functional.mse_loss(m(x), y).backward()
            for p in ref_model.parameters():  # no grad is a zero grad (ZeroAdamW's rule)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            o.step()
            o.zero_grad()
        peaks.append(z.max_gathered)
    assert peaks[0] == 4 and peaks[1:] == [2, 2], peaks
    assert {u.index for u in z.units if u.late} == {1, 2, 3, 4}
    with opt.gathered_params():
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=n)
