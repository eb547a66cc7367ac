"""Stage 3 hazards outside the happy path (issue 9): step ordering against in-flight gathers,
params touched outside a forward, and state dicts."""
from __future__ import annotations

import torch
from torch import nn

import fusedzero.optim as optim_mod
from fusedzero.optim import ZeroAdamW


class Stack(nn.Module):
    """Three units (the ModuleList children) and a root-owned head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _setup(seed: int = 0, **kw) -> tuple[Stack, ZeroAdamW]:
    torch.manual_seed(seed)
    model = Stack()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=3, module=model, **kw)
    return model, opt


def test_stage3_step_frees_in_flight_gathers_before_the_kernel(monkeypatch) -> None:
    model, opt = _setup(trace=True)
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    # A partial no-grad forward after backward: block 0's pre-hook prefetches block 1, whose
    # gather is left in flight (its forward never runs) while param_shard is its source.
    with torch.no_grad():
        model.blocks[0](x)
    z = opt._zero3
    assert any(s.name != "FREE" for s in z.state), "the setup must leave a unit gathered"
    real = optim_mod.adamw_step

    def recording_step(*args, **kwargs):
        opt.trace.append(("kernel", None))
        return real(*args, **kwargs)

    monkeypatch.setattr(optim_mod, "adamw_step", recording_step)
    del opt.trace[:]
    opt.step()
    kinds = [k for k, _ in opt.trace]
    first_kernel = kinds.index("kernel")
    assert "free" in kinds[:first_kernel], f"nothing freed before the update: {opt.trace}"
    assert "free" not in kinds[first_kernel:], (
        f"a unit was freed (its gather waited) after the kernel rewrote its shard: {opt.trace}")
    assert all(s.name == "FREE" for s in z.state)
