"""At world size 1, ZeroAdamW adds no device work to forward at stages 0-2: the ops dispatched
during a training forward are exactly those of the bare model (no copy, no wait, no cast).

Stage 1 and 2 share the forward path (params are views of the flat buffer, each module's
pre-hook waits for its buckets' all-gathers, which at W=1 alias the params): a slower stage-1
forward would have to come from here. Counted with a TorchDispatchMode, on the CPU.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusedzero import ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups

CFG = GPTConfig(
    n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu", block_size=16, vocab_size=64
)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _forward_ops(stage: int | None) -> collections.Counter[str]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = (
        None
        if stage is None
        else ZeroAdamW(
            gpt_param_groups(model, 0.1), lr=1e-3, stage=stage, module=model, max_grad_norm=1.0
        )
    )
    x = torch.randint(
        0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(0)
    )
    for _ in range(2):  # the second forward follows a step: the all-gather of updated params
        with _Ops() as counted:
            loss = model(x, x)[1]
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
    return counted.ops


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_forward_at_one_rank_runs_exactly_the_bare_models_ops(stage: int) -> None:
    bare, ours = _forward_ops(None), _forward_ops(stage)
    assert ours == bare, f"extra: {dict(ours - bare)}, missing: {dict(bare - ours)}"
