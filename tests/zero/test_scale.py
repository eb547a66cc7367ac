"""Rank 0 and rank W-1 of W = 8..1024, emulated: a real ZeroAdamW built in this process on
torch's fake process group, the model on the meta device (fusedzero/emulate.py).

Each case checks, exactly: resident bytes (`ZeroAdamW.memory()`) = `fusedzero plan` = the ZeRO
formula within padding, padding <= 0.5% of Psi, and one step's collectives as counted by
`fusedzero._comm` = the plan's bytes. Stage 3 materialises the local shard (real CPU memory)
where it is at most ~1.5 GB; everything else is built on the meta device, with the same byte
counts. Construction time and RSS are reported by bench/bench_scale.py, not asserted here.
"""

from __future__ import annotations

import pytest

from fusedzero.emulate import Emulation, emulate

pytestmark = pytest.mark.slow

PARAM, GRAD, K = 2, 2, 12  # bf16 params, bf16 grads, fp32 master + exp_avg + exp_avg_sq


def _zero_formula(psi: int, W: int, stage: int) -> float:
    """Rajbhandari et al. (2020): bytes per rank of each stage, no padding."""
    return {
        1: (PARAM + GRAD) * psi + K * psi / W,
        2: PARAM * psi + (GRAD + K) * psi / W,
        3: (PARAM + GRAD + K) * psi / W,
    }[stage]


def _check(e: Emulation) -> None:
    what = f"{e.shape} stage {e.stage} rank {e.rank} of {e.world_size}"
    assert e.resident_bytes == e.plan_bytes, what
    assert e.comm_bytes_per_step == e.plan_comm_bytes, what
    assert e.padding_fraction <= 0.005, (what, e.padding_fraction)
    ideal = _zero_formula(e.params, e.world_size, e.stage)
    assert ideal <= e.resident_bytes <= ideal * 1.005, (what, e.resident_bytes / ideal - 1)


@pytest.mark.parametrize("last", [False, True], ids=["rank0", "last"])
@pytest.mark.parametrize("W", [64, 256, 1024])
def test_llama_70b_stage3(W: int, last: bool) -> None:
    # Only the local shard is real at W=1024 (1.1 GB); at W=64 it would be 17.6 GB.
    e = emulate(
        "llama-70b", world_size=W, rank=W - 1 if last else 0, stage=3, materialize=W == 1024
    )
    assert e.params == 70_553_706_496
    _check(e)


@pytest.mark.parametrize("last", [False, True], ids=["rank0", "last"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("W", [8, 64, 256, 1024])
def test_llama_8b(W: int, stage: int, last: bool) -> None:
    e = emulate(
        "llama-8b",
        world_size=W,
        rank=W - 1 if last else 0,
        stage=stage,
        materialize=stage == 3 and W >= 256,
    )
    assert e.params == 8_030_261_248
    _check(e)
