"""Stage 3 from the meta device: construction time and memory beyond the rank's own state, per
init path (script, not collected). One process plays rank W-1 of W on torch's fake process
group (fusedzero/emulate.py); each case runs in a fresh subprocess.

    python bench/bench_shard_init.py                      # llama-70b at W=1024, every provider
    python bench/bench_shard_init.py --shape llama-1b --full

Providers (the `param_init_fn` a user passes):
- `zeros`: a `ShardInit` writing zeros into each local segment (the emulation's default);
- `model`: none, i.e. each module's `reset_parameters()`, run on this rank's elements only
  (fusedzero/_shard_init.py: the default);
- `full-unit`: `FullUnitInit()`, every unit built in full on every rank (the old default; the
  70B shape takes minutes: `--full` asks for it).

"Beyond" is the child's peak RSS during construction (ru_maxrss) minus its RSS before, minus
the optimizer's resident bytes (`ZeroAdamW.memory().total`): what construction held above the
rank's own state. On a machine shared with other jobs, times spread widely; the bytes do not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from fusedzero.emulate import fake_group, meta_model, param_groups, rss_bytes
from fusedzero import Precision, Sharding, ZeroAdamW
from fusedzero import FullUnitInit, ShardInit

shape, W, provider = sys.argv[1], int(sys.argv[2]), sys.argv[3]
init = {"zeros": ShardInit(lambda n, out, s: out.zero_()), "model": None,
        "full-unit": FullUnitInit()}[provider]
m = meta_model(shape)
with fake_group(W - 1, W):
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    opt = ZeroAdamW(param_groups(m), stage=3, module=m, max_grad_norm=1.0, device="cpu",
                    precision=Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
                    sharding=Sharding(param_init_fn=init))
    s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = opt.memory().total
    print(json.dumps({"construct_s": s, "resident": res, "beyond": peak - rss0 - res}))
"""

PROVIDERS = ("zeros", "model", "full-unit")


def run(shape: str, W: int, provider: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, shape, str(W), provider],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-70b")
    ap.add_argument("-W", type=int, default=1024)
    ap.add_argument("--full", action="store_true", help="also the full-unit path (slow)")
    a = ap.parse_args()
    print("| shape | W | init | construct s | resident GiB | beyond GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in PROVIDERS:
        if p == "full-unit" and not a.full:
            continue
        r = run(a.shape, a.W, p)
        print(
            f"| {a.shape} | {a.W} | {p} | {r['construct_s']:.1f} | "
            f"{r['resident'] / 2**30:.3f} | {r['beyond'] / 2**30:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
