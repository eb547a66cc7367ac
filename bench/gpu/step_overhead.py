"""Step time on one device at W=1 (a process group of one), systems timed in interleaved rounds.

    python bench/gpu/step_overhead.py SYSTEM,SYSTEM,... OUT.json
    python bench/gpu/step_overhead.py --shape gpt2-124m|llama-255m OUT.json [--systems A,B] [--cpu]

The first form times bench/_systems.py's systems at FUSEDZERO_BENCH_MODEL / _BATCH / _BUCKET
(the step bench's GPT). The second (`--shape`) times the per-shape step rows: bare forward +
backward, stages 0-3, DDP + fused AdamW under bf16 autocast and FSDP2 with bf16 params on GPT-2
124M or the 255M Llama, beside the update's memory-traffic limit (bench/gpu/shape_systems.py
says what each system is and how the limit is computed). `--cpu` (gloo, the shape at a tiny
size) is the dry run: the code runs, nothing is measured.

[Note: stable rounds] Every system is built, then stepped WARMUP times (compiles, allocator
pools, cuBLAS heuristics), then timed in ROUNDS rounds of STEPS steps each, device-synchronised
around each round; round r starts at system r mod n, so drift (clocks, another process on the
host) hits all alike. Python's garbage collector runs between rounds, never inside one (a
collection inside a round costs a host-bound step milliseconds). Each row reports its rounds' range
over their median, which the targets want at most 10% for the bf16 rows. A world of one has no
collective traffic worth the name: this measures what each system adds on one device (hooks,
copies, casts, the update, clipping), not communication.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import shape_systems as SH  # noqa: E402  (bench/ is a folder of scripts)

from fusedzero import ZeroAdamW  # noqa: E402
from fusedzero._spawn import reserved_port  # noqa: E402
from fusedzero.app.model import GPT  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
STEPS = int(os.environ.get("STEPS", "10"))
WARMUP = int(os.environ.get("WARMUP", "5"))
SHAPE_SYSTEMS = (
    "bare",
    "bare-autocast",
    "fusedzero-0",
    "fusedzero-1",
    "fusedzero-2",
    "fusedzero-3",
    "ddp-autocast",
    "fsdp2",
    "fsdp2-keep",
)


@contextlib.contextmanager
def one_rank_group(dev: torch.device) -> Iterator[None]:
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    with reserved_port() as port:  # held until the store listens on it
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
            **({"device_id": dev} if cuda else {}),
        )
    try:
        yield
    finally:
        dist.destroy_process_group()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_rounds(
    steps: dict[str, Callable[[], object]],
    dev: torch.device,
    *,
    rounds: int,
    steps_per_round: int,
    warmup: int,
    after_round: Callable[[dict[str, list[float]]], None] = lambda t: None,
) -> dict[str, list[float]]:
    """Seconds per step of each system, one entry per round; `after_round` sees the times so
    far after each round (a run cut short keeps them). See [Note: stable rounds]."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    enabled = gc.isenabled()
    try:
        for r in range(rounds):
            gc.collect()
            gc.disable()
            for n in names[r % len(names) :] + names[: r % len(names)]:
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(steps_per_round):
                    steps[n]()
                sync(dev)
                times[n].append((time.perf_counter() - t0) / steps_per_round)
            gc.enable()
            after_round(times)
    finally:
        if enabled:
            gc.enable()
    return times


def row_stats(t: list[float]) -> dict[str, object]:
    med = statistics.median(t)
    return {
        "median_s": med,
        "min_s": min(t),
        "max_s": max(t),
        "times_s": t,
        "range_over_median": (max(t) - min(t)) / med,
    }


def bench_systems(names: list[str], out: Path, cpu: bool) -> None:
    """The first form: bench/_systems.py's systems on cuda:0 (`cpu`: gloo on the CPU)."""
    import _systems as S

    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    with one_rank_group(dev):
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, S.CFG.vocab_size, (S.BATCH, S.CFG.block_size + 1), generator=gen)
        x, y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
        steps, errors = {}, {}
        for n in names:
            try:
                with torch.device(dev):  # only while building (see shape_systems.build)
                    s = S.build(n, 1)
                steps[n] = lambda s=s: s.step(x, y)
            except Exception as e:  # noqa: BLE001 - a system that cannot run here is reported
                errors[n] = f"{type(e).__name__}: {e}"[:300]
        times = _timed(steps, errors, dev)
        rows = [
            {"system": n, **dataclasses.asdict(S.SYSTEMS[n]), **row_stats(t)}
            for n, t in times.items()
        ]
        out.write_text(
            json.dumps(
                {
                    "device": _device_name(dev),
                    "torch": torch.__version__,
                    "model": dataclasses.asdict(S.CFG),
                    "batch": S.BATCH,
                    "bucket_numel": S.BUCKET,
                    "clip": S.CLIP,
                    "warmup": WARMUP,
                    "steps_per_round": STEPS,
                    "rounds": ROUNDS,
                    "world_size": 1,
                    "rows": rows,
                    "errors": errors,
                },
                indent=1,
            )
            + "\n"
        )


def _timed(
    steps: dict[str, Callable[[], object]],
    errors: dict[str, str],
    dev: torch.device,
    after_round: Callable[[dict[str, list[float]]], None] = lambda t: None,
) -> dict[str, list[float]]:
    """Warm each system up alone (one that fails is reported and dropped), then time them."""
    for n in list(steps):
        try:
            steps[n]()
        except Exception as e:  # noqa: BLE001
            errors[n] = f"{type(e).__name__}: {e}"[:300]
            del steps[n]
    return time_rounds(
        steps, dev, rounds=ROUNDS, steps_per_round=STEPS, warmup=WARMUP, after_round=after_round
    )


def bench_shape(name: str, systems: list[str], out: Path, cpu: bool) -> None:
    """The second form: the step rows on one shape."""
    for s in systems:
        SH.parse(s)  # a typo fails before minutes of building
    sh = SH.shape(name, tiny=cpu)
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    with one_rank_group(dev):
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(
            0, sh.config.vocab_size, (sh.batch, sh.config.block_size + 1), generator=gen
        )
        x, y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
        limit = SH.traffic_limit(_count_params(sh), dev)  # before the systems take memory
        built, errors = {}, {}
        for s in systems:
            try:
                built[s] = SH.build(s, sh, x, y)
            except Exception as e:  # noqa: BLE001 - a system that cannot run here is reported
                errors[s] = f"{type(e).__name__}: {e}"[:300]
        record = {
            "subject": "step_rows",
            "shape": name,
            "tiny": cpu,
            "device": _device_name(dev),
            "torch": torch.__version__,
            "model": dataclasses.asdict(sh.config),
            "batch": sh.batch,
            "clip": SH.CLIP,
            "warmup": WARMUP,
            "steps_per_round": STEPS,
            "rounds": ROUNDS,
            "world_size": 1,
            "traffic": limit,
            "rows": [],
            "errors": errors,
        }

        def write(times: dict[str, list[float]]) -> None:
            record["rounds_done"] = min(len(t) for t in times.values()) if times else 0
            record["rows"] = [
                {"system": s, "note": built[s].note, **row_stats(t)} for s, t in times.items() if t
            ]
            out.write_text(json.dumps(record, indent=1) + "\n")

        write({})  # what was built, and what failed to, before minutes of stepping
        write(_timed({s: b.step for s, b in built.items()}, errors, dev, after_round=write))
        for b in built.values():
            if isinstance(b.opt, ZeroAdamW):
                b.opt.close()


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)"


def _count_params(sh: SH.Shape) -> int:
    """Params of the shape's model, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(sh.config).parameters())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("systems_or_out", help="SYSTEM,SYSTEM,... then OUT.json; with --shape: OUT")
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--shape", choices=("gpt2-124m", "llama-255m"))
    ap.add_argument(
        "--systems",
        default=",".join(SHAPE_SYSTEMS),
        help=f"with --shape (default {','.join(SHAPE_SYSTEMS)})",
    )
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="gloo on the CPU (the dry run; with --shape at a tiny size)",
    )
    args = ap.parse_args(argv)
    if args.shape:
        if args.out is not None:
            ap.error("with --shape give only OUT.json")
        bench_shape(args.shape, args.systems.split(","), Path(args.systems_or_out), args.cpu)
    else:
        if args.out is None:
            ap.error("give SYSTEM,SYSTEM,... OUT.json (or --shape NAME OUT.json)")
        bench_systems(args.systems_or_out.split(","), args.out, args.cpu)


if __name__ == "__main__":
    main()
