"""Step overhead on one CUDA device: bench/_systems.py's systems in a world of one (NCCL).

    python bench/gpu/step_overhead.py SYSTEM,SYSTEM,... OUT.json

Same systems, model and per-rank batch as the CPU step bench (FUSEDZERO_BENCH_MODEL / _BATCH /
_BUCKET choose them), built on cuda:0 and timed interleaved: ROUNDS rounds (default 5) of STEPS
steps (default 10) each, every system in turn, CUDA-synchronised around each round. A system's
overhead is its median step time minus the median of `bare` (or `bare-bf16`) of the same round
set. A world of one has no collective traffic worth the name: this measures what each system
adds on one GPU (hooks, copies, casts, the update, clipping), not communication.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _systems as S  # noqa: E402  (bench/ is a folder of scripts)

from fusedzero.spawn import free_port  # noqa: E402


def main(names: list[str], out: Path) -> None:
    steps, rounds = int(os.environ.get("STEPS", "10")), int(os.environ.get("ROUNDS", "5"))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=120), device_id=dev)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, S.CFG.vocab_size, (S.BATCH, S.CFG.block_size + 1), generator=gen)
    x, y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
    systems, errors = {}, {}
    for n in names:
        try:
            # Only while building: a default-device mode would tax every op of every step.
            with torch.device(dev):
                systems[n] = S.build(n, 1)
            for _ in range(3):
                systems[n].step(x, y)
        except Exception as e:  # noqa: BLE001 - a system that cannot run here is reported
            errors[n] = f"{type(e).__name__}: {e}"[:300]
    times: dict[str, list[float]] = {n: [] for n in systems}
    for _ in range(rounds):
        for n, s in systems.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                s.step(x, y)
            torch.cuda.synchronize()
            times[n].append((time.perf_counter() - t0) / steps)
    rows = []
    for n, t in times.items():
        rows.append({"system": n, **dataclasses.asdict(S.SYSTEMS[n]),
                     "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                     "times_s": t})
    out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "model": dataclasses.asdict(S.CFG), "batch": S.BATCH, "bucket_numel": S.BUCKET,
        "clip": S.CLIP, "steps_per_round": steps, "rounds": rounds, "world_size": 1,
        "rows": rows, "errors": errors}, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
