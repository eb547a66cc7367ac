"""torch.compile under ZeroAdamW, stages 0-3 on 2 gloo ranks: a whole-model compile gives the
eager losses, and the only graph breaks are the documented ones, at our hooks' waits (stages
1-2) and stage 3's unit hooks. Stage 3 failed in backward before ("modified by an inplace
operation": the traced `.data` re-pointing bumped saved tensors' version counters).

Backend: "aot_eager" runs all of torch.compile that our hooks meet (Dynamo traces the forward
and the module hooks, AOTAutograd builds the joint forward/backward graph, where the version
counter bug lived) and executes the captured graphs with eager kernels; Inductor would only add
CPU C++ codegen of those graphs (about 100 s of compiler time on 2 cores). Inductor itself was
checked by hand at one rank; the README says so.
"""

from __future__ import annotations

from typing import Any

import pytest

from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks or the CLI

CFG = GPTConfig(vocab_size=61, block_size=12, n_layer=1, n_head=2, n_embd=32)
STEPS, BATCH = 2, 4

# Graph breaks our hooks cause, by the words of Dynamo's reason (torch 2.13):
DOCUMENTED = {
    # stages 1-2: a module's forward pre-hook waits on its buckets' param all-gather
    # (fusedzero._comm.wait runs eagerly, `_eager.eager`: a wait on other ranks). Dynamo names the
    # skipped function by its module and qualname.
    "wait": "module: fusedzero._comm, qualname: wait,",
    # stage 3: a unit's forward hooks (gather, prefetch, free: collectives, storage resizes and
    # `.data` re-pointing) run eagerly (see [Note: stage 3 under torch.compile] in _zero3.py)
    "unit": "fusedzero stage 3: a unit's gather/free hook runs eagerly",
}


def train(rank: int, world: int, stage: int, mode: str) -> dict[str, Any]:
    import time

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroAdamW(gpt_param_groups(model, 0.1), lr=1e-3, stage=stage, module=model)
    run = torch.compile(model, backend="aot_eager") if mode == "model" else model
    losses = []
    n = BATCH // world
    t0 = time.perf_counter()
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
        x = x[rank * n : (rank + 1) * n]
        _, loss = run(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # A graph break Dynamo recovers from is counted in "graph_break"; one that makes it run a
    # whole frame eagerly (a break inside a loop) in "unimplemented".
    breaks = {**counters["graph_break"], **counters["unimplemented"]}
    return {
        "losses": losses,
        "breaks": breaks,
        "graphs": counters["stats"]["unique_graphs"],
        "seconds": time.perf_counter() - t0,
    }


def train_all(rank: int, world: int) -> dict[tuple[int, str], dict[str, Any]]:
    return {(s, m): train(rank, world, s, m) for s in (0, 1, 2, 3) for m in ("eager", "model")}


def _kinds(breaks: dict[str, int]) -> set[str]:
    out = set()
    for reason in breaks:
        kind = [k for k, words in DOCUMENTED.items() if words in reason]
        assert kind, f"undocumented graph break: {reason}"
        out.update(kind)
    return out


@pytest.mark.timeout(600)
def test_compiled_model_gives_eager_losses_at_stages_0_to_3_on_2_ranks() -> None:
    outs = run_ranks(train_all, 2, timeout=600)
    for rank, out in enumerate(outs):
        for stage in (0, 1, 2, 3):
            eager, o = out[(stage, "eager")]["losses"], out[(stage, "model")]
            # The captured graphs run the eager aten kernels; only AOTAutograd's
            # decompositions can reorder fp32 arithmetic: 1e-6 relative is ~10 ulp.
            assert o["losses"] == pytest.approx(eager, rel=1e-6), (stage, rank, o, eager)
            assert o["graphs"] >= 1, (stage, o)
            # Stage 0 has no hook that breaks: the whole forward is one graph. Stages 1-2
            # break only at the per-module all-gather waits, stage 3 only at its unit hooks;
            # both sit inside GPT.forward's loop over blocks, so Dynamo runs that frame
            # eagerly and compiles each block's forward as its own graph.
            # (Stages 1-2 may break at none: a wait that finds its gathers done, or that runs in
            # a pre-hook outside the compiled frame, costs no break. Any other break fails.)
            want = {0: set(), 1: {"wait"}, 2: {"wait"}, 3: {"unit"}}[stage]
            assert _kinds(o["breaks"]) <= want, (stage, o["breaks"])
            if stage == 0:
                assert o["graphs"] == 1, o
