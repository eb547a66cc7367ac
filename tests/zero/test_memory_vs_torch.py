"""Resident bytes at world size 1: ZeroAdamW stage 1 against torch.optim.AdamW, fp32 params.

At W=1 nothing is sharded, so stage 1 must hold what torch holds: params, one copy of the
grads and two moments (fp32 params are their own master), 16 bytes per param, plus alignment
padding. Counted exactly from the tensors alive in this process (every CPU storage, by address),
not from RSS: after backward and after step, the peaks of a training step outside the update.

About an internal: fusedzero.kernels._sum_of_squares.
"""

from __future__ import annotations

import gc

import pytest
import torch

from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.kernels import _sum_of_squares as sum_of_squares
from fusedzero.optim import ZeroAdamW

# Slow: the first count walks every object of the process (gc), ~1 s in a pytest session.
pytestmark = pytest.mark.slow

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=32, vocab_size=256)  # 445k params
# torch.optim.AdamW keeps each param's step count as a one-element tensor (fp32).
STEP_BYTES = 4


def _storages(generation: int | None = None) -> dict[int, int]:
    """Every live CPU tensor storage (of the tensors in that gc generation): address -> bytes."""
    out = {}
    for o in gc.get_objects(generation):
        if type(o) in (torch.Tensor, torch.nn.Parameter):
            st = o.untyped_storage()
            if st.device.type == "cpu" and st.nbytes():
                out[st.data_ptr()] = st.nbytes()
    return out


def _peak_new_bytes(system: str) -> tuple[int, object, torch.nn.Module]:
    """Most bytes of new storages alive after a backward or a step, over two steps."""
    x = torch.randint(
        0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(0)
    )
    gc.collect()
    before = _storages()
    # From here on every new tensor object stays in gc generation 0 (no automatic collection
    # moves it on): the counts below walk only those, not every object of the test session.
    gc.disable()
    try:
        return _peak_after(system, x, before)
    finally:
        gc.enable()


def _peak_after(
    system: str, x: torch.Tensor, before: dict[int, int]
) -> tuple[int, object, torch.nn.Module]:
    torch.manual_seed(0)
    model = GPT(CFG)
    if system == "zero1":
        opt = ZeroAdamW(
            gpt_param_groups(model, 0.1), lr=1e-3, stage=1, module=model, max_grad_norm=1.0
        )
    else:
        opt = torch.optim.AdamW(gpt_param_groups(model, 0.1), lr=1e-3, **{system: True})
    peak = 0
    for i in range(2):  # counted in the second step, when every buffer exists
        loss = model(x, x)[1]
        loss.backward()
        del loss  # the graph's saved activations are not optimizer state
        if i:
            peak = max(peak, sum(n for a, n in _storages(0).items() if a not in before))
        if system != "zero1":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i:
            peak = max(peak, sum(n for a, n in _storages(0).items() if a not in before))
        opt.zero_grad(set_to_none=False)  # torch keeps its grads allocated, as ours does
    return peak, opt, model


@pytest.mark.parametrize("torch_impl", ["foreach", "fused"])
def test_stage1_at_one_rank_holds_what_torch_adamw_holds(torch_impl: str) -> None:
    theirs, _, ref_model = _peak_new_bytes(torch_impl)
    psi = sum(p.numel() for p in ref_model.parameters())
    # params, grads, exp_avg, exp_avg_sq: fp32 each; and a step counter per param
    assert theirs == 16 * psi + STEP_BYTES * len(list(ref_model.parameters()))

    ours, opt, model = _peak_new_bytes("zero1")
    mem = opt.memory()
    pad = sum(fg.layout.padded_numel for fg in opt.flat_groups)
    # What the optimizer reports: one fp32 copy each of params and grads, two moments.
    assert (mem.params, mem.grads, mem.optimizer) == (4 * pad, 4 * pad, 8 * pad)
    # No second copy of the grads: every .grad is a view of the flat grad buffer.
    grad_buffers = {fg.grad_flat.untyped_storage().data_ptr() for fg in opt.flat_groups}
    assert all(p.grad.untyped_storage().data_ptr() in grad_buffers for p in model.parameters())
    # Everything alive beyond that: the CPU sum of squares' scratch (one chunk, bounded) and the
    # per-step scalars and piece tables (a few KiB).
    scratch = 4 * min(pad, sum_of_squares._CHUNK)
    extra = ours - 16 * pad - scratch
    assert 0 <= extra <= 16 << 10, f"{extra} bytes beyond params, grads, moments and scratch"
    # Within 2% of torch's, beside the bounded scratch (padding is 0.7% here).
    assert ours <= theirs * 1.02 + scratch, (ours, theirs)
    opt.close()
