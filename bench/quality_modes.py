"""Gather the final val losses of bench/quality_modes.sh's runs into bench/quality/quality.json
and a markdown table (bench/quality/quality.md), each next to the baseline (bf16 params, fp32
master and states), with torchao's AdamW8bit runs (bench/quality_torchao.py, JSON lines) beside.

    OUT=/tmp/fz_quality sh bench/quality_modes.sh
    python bench/quality_torchao.py >> /tmp/fz_quality/torchao.jsonl
    python bench/quality_torchao.py --bf16 >> /tmp/fz_quality/torchao.jsonl
    python bench/quality_modes.py /tmp/fz_quality
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

COMBOS = [("fp32", "fp32"), ("bf16-kahan", "int8"), ("bf16-kahan", "fp32"), ("bf16-sr", "int8"),
          ("bf16", "fp32"), ("fp32", "int8")]


def main(src: Path, dst: Path) -> None:
    runs = {}
    for master, states in COMBOS:
        f = src / f"{master}-{states}.json"
        if not f.is_file():
            continue
        s = json.loads(f.read_text())
        runs[f"{master}+{states}"] = {
            "master": master, "states": states, "val_loss": s["val_loss"],
            "train_loss": s["train_loss"], "steps": s["steps"][-1]["step"] if s["steps"] else 0,
            "optimizer_bytes_per_rank": s["resident_bytes"]["optimizer"],
            "world_size": s["world_size"], "stage": s["stage"], "param_elements": s["params"],
            "device": s["device"]}
    base = runs.get("fp32+fp32", {}).get("val_loss")
    for r in runs.values():
        r["vs_baseline"] = None if base is None else r["val_loss"] / base - 1
    peers = []
    tao = src / "torchao.jsonl"
    if tao.is_file():
        for line in tao.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                r["vs_baseline"] = None if base is None else r["val_loss"] / base - 1
                r["optimizer_bytes_per_param"] = r["optimizer_state_bytes"] / r["param_elements"]
                peers.append(r)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "quality.json").write_text(json.dumps(
        {"config": "fusedzero train, default config, 500 steps, seed 0, --param-dtype bf16",
         "runs": runs, "peers": peers}, indent=1) + "\n")
    # Every ZeroAdamW run here has bf16 params (2 B/param); torchao's params are fp32 or bf16.
    lines = ["| optimizer | master / params | states | final val loss | vs baseline | "
             "optimizer bytes/param | params + optimizer bytes/param |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs.values():
        vs = "-" if r["vs_baseline"] is None else f"{100 * r['vs_baseline']:+.2f}%"
        # Stage >= 1 shards the optimizer state: per rank x W over the params is per param.
        per = r["optimizer_bytes_per_rank"] * r["world_size"] / r["param_elements"]
        lines.append(f"| ZeroAdamW (W={r['world_size']}) | {r['master']} | {r['states']} | "
                     f"{r['val_loss']:.4f} | {vs} | {per:.3f} | {2 + per:.3f} |")
    for r in peers:
        vs = "-" if r["vs_baseline"] is None else f"{100 * r['vs_baseline']:+.2f}%"
        master = ("bf16 params, stochastic rounding" if r["bf16_stochastic_round"] else
                  "fp32 params")
        lines.append(f"| torchao AdamW8bit (1 process) | {master} | int8 (dynamic tree, "
                     f"block 256) | {r['val_loss']:.4f} | {vs} | "
                     f"{r['optimizer_bytes_per_param']:.3f} | "
                     f"{(2 if r['params'] == 'bf16' else 4) + r['optimizer_bytes_per_param']:.3f} |")
    (dst / "quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fz_quality"),
         Path(__file__).parent / "quality")
