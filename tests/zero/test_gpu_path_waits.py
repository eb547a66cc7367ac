"""Every forward read is covered by a wait, at every stage: a module's forward may read params of
its children without calling them (nn.MultiheadAttention reads `out_proj.weight`; an
nn.TransformerEncoderLayer in eval under no_grad reads every child's params in one fused op).

[Note: deferred all-gather] The mechanism: `fusedzero._comm.all_gather` is replaced, in this one
process (world size 1, no process group), by a fake whose output holds NaN until its handle's
`wait()` copies the gathered values in. A real NCCL all-gather behaves the same way from the
compute stream's point of view (the values land whenever the collective runs, and only the wait
orders the reader after it), but on CPU gloo the wait is usually a formality because the
collective already finished. Here a read that no wait covers sees NaN, which reaches the loss:
the results must equal a single-process torch.optim.AdamW run bit for bit in what they depend on
(1e-6 relative: the fused update's arithmetic order).

About an internal: fusedzero._comm.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
from torch import nn

import fusedzero._comm as comm
from fusedzero import Sharding, ZeroAdamW

STEPS = 3
RTOL, ATOL = 1e-6, 1e-6


class DeferredWork:
    """A work handle whose output is NaN until `wait()` (see [Note: deferred all-gather])."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, log: list[str]) -> None:
        self.out, self.value, self.log = out, inp.detach().clone(), log
        with torch.no_grad():
            out.fill_(float("nan"))
        log.append("issue")

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.value is not None:
            with torch.no_grad():
                self.out.copy_(self.value)  # world size 1: the gathered tensor is the input
            self.value = None
            self.log.append("wait")
        return True

    def is_completed(self) -> bool:
        return self.value is None


@pytest.fixture
def deferred(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []

    def all_gather(
        out: torch.Tensor, inp: torch.Tensor, group: Any, world_size: int, counter: comm.CommCounter
    ) -> DeferredWork:
        return DeferredWork(out, inp, log)

    monkeypatch.setattr(comm, "all_gather", all_gather)
    return log


# bias=False: the grad of the attention's key bias is rounding noise (softmax ignores a shift of
# the scores), which Adam's normalisation turns into full-size updates of any sign.


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, bias=False, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mha(x, x, x, need_weights=False)[0])


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, bias=False)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


MODELS = {"mha": Attention, "encoder": Encoder}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(4, 5, 16, generator=g), torch.randn(4, 5, 3, generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Losses of STEPS train steps, each followed by an eval forward under no_grad (the
    encoder layer's fused fast path)."""
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        model.train()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            out += [loss.detach(), nn.functional.mse_loss(model(x), y)]
    return out


# One case in the fast tier (about 1 s alone); the rest take 3-6 s each on 2 shared cores.
CASES = [
    pytest.param(stage, kind, marks=() if (stage, kind) == (1, "mha") else pytest.mark.slow)
    for stage in (0, 1, 2, 3)
    for kind in sorted(MODELS)
]


@pytest.mark.parametrize("stage,kind", CASES)
def test_forward_reads_wait_for_children(deferred: list[str], stage: int, kind: str) -> None:
    torch.manual_seed(0)
    ref_model = MODELS[kind]()
    torch.manual_seed(0)
    model = MODELS[kind]()
    ref = _train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1))
    # bucket_numel 256: in_proj, out_proj and the head land in different buckets.
    opt = ZeroAdamW(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        stage=stage,
        module=model,
        sharding=Sharding(bucket_numel=256),
    )
    got = _train(model, opt)
    if stage:
        assert "issue" in deferred and "wait" in deferred  # the fake was on the path
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.isfinite(a), f"loss {i} is {a}: a forward read params before their wait"
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"loss {i}")
    with opt.gathered_params():
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=n)
    opt.close()


class Blocks(nn.Module):
    """Blocks in an nn.ModuleList (units), biases in a no-decay group registered last: the flat
    buffers' own order would gather every weight bucket before the first bias."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.h:
            x = torch.tanh(m(x))
        return x


def test_gather_in_forward_order(deferred: list[str]) -> None:
    """The second forward's waits come in the order the gathers were issued: each wait is for
    the oldest gather still in flight, so none waits behind a bucket forward needs later."""
    torch.manual_seed(0)
    model = Blocks()
    groups = [
        {"params": [m.weight for m in model.h]},
        {"params": [m.bias for m in model.h], "weight_decay": 0.0},
    ]
    opt = ZeroAdamW(
        groups, lr=1e-2, stage=1, module=model, trace=True, sharding=Sharding(bucket_numel=256)
    )
    x = torch.randn(3, 16)
    for _ in range(2):
        assert opt.trace is not None
        opt.trace.clear()
        model(x).square().mean().backward()
        opt.step()
        issued = [d for e, d in opt.trace if e == "param_gather"]
        model(x)
        waited = [d for e, d in opt.trace if e == "param_wait"]
        assert waited == issued[: len(waited)], (issued, waited)
        # (buffer, bucket): a weight bucket per block; two biases (128-element aligned) per
        # bucket of the no-decay buffer. The buffers' own order was (0, 0), (0, 1), ... (1, 1).
        assert issued == [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3)]
    opt.close()
