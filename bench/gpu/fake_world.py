"""Stages 1-3 at a large world size on one device, under torch's fake process group:

    python bench/gpu/fake_world.py OUT.json [--world 8] [--ranks 0,3,7] [--cpu]

The fake group plays rank r of W in this one process: its collectives are no-ops that return
at once (values are not exchanged: the numbers are meaningless), but everything around them is
real: streams, events, hooks, the flat buffers and shards of rank r at world size W, and any
host sync. Per stage and rank index it records
- the optimizer's own trace (gathers, reductions, waits, frees, in order) and its byte counter;
- on CUDA, whether `step()` makes a host sync (torch.cuda.set_sync_debug_mode("error") around
  every step after the first, which makes the one-time agreements of the first: the gather
  order and which buckets wait for the end of backward) and the CUDA kernels one step runs;
- that it finished (a hang would end the run at the shell's timeout, naming this script).
Every rank index must show the same trace and kernel sequence: a rank-dependent path is a hang
or wrong values at that world size on a real cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fusedzero import Sharding, ZeroAdamW  # noqa: E402
from fusedzero.app.model import GPT, gpt_param_groups  # noqa: E402

import _systems as S  # noqa: E402  (bench/ is a folder of scripts)

STEPS = 3


def one(dev: torch.device, rank: int, world: int, stage: int) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        torch.manual_seed(0)
        with torch.device(dev):
            model = GPT(S.CFG)
        opt = ZeroAdamW(
            gpt_param_groups(model, 0.1),
            lr=1e-3,
            stage=stage,
            module=model,
            max_grad_norm=1.0,
            trace=True,
            sharding=Sharding(bucket_numel=S.BUCKET),
        )
        t = torch.randint(
            0,
            S.CFG.vocab_size,
            (S.BATCH, S.CFG.block_size + 1),
            generator=torch.Generator().manual_seed(0),
        )
        x, y = t[:, :-1].to(dev), t[:, 1:].to(dev)
        kernels: list[str] = []
        for step in range(STEPS):
            _, loss = model(x, y)
            loss.backward()
            if dev.type == "cuda" and step > 0:
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.set_sync_debug_mode("error")
                try:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                kernels = [
                    e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                ]
            else:
                opt.step()
            opt.zero_grad()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        assert opt.trace is not None
        trace = [[e, str(d)] for e, d in opt.trace]
        return {
            "trace": trace,
            "kernels": kernels,
            "comm": opt.comm.snapshot(),
            "host_sync_in_step": False if dev.type == "cuda" else None,
        }
    except RuntimeError as e:
        if "synchroniz" in str(e):
            return {"host_sync_in_step": True, "error": str(e)[-500:]}
        raise
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--ranks", default="0,3,7")
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    ranks = [int(r) for r in args.ranks.split(",")]
    rows = []
    for stage in (1, 2, 3):
        per_rank: dict[int, Any] = {}
        for r in ranks:
            try:
                per_rank[r] = one(dev, r, args.world, stage)
            except Exception:  # noqa: BLE001 - reported in the results
                per_rank[r] = {"error": traceback.format_exc()[-1500:]}
        first = per_rank[ranks[0]]
        same = all(
            per_rank[r].get("trace") == first.get("trace")
            and per_rank[r].get("kernels") == first.get("kernels")
            and per_rank[r].get("comm") == first.get("comm")
            for r in ranks
        )
        rows.append(
            {
                "stage": stage,
                "world": args.world,
                "ranks": ranks,
                "same_on_every_rank": same and "error" not in first,
                "host_sync_in_step": [per_rank[r].get("host_sync_in_step") for r in ranks],
                "trace_events": len(first.get("trace", [])),
                "kernels_per_step": len(first.get("kernels", [])),
                "errors": {r: v["error"] for r, v in per_rank.items() if "error" in v},
            }
        )
    args.out.write_text(
        json.dumps(
            {"device": str(dev) if args.cpu else torch.cuda.get_device_name(dev), "rows": rows},
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
