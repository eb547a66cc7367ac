"""`model.load_state_dict()` under ZeroAdamW: at stage 3, where a freed unit's params are empty
tensors, it loads the full values into every rank's shard (a collective, as `state_dict()`);
at every stage it gives what `fusedzero.checkpoint.import_weights` gives, the fp32 master from
the given values included (with bf16 params the next step used to write the old master back)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fusedzero import Precision, ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.checkpoint import import_weights
from fusedzero.testing import run_ranks

pytestmark = pytest.mark.slow  # spawns ranks or the CLI

CFG = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _batch() -> torch.Tensor:
    return torch.randint(
        0, CFG.vocab_size, (2, CFG.block_size + 1), generator=torch.Generator().manual_seed(7)
    )


def test_load_state_dict_at_stage_3_sets_the_full_values_one_rank() -> None:
    model = _gpt(0)
    opt = ZeroAdamW(gpt_param_groups(model, 0.1), lr=1e-2, stage=3, module=model)
    x = _batch()
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()  # master, moments and params away from the init
    ref = _gpt(1)
    sd = ref.state_dict()
    model.load_state_dict(sd)  # before: size mismatch against the empty freed params
    z = opt.zero3
    assert z is not None and all(u.state.name == "FREE" for u in z.units), "units left gathered"
    assert all(p.numel() == 0 for p in model.blocks.parameters())
    got = model.state_dict()
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    # The forward runs on what was loaded: the same fp32 ops on the same values as ref's.
    with torch.no_grad():
        assert torch.equal(model(x[:, :-1], x[:, 1:])[1], ref(x[:, :-1], x[:, 1:])[1])
    with pytest.raises(RuntimeError, match="import_weights"):
        model.load_state_dict(sd, assign=True)
    # torch's own checks still speak: a wrong shape is refused by name.
    bad = dict(sd)
    bad["lm_head.weight"] = bad["wte.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="size mismatch for wte.weight"):
        model.load_state_dict(bad)
    assert all(u.state.name == "FREE" for u in z.units), "a refused load left units gathered"


def _ranks(rank: int, world: int) -> dict[int, dict[str, Any]]:
    sd = _gpt(1).state_dict()  # fp32 values; the models below hold bf16 params
    x = _batch()
    res: dict[int, dict[str, Any]] = {}
    for stage in (0, 1, 2, 3):
        out: dict[str, Any] = {}
        for how in ("load_state_dict", "import_weights"):
            model = _gpt(0)
            opt = ZeroAdamW(
                gpt_param_groups(model, 0.1),
                lr=1e-2,
                stage=stage,
                module=model,
                precision=Precision(param_dtype=torch.bfloat16),
            )
            model(x[:, :-1], x[:, 1:])[1].backward()
            opt.step()  # at stages 1-2 the param all-gather is left in flight
            if how == "load_state_dict":
                model.load_state_dict(sd)
            else:
                import_weights(opt, sd)
            out[how] = {
                "master": opt.shard_state().master,
                "params": {k: v.clone() for k, v in model.state_dict().items()},
            }
        res[stage] = out
    return res


@pytest.mark.timeout(300)
def test_load_state_dict_matches_import_weights_at_stages_0_to_3_on_2_ranks_bf16() -> None:
    sd = _gpt(1).state_dict()
    for rank, res in enumerate(run_ranks(_ranks, 2, timeout=300)):
        for stage, out in res.items():
            a, b = out["load_state_dict"], out["import_weights"]
            # The fp32 master comes from the given values, not from their bf16 cast.
            for i, (ma, mb) in enumerate(zip(a["master"], b["master"], strict=True)):
                assert torch.equal(ma, mb), (stage, rank, i)
            for k, v in sd.items():
                assert torch.equal(a["params"][k], b["params"][k]), (stage, rank, k)
                assert torch.equal(a["params"][k], v.to(torch.bfloat16)), (stage, rank, k)
