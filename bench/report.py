"""Turn benchmark JSON into a markdown report with PNG plots.

    python bench/report.py bench/results -o bench/REPORT.md

Reads every `*.json` in the folder (the per-subject files `bench/conftest.py` writes, or
pytest-benchmark's own `--benchmark-json` output: both are `{"machine_info", "benchmarks"}`),
picks rows by `extra_info["subject"]` (update, step, memory_comm), and writes the report plus its
plots into `<report dir>/report/`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

MB = 1e6


def _sibling(name: str) -> Any:
    """bench/<name>.py as a module (bench/ is a folder of scripts, not a package; its files
    import each other by name, as pytest's rootdir-relative collection lets them)."""
    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(folder: Path) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Machine info per results file, and benchmark rows grouped by subject. Files are read in
    name order (not mtime: a checkout sets mtimes), so the report is a function of the JSON."""
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    infos: dict[str, dict[str, Any]] = {}
    files = sorted(folder.glob("*.json"))
    if not files:
        raise SystemExit(f"no *.json in {folder}: run `pytest bench/ --benchmark-only` first")
    for path in files:
        data = json.loads(path.read_text())
        infos[path.name] = data.get("machine_info", {})
        for b in data.get("benchmarks", []):
            subject = b.get("extra_info", {}).get("subject")
            if subject:
                rows[subject].append(b)
    return infos, rows


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


def _figure(fig: Any, figdir: Path | None, name: str, alt: str) -> list[str]:
    """Write `fig` as figdir/name (None: text only) and return the markdown lines that show it."""
    if figdir is not None:
        fig.tight_layout()
        fig.savefig(figdir / name, dpi=110)
    _plt().close(fig)
    return [f"![{alt}](report/{name})", ""]


# -- update --------------------------------------------------------------------------------------
def _pct_of_copy(x: dict[str, Any]) -> str:
    if "pct_of_copy" not in x:  # results from before the copy was measured
        return "-"
    return f"{x['pct_of_copy']:.0f}% ({x['copy_gbps']:.1f})"


def update_section(rows: list[dict[str, Any]], figdir: Path | None) -> str:
    plt = _plt()
    e = [r["extra_info"] for r in rows]
    e.sort(key=lambda x: (x["device"], x["numel"], x["provider"]))
    lines = [
        [
            x["device"],
            f"{x['numel'] / 2**20:g}M",
            x["provider"],
            _ms(x["time_median"]),
            f"{_ms(x['time_p20'])} - {_ms(x['time_p80'])}",
            x["bytes_per_param_min"],
            x["bytes_per_param_impl"],
            f"{x['gbps_min']:.2f}",
            f"{x['gbps_impl']:.2f}",
            _pct_of_copy(x),
            f"{x['ratio_vs_torch_fused']:.3f}",
        ]
        for x in e
    ]
    timings = sorted({f"{x['device']}: {x['timing']}" for x in e if "timing" in x})
    text = [
        "## Update over a flat shard (`bench_update.py`)",
        "",
        "One AdamW update of N elements. GB/s(min) = bytes the math must touch (28 B/param: "
        "fp32 read p,g,m,v + write p,m,v; bf16 grad/out: read 4+2+4+4, write 4+4+4+2) / "
        "median time; GB/s(impl) = bytes the implementation's passes move / median time. "
        "% of copy = GB/s(min) / the GB/s of a plain device copy of the same bytes "
        "(`dst.copy_(src)`, read + write of 28 B/param), timed in the same rounds: the "
        "fraction of the bandwidth this device delivers that the update achieves. "
        "Providers and the copy are timed round-robin per size"
        + (f" ({'; '.join(timings)})." if timings else "."),
        "",
        _table(
            [
                "device",
                "N",
                "provider",
                "median ms",
                "p20 - p80 ms",
                "B/param min",
                "B/param impl",
                "GB/s min",
                "GB/s impl",
                "% of copy (copy GB/s)",
                "time / torch fused",
            ],
            lines,
        ),
        "",
    ]
    text += [
        "On CPU, fusedzero's fp32 path calls torch's own fused AdamW kernel "
        "(`torch._fused_adamw_`) on the same tensors: its ratio to `torch_fused` compares "
        "torch's kernel with itself (the only difference is the grad written back when a "
        "grad scale is given) and says nothing about our Triton kernel. The row that "
        "measures our CPU code is `fusedzero_bf16` (bf16 grad in, fp32 master, bf16 param "
        "out: cast pass + fused pass + output copy).",
        "",
    ]
    for x in e:
        if x["provider"] in ("fusedzero", "fusedzero_bf16"):
            what = (
                "torch's kernel vs itself"
                if x["provider"] == "fusedzero"
                else "our bf16 path vs torch fused fp32"
            )
            text.append(
                f"- {x['device']} N={x['numel'] / 2**20:g}M: {x['provider']} / "
                f"torch fused = **{x['ratio_vs_torch_fused']:.3f}** ({what})"
            )
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
            pts = sorted(
                (x["numel"], x["gbps_min"], x["time_median"]) for x in sub if x["provider"] == p
            )
            a1.plot([s / 2**20 for s, _, _ in pts], [g for _, g, _ in pts], "o-", label=p)
        copies = sorted({(x["numel"], x["copy_gbps"]) for x in sub if "copy_gbps" in x})
        if copies:  # one copy per size, timed beside the providers
            a1.plot(
                [s / 2**20 for s, _ in copies],
                [g for _, g in copies],
                "k--",
                label="device copy, same bytes",
            )
        a1.set_xscale("log", base=2)
        a1.set_xlabel("elements (M)")
        a1.set_ylabel("effective GB/s (28 B/param)")
        a1.set_title(f"AdamW update, {device}")
        a1.legend(fontsize=8)
        a1.grid(alpha=0.3)
        by = {x["provider"]: x for x in sub if x["numel"] == sizes[-1]}
        xs = range(len(providers))
        a2.bar(
            [i - 0.2 for i in xs],
            [by[p]["bytes_per_param_min"] for p in providers],
            0.4,
            label="needed by the math",
        )
        a2.bar(
            [i + 0.2 for i in xs],
            [by[p]["bytes_per_param_impl"] for p in providers],
            0.4,
            label="moved by the implementation",
        )
        a2.set_xticks(list(xs), providers, rotation=20, fontsize=8)
        a2.set_ylabel("bytes per parameter per update")
        a2.set_title("bytes per param of the update")
        a2.legend(fontsize=8)
        text += _figure(fig, figdir, f"update_{device}.png", f"update {device}")
    return "\n".join(text)


# -- step ----------------------------------------------------------------------------------------
def _span(x: dict[str, Any], key: str) -> str:
    return f"{_ms(x[key + '_median'])} ({_ms(x[key + '_p20'])} - {_ms(x[key + '_p80'])})"


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["overhead_p20"] <= b["overhead_p80"] and b["overhead_p20"] <= a["overhead_p80"]


def _regather(x: dict[str, Any]) -> str:
    """Stage 3's re-gather policy as "reshard" or "keep" ("" elsewhere). DeepSpeed's default keeps
    this small model's params gathered between forward and backward (see its spec's note)."""
    return {"default": "keep"}.get(x.get("regather") or "", x.get("regather") or "")


def _peers_of(x: dict[str, Any], e: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peers of fusedzero row x: same precision, compared at x's stage, same reduce dtype and,
    at stage 3, the same re-gather policy (compare reshard with reshard)."""
    stage = x["stages"][0]
    return [
        p
        for p in e
        if p["family"] not in ("fusedzero", "bare")
        and p["precision"] == x["precision"]
        and stage in p["stages"]
        and p["reduce"] == x["reduce"]
        and (stage != 3 or _regather(p) == _regather(x))
    ]


def headline(e: list[dict[str, Any]]) -> str:
    """Our overhead against the best peer's at every stage, precision and reduce dtype."""
    lines = []
    for x in e:
        if x["family"] != "fusedzero":
            continue
        peers = _peers_of(x, e)
        best = min(peers, key=lambda p: p["overhead_median"]) if peers else None
        if best is None:
            lines.append(
                [
                    x["precision"],
                    x["stages"][0],
                    x["reduce"],
                    x["system"],
                    _span(x, "overhead"),
                    "(no peer reduces in this dtype here)",
                    "",
                    "",
                    "",
                ]
            )
            continue
        tie = _overlap(x, best)
        verdict = (
            "tie (p20-p80 overlap): no ratio can be claimed"
            if tie
            else "faster"
            if x["overhead_median"] < best["overhead_median"]
            else "slower"
        )
        if best["overhead_median"] > 0 and x["overhead_median"] > 0:
            r = x["overhead_median"] / best["overhead_median"]
            ratio = f"{r:.2f}"
            if not tie:
                verdict += f"; target <= 0.5: {'met' if r <= 0.5 else 'not met'}"
        else:  # an overhead at or below zero is noise larger than the overhead itself
            ratio = "n/a (overhead <= 0: below the noise)"
        lines.append(
            [
                x["precision"],
                x["stages"][0],
                x["reduce"],
                x["system"],
                _span(x, "overhead"),
                best["system"],
                _span(best, "overhead"),
                ratio,
                verdict,
            ]
        )
    return _table(
        [
            "precision",
            "stage",
            "reduce",
            "fusedzero",
            "overhead ms median (p20 - p80)",
            "best peer (same precision, stage, reduce dtype; stage 3: re-gather)",
            "its overhead ms",
            "ours / best",
            "verdict",
        ],
        lines,
    )


def _stale_note(e: list[dict[str, Any]]) -> list[str]:
    """Results measured while fusedzero's CPU ranks had their own transport (`info`
    `gloo_collectives` other than "torch"): a warning naming the rows the current code, whose
    only transport is torch.distributed, would not reproduce."""
    old = [
        x["system"] for x in e if (x.get("info") or {}).get("gloo_collectives", "torch") != "torch"
    ]
    if not old:
        return []
    return [
        f"**Stale until rerun:** {', '.join(f'`{s}`' for s in old)} ran fusedzero's "
        "collectives on a shared-memory transport of its own, since removed (torch.distributed "
        "is the only transport: gloo on CPU). Rows suffixed `-torchgloo` are fusedzero on "
        "torch's gloo collectives, what every fusedzero row runs on now. Rerun "
        "`pytest bench/bench_step.py --benchmark-only` and this report to restate them.",
        "",
    ]


def _matmul_note(x: dict[str, Any]) -> str:
    if x.get("bf16_matmul") != "fp32":
        return ""
    return (
        " bf16 linears computed in fp32 from their bf16 operands and rounded to bf16 (this "
        "CPU has no bf16 GEMM; see [Note: bf16 matmuls on CPUs without bf16 units] in "
        "`bench/_systems.py`): the same model for every system."
    )


def step_section(rows: list[dict[str, Any]], figdir: Path | None) -> str:
    plt = _plt()
    order = {"bare": 0, "fusedzero": 1, "torch": 2, "deepspeed": 3}
    e = sorted(
        (r["extra_info"] for r in rows),
        key=lambda x: (
            x["precision"] != "fp32",
            (x["stages"] or [-1])[0],
            order[x["family"]],
            x["system"],
        ),
    )
    x0 = e[0]
    m = x0["model"]
    text = [
        "## Training step and its overhead per stage (`bench_step.py`)",
        "",
        f"GPT {m['n_layer']} layers x {m['n_embd']} wide, {m['params'] / 1e6:.2f}M params, "
        f"global batch {x0['global_batch']} x {m['block_size']} tokens on W={x0['world']} "
        f"gloo ranks, clip {x0['clip']:g} everywhere, {x0['steps']} timed rounds after "
        f"{x0['warmup']} warm-up; each precision is one run in which every system is "
        f"stepped round-robin in the same ranks. Step time = the slower rank's. "
        f"**Overhead** = step time - `bare` step time of the same round (the plain model of "
        f"the same precision: forward, backward, grads dropped; no optimizer, hook or "
        f"wrapper): median and p20 - p80 over the rounds. Two systems tie where their "
        f"p20 - p80 ranges overlap. Timed on a shared machine (see the header): compare "
        f"within a precision, not across runs.{_matmul_note(x0)}",
        "",
        *_stale_note(e),
        "### Overhead: fusedzero vs the best peer",
        "",
        "<!-- headline:begin -->",
        headline(e),
        "<!-- headline:end -->",
        "",
        "### Every system",
        "",
    ]
    lines = []
    for x in e:
        own = x["own_memory"][0]
        own_s = f"{(own['params'] + own['grads'] + own['optimizer']) / MB:.2f}" if own else ""
        comm = ", ".join(f"{k} {v / MB:.2f}" for k, v in x["comm_bytes"].items() if v)
        dtypes = ", ".join(f"{k}: {'/'.join(v)}" for k, v in x.get("comm_dtypes", {}).items())
        lines.append(
            [
                x["precision"],
                "/".join(map(str, x["stages"])) or "-",
                x["system"],
                x["reduce"] or "-",
                x["regather"] or "-",
                _span(x, "time"),
                _span(x, "overhead") if x["family"] != "bare" else "-",
                f"{x['comm_bytes_total'] / MB:.2f}",
                comm or "0",
                dtypes or "-",
                f"{x['tensor_bytes'][0] / MB:.2f}",
                own_s,
                f"{x['last_loss']:.4f}",
            ]
        )
    text += [
        _table(
            [
                "precision",
                "stage",
                "system",
                "reduce",
                "stage-3 re-gather",
                "step ms median (p20 - p80)",
                "overhead ms median (p20 - p80)",
                "comm MB/step",
                "comm by kind (MB)",
                "dtypes seen on the wire (Python collectives)",
                "resident MB/rank",
                "opt.memory() MB",
                "loss at last step",
            ],
            lines,
        ),
        "",
    ]
    for x in e:
        i = x.get("info") or {}
        note = x.get("note", "")
        if "deepspeed" in i or note:
            ds = (
                f"DeepSpeed {i['deepspeed']}, optimizer {i['optimizer']}, backend "
                f"{i['comm_backend']}. "
                if "deepspeed" in i
                else ""
            )
            text.append(f"- `{x['system']}`: {ds}{note}")
    text += [
        "",
        "fusedzero's own collectives are counted by its own counter (`opt.comm`), not by "
        "the wrapper, so their dtype shows in the bytes (a bf16 reduce-scatter of the grads "
        "moves half the fp32 bytes), not in the dtypes column, which shows only its "
        "grad-norm all-reduce.",
        "",
    ]

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = {"fusedzero": "C0", "torch": "C1", "deepspeed": "C2"}
    for a, prec in zip(axes, ("fp32", "bf16")):
        sub = [x for x in e if x["precision"] == prec and x["family"] != "bare"]
        for i, x in enumerate(sub):
            med = x["overhead_median"] * 1e3
            err = [[med - x["overhead_p20"] * 1e3], [x["overhead_p80"] * 1e3 - med]]
            a.bar(i, med, 0.8, yerr=err, color=colors[x["family"]], capsize=2)
        a.set_xticks(range(len(sub)), [x["system"] for x in sub], rotation=70, fontsize=7)
        a.set_ylabel("overhead ms (step - bare; median, bars p20-p80)")
        a.set_title(f"overhead per system, {prec}")
        a.grid(axis="y", alpha=0.3)
    text += _figure(fig, figdir, "step.png", "overhead per system")
    return "\n".join(text)


# -- memory and communication ---------------------------------------------------------------------
def memory_section(rows: list[dict[str, Any]], figdir: Path | None) -> str:
    plt = _plt()
    e = sorted((r["extra_info"] for r in rows), key=lambda x: (x["stage"], x["world"]))
    text = [
        "## Resident bytes and communication per stage and world size (`bench_memory_comm.py`)",
        "",
        f"bf16 params and grads, fp32 master + moments; GPT with "
        f"{e[0]['model']['params'] / 1e6:.2f}M params (Psi = padded elements of the flat "
        f"buffers). Measured `opt.memory()` / `opt.comm` of rank 0 after a step vs the ZeRO "
        f"formulas.",
        "",
    ]
    lines = []
    for x in e:
        m, f = x["memory"][0], x["memory_formula"]
        lines.append(
            [
                x["stage"],
                x["world"],
                x["psi_padded"],
                f"{m['params'] / MB:.2f}",
                f"{m['grads'] / MB:.2f}",
                f"{m['optimizer'] / MB:.2f}",
                f"{m['total'] / MB:.2f}",
                f"{f['total'] / MB:.2f}",
                "yes" if x["memory_matches_formula"] else "**no**",
                f"{sum(x['comm_bytes'].values()) / MB:.2f}",
                f"{sum(x['comm_formula'].values()) / MB:.2f}",
                "yes" if x["comm_matches_formula"] else "**no**",
            ]
        )
    text += [
        _table(
            [
                "stage",
                "W",
                "Psi",
                "params MB",
                "grads MB",
                "optimizer MB",
                "total MB",
                "formula MB",
                "match",
                "comm MB/step",
                "formula MB",
                "match",
            ],
            lines,
        ),
        "",
    ]
    u = e[0]["update_bytes_per_param"]
    text += [
        f"Update bytes per parameter from the kernel's streams: reads {u['reads']}, writes "
        f"{u['writes']}: **{u['kernel']} B/param** for the Triton kernel; the CPU torch "
        f"path moves {u['cpu_path']} B/param (grad cast pass, grad write-back by "
        f"torch's fused kernel, output copy pass).",
        "",
    ]

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    worlds = sorted({x["world"] for x in e})
    for s in sorted({x["stage"] for x in e}):
        pts = [x for x in e if x["stage"] == s]
        c = f"C{s}"
        a1.plot(
            [x["world"] for x in pts],
            [x["memory"][0]["total"] / MB for x in pts],
            "o",
            color=c,
            ms=8,
            label=f"stage {s} measured",
        )
        a1.plot(
            [x["world"] for x in pts],
            [x["memory_formula"]["total"] / MB for x in pts],
            "--",
            color=c,
            label=f"stage {s} formula",
        )
        a2.plot(
            [x["world"] for x in pts],
            [sum(x["comm_bytes"].values()) / MB for x in pts],
            "o",
            color=c,
            ms=8,
            label=f"stage {s} measured",
        )
        a2.plot(
            [x["world"] for x in pts],
            [sum(x["comm_formula"].values()) / MB for x in pts],
            "--",
            color=c,
            label=f"stage {s} formula",
        )
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


HEADLINE = re.compile(r"<!-- headline:begin -->\n.*?<!-- headline:end -->", re.S)
COMMAND = "python bench/report.py bench/results -o bench/REPORT.md"


def _capability(i: dict[str, Any]) -> str:
    return f" ({i['cpu_capability']})" if i.get("cpu_capability") else ""


def _machine(name: str, i: dict[str, Any]) -> str:
    load = ", ".join(f"{x:.2f}" for x in i.get("loadavg_at_end") or [])
    return (
        f"- `{name}`: commit {i.get('commit') or '?'}, {i.get('datetime', '?')}; "
        f"{i.get('cpu_count')} CPUs{_capability(i)}, torch {i.get('torch')} "
        f"({i.get('torch_threads')} "
        f"threads), CUDA: {i.get('cuda') or 'none'}; load average at end {load}"
    )


def render(folder: Path, out: Path, plots: bool = True, root: Path = Path(".")) -> str:
    """The report's text; with `plots`, also its PNGs in `<out dir>/report/`. `folder` is read
    relative to `root` and named in the text as given."""
    infos, rows = load(root / folder)
    figdir = out.parent / "report" if plots else None
    if figdir is not None:
        figdir.mkdir(parents=True, exist_ok=True)
    parts = [
        "# fusedzero benchmark report",
        "",
        f"Generated by `{COMMAND}` from the committed raw results in `{folder.as_posix()}` "
        "(one JSON per bench file, written by `pytest bench/ --benchmark-only`). Where "
        "and when each was measured:",
        "",
    ]
    parts += [_machine(n, i) for n, i in infos.items()] + [""]
    sections = {"update": update_section, "step": step_section, "memory_comm": memory_section}
    for subject, fn in sections.items():
        if rows.get(subject):
            parts.append(fn(rows[subject], figdir))
    quality = _sibling("quality_modes")
    if (root / quality.TABLE).is_file():
        parts.append(quality.report_section((root / quality.TABLE).read_text()))
    return "\n".join(parts)


def headline_block(report: str) -> str:
    m = HEADLINE.search(report)
    if m is None:
        raise SystemExit("the report has no headline table (no step results?)")
    return m.group(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="folder of benchmark JSON files")
    ap.add_argument("-o", "--output", type=Path, default=Path("bench/REPORT.md"))
    ap.add_argument("--no-plots", action="store_true", help="text only (no PNG written)")
    a = ap.parse_args(argv)
    text = render(a.results, a.output, plots=not a.no_plots)
    a.output.write_text(text)
    print(f"wrote {a.output}" + ("" if a.no_plots else f" and plots in {a.output.parent}/report"))


if __name__ == "__main__":
    main()
