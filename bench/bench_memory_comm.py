"""Resident bytes and bytes communicated per rank, stages 0-3 at W = 1, 2, 4, beside the formulas.

The setup is the one the ZeRO paper's formulas describe: bf16 params, bf16 grads (reduce dtype),
fp32 master + exp_avg + exp_avg_sq (12 bytes per param). With Psi the padded element count of
all flat buffers (padding is resident, so it is counted; it is reported separately):

  stage 0   2Psi + 2Psi + 12Psi           comm: all-reduce 2(W-1)/W * 2Psi
  stage 1   2Psi + 2Psi + 12Psi/W         comm: reduce-scatter (W-1)/W * 2Psi
                                              + all-gather (W-1)/W * 2Psi
  stage 2   2Psi + (2 + 12)Psi/W          comm: as stage 1
  stage 3   (2 + 2 + 12)Psi/W             comm: as stage 1 + one more all-gather in backward of
                                          every unit but the root (Psi - Psi_root), which stays
                                          gathered from its forward into its backward
plus a 4-byte grad-norm all-reduce for stages >= 1 (skip/clip).

Measured: `opt.memory()` and `opt.comm` of each rank after one step, in W spawned gloo ranks.
Also the bytes per parameter of the update, from the kernel's streams (the dtypes the flat
buffers actually have): master r/w, grad r, exp_avg r/w, exp_avg_sq r/w, bf16 output w.

The timed quantity of this file is the in-rank step time (bf16 on CPU, W ranks on the machine's
cores): a by-product, not a metric to compare; bench_step.py compares step times.

Env: FUSEDZERO_BENCH_MEM_MODEL  n_layer,n_embd,n_head,block_size (4,256,4,64).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from fusedzero import Precision, Sharding, ZeroAdamW
from fusedzero.app.model import GPT, GPTConfig, gpt_param_groups
from fusedzero.testing import run_ranks

from _common import SUMMARY, replay

_L, _D, _H, _T = (
    int(x) for x in os.environ.get("FUSEDZERO_BENCH_MEM_MODEL", "4,256,4,64").split(",")
)
CFG = GPTConfig(n_layer=_L, n_embd=_D, n_head=_H, block_size=_T, vocab_size=256)
WORLDS = (1, 2, 4)
STAGES = (0, 1, 2, 3)
STEPS = 2
# 2**18 elements: several buckets for this model, so padding and bucket edges are exercised.
BUCKET = 1 << 18
OPT_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq


def formula_memory(stage: int, psi: int, world: int) -> dict[str, int]:
    """Per-rank resident bytes by the ZeRO formulas (bf16 params and grads, 12-byte state)."""
    W = world
    params = 2 * psi if stage < 3 else 2 * psi // W
    grads = 2 * psi if stage < 2 else 2 * psi // W
    opt = OPT_BYTES * psi if stage == 0 else OPT_BYTES * psi // W
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def formula_comm(stage: int, psi: int, world: int, psi_root: int = 0) -> dict[str, int]:
    """Per-rank bytes on the wire per step by the ring formulas (bf16 grads and params);
    `psi_root`: the padded elements of stage 3's root unit, gathered once per step."""
    W = world
    if W == 1:
        return {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    if stage == 0:
        return {"all_reduce": 2 * (W - 1) * 2 * psi // W, "reduce_scatter": 0, "all_gather": 0}
    gathered = 2 * psi - psi_root if stage == 3 else psi
    return {
        "all_reduce": 2 * (W - 1) * 4 // W,  # the grad-norm scalar
        "reduce_scatter": (W - 1) * 2 * psi // W,
        "all_gather": (W - 1) * 2 * gathered // W,
    }


def update_bytes_per_param(opt: ZeroAdamW) -> dict[str, Any]:
    """Bytes per parameter the update moves, from the streams of the first flat buffer."""
    fg = opt.flat_groups[0]
    master = fg.master_view()
    grad = fg.grad_view()
    out = fg.out_view()

    def size(s: Any) -> int:
        t = s if isinstance(s, torch.Tensor) else s.tensor
        return t.element_size()

    mb, gb = size(master), size(grad)
    ob = 0 if out is None else size(out)
    reads = {"master": mb, "grad": gb, "exp_avg": 4, "exp_avg_sq": 4}
    writes = {"master": mb, "exp_avg": 4, "exp_avg_sq": 4, "out": ob}
    # The CPU path: torch._fused_adamw_ reads and writes p, g, m, v in fp32 (32: it writes the
    # grad back divided by grad_scale); a cast pass before it when the grad is not fp32
    # (read gb, write 4); a copy pass into the output after it (read 4, write ob).
    cpu = 32 + (gb + 4 if gb != 4 else 0) + (4 + ob if ob else 0)
    return {
        "reads": reads,
        "writes": writes,
        "kernel": sum(reads.values()) + sum(writes.values()),
        "cpu_path": cpu,
    }


def worker(rank: int, world: int, stages: list[int]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    n = 8 // world
    for stage in stages:
        torch.manual_seed(0)
        model = GPT(CFG)
        try:
            opt = ZeroAdamW(
                gpt_param_groups(model, 0.1),
                lr=1e-3,
                stage=stage,
                module=model,
                max_grad_norm=1.0,
                precision=Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
                sharding=Sharding(bucket_numel=BUCKET),
            )
        except Exception as e:  # noqa: BLE001 - stage 3 may not exist yet
            out[stage] = {"error": f"{type(e).__name__}: {e}"}
            continue
        times = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, CFG.vocab_size, (8, CFG.block_size + 1), generator=g)
            xs = x[rank * n : (rank + 1) * n]
            opt.comm.reset()
            t = time.perf_counter()
            model(xs[:, :-1], xs[:, 1:])[1].backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
        out[stage] = {
            "memory": opt.memory()._asdict(),
            "comm": opt.comm.snapshot(),
            "padded": sum(fg.layout.padded_numel for fg in opt.flat_groups),
            "padded_root": sum(fg.layout.padded_numel for fg in opt.flat_groups if fg.unit == 0),
            "update": update_bytes_per_param(opt),
            "param_dtype": str(opt.flat_groups[0].dtype),
            "times": times,
        }
    return out


_RESULTS: dict[int, list[dict[int, Any]]] = {}


def results(world: int) -> list[dict[int, Any]]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(worker, world, list(STAGES), timeout=600)
    return _RESULTS[world]


pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", WORLDS)
def test_memory_comm(benchmark, world: int, stage: int) -> None:
    ranks = [r[stage] for r in results(world)]
    if "error" in ranks[0]:
        pytest.skip(f"stage {stage} cannot be built: {ranks[0]['error']}")
    benchmark.group = f"memory/comm W={world}"
    replay(benchmark, [max(ts) for ts in zip(*(r["times"] for r in ranks))])
    r0 = ranks[0]
    psi = r0["padded"]
    mem = [r["memory"] for r in ranks]
    for m in mem:
        m["total"] = m["params"] + m["grads"] + m["optimizer"]
    f_mem = formula_memory(stage, psi, world)
    f_comm = formula_comm(stage, psi, world, r0["padded_root"])
    comm = r0["comm"]["bytes"]
    benchmark.extra_info.update(
        {
            "subject": "memory_comm",
            "stage": stage,
            "world": world,
            "psi_padded": psi,
            "psi_params": mem[0]["param_elements"],
            "padding_elements": mem[0]["padding_elements"],
            "memory": mem,
            "memory_formula": f_mem,
            "memory_matches_formula": all({k: m[k] for k in f_mem} == f_mem for m in mem),
            "comm_bytes": comm,
            "comm_formula": f_comm,
            "comm_matches_formula": comm == f_comm,
            "comm_calls": r0["comm"]["calls"],
            "update_bytes_per_param": r0["update"],
            "param_dtype": r0["param_dtype"],
            "model": {
                "n_layer": CFG.n_layer,
                "n_embd": CFG.n_embd,
                "params": mem[0]["param_elements"],
            },
        }
    )
    SUMMARY.append(
        f"memory stage {stage} W={world}: {mem[0]['total'] / 1e6:.2f} MB/rank (formula "
        f"{f_mem['total'] / 1e6:.2f}, match={benchmark.extra_info['memory_matches_formula']}); "
        f"comm {sum(comm.values()) / 1e6:.2f} MB/step (formula {sum(f_comm.values()) / 1e6:.2f}, "
        f"match={comm == f_comm}); update {r0['update']['kernel']} B/param kernel, "
        f"{r0['update']['cpu_path']} B/param CPU path"
    )
