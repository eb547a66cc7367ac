"""Turn benchmark JSON into a markdown report with PNG plots.

    python bench/report.py bench/results -o bench/REPORT.md

Reads every `*.json` in the folder (the per-subject files `bench/conftest.py` writes, or
pytest-benchmark's own `--benchmark-json` output: both are `{"machine_info", "benchmarks"}`),
picks rows by `extra_info["subject"]` (update, step, memory_comm), and writes the report plus its
plots into `<report dir>/report/`.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

MB = 1e6


def load(folder: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Machine info (of the newest file) and benchmark rows grouped by subject."""
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    info: dict[str, Any] = {}
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no *.json in {folder}: run `pytest bench/ --benchmark-only` first")
    for path in files:
        data = json.loads(path.read_text())
        info = data.get("machine_info", info)
        for b in data.get("benchmarks", []):
            subject = b.get("extra_info", {}).get("subject")
            if subject:
                rows[subject].append(b)
    return info, rows


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _table(header: list[str], lines: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _figure(fig: Any, figdir: Path, name: str, alt: str) -> list[str]:
    """Write `fig` as figdir/name and return the markdown lines that show it."""
    fig.tight_layout()
    fig.savefig(figdir / name, dpi=110)
    _plt().close(fig)
    return [f"![{alt}](report/{name})", ""]


# -- update --------------------------------------------------------------------------------------
def _pct_of_copy(x: dict[str, Any]) -> str:
    if "pct_of_copy" not in x:  # results from before the copy was measured
        return "-"
    return f"{x['pct_of_copy']:.0f}% ({x['copy_gbps']:.1f})"


def update_section(rows: list[dict[str, Any]], figdir: Path) -> str:
    plt = _plt()
    e = [r["extra_info"] for r in rows]
    e.sort(key=lambda x: (x["device"], x["numel"], x["provider"]))
    lines = [[x["device"], f"{x['numel'] / 2**20:g}M", x["provider"], _ms(x["time_median"]),
              f"{_ms(x['time_p20'])} - {_ms(x['time_p80'])}", x["bytes_per_param_min"],
              x["bytes_per_param_impl"], f"{x['gbps_min']:.2f}", f"{x['gbps_impl']:.2f}",
              _pct_of_copy(x), f"{x['ratio_vs_torch_fused']:.3f}"] for x in e]
    timings = sorted({f"{x['device']}: {x['timing']}" for x in e if "timing" in x})
    text = ["## Update over a flat shard (`bench_update.py`)", "",
            "One AdamW update of N elements. GB/s(min) = bytes the math must touch (28 B/param: "
            "fp32 read p,g,m,v + write p,m,v; bf16 grad/out: read 4+2+4+4, write 4+4+4+2) / "
            "median time; GB/s(impl) = bytes the implementation's passes move / median time. "
            "% of copy = GB/s(min) / the GB/s of a plain device copy of the same bytes "
            "(`dst.copy_(src)`, read + write of 28 B/param), timed in the same rounds: the "
            "fraction of the bandwidth this device delivers that the update achieves. "
            "Providers and the copy are timed round-robin per size"
            + (f" ({'; '.join(timings)})." if timings else "."), "",
            _table(["device", "N", "provider", "median ms", "p20 - p80 ms", "B/param min",
                    "B/param impl", "GB/s min", "GB/s impl", "% of copy (copy GB/s)",
                    "time / torch fused"], lines), ""]
    ratios = [x for x in e if x["provider"] == "fusedzero"]
    for x in ratios:
        r = x["ratio_vs_torch_fused"]
        text.append(f"- {x['device']} N={x['numel'] / 2**20:g}M: fusedzero fp32 / torch fused = "
                    f"**{r:.3f}** ({'within' if r <= 1.1 else 'NOT within'} the 1.1x target)")
    text.append("")
    notes = {x["provider"]: x["bytes_note"] for x in e if x["device"] == "cpu"}
    text += [f"- `{p}`: {n}" for p, n in notes.items()]
    text.append("")

    for device in sorted({x["device"] for x in e}):
        sub = [x for x in e if x["device"] == device]
        providers = sorted({x["provider"] for x in sub})
        sizes = sorted({x["numel"] for x in sub})
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for p in providers:
            pts = sorted((x["numel"], x["gbps_min"], x["time_median"]) for x in sub
                         if x["provider"] == p)
            a1.plot([s / 2**20 for s, _, _ in pts], [g for _, g, _ in pts], "o-", label=p)
        copies = sorted({(x["numel"], x["copy_gbps"]) for x in sub if "copy_gbps" in x})
        if copies:  # one copy per size, timed beside the providers
            a1.plot([s / 2**20 for s, _ in copies], [g for _, g in copies], "k--",
                    label="device copy, same bytes")
        a1.set_xscale("log", base=2)
        a1.set_xlabel("elements (M)")
        a1.set_ylabel("effective GB/s (28 B/param)")
        a1.set_title(f"AdamW update, {device}")
        a1.legend(fontsize=8)
        a1.grid(alpha=0.3)
        by = {x["provider"]: x for x in sub if x["numel"] == sizes[-1]}
        xs = range(len(providers))
        a2.bar([i - 0.2 for i in xs], [by[p]["bytes_per_param_min"] for p in providers], 0.4,
               label="needed by the math")
        a2.bar([i + 0.2 for i in xs], [by[p]["bytes_per_param_impl"] for p in providers], 0.4,
               label="moved by the implementation")
        a2.set_xticks(list(xs), providers, rotation=20, fontsize=8)
        a2.set_ylabel("bytes per parameter per update")
        a2.set_title("bytes per param of the update")
        a2.legend(fontsize=8)
        text += _figure(fig, figdir, f"update_{device}.png", f"update {device}")
    return "\n".join(text)


# -- step ----------------------------------------------------------------------------------------
def step_section(rows: list[dict[str, Any]], figdir: Path) -> str:
    plt = _plt()
    e = sorted((r["extra_info"] for r in rows), key=lambda x: (x["stage"], x["family"] != "fusedzero",
                                                              x["system"]))
    m = e[0]["model"]
    text = ["## Training step per stage (`bench_step.py`)", "",
            f"GPT {m['n_layer']} layers x {m['n_embd']} wide, {m['params'] / 1e6:.2f}M params, "
            f"fp32 params and grads, global batch {e[0]['global_batch']} x {m['block_size']} "
            f"tokens on W={e[0]['world']} gloo ranks, {e[0]['steps']} timed steps after "
            f"{e[0]['warmup']} warmup, every system stepped round-robin in the same ranks. "
            f"Step time = the slower rank's; resident = bytes of distinct tensor storages "
            f"reachable from the system's objects between steps (exact); comm = bytes on the wire "
            f"per rank per step by the ring formulas.", ""]
    lines = []
    for x in e:
        own = x["own_memory"][0]
        own_s = f"{(own['params'] + own['grads'] + own['optimizer']) / MB:.2f}" if own else ""
        comm = ", ".join(f"{k} {v / MB:.2f}" for k, v in x["comm_bytes"].items() if v)
        lines.append([x["stage"], x["system"], _ms(x["time_median"]),
                      f"{_ms(x['time_p20'])} - {_ms(x['time_p80'])}",
                      f"{x['comm_bytes_total'] / MB:.2f}", comm or "0",
                      f"{x['tensor_bytes'][0] / MB:.2f}", own_s,
                      f"{x['rss_growth'][0] / MB:.1f}", f"{x['last_loss']:.4f}"])
    text += [_table(["stage", "system", "median ms", "p20 - p80 ms", "comm MB/step",
                     "comm by kind (MB)", "resident MB/rank", "opt.memory() MB",
                     "RSS growth MB", "loss at last step"], lines), ""]
    infos = {x["system"]: x["info"] for x in e if x.get("info")}
    for s, i in infos.items():
        if "deepspeed" in i:
            text.append(f"- `{s}`: DeepSpeed {i['deepspeed']}, optimizer {i['optimizer']}, "
                        f"backend {i['comm_backend']}")
    text.append("")

    stages = sorted({x["stage"] for x in e})
    families = ["fusedzero", "torch", "deepspeed"]
    colors = {"fusedzero": "C0", "torch": "C1", "deepspeed": "C2"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.27
    for j, fam in enumerate(families):
        for s in stages:
            pts = [x for x in e if x["stage"] == s and x["family"] == fam]
            for x in pts:
                med = x["time_median"] * 1e3
                err = [[med - x["time_p20"] * 1e3], [x["time_p80"] * 1e3 - med]]
                a1.bar(s + (j - 1) * width, med, width, yerr=err, color=colors[fam], capsize=3)
                a1.text(s + (j - 1) * width, 0, x["system"], rotation=90, ha="center",
                        va="bottom", fontsize=7, color="white")
                a2.bar(s + (j - 1) * width, x["tensor_bytes"][0] / MB, width, color=colors[fam])
    for a in (a1, a2):
        a.set_xticks(stages, [f"stage {s}" for s in stages])
        a.bar(0, 0, 0, color=colors["fusedzero"], label="fusedzero")
        a.bar(0, 0, 0, color=colors["torch"], label="torch (DDP / ZeRO-1 / FSDP2)")
        a.bar(0, 0, 0, color=colors["deepspeed"], label="DeepSpeed")
        a.legend(fontsize=8)
        a.grid(axis="y", alpha=0.3)
    a1.set_ylabel("step time, ms (median, bars p20-p80)")
    a1.set_title(f"training step, W={e[0]['world']} gloo ranks")
    a2.set_ylabel("resident tensor MB per rank")
    a2.set_title("resident bytes between steps")
    text += _figure(fig, figdir, "step.png", "step time and resident bytes")
    return "\n".join(text)


# -- memory and communication ---------------------------------------------------------------------
def memory_section(rows: list[dict[str, Any]], figdir: Path) -> str:
    plt = _plt()
    e = sorted((r["extra_info"] for r in rows), key=lambda x: (x["stage"], x["world"]))
    text = ["## Resident bytes and communication per stage and world size "
            "(`bench_memory_comm.py`)", "",
            f"bf16 params and grads, fp32 master + moments; GPT with "
            f"{e[0]['model']['params'] / 1e6:.2f}M params (Psi = padded elements of the flat "
            f"buffers). Measured `opt.memory()` / `opt.comm` of rank 0 after a step vs the ZeRO "
            f"formulas.", ""]
    lines = []
    for x in e:
        m, f = x["memory"][0], x["memory_formula"]
        lines.append([x["stage"], x["world"], x["psi_padded"], f"{m['params'] / MB:.2f}",
                      f"{m['grads'] / MB:.2f}", f"{m['optimizer'] / MB:.2f}",
                      f"{m['total'] / MB:.2f}", f"{f['total'] / MB:.2f}",
                      "yes" if x["memory_matches_formula"] else "**no**",
                      f"{sum(x['comm_bytes'].values()) / MB:.2f}",
                      f"{sum(x['comm_formula'].values()) / MB:.2f}",
                      "yes" if x["comm_matches_formula"] else "**no**"])
    text += [_table(["stage", "W", "Psi", "params MB", "grads MB", "optimizer MB", "total MB",
                     "formula MB", "match", "comm MB/step", "formula MB", "match"], lines), ""]
    u = e[0]["update_bytes_per_param"]
    text += [f"Update bytes per parameter from the kernel's streams: reads {u['reads']}, writes "
             f"{u['writes']}: **{u['kernel']} B/param** for the Triton kernel; the CPU torch "
             f"path moves {u['cpu_path']} B/param (grad cast pass, grad write-back by "
             f"torch's fused kernel, output copy pass).", ""]

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    worlds = sorted({x["world"] for x in e})
    for s in sorted({x["stage"] for x in e}):
        pts = [x for x in e if x["stage"] == s]
        c = f"C{s}"
        a1.plot([x["world"] for x in pts], [x["memory"][0]["total"] / MB for x in pts], "o",
                color=c, ms=8, label=f"stage {s} measured")
        a1.plot([x["world"] for x in pts], [x["memory_formula"]["total"] / MB for x in pts],
                "--", color=c, label=f"stage {s} formula")
        a2.plot([x["world"] for x in pts], [sum(x["comm_bytes"].values()) / MB for x in pts],
                "o", color=c, ms=8, label=f"stage {s} measured")
        a2.plot([x["world"] for x in pts], [sum(x["comm_formula"].values()) / MB for x in pts],
                "--", color=c, label=f"stage {s} formula")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xticks(worlds, [str(w) for w in worlds])
        a.set_xlabel("world size W")
        a.grid(alpha=0.3)
        a.legend(fontsize=7, ncol=2)
    a1.set_ylabel("resident MB per rank")
    a1.set_title("2Psi+2Psi+12Psi, ..., (2+2+12)Psi/W")
    a2.set_ylabel("MB on the wire per rank per step")
    a2.set_title("communication per step")
    text += _figure(fig, figdir, "memory_comm.png", "memory and comm")
    return "\n".join(text)


def render(folder: Path, out: Path) -> str:
    info, rows = load(folder)
    figdir = out.parent / "report"
    figdir.mkdir(parents=True, exist_ok=True)
    parts = ["# fusedzero benchmark report", "",
             f"Generated from `{folder}` by `python bench/report.py`. Machine: "
             f"{info.get('cpu_count')} CPUs, torch {info.get('torch')} "
             f"({info.get('torch_threads')} threads), CUDA: {info.get('cuda') or 'none'}, "
             f"commit {info.get('commit') or '?'}, {info.get('datetime', '')}, load average at "
             f"end {info.get('loadavg_at_end')}.", ""]
    sections = {"update": update_section, "step": step_section, "memory_comm": memory_section}
    for subject, fn in sections.items():
        if rows.get(subject):
            parts.append(fn(rows[subject], figdir))
    text = "\n".join(parts)
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="folder of benchmark JSON files")
    ap.add_argument("-o", "--output", type=Path, default=Path("bench/REPORT.md"))
    a = ap.parse_args(argv)
    render(a.results, a.output)
    print(f"wrote {a.output} and plots in {a.output.parent / 'report'}")


if __name__ == "__main__":
    main()
