"""Gather the final val losses of bench/quality_modes.sh's runs into bench/results/quality.json
and a markdown table (bench/results/quality.md), each next to the baseline (bf16 params, fp32
master and states).

    OUT=/tmp/fz_quality sh bench/quality_modes.sh && python bench/quality_modes.py /tmp/fz_quality
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
            "world_size": s["world_size"], "device": s["device"]}
    base = runs.get("fp32+fp32", {}).get("val_loss")
    for r in runs.values():
        r["vs_baseline"] = None if base is None else r["val_loss"] / base - 1
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "quality.json").write_text(json.dumps(
        {"config": "fusedzero train, default config, 500 steps, seed 0, --param-dtype bf16",
         "runs": runs}, indent=1) + "\n")
    lines = ["| master | states | final val loss | vs baseline | optimizer bytes/rank |",
             "| --- | --- | --- | --- | --- |"]
    for r in runs.values():
        vs = "-" if r["vs_baseline"] is None else f"{100 * r['vs_baseline']:+.2f}%"
        lines.append(f"| {r['master']} | {r['states']} | {r['val_loss']:.4f} | {vs} | "
                     f"{r['optimizer_bytes_per_rank']:,} |")
    (dst / "quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fz_quality"),
         Path(__file__).parent / "results")
