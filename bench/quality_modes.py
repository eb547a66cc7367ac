"""Gather the final val losses of bench/quality_modes.sh's runs into bench/quality/quality.json
and a markdown table (bench/quality/quality.md), each next to the baseline (bf16 params, fp32
master and states), with torchao's AdamW8bit runs (bench/quality_torchao.py, JSON lines) beside.

    OUT=/tmp/fz_quality sh bench/quality_modes.sh
    python bench/quality_torchao.py >> /tmp/fz_quality/torchao.jsonl
    python bench/quality_torchao.py --bf16 >> /tmp/fz_quality/torchao.jsonl
    python bench/quality_modes.py /tmp/fz_quality

The first table is seed 0 (`<master>-<states>.json`, torchao lines without a seed or with seed
0). Runs at other seeds (`SEEDS="1 2" sh bench/quality_modes.sh` writes
`<master>-<states>-seed<N>.json`; `quality_torchao.py --seed N` records its seed) add a second
table: per mode, the val loss at each seed, the mean, the spread (max - min) and the mean against
the baseline's mean; quality.json gets the same under "seeds".

    OUT=/tmp/fz_quality SEEDS="1 2" COMBOS="fp32:fp32 bf16-kahan:int8" sh bench/quality_modes.sh
    python bench/quality_torchao.py --seed 1 >> /tmp/fz_quality/torchao.jsonl
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

COMBOS = [
    ("fp32", "fp32"),
    ("bf16-kahan", "int8"),
    ("bf16-kahan", "fp32"),
    ("bf16-sr", "int8"),
    ("bf16", "fp32"),
    ("fp32", "int8"),
]


def main(src: Path, dst: Path) -> None:
    runs = {}
    for master, states in COMBOS:
        f = src / f"{master}-{states}.json"
        if not f.is_file():
            continue
        s = json.loads(f.read_text())
        runs[f"{master}+{states}"] = {
            "master": master,
            "states": states,
            "val_loss": s["val_loss"],
            "train_loss": s["train_loss"],
            "steps": s["steps"][-1]["step"] if s["steps"] else 0,
            "optimizer_bytes_per_rank": s["resident_bytes"]["optimizer"],
            "world_size": s["world_size"],
            "stage": s["stage"],
            "param_elements": s["params"],
            "device": s["device"],
        }
    base = runs.get("fp32+fp32", {}).get("val_loss")
    for r in runs.values():
        r["vs_baseline"] = None if base is None else r["val_loss"] / base - 1
    peers, other_seeds = [], []
    tao = src / "torchao.jsonl"
    if tao.is_file():
        for line in tao.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if r.get("seed", 0) != 0:  # lines from before --seed are seed 0
                    other_seeds.append(r)
                    continue
                r["vs_baseline"] = None if base is None else r["val_loss"] / base - 1
                r["optimizer_bytes_per_param"] = r["optimizer_state_bytes"] / r["param_elements"]
                peers.append(r)
    seeds = _seed_rows(src, runs, peers, other_seeds)
    out = {
        "config": "fusedzero train, default config, 500 steps, seed 0, --param-dtype bf16",
        "runs": runs,
        "peers": peers,
    }
    if seeds:
        out["seeds"] = seeds
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "quality.json").write_text(json.dumps(out, indent=1) + "\n")
    # Every ZeroAdamW run here has bf16 params (2 B/param); torchao's params are fp32 or bf16.
    lines = [
        "| optimizer | master / params | states | final val loss | vs baseline | "
        "optimizer bytes/param | params + optimizer bytes/param |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs.values():
        vs = "-" if r["vs_baseline"] is None else f"{100 * r['vs_baseline']:+.2f}%"
        # Stage >= 1 shards the optimizer state: per rank x W over the params is per param.
        per = r["optimizer_bytes_per_rank"] * r["world_size"] / r["param_elements"]
        lines.append(
            f"| ZeroAdamW (W={r['world_size']}) | {r['master']} | {r['states']} | "
            f"{r['val_loss']:.4f} | {vs} | {per:.3f} | {2 + per:.3f} |"
        )
    for r in peers:
        vs = "-" if r["vs_baseline"] is None else f"{100 * r['vs_baseline']:+.2f}%"
        master = "bf16 params, stochastic rounding" if r["bf16_stochastic_round"] else "fp32 params"
        total = (2 if r["params"] == "bf16" else 4) + r["optimizer_bytes_per_param"]
        lines.append(
            f"| torchao AdamW8bit (1 process) | {master} | int8 (dynamic tree, "
            f"block 256) | {r['val_loss']:.4f} | {vs} | "
            f"{r['optimizer_bytes_per_param']:.3f} | {total:.3f} |"
        )
    if seeds:
        lines += [""] + _seed_table(seeds)
    (dst / "quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _tao_mode(r: dict) -> tuple[str, str]:
    return (
        ("bf16 params, stochastic rounding" if r["bf16_stochastic_round"] else "fp32 params"),
        "int8 (dynamic tree, block 256)",
    )


def _seed_rows(src: Path, runs: dict, peers: list, other_seeds: list) -> list:
    """Per mode with a run at a seed other than 0: its val loss at every seed, in the first
    table's row order. Same seed = same init and global batches, so per-seed differences from
    the baseline are paired; the mean and spread are over the seeds that mode has."""
    at_seed: dict[tuple, dict[int, float]] = {}
    for r in runs.values():
        at_seed[("ZeroAdamW", r["master"], r["states"])] = {0: r["val_loss"]}
    for r in peers:
        at_seed[("torchao AdamW8bit", *_tao_mode(r))] = {0: r["val_loss"]}
    seeded = set()
    for master, states in COMBOS:
        for f in src.glob(f"{master}-{states}-seed*.json"):
            m = re.fullmatch(re.escape(f"{master}-{states}-seed") + r"(\d+)\.json", f.name)
            if m is None:
                continue
            key = ("ZeroAdamW", master, states)
            at_seed.setdefault(key, {})[int(m.group(1))] = json.loads(f.read_text())["val_loss"]
            seeded.add(key)
    for r in other_seeds:
        key = ("torchao AdamW8bit", *_tao_mode(r))
        at_seed.setdefault(key, {})[r["seed"]] = r["val_loss"]
        seeded.add(key)
    if not seeded:
        return []
    base = at_seed.get(("ZeroAdamW", "fp32", "fp32"), {})
    base_mean = sum(base.values()) / len(base) if base else None
    rows = []
    for key, losses in at_seed.items():
        if key not in seeded:
            continue
        vals = [losses[k] for k in sorted(losses)]
        mean = sum(vals) / len(vals)
        rows.append(
            {
                "optimizer": key[0],
                "master": key[1],
                "states": key[2],
                "val_loss": {str(k): losses[k] for k in sorted(losses)},
                "mean": mean,
                "spread": max(vals) - min(vals),
                "mean_vs_baseline_mean": None if base_mean is None else mean / base_mean - 1,
                "vs_baseline_same_seed": {
                    str(k): losses[k] / base[k] - 1 for k in sorted(losses) if k in base
                },
            }
        )
    return rows


def _seed_table(rows: list) -> list[str]:
    seeds = sorted({int(k) for r in rows for k in r["val_loss"]})
    cols = " | ".join(f"seed {k}" for k in seeds)
    lines = [
        f"Seed-to-seed: final val loss per `--seed` (model init and data order), modes rerun "
        f"at seeds {', '.join(map(str, seeds))}. Spread = max - min over the seeds; the last "
        "column is each seed's val loss against the baseline's at the same seed.",
        "",
        f"| optimizer | master / params | states | {cols} | mean | spread (max - min) | "
        "mean vs baseline mean | vs baseline, same seed |",
        "| --- | --- | --- | " + " | ".join("---" for _ in seeds) + " | --- | --- | --- | --- |",
    ]
    for r in rows:
        per = " | ".join(
            f"{r['val_loss'][str(k)]:.4f}" if str(k) in r["val_loss"] else "-" for k in seeds
        )
        vs = (
            "-"
            if r["mean_vs_baseline_mean"] is None
            else f"{100 * r['mean_vs_baseline_mean']:+.2f}%"
        )
        same = " / ".join(f"{100 * v:+.2f}%" for v in r["vs_baseline_same_seed"].values()) or "-"
        opt = (
            "ZeroAdamW (W=2)" if r["optimizer"] == "ZeroAdamW" else "torchao AdamW8bit (1 process)"
        )
        lines.append(
            f"| {opt} | {r['master']} | {r['states']} | {per} | {r['mean']:.4f} | "
            f"{r['spread']:.4f} ({100 * r['spread'] / r['mean']:.2f}%) | {vs} | {same} |"
        )
    return lines


TABLE = Path("bench/quality/quality.md")  # relative to the repo root


def report_section(table: str) -> str:
    """The memory modes' training quality: the table `bench/quality_modes.py` generates from the
    committed run summaries in bench/quality/raw (tests/app/test_bench_report.py regenerates it)."""
    return "\n".join(
        [
            "## Memory modes: training quality (`bench/quality_modes.py`)",
            "",
            "`fusedzero train`, default config (GPT 2 x 128, 500 steps, seed 0, stage 2, W=2 gloo "
            "ranks, CPU), bf16 params, once per (master, states); the baseline is fp32 master and "
            "fp32 states. torchao's AdamW8bit runs the same model, init, global batches, schedule, "
            "clip and validation set in one process (`bench/quality_torchao.py`). The first table "
            "is seed 0, one run each, fusedzero's made at commit 7500baf (the shipped grouped "
            "kernel), torchao's at d61119a (its side does not use our kernels). The second, where "
            "present, reruns some modes at other seeds (`--seed`: model init and data order; "
            "made at f7c9c12-7903324, whose changes since 7500baf are the gloo transport's only, "
            "bitwise the same losses); a seed moves the loss of every mode together, so each "
            "mode's difference from the baseline at the same seed is the comparison to read. "
            "Tables generated by `python bench/quality_modes.py "
            "bench/quality/raw` from the committed summaries in `bench/quality/raw`.",
            "",
            table.rstrip("\n"),
            "",
        ]
    )


if __name__ == "__main__":
    main(
        Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fz_quality"),
        Path(__file__).parent / "quality",
    )
