"""Scaling in W without a cluster (script, not collected): one process plays one rank of W on
torch's fake process group (fusedzero/emulate.py).

    python bench/bench_scale.py step        # step() host time per rank vs W, same shard size
    python bench/bench_scale.py construct   # construction time and peak RSS, 8B and 70B shapes
    python bench/bench_scale.py ckpt        # save at W=1024 (1024 shard files), load at W=8

step: a stage-3 ZeroAdamW with a real local shard of about SHARD elements per rank at every W:
the model (Llama-style, 16 blocks) is as wide as W x SHARD elements need, ~1.5e9 params at
W=1024 (a "1B" shape), 12M at W=8; same number of blocks, so the same flat buffers and pieces.
Grads are random values written into the grad shard (as a reduce-scatter leaves them); then
`step()` alone is timed (fake collectives: what remains is this rank's host work plus the
update over its shard). Rounds interleave the W values; medians with p20/p80.

construct: each (shape, W, rank) in a fresh subprocess (`fusedzero plan --emulate --json`):
construction wall time and the child's peak RSS (wait4's ru_maxrss).

Env: FUSEDZERO_BENCH_SCALE_SHARD (elements per rank, default 1.5e6), ..._ROUNDS (default 30),
..._THREADS (torch threads, default 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from fusedzero import Precision, Sharding, ShardInit, ZeroAdamW
from fusedzero.emulate import LlamaShape, fake_group, meta_model, param_groups

SHARD = int(float(os.environ.get("FUSEDZERO_BENCH_SCALE_SHARD", "1.5e6")))
ROUNDS = int(os.environ.get("FUSEDZERO_BENCH_SCALE_ROUNDS", "30"))
THREADS = int(os.environ.get("FUSEDZERO_BENCH_SCALE_THREADS", "1"))
WORLDS = (8, 64, 256, 1024)


def scaled_shape(W: int, shard: int = SHARD) -> LlamaShape:
    """16 blocks (SwiGLU 4d, kv d/4), vocab 8d: 248 d^2 params; d sized for W * shard."""
    d = max(16, round((W * shard / 248) ** 0.5 / 16) * 16)
    return LlamaShape(n_layer=16, d=d, ffn=4 * d, vocab=8 * d, n_head=4, n_kv_head=1)


def _rand_init(name: str, out: torch.Tensor, start: int) -> None:
    out.normal_(0, 0.02)


class Rank:
    """One emulated rank's optimizer, kept while its process group is the current one."""

    def __init__(self, W: int) -> None:
        self.W = W
        self.shape = scaled_shape(W)
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(fake_group(W - 1, W))
        model = meta_model(self.shape)
        t = time.perf_counter()
        self.opt = ZeroAdamW(
            param_groups(model),
            stage=3,
            module=model,
            lr=1e-4,
            max_grad_norm=1.0,
            device="cpu",
            precision=Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
            sharding=Sharding(param_init_fn=ShardInit(_rand_init)),
        )
        self.construct_s = time.perf_counter() - t
        self.local = sum(b.layout.local_numel for b in self.opt.flat_groups)

    def step(self) -> float:
        for b in self.opt.flat_groups:
            assert b.grad_shard is not None
            b.grad_shard.normal_()
        # The grads came from here, not from a backward: let step() take them (it refuses a
        # step with no backward since the last one, see [Note: one step per backward]).
        self.opt.grads.grads_since_step = True
        t = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t


def bench_step() -> dict:
    torch.set_num_threads(THREADS)
    times: dict[int, list[float]] = {W: [] for W in WORLDS}
    info = {}
    # One fake group at a time: each W is built, warmed up and timed in turn, ROUNDS steps per
    # visit, visiting the W values round-robin three times to spread machine drift.
    for _visit in range(3):
        for W in WORLDS:
            r = Rank(W)
            for _ in range(2):
                r.step()
            times[W] += [r.step() for _ in range(ROUNDS // 3)]
            info[W] = {
                "params": r.shape.params,
                "d": r.shape.d,
                "local_numel": r.local,
                "buffers": len(r.opt.flat_groups),
                "construct_s": r.construct_s,
            }
            r.stack.close()
            del r
    out = {}
    for W in WORLDS:
        q = torch.quantile(
            torch.tensor(times[W], dtype=torch.float64),
            torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64),
        ).tolist()
        out[W] = dict(
            info[W],
            p20_s=q[0],
            median_s=q[1],
            p80_s=q[2],
            median_per_1m_elements_s=q[1] / info[W]["local_numel"] * 1e6,
        )
    return out


def bench_construct(cases: list[tuple[str, int, int, int, bool]]) -> list[dict]:
    rows = []
    for shape, W, rank, stage, meta in cases:
        cmd = [
            sys.executable,
            "-m",
            "fusedzero.cli",
            "plan",
            "--shape",
            shape,
            "-W",
            str(W),
            "--emulate",
            "--rank",
            str(rank),
            "--stage",
            str(stage),
            "--json",
        ]
        if meta:
            cmd.append("--meta")
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        stdout = p.stdout.read() if p.stdout else ""
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        if status != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with status {status}")
        e = json.loads(stdout)["emulation"]
        rows.append(
            {
                "shape": shape,
                "W": W,
                "rank": rank,
                "stage": stage,
                "materialized": e["materialized"],
                "resident_bytes": e["resident_bytes"],
                "construct_s": e["construct_s"],
                "process_s": wall,
                "peak_rss_bytes": usage.ru_maxrss * 1024,
            }
        )
    return rows


CKPT_SHAPE = LlamaShape(n_layer=2, d=64, ffn=128, vocab=256, n_head=4, n_kv_head=2)


def _ckpt_opt() -> ZeroAdamW:
    model = meta_model(CKPT_SHAPE)
    return ZeroAdamW(
        param_groups(model),
        stage=3,
        module=model,
        device="cpu",
        precision=Precision(param_dtype=torch.bfloat16),
        sharding=Sharding(param_init_fn=ShardInit(_rand_init)),
    )


def bench_ckpt(W: int = 1024, load_world: int = 8) -> dict:
    """Save at W (one emulated rank at a time, W shard files), verify, load into each rank of
    `load_world`: wall times, manifest bytes, this process's RSS."""
    import tempfile

    from fusedzero.checkpoint import _catalog as catalog, _loading as loading
    from fusedzero.emulate import rss_bytes
    from fusedzero.emulate_ckpt import emulated_rank, save_emulated

    with tempfile.TemporaryDirectory() as tmp:
        saved = save_emulated(_ckpt_opt, W, Path(tmp))
        t = time.perf_counter()
        catalog.verify(saved.path)
        verify_s = time.perf_counter() - t
        loads = []
        for r in range(load_world):
            with emulated_rank(r, load_world):
                opt = _ckpt_opt()
                t = time.perf_counter()
                got = loading.load(opt, saved.path)
                loads.append(
                    {"seconds": time.perf_counter() - t, "peak_buffer_bytes": got.peak_buffer_bytes}
                )
        return {
            "params": CKPT_SHAPE.params,
            "save_world": W,
            "load_world": load_world,
            "save_s": saved.seconds,
            "save_s_per_rank": saved.seconds / W,
            "shard_files": saved.shard_files,
            "manifest_bytes": saved.manifest_bytes,
            "verify_s": verify_s,
            "load_s_per_rank": [x["seconds"] for x in loads],
            "load_peak_buffer_bytes": max(x["peak_buffer_bytes"] for x in loads),
            "rss_bytes_sampled_max": max(saved.peak_rss_bytes, rss_bytes()),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


# (shape, W, rank, stage, meta): the local shard is materialised only where it is ~1 GB (the
# 8B shape's at W=8, stage 3, is 16 GB: measured once, 16.6 GB peak RSS, 129 s on a loaded box).
CONSTRUCT_CASES = [
    ("llama-70b", W, r, 3, W < 1024) for W in (64, 256, 1024) for r in (0, W - 1)
] + [("llama-8b", W, W - 1, s, not (s == 3 and W >= 256)) for W in (8, 1024) for s in (1, 2, 3)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["step", "construct", "ckpt"])
    ap.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    if args.part == "step":
        res: object = bench_step()
        print(
            f"step() host time per rank, stage 3, ~{SHARD:.3g} elements per rank, "
            f"{THREADS} thread(s), load {load:.1f}"
        )
        print("| W | params | local elements | median ms | p20-p80 ms | ms per 1M local |")
        print("| --- | --- | --- | --- | --- | --- |")
        for W, r in res.items():  # type: ignore[union-attr]
            print(
                f"| {W} | {r['params']:.3g} | {r['local_numel']:,} | "
                f"{r['median_s'] * 1e3:.2f} | {r['p20_s'] * 1e3:.2f}-{r['p80_s'] * 1e3:.2f} | "
                f"{r['median_per_1m_elements_s'] * 1e3:.2f} |"
            )
        a, b = res[1024], res[8]  # type: ignore[index]
        print(
            f"W=1024 / W=8: {a['median_s'] / b['median_s']:.3f} (medians), "
            f"{a['median_per_1m_elements_s'] / b['median_per_1m_elements_s']:.3f} "
            "(per local element)"
        )
    elif args.part == "construct":
        res = bench_construct(CONSTRUCT_CASES)
        print(
            "| shape | stage | W | rank | local shard | resident GB | construct s | peak RSS GB |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in res:  # type: ignore[union-attr]
            print(
                f"| {r['shape']} | {r['stage']} | {r['W']} | {r['rank']} | "
                f"{'real' if r['materialized'] else 'meta'} | "
                f"{r['resident_bytes'] / 1e9:.3g} | {r['construct_s']:.1f} | "
                f"{r['peak_rss_bytes'] / 1e9:.2f} |"
            )
    else:
        res = bench_ckpt()
        print(json.dumps(res, indent=1))
    print(f"(load average {load:.1f} at start, {os.cpu_count()} CPUs)")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
