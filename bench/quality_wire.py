"""Gather bench/quality_wire.sh's runs into bench/quality/wire.json, a markdown table
(bench/quality/wire.md) and a plot (bench/quality/wire.png): per grad wire format, the final val
loss at each seed, and whether it lies within the fp32 wire's seed spread.

    OUT=/tmp/fz_wire_quality nice -n 10 sh bench/quality_wire.sh
    python bench/quality_wire.py /tmp/fz_wire_quality          # copies the summaries to
                                                               # bench/quality/wire_raw
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

WIRES = ("fp32", "bf16", "int8")


def load(src: Path) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for f in sorted(src.glob("*-seed*.json")):
        m = re.fullmatch(r"(\w+)-seed(\d+)\.json", f.name)
        if m and m.group(1) in WIRES:
            runs.setdefault(m.group(1), {})[int(m.group(2))] = json.loads(f.read_text())
    return {w: runs[w] for w in WIRES if w in runs}


def summarize(runs: dict[str, dict[int, dict]]) -> dict:
    base = runs.get("fp32", {})
    lo = min((s["val_loss"] for s in base.values()), default=None)
    hi = max((s["val_loss"] for s in base.values()), default=None)
    rows = {}
    for w in WIRES:
        if w not in runs:
            continue
        vals = {k: s["val_loss"] for k, s in sorted(runs[w].items())}
        mean = sum(vals.values()) / len(vals)
        one = next(iter(runs[w].values()))
        rows[w] = {
            "val_loss": {str(k): v for k, v in vals.items()},
            "mean": mean,
            "spread": max(vals.values()) - min(vals.values()),
            "vs_fp32_same_seed": {
                str(k): v - base[k]["val_loss"] for k, v in vals.items() if k in base
            },
            "within_fp32_spread": None if lo is None else lo <= mean <= hi,
            "mean_minus_fp32_mean": None
            if not base
            else mean - sum(b["val_loss"] for b in base.values()) / len(base),
            "all_seeds_within_fp32_range": None
            if lo is None
            else all(lo <= v <= hi for v in vals.values()),
            "grad_bytes_per_step_per_rank": one["comm_bytes_per_step"]["reduce_scatter"]
            + one["comm_bytes_per_step"]["all_to_all"],
            # Has val loss settled? Its fall over the last fifth of the run, worst seed.
            "last_fifth_drop": max(_last_fifth_drop(r) for r in runs[w].values()),
        }
    one = next(iter(next(iter(runs.values())).values()))
    c = one["config"]
    return {
        "config": (
            f"fusedzero train --stage {c['stage']}, W={one['world_size']} gloo (CPU), "
            f"GPT {c['n_layer']} x {c['n_embd']}, block {c['block_size']}, batch "
            f"{c['batch_size']}, {c['steps']} steps, lr {c['lr']}, fp32 params and "
            f"grads, {one['params']:,} params"
        ),
        "fp32_range": [lo, hi],
        "wires": rows,
    }


def _last_fifth_drop(run: dict) -> float:
    """Val loss at 80% of the run minus the final one (the eval nearest before 80%)."""
    val = run["val"]
    at = max(
        (v for v in val if v["step"] <= 0.8 * run["steps"][-1]["step"]), key=lambda v: v["step"]
    )
    return at["val_loss"] - run["val_loss"]


def table(s: dict) -> str:
    seeds = sorted({int(k) for r in s["wires"].values() for k in r["val_loss"]})
    lines = [
        f"Config: {s['config']}.",
        "",
        "| wire | "
        + " | ".join(f"seed {k}" for k in seeds)
        + " | mean | spread (max - min) | mean - fp32 mean | mean within fp32's seed range "
        "| vs fp32, same seed | val loss fall over the last fifth (worst seed) "
        "| grad bytes/step/rank |",
        "| --- | "
        + " | ".join("---" for _ in seeds)
        + " | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w, r in s["wires"].items():
        per = " | ".join(
            f"{r['val_loss'][str(k)]:.4f}" if str(k) in r["val_loss"] else "-" for k in seeds
        )
        same = " / ".join(f"{v:+.4f}" for v in r["vs_fp32_same_seed"].values())
        lines.append(
            f"| {w} | {per} | {r['mean']:.4f} | {r['spread']:.4f} | "
            f"{r['mean_minus_fp32_mean']:+.4f} | "
            f"{'yes' if r['within_fp32_spread'] else 'no'} | {same} | "
            f"{r['last_fifth_drop']:.4f} | "
            f"{r['grad_bytes_per_step_per_rank']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"fp32": "black", "bf16": "tab:blue", "int8": "tab:red"}
    base = runs.get("fp32", {})
    for w, by_seed in runs.items():
        for k, s in sorted(by_seed.items()):
            steps = [v["step"] for v in s["val"]]
            ax.plot(
                steps,
                [v["val_loss"] for v in s["val"]],
                color=colors[w],
                alpha=0.6,
                label=w if k == min(by_seed) else None,
            )
            bx.scatter([w], [s["val_loss"]], color=colors[w])
            if k in base and w != "fp32":
                cx.scatter([w], [s["val_loss"] - base[k]["val_loss"]], color=colors[w])
    ax.set_xlabel("step")
    ax.set_ylabel("val loss")
    ax.set_ylim(top=3.2)
    ax.legend(title="grad wire")
    bx.set_ylabel("final val loss (one point per seed)")
    if base:
        vals = [s["val_loss"] for s in base.values()]
        bx.axhspan(min(vals), max(vals), color="gray", alpha=0.2, label="fp32 seed range")
        bx.legend()
    cx.axhline(0.0, color="black", lw=0.8)
    cx.set_ylabel("final val loss - fp32's, same seed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(src: Path, dst: Path) -> None:
    runs = load(src)
    if not runs:
        raise SystemExit(f"no <wire>-seed<N>.json summaries in {src}")
    s = summarize(runs)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "wire.json").write_text(json.dumps(s, indent=1) + "\n")
    (dst / "wire.md").write_text(table(s))
    plot(runs, dst / "wire.png")
    raw = dst / "wire_raw"
    raw.mkdir(exist_ok=True)
    for f in src.glob("*-seed*.json"):
        shutil.copy(f, raw / f.name)
    print(table(s))


if __name__ == "__main__":
    main(
        Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fz_wire_quality"),
        Path(__file__).parent / "quality",
    )
