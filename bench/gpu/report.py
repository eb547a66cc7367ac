"""bench/gpu/REPORT.md from the raw results `bench/gpu/run.sh` writes (bench/gpu/results/).

    python bench/gpu/report.py bench/gpu/results -o bench/gpu/REPORT.md

A function of the committed JSON only (no torch, no GPU needed to regenerate it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
from pathlib import Path
from typing import Any, NamedTuple

BENCH = Path(__file__).resolve().parents[1]
# The step rows' files, one per shape (run.sh and lease.sh write them), in the report's order.
STEP_ROWS = ("step_gpt2-124m.json", "step_llama-255m.json", "step_graph_gpt2-124m.json")


def _bench_report() -> Any:
    """bench/report.py, for its peer matching (same precision, stage, reduce dtype, policy)."""
    spec = importlib.util.spec_from_file_location("bench_report_cpu", BENCH / "report.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _read(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def doctor_section(d: dict[str, Any]) -> str:
    rows = [[r["check"], r["status"], r["detail"].replace("|", "/")] for r in d["rows"]]
    return "## `fusedzero doctor`\n\n" + _table(["check", "status", "detail"], rows)


def update_section(d: dict[str, Any]) -> str:
    rows = []
    for b in sorted(
        d["benchmarks"], key=lambda b: (b["extra_info"]["numel"], b["extra_info"]["provider"])
    ):
        e = b["extra_info"]
        rows.append(
            [
                f"{e['numel'] >> 20}M",
                e["provider"],
                f"{e['time_median'] * 1e3:.3f}",
                e["bytes_per_param_impl"],
                f"{e['gbps_min']:.0f}",
                f"{e['pct_of_copy']:.0f}%",
                f"{e['ratio_vs_torch_fused']:.2f}",
            ]
        )
    return (
        "## The update, one flat shard (`bench/bench_update.py`, CUDA rows)\n\n"
        "Median of interleaved rounds of `triton.testing.do_bench` (CUDA events, L2 flushed "
        "between reps); fusedzero through `AdamWPlan` (planned once, as the optimizer "
        "does). GB/s counts the bytes the update must touch.\n\n"
        + _table(
            [
                "elements",
                "provider",
                "median ms",
                "B/param moved",
                "GB/s",
                "of a device copy",
                "time vs torch fused",
            ],
            rows,
        )
    )


def modes_section(d: dict[str, Any]) -> str:
    rows = [
        [
            r["mode"],
            f"{r['block']}x{r['warps']}" + (" (shipped)" if r["shipped"] else ""),
            f"{r['seconds'] * 1e3:.3f}",
            f"{r['bytes_per_param']:g}",
            f"{r['gbps']:.0f}",
            f"{100 * r['gbps'] / d['copy_gbps']:.0f}%",
        ]
        for r in d["rows"]
    ]
    return (
        f"## The grouped kernel per memory mode ({d['numel'] >> 20}M elements, "
        "`bench/gpu/update_modes.py`)\n\n"
        f"Device copy: {d['copy_gbps']:.0f} GB/s; torch.optim.AdamW(fused=True), fp32: "
        f"{d['torch_fused_fp32_seconds'] * 1e3:.3f} ms ({d['torch_fused_gbps']:.0f} GB/s "
        "at 28 B/param). Launch shapes other than the shipped one are a sweep.\n\n"
        + _table(["mode", "BLOCK x warps", "ms", "B/param", "GB/s", "of copy"], rows)
    )


def probe_section(d: dict[str, Any]) -> str:
    par = [[r["stage"], f"{r['worst_rel_diff']:.1e}"] for r in d["rows"] if r["check"] == "parity"]
    errors = [r for r in d["rows"] if "error" in r]
    facts = []
    for r in (r for r in d["rows"] if r["check"] == "step"):
        k = r["kernels"]
        adamw = sum(n for name, n in k.items() if "grouped_adamw" in name)
        sumsq = sum(n for name, n in k.items() if "grouped_sumsq" in name)
        facts.append(
            [
                r["stage"],
                f"{r['master']} / {r['states']}",
                adamw,
                sumsq,
                sum(k.values()) - adamw - sumsq,
                "none" if not r["host_sync_in_step"] else "SYNC",
                r["memory_report_total"],
                r["allocator_added"] + r["params_before"],
            ]
        )
    out = [
        "## ZeroAdamW on the GPU (`bench/gpu/probe.py`, NCCL, world of one)",
        "",
        "Parity: 5 steps x 2 micro-batches with clipping, fp32, small GPT, against "
        "torch.optim.AdamW + clip_grad_norm_; worst |ours - torch| / max(|torch|, 1e-3) "
        "over all params.",
        "",
        _table(["stage", "worst relative difference"], par),
        "",
        "One `step()` per stage and memory mode (bf16 params, bf16 reduce, clipping on): "
        "CUDA kernels it ran (torch profiler), host syncs (set_sync_debug_mode('error') "
        "around it), and `opt.memory().total` beside what the caching allocator holds for "
        "params + optimizer after 3 steps (bytes added since the model was built, plus the "
        "model's own params, which the flat buffers replace).",
        "",
        _table(
            [
                "stage",
                "master / states",
                "AdamW launches",
                "sum-of-squares launches",
                "other kernels (torch: scalars, norm, casts)",
                "host sync in step()",
                "opt.memory() bytes",
                "allocator bytes",
            ],
            facts,
        ),
    ]
    if errors:
        out += ["", "Errors:", ""] + [
            f"- {e['check']} {e.get('args')}: {e['error'].splitlines()[-1]}" for e in errors
        ]
    return "\n".join(out)


def _compared(d: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each system's row with its overhead, and for ours the best peer's row (bench/report.py's
    matching: same precision, stage, reduce dtype and stage-3 policy)."""
    peers_of = _bench_report()._peers_of
    rows = [dict(r) for r in d["rows"]]
    bare = {r["precision"]: r["median_s"] for r in rows if r["family"] == "bare"}
    for r in rows:
        r["overhead_median"] = r["median_s"] - bare.get(r["precision"], float("nan"))
    out = []
    for r in rows:
        peers = peers_of(r, rows) if r["family"] == "fusedzero" else []
        out.append((r, min(peers, key=lambda p: p["overhead_median"]) if peers else None))
    return out


def _vs(r: dict[str, Any], best: dict[str, Any] | None) -> str:
    if best is None or best["overhead_median"] <= 0:
        return ""
    return f"{r['overhead_median'] / best['overhead_median']:.2f} of {best['system']}"


def step_section(runs: list[dict[str, Any]]) -> str:
    out = ["## Step overhead on one GPU (`bench/gpu/step_overhead.py`)", ""]
    for d in runs:
        m = d["model"]
        out += [
            f"GPT {m['n_layer']} layers x {m['n_embd']} wide, {m['block_size']} tokens x "
            f"{d['batch']} sequences per step, clip {d['clip']}, bucket {d['bucket_numel']} "
            f"elements; {d['rounds']} interleaved rounds of {d['steps_per_round']} steps, "
            f"world of one (NCCL); {d['device']}, torch {d['torch']}. Overhead: median step "
            "minus the median bare forward+backward of the same precision.",
            "",
        ]
        table = [
            [
                r["system"],
                r["precision"],
                ",".join(map(str, r["stages"])) or "-",
                r["reduce"] or "-",
                r["regather"] or "-",
                f"{r['median_s'] * 1e3:.2f}",
                f"{r['min_s'] * 1e3:.2f}-{r['max_s'] * 1e3:.2f}",
                f"{r['overhead_median'] * 1e3:.2f}",
                _vs(r, best),
            ]
            for r, best in _compared(d)
        ]
        out += [
            _table(
                [
                    "system",
                    "precision",
                    "stages",
                    "reduce",
                    "stage-3 policy",
                    "median ms",
                    "rounds' range",
                    "overhead ms",
                    "ours vs best peer",
                ],
                table,
            ),
            "",
        ]
        if d.get("errors"):
            out += [f"Not run: {k}: {v}" for k, v in d["errors"].items()] + [""]
    return "\n".join(out)


# The step rows' targets: see [Note: the update's memory-traffic limit]
# (bench/gpu/shape_systems.py) (stages 0-2 within 1.2x the limit over bare; stage 3 within 1 ms of
# stage 2; rounds' range within 10% of their median).
LIMIT_FACTOR, STAGE3_OVER_STAGE2_S, MAX_RANGE = 1.2, 1e-3, 0.10


class StepCheck(NamedTuple):
    """One target of a step-rows run, measured: what is compared, the figures, met or not."""

    what: str
    measured: str
    target: str
    met: bool


def step_rows_checks(d: dict[str, Any]) -> list[StepCheck]:
    """The targets on one shape's step rows (bench/gpu/step_overhead.py --shape):
    stages 0-2 total <= bare + 1.2 x the update's memory-traffic limit, stage 3 <= stage 2 +
    1 ms, each stage faster than DDP + autocast and than FSDP2 (the faster of its two policies),
    and every row's rounds' range <= 10% of its median. A row that did not run is left out."""
    med = {r["system"]: r["median_s"] for r in d["rows"]}
    limit = d["traffic"]["limit_s"]
    out = []
    bare = med.get("bare")
    for s in range(4):
        ours = med.get(f"fusedzero-{s}")
        if ours is None:
            continue
        if s < 3 and bare is not None:
            target = bare + LIMIT_FACTOR * limit
            out.append(
                StepCheck(
                    f"stage {s} total <= bare + {LIMIT_FACTOR} x limit",
                    f"{ours * 1e3:.2f} ms",
                    f"{target * 1e3:.2f} ms",
                    ours <= target,
                )
            )
        if s == 3 and "fusedzero-2" in med:
            target = med["fusedzero-2"] + STAGE3_OVER_STAGE2_S
            out.append(
                StepCheck(
                    "stage 3 total <= stage 2 + 1 ms",
                    f"{ours * 1e3:.2f} ms",
                    f"{target * 1e3:.2f} ms",
                    ours <= target,
                )
            )
        for peer in ("ddp-autocast", "fsdp2"):
            times = [t for n, t in med.items() if n == peer or n.startswith(peer + "-")]
            if times:
                out.append(
                    StepCheck(
                        f"stage {s} faster than {peer}",
                        f"{ours * 1e3:.2f} ms",
                        f"< {min(times) * 1e3:.2f} ms",
                        ours < min(times),
                    )
                )
    if d["rows"]:
        worst = max(d["rows"], key=lambda r: r["range_over_median"])
        spread = worst["range_over_median"]
        out.append(
            StepCheck(
                "every row's rounds' range / median",
                f"{spread:.1%} at worst ({worst['system']})",
                f"<= {MAX_RANGE:.0%}",
                spread <= MAX_RANGE,
            )
        )
    return out


def _rounds(d: dict[str, Any]) -> str:
    done = d.get("rounds_done", d["rounds"])
    return str(done) if done == d["rounds"] else f"{done} (of {d['rounds']}: cut short)"


def step_rows_section(runs: list[dict[str, Any]]) -> str:
    """bench/gpu/step_overhead.py --shape, one JSON per shape."""
    out = [
        "## Step rows at W=1: GPT-2 124M and the 255M Llama (`bench/gpu/step_overhead.py --shape`)",
        "",
    ]
    for d in runs:
        m, t = d["model"], d["traffic"]
        streams = " + ".join(f"{k} {v:g}" for k, v in t["streams"].items())
        bare = {r["system"]: r["median_s"] for r in d["rows"]}.get("bare")
        out += [
            f"**{d['shape']}**{' (tiny: the dry run)' if d.get('tiny') else ''}: "
            f"{m['n_layer']} x {m['n_embd']}, vocab {m['vocab_size']}, {d['batch']} x "
            f"{m['block_size']} tokens, {t['params'] / 1e6:.1f}M params, clip {d['clip']}; "
            f"{_rounds(d)} interleaved rounds of {d['steps_per_round']} steps after "
            f"{d['warmup']} warm-up steps, world of one; {d['device']}, torch {d['torch']}.",
            "",
            f"The update's memory-traffic limit = params x bytes per param / device copy "
            f"bandwidth = {t['params']:,} x {t['bytes_per_param']:g} B ({streams}) / "
            f"{t['copy_gbps']:.0f} GB/s = {t['limit_s'] * 1e3:.3f} ms.",
            "",
        ]
        rows = []
        for r in d["rows"]:
            over = "" if bare is None else f"{(r['median_s'] - bare) * 1e3:.2f}"
            ratio = "" if bare is None else f"{r['median_s'] / bare:.3f}"
            rows.append(
                [
                    r["system"],
                    f"{r['median_s'] * 1e3:.2f}",
                    f"{r['min_s'] * 1e3:.2f}-{r['max_s'] * 1e3:.2f}",
                    f"{r['range_over_median']:.1%}",
                    ratio,
                    over,
                    r["note"],
                ]
            )
        out += [
            _table(
                [
                    "system",
                    "median ms",
                    "rounds' range ms",
                    "range / median",
                    "total / bare",
                    "over bare ms",
                    "what it runs",
                ],
                rows,
            ),
            "",
        ]
        checks = [
            [c.what, c.measured, c.target, "met" if c.met else "MISSED"]
            for c in step_rows_checks(d)
        ]
        out += [_table(["check", "measured", "target", "verdict"], checks), ""]
        if d.get("errors"):
            out += [f"Not run: {k}: {v}" for k, v in d["errors"].items()] + [""]
    return "\n".join(out)


def multi_section(runs: list[dict[str, Any]]) -> str:
    """bench/gpu/multi.py, one JSON per world size."""
    out = [
        "## Every stage at W = 1..N (`bench/gpu/multi.py` under torchrun)",
        "",
        "Parity: 5 steps; fp32 against DDP + torch.optim.AdamW (params: worst |ours - DDP| / "
        "(1e-6 + 1e-6 |DDP|), at most 1 passes), bf16 against FSDP2 MixedPrecisionPolicy("
        "param_dtype=bf16, reduce_dtype=fp32) (losses within 2^-7 relative).",
        "",
    ]
    controlled = [r for d in runs for r in d.get("parity", []) if "control" in r]
    if controlled:  # newer runs: each reference run twice (multi.py's noise floor)
        out[-2] = (
            "Parity: 5 steps; fp32 against DDP + torch.optim.AdamW, bf16 against FSDP2 "
            "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). Each reference "
            "also runs twice from the same seed (the control). fp32 params: the worst "
            "|ours - ref| / (1e-6 + 1e-6 |ref|) passes at most max(3 x the control's, "
            "1); bf16 losses within 2^-7 relative."
        )
        out += [parity_table(runs), ""]
    rows = []
    for d in runs:
        for r in d.get("parity", []) if not controlled else []:
            rows.append(
                [
                    d["world_size"],
                    r["ours"],
                    r["ref"],
                    r["kind"],
                    "error" if "error" in r else ("ok" if r["ok"] else "FAIL"),
                    f"{r['loss_rel_diff']:.1e}" if "loss_rel_diff" in r else "-",
                    f"{r['param_worst_over_tol']:.2f}" if "param_worst_over_tol" in r else "-",
                ]
            )
    if rows:  # (a run with FUSEDZERO_MULTI_SECTIONS may leave a section out)
        out += [
            _table(
                [
                    "W",
                    "ours",
                    "reference",
                    "dtype",
                    "verdict",
                    "worst loss rel. diff",
                    "worst param diff / tolerance",
                ],
                rows,
            ),
            "",
        ]
    rows = []
    for d in runs:
        t = d.get("timing") or {}
        bare = {r["system"]: r["median_s"] for r in t.get("rows", [])}.get("bare")
        for r in t.get("rows", []):
            over = f"{(r['median_s'] - bare) * 1e3:.2f}" if bare is not None else "-"
            rows.append([d["world_size"], r["system"], f"{r['median_s'] * 1e3:.2f}", over])
        rows += [
            [d["world_size"], n, "not run", why.splitlines()[0][:80]]
            for n, why in t.get("errors", {}).items()
        ]
    if rows:
        out += [
            "Step time (median of interleaved rounds) and overhead over `bare` "
            "forward+backward at the same W:",
            "",
            _table(["W", "system", "median ms", "overhead ms"], rows),
            "",
        ]
    rows = [
        [
            d["world_size"],
            e["system"],
            e["timeline"],
            f"{e['exposed'] * 1e-3:.2f}",
            f"{e['comm'] * 1e-3:.2f}",
            f"{e['span'] * 1e-3:.2f}",
            f"{100 * e['exposed_fraction']:.1f}%",
        ]
        for d in runs
        if (e := d.get("exposed"))
    ]
    if rows:
        out += [
            "Exposed communication (bench/gpu/timeline.py: collective kernel time no "
            "compute kernel overlaps, over the profiled steps' span):",
            "",
            _table(
                [
                    "W",
                    "system",
                    "timeline",
                    "exposed ms",
                    "collectives ms",
                    "span ms",
                    "exposed fraction",
                ],
                rows,
            ),
            "",
        ]
    graphs = [
        (d["world_size"], g)
        for d in runs
        for g in (d["graph"] if isinstance(d.get("graph"), list) else [])
    ]
    if graphs:  # newer runs: under each attention kernel, with an eager twin (the control)
        out += [
            "CUDA graph of a whole step, replayed, against the same steps run eagerly, "
            "beside two eager runs (the control); passes at most max(3 x the control, 0):",
            "",
            _table(
                [
                    "W",
                    "system",
                    "attention",
                    "replays",
                    "max |graph - eager|",
                    "max |eager - eager|",
                    "tolerance",
                    "bit-exact",
                    "verdict",
                ],
                [
                    [
                        w,
                        g["system"],
                        g["attention"],
                        g["replays"],
                        f"{g['max_abs_diff_vs_eager']:.2e}",
                        f"{g['control_max_abs_diff_eager_vs_eager']:.2e}",
                        f"{g['tolerance']:.2e}",
                        "yes" if g["ok_bit_exact"] else "no",
                        "ok" if g["ok"] else "FAIL",
                    ]
                    for w, g in graphs
                ],
            ),
            "",
        ]
    for d in runs:
        if (g := d.get("graph")) and not isinstance(g, list):
            out.append(
                f"CUDA graph of a whole {g['system']} step at W={d['world_size']}: "
                f"{g['replays']} replays, max |replayed - eager| = "
                f"{g['max_abs_diff_vs_eager']:g} ({'ok' if g['ok'] else 'FAIL'})."
            )
        for k, v in d.get("errors", {}).items():
            out.append(f"W={d['world_size']} {k}: error: {v.strip().splitlines()[-1]}")
    return "\n".join(out).rstrip() + "\n"


def parity_table(runs: list[dict[str, Any]]) -> str:
    """Parity rows with their controls, side by side (bench/gpu/multi.py, newer runs)."""
    rows = []
    for d in runs:
        for r in d.get("parity", []):
            if "error" in r:
                rows.append(
                    [
                        d["world_size"],
                        r["ours"],
                        r["ref"],
                        r["kind"],
                        r.get("attention", "-"),
                        "error",
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                    ]
                )
                continue
            c = r["control"]
            fp32 = r["kind"] == "fp32"
            rows.append(
                [
                    d["world_size"],
                    r["ours"],
                    r["ref"],
                    r["kind"],
                    r["attention"],
                    f"{r['loss_rel_diff']:.1e}",
                    f"{c['loss_rel_diff']:.1e}",
                    f"{r['param_worst_over_tol']:.2f}" if fp32 else "-",
                    f"{c['param_worst_over_tol']:.2f}" if fp32 else "-",
                    f"{r['tolerance_over_tol']:.2f}" if fp32 else "-",
                    "ok" if r["ok"] else "FAIL",
                    ("ok" if r["ok_fixed_tolerance"] else "FAIL") if fp32 else "-",
                ]
            )
    return _table(
        [
            "W",
            "ours",
            "reference",
            "dtype",
            "attention",
            "loss rel. diff",
            "control's",
            "param diff / 1e-6 tol",
            "control's",
            "tolerance",
            "verdict",
            "at 1e-6 alone",
        ],
        rows,
    )


def numerics_section(d: dict[str, Any]) -> str:
    """bench/gpu/numerics.py: each AdamW implementation against float64, and attention's
    determinism."""
    rows = [
        [r["impl"], r.get("error") or f"{r['worst_rel']:.1e}", r.get("past_1e-6", "-")]
        for r in d["update"]
    ]
    det = [
        [r["attention"], "yes" if r["grads_bit_equal"] else "no", f"{r['max_abs_diff']:.1e}"]
        for r in d["determinism"]
    ]
    return "\n".join(
        [
            f"## fp32 numerics (`bench/gpu/numerics.py`, {d['device']}, torch {d['torch']})",
            "",
            "5 AdamW steps (lr 3e-3, betas 0.9/0.95, weight decay 0.1) of fp32 params whose grads "
            "span six decades, against the same steps in float64: worst |x - x64| / max(|x64|, "
            "1e-3), and the elements past 1e-6 of that.",
            "",
            _table(["implementation", "worst relative error", "elements past 1e-6"], rows),
            "",
            "The step bench's GPT, forward + backward twice on the same params and batch:",
            "",
            _table(["attention kernels", "grads bit-equal", "max abs difference"], det),
        ]
    )


def phases_section(d: dict[str, Any]) -> str:
    """bench/bench_phases.py --json: each phase's median per system, and the hooks' host time."""
    out = [
        "## Forward, backward, step and zero_grad apart, W = 1 (`bench/bench_phases.py`)",
        "",
        f"{d.get('device_name', d['device'])}, torch {d['torch']}; medians in ms, each phase "
        "ended by a device synchronize.",
    ]
    phases = ("forward", "backward", "step", "zero_grad")
    for model, times in d["phases"].items():
        sh = d["shapes"][model]
        rows = []
        for system, t in times.items():
            med = [statistics.median(t[p]) * 1e3 for p in phases]
            rows.append([system, *(f"{m:.2f}" for m in med), f"{sum(med):.2f}"])
        out += [
            "",
            f"**{model}**: {sh['n_layer']} layers, d {sh['n_embd']}, {sh['batch']} x "
            f"{sh['tokens']} tokens, medians of {len(next(iter(times.values()))['step'])} "
            "steps",
            "",
            _table(["system", *phases, "total"], rows),
        ]
    if "hooks" in d:
        h = d["hooks"]
        n = int(next(iter(h.values()))["params"])
        # Since 07e21c3: the fastest round, and backward plus zero_grad (bare frees its grads
        # in zero_grad, stages 2-3 in backward); earlier files hold medians of backward alone.
        zg = all("backward_zero_grad_us_per_param" in v for v in h.values())
        rows = [
            [
                k,
                f"{v['forward'] * 1e3:.2f}",
                f"{v['backward'] * 1e3:.2f}",
                f"{v['forward_us_per_param']:.1f}",
                f"{v['backward_us_per_param']:.1f}",
            ]
            + ([f"{v['backward_zero_grad_us_per_param']:.1f}"] if zg else [])
            for k, v in h.items()
        ]
        how = ", fastest of its rounds" if zg else ""
        out += [
            "",
            f"Hook host time on this machine's CPU ({n} params of tiny Linear layers, "
            f"thread CPU time{how}; target <= 10 us per param over bare):",
            "",
            _table(
                ["system", "forward ms", "backward ms", "forward us/param", "backward us/param"]
                + (["backward + zero_grad us/param"] if zg else []),
                rows,
            ),
        ]
        s3 = h.get("fusedzero-3", {})
        if "backward_us_per_unit" in s3:  # since 2026-11-26: stage 3 per unit and per param
            coarse = next(k for k in h if k.startswith("fusedzero-3/")).split("/")[1]
            out += [
                "",
                f"Stage 3 apart (from units of 1 and {coarse} layers): backward "
                f"{s3['backward_us_per_unit']:.0f} us per unit + "
                f"{s3['backward_us_per_param_alone']:.1f} us per param; forward "
                f"{s3['forward_us_per_unit']:.0f} us per unit + "
                f"{s3['forward_us_per_param_alone']:.1f} us per param.",
            ]
    return "\n".join(out)


def fake_world_section(d: dict[str, Any]) -> str:
    rows = [
        [
            r["stage"],
            r["world"],
            ",".join(map(str, r["ranks"])),
            "yes" if r["same_on_every_rank"] else "NO",
            ",".join(
                "-" if h is None else ("SYNC" if h else "none") for h in r["host_sync_in_step"]
            ),
            r["trace_events"],
            r["kernels_per_step"],
            "; ".join(f"rank {k}: {v.strip().splitlines()[-1]}" for k, v in r["errors"].items()),
        ]
        for r in d["rows"]
    ]
    return (
        "## Large world on one device (`bench/gpu/fake_world.py`, torch's fake process "
        f"group, {d['device']})\n\nCollectives are no-ops; streams, hooks and host syncs "
        "are real. The same trace and kernels at every rank index, and no host sync in "
        "`step()` (after the first, which makes one-time agreements):\n\n"
        + _table(
            [
                "stage",
                "W",
                "rank indexes",
                "same on every rank",
                "host sync in step",
                "trace events",
                "CUDA kernels per step",
                "errors",
            ],
            rows,
        )
    )


# The suite's runs in run.sh (docs/gpu_suite.md): pytest.json's key, the log, the command.
PYTEST_RUNS = (
    ("cuda", "pytest_cuda.txt", "pytest -m cuda"),
    ("suite", "pytest_suite.txt", "pytest (the whole suite, GPU visible)"),
    (
        "interpreter",
        "pytest_interpreter.txt",
        "CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 pytest -m interpreter",
    ),
)


def tests_section(folder: Path, exits: dict[str, int]) -> list[str]:
    """One line per suite run: its exit status and pytest's summary line (runs an older
    run.sh did not make are left out)."""
    lines = []
    for key, name, command in PYTEST_RUNS:
        if exits.get(key) is None:  # not run (older run.sh, FUSEDZERO_GPU_SUITE=cuda)
            continue
        log = folder / name
        last = log.read_text().strip().splitlines()[-1:] if log.exists() else ["(no log)"]
        lines.append(f"- `{command}`: exit {exits[key]}: {last[0] if last else ''}")
    return lines


HEADLINE = re.compile(r"<!-- gpu-headline:begin -->\n.*?<!-- gpu-headline:end -->", re.S)


def headline(folder: Path) -> str:
    """The report's headline table: the update against torch's fused AdamW, and each of our
    step overheads against the best peer's (both from the committed results)."""
    meta = _read(folder, "meta.json") or {}
    rows = []
    upd = _read(folder, "update.json")
    if upd is not None:
        e = {
            (b["extra_info"]["provider"], b["extra_info"]["numel"]): b["extra_info"]
            for b in upd["benchmarks"]
        }
        n = min(k[1] for k in e)
        ours, ref = e[("fusedzero_bf16", n)], e[("torch_fused", n)]
        rows.append(
            [
                f"AdamW update, {n >> 20}M params (bf16 grad + bf16 copy out)",
                f"{ours['time_median'] * 1e3:.3f} ms ({ours['pct_of_copy']:.0f}% of copy)",
                f"{ref['time_median'] * 1e3:.3f} ms torch fused (fp32)",
                f"{ours['time_median'] / ref['time_median']:.2f}",
            ]
        )
    for name in STEP_ROWS[:2]:
        d = _read(folder, name)
        med = {r["system"]: r["median_s"] for r in (d or {}).get("rows", [])}
        peers = {n: t for n, t in med.items() if n.startswith(("ddp", "fsdp2"))}
        if not peers:
            continue
        best = min(peers, key=peers.__getitem__)
        rows += [
            [
                f"step total, {d['shape']}, {n}",
                f"{t * 1e3:.2f} ms",
                f"{peers[best] * 1e3:.2f} ms {best}",
                f"{t / peers[best]:.2f}",
            ]
            for n, t in med.items()
            if n.startswith("fusedzero")
        ]
    for name in ("step_fp32.json", "step_bf16.json"):
        d = _read(folder, name)
        for r, best in _compared(d) if d else []:
            if best is not None and best["overhead_median"] > 0:
                rows.append(
                    [
                        f"step overhead, {r['system']}",
                        f"{r['overhead_median'] * 1e3:.2f} ms",
                        f"{best['overhead_median'] * 1e3:.2f} ms {best['system']}",
                        f"{r['overhead_median'] / best['overhead_median']:.2f}",
                    ]
                )
    return "\n".join(
        [
            "<!-- gpu-headline:begin -->",
            f"{meta.get('machine', '?')}, commit {meta.get('commit', '?')}, "
            f"{meta.get('date', '?')}; "
            f"`bash bench/gpu/{'lease.sh' if meta.get('lease') else 'run.sh'}`, then "
            f"`{command(folder)}`",
            "",
            _table(["measured", "fusedzero", "best peer", "ratio"], rows),
            "<!-- gpu-headline:end -->",
        ]
    )


def command(folder: Path) -> str:
    """The command that regenerates the report of `folder` (bench/gpu/results: the committed
    bench/gpu/REPORT.md; an archived lease: the REPORT.md inside it)."""
    root = Path(__file__).resolve().parents[2]
    try:
        rel = folder.resolve().relative_to(root).as_posix()
    except ValueError:
        rel = str(folder)
    out = "bench/gpu/REPORT.md" if rel == "bench/gpu/results" else f"{rel}/REPORT.md"
    return f"python bench/gpu/report.py {rel} -o {out}"


def lease_section(folder: Path) -> str:
    """bench/gpu/lease.sh's pieces: exit status (124: cut by its timeout) and seconds."""
    rows = [line.split("\t") for line in (folder / "lease.tsv").read_text().splitlines() if line]
    return "## The lease's pieces (`bench/gpu/lease.sh`)\n\n" + _table(
        ["piece", "exit (124: cut by its time limit)", "seconds"], rows
    )


def render(folder: Path) -> str:
    meta = _read(folder, "meta.json") or {}
    script = "lease.sh" if meta.get("lease") else "run.sh"
    parts = [
        "# GPU results",
        "",
        f"Generated by `{command(folder)}` "
        f"from the JSON that `bash bench/gpu/{script}` wrote "
        f"(commit {meta.get('commit', '?')}, {meta.get('date', '?')}, "
        f"{meta.get('machine', '?')}).",
        "",
        headline(folder),
    ]
    if (folder / "lease.tsv").exists():
        parts += ["", lease_section(folder)]
    for name, fn in (
        ("doctor.json", doctor_section),
        ("update.json", update_section),
        ("update_modes.json", modes_section),
        ("probe.json", probe_section),
    ):
        d = _read(folder, name)
        if d is not None:
            parts += ["", fn(d)]
    shapes = [d for n in STEP_ROWS if (d := _read(folder, n))]
    if shapes:
        parts += ["", step_rows_section(shapes)]
    steps = [d for n in ("step_fp32.json", "step_bf16.json") if (d := _read(folder, n))]
    if steps:
        parts += ["", step_section(steps)]
    # By name, then W (stable): multi_wW.json, then lease.sh's multi_w1_default.json.
    multi = sorted(
        (json.loads(p.read_text()) for p in sorted(folder.glob("multi_w*.json"))),
        key=lambda d: d["world_size"],
    )
    if multi:
        parts += ["", multi_section(multi)]
    numerics = _read(folder, "numerics.json")
    if numerics is not None:
        parts += ["", numerics_section(numerics)]
    phases = _read(folder, "phases.json")
    if phases is not None:
        parts += ["", phases_section(phases)]
    fake = _read(folder, "fake_world.json")
    if fake is not None:
        parts += ["", fake_world_section(fake)]
    tests = _read(folder, "pytest.json")
    if tests is not None:
        parts += ["", "## Tests on this machine", ""] + tests_section(folder, tests)
    failed = sorted(p.name for p in folder.glob("*.failed"))
    if failed:
        parts += ["", "Failed or hung: " + ", ".join(failed)]
    return "\n".join(parts).rstrip("\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("-o", "--out", type=Path, default=None)
    args = ap.parse_args()
    text = render(args.folder)
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
