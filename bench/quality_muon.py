"""Muon against AdamW on `fusedzero train`'s default model and corpus: each optimizer at a
3-point lr sweep, the final val loss of each run, and the first eval step at which the best Muon
run reaches the best AdamW run's final val loss.

    python bench/quality_muon.py --out /tmp/fz_muon          # 500 steps, as the default run
    python bench/quality_muon.py --out /tmp/fz_muon --steps 200 --eval-every 20

Every run is `fusedzero train --stage 1` (--stage; the same math as stage 0, with each
Newton-Schulz run once, on the matrix's owner rank, so the Muon runs go faster) on --nproc
ranks with the default model, batch, schedule and seed; AdamW sweeps --lr, Muon sweeps
--muon-lr (its AdamW groups, embeddings, head, norms and biases, at the default --lr). Each run's
summary lands in OUT/<optimizer>-<lr>.json (a run whose file exists is not run again, so an
interrupted sweep continues); the table is printed as markdown and written with the settings to
OUT/quality_muon.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from fusedzero.app.config import DEFAULT_LR

# Three points a factor of 2-3 apart, each optimizer's best at 500 steps in the middle
# (docs/benchmarks.md, "Muon"): AdamW around --lr's default, Muon around the default --muon-lr
# (fusedzero/app/config.py).
SWEEPS = {
    "adamw": (DEFAULT_LR / 3, DEFAULT_LR, DEFAULT_LR * 3),
    "muon": (0.02, 0.05, 0.1),
}


def _argv(opt: str, lr: float, args: argparse.Namespace, out: Path) -> list[str]:
    flag = "--lr" if opt == "adamw" else "--muon-lr"
    return [
        sys.executable,
        "-m",
        "fusedzero.cli",
        "train",
        "--optimizer",
        opt,
        flag,
        f"{lr:g}",
        "--stage",
        str(args.stage),
        "--nproc",
        str(args.nproc),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--device",
        "cpu",
        "--no-progress",
        "--sample-tokens",
        "0",
        "--out-json",
        str(out),
    ]


def _run_all(args: argparse.Namespace) -> dict[str, dict]:
    runs: dict[str, dict] = {}
    # Interleaved, so that a sweep cut short still has both optimizers near their defaults.
    order = [(o, lr) for i in (1, 0, 2) for o in SWEEPS for lr in SWEEPS[o][i : i + 1]]
    for opt, lr in order:
        f = args.out / f"{opt}-{lr:g}.json"
        if not f.is_file():
            t0 = time.perf_counter()
            log = f.with_suffix(".log")
            with log.open("w") as fh:
                rc = subprocess.call(_argv(opt, lr, args, f), stdout=fh, stderr=subprocess.STDOUT)
            if rc != 0:
                raise SystemExit(f"{opt} lr {lr:g} failed (exit {rc}): see {log}")
            print(f"{opt} lr {lr:g}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        s = json.loads(f.read_text())
        runs[f"{opt}-{lr:g}"] = {
            "optimizer": opt,
            "lr": lr,
            "val_loss": s["val_loss"],
            "train_loss": s["train_loss"],
            "val": [(v["step"], v["val_loss"]) for v in s["val"]],
        }
    return runs


def _reach(val: list[tuple[int, float]], target: float) -> int | None:
    """The first eval step whose val loss is at most `target` (None: never)."""
    return next((step for step, v in val if v <= target), None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the runs' summaries")
    p.add_argument("--steps", type=int, default=500, help="steps of every run (default 500)")
    p.add_argument("--eval-every", type=int, default=25, help="steps between val evals")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks of every run (default 2)")
    p.add_argument(
        "--stage",
        type=int,
        default=1,
        help="ZeRO stage of every run (default 1: Newton-Schulz "
        "split over the ranks; the same math as stage 0)",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = _run_all(args)
    best = {
        o: min((r for r in runs.values() if r["optimizer"] == o), key=lambda r: r["val_loss"])
        for o in SWEEPS
    }
    target = best["adamw"]["val_loss"]
    reach = _reach(best["muon"]["val"], target)
    lines = [
        f"{args.steps} steps, stage {args.stage}, {args.nproc} ranks, val loss every "
        f"{args.eval_every} steps",
        "",
        "| optimizer | lr | final val loss | final train loss |",
        "| --- | --- | --- | --- |",
    ]
    for r in runs.values():
        star = " (best)" if r is best[r["optimizer"]] else ""
        lines.append(
            f"| {r['optimizer']} | {r['lr']:g}{star} | {r['val_loss']:.4f} | "
            f"{r['train_loss']:.4f} |"
        )
    lines += [
        "",
        f"best Muon (--muon-lr {best['muon']['lr']:g}) reaches the best AdamW's final val loss "
        f"{target:.4f} (--lr {best['adamw']['lr']:g}) at step "
        + (f"{reach} of {args.steps}" if reach is not None else f"- (not within {args.steps})"),
    ]
    print("\n".join(lines))
    (args.out / "quality_muon.json").write_text(
        json.dumps(
            {
                "steps": args.steps,
                "eval_every": args.eval_every,
                "nproc": args.nproc,
                "stage": args.stage,
                "runs": runs,
                "best": {o: r["lr"] for o, r in best.items()},
                "muon_reaches_adamw_final_at_step": reach,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
