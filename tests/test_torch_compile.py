"""torch.compile under ZeroAdamW, stages 0-3 on 2 gloo ranks: the compiled model gives the eager
losses, and the only graph breaks are the documented ones, at our hooks' waits and collectives.

Backend: "aot_eager" runs all of torch.compile that our hooks meet (Dynamo traces the forward
and the module hooks, AOTAutograd builds the joint forward/backward graph) and executes the
captured graphs with eager kernels; Inductor would only add CPU C++ codegen of those graphs
(about 100 s of compiler time on 2 cores). Inductor itself was checked by hand at one rank
(losses within 2e-7 relative); the README says so.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.optim import ZeroAdamW
from fusedzero.testing import run_ranks

CFG = GPTConfig(vocab_size=61, block_size=12, n_layer=1, n_head=2, n_embd=32)
STEPS, BATCH = 2, 4

# Graph breaks our hooks cause, by the words of Dynamo's reason (torch 2.13):
DOCUMENTED = {
    # stages 1-2: a module's forward pre-hook waits on its buckets' param all-gather
    # (fusedzero.comm.wait is marked torch.compiler.disable: a wait on other ranks)
    "wait": "fusedzero.comm.wait blocks on other ranks",
    # stage 3: a unit's pre-forward hook issues its all-gather with async_op=True
    "gather": "async_op=True for distributed collectives",
    # every stage: the model's output hook asks whether it runs inside backward
    "in_backward": "_current_graph_task_id",
}


def train(rank: int, world: int, stage: int, mode: str) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroAdamW(gpt_param_groups(model, 0.1), lr=1e-3, stage=stage, module=model)
    run = model
    if mode == "model":
        run = torch.compile(model, backend="aot_eager")
    elif mode == "blocks":  # compile each block's forward: the unit hooks stay outside
        for blk in model.blocks:
            blk.forward = torch.compile(blk.forward, backend="aot_eager")
    losses = []
    n = BATCH // world
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
        x = x[rank * n:(rank + 1) * n]
        _, loss = run(x[:, :-1], x[:, 1:])
        if stage == 3 and mode == "model":
            # Known limitation (README): a whole-model compile at stage 3 fails in backward.
            try:
                loss.backward()
            except RuntimeError as e:
                return {"error": str(e)}
            return {"error": None}
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    breaks = {k: v for k, v in counters["graph_break"].items()}
    return {"losses": losses, "breaks": breaks, "graphs": counters["stats"]["unique_graphs"]}


def train_all(rank: int, world: int) -> dict[tuple[int, str], dict[str, Any]]:
    cases = [(s, m) for s in (0, 1, 2, 3) for m in ("eager", "model")] + [(3, "blocks")]
    return {c: train(rank, world, *c) for c in cases}


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
            eager = out[(stage, "eager")]["losses"]
            if stage == 3:
                err = out[(3, "model")]["error"]
                assert err is not None and "modified by an inplace operation" in err, err
            for mode in ("blocks",) if stage == 3 else ("model",):
                o = out[(stage, mode)]
                # The captured graphs run the eager aten kernels; only AOTAutograd's
                # decompositions can reorder fp32 arithmetic: 1e-6 relative is ~10 ulp.
                assert o["losses"] == pytest.approx(eager, rel=1e-6), (stage, mode, rank)
                assert o["graphs"] >= 1, (stage, mode)
            # Whole-model compile: stage 0 has no hook that breaks; stages 1-2 break only at
            # the per-module all-gather waits; stage 3 at its gathers (+ the waits and the
            # in-backward test).
            if stage == 3:
                continue
            kinds = _kinds(out[(stage, "model")]["breaks"])
            # Every stage: the model's output hook (it queues the end-of-backward callback on
            # the outer graph task) asks whether it runs inside backward: one break at the end
            # of the forward, after the graph that does the work.
            want = {0: {"in_backward"}, 1: {"wait", "in_backward"},
                    2: {"wait", "in_backward"}}[stage]
            assert want <= kinds <= want | {"wait"}, (stage, out[(stage, "model")]["breaks"])
        # Stage 3 with each block's forward compiled: the unit hooks run outside the graphs
        # (and stage 3 installs no per-module waits): no graph break at all.
        assert out[(3, "blocks")]["breaks"] == {}, out[(3, "blocks")]
