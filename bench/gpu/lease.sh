#!/usr/bin/env bash
# The step rows' GPU evidence in one short lease (target: under 4 minutes on an H200 whose python3
# has torch, triton, transformers; docs/gpu.md says what each result means):
#   bash bench/gpu/lease.sh RESULTS_DIR             on a CUDA machine, from a copied checkout
#   bash bench/gpu/lease.sh --dry-run RESULTS_DIR   CPU: tiny shapes, gloo; no install, no tests
# Pieces, most telling first; each runs under `timeout` for at most FUSEDZERO_RUN_TIMEOUT
# seconds (default 75) and never past the lease's own budget, FUSEDZERO_LEASE_S seconds from the
# start (default 225), so a slow piece cannot eat the lease: a cut or failed piece leaves
# NAME.failed, one with no time left NAME.skipped, and the next piece runs.
#   install      pip install --no-deps --no-build-isolation -e .
#   cuda_tests   pytest -m cuda from tests/ (pytest_cuda.txt, pytest.json)
#   step_gpt2    bench/gpu/step_overhead.py --shape gpt2-124m: bare, stages 0-3, DDP + autocast,
#                FSDP2, bf16 (step_gpt2-124m.json); rows are written after every round
#   step_llama   the same on the 255M Llama (step_llama-255m.json)
#   controls_default  bench/gpu/multi.py at W=1 under the default attention kernels: fp32
#                parity at the bench shape beside the reference run twice, and the CUDA graph of
#                a step beside eager vs eager (multi_w1_default.json); where both "failed" at
#                4c9e4f5 without a control
#   controls_math     the same under the math attention kernel (multi_w1.json)
#   step_graph   bare and stage 2 as CUDA graphs beside eager on GPT-2 124M (step_graph_*.json)
#   update       bench/bench_update.py's CUDA rows at 64M params: the kernel vs a device copy
#                (update.json; needs pytest-benchmark)
# then bench/gpu/report.py RESULTS_DIR -o RESULTS_DIR/REPORT.md. A real run names the commit:
# FUSEDZERO_COMMIT, or a clean git tree. ROUNDS / STEPS / WARMUP override the step rows'.
set -euo pipefail
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
R=${1:?usage: bash bench/gpu/lease.sh [--dry-run] RESULTS_DIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
BUDGET=${FUSEDZERO_LEASE_S:-225}
PIECE_MAX=${FUSEDZERO_RUN_TIMEOUT:-75}
REPORT_RESERVE=10  # seconds kept for report.py at the end
export PYTHONUNBUFFERED=1
if [[ $DRY == 0 && -z "${FUSEDZERO_COMMIT:-}" \
      && -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]]; then
  echo "lease.sh: error: the git tree has changes; commit them (the results name the commit)" \
       "or set FUSEDZERO_COMMIT for a copied checkout" >&2
  exit 2
fi
mkdir -p "$R"
R=$(cd "$R" && pwd)
RUNDIR=$(mktemp -d)
trap 'rm -rf "$RUNDIR"' EXIT
if [[ $DRY == 1 ]]; then
  CPU=--cpu
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  export ROUNDS=${ROUNDS:-2} STEPS=${STEPS:-2} WARMUP=${WARMUP:-1}
  BENCH_MODEL=1,32,2,16 BENCH_BATCH=4 BENCH_BUCKET=4096
else
  CPU=
  export TRITON_INTERPRET=0
  # Fewer than run.sh's 7 rounds after 5 warm-up steps: the lease's minutes (docs/gpu.md).
  export ROUNDS=${ROUNDS:-5} STEPS=${STEPS:-10} WARMUP=${WARMUP:-3}
  BENCH_MODEL=12,768,12,1024 BENCH_BATCH=8 BENCH_BUCKET=16777216  # run.sh's bench shape
fi
commit=${FUSEDZERO_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
printf '{"commit": "%s", "date": "%s", "machine": "%s", "gpus": 1, "dry_run": %s, "lease": %s}\n' \
  "$commit" "$(date -u +%F)" "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
  | head -1 || echo cpu)" "$([[ $DRY == 1 ]] && echo true || echo false)" true > "$R/meta.json"
: > "$R/lease.tsv"  # piece, exit status, seconds (report.py shows them)

# piece NAME CMD...: CMD under timeout min(PIECE_MAX, budget left); see the header.
piece() {
  local name=$1 left t0 rc=0
  shift
  left=$((BUDGET - SECONDS - REPORT_RESERVE))
  if ((left < 20)); then
    echo "lease.sh: $name skipped: ${left}s of the lease left" | tee "$R/$name.skipped"
    printf '%s\tskipped\t0\n' "$name" >> "$R/lease.tsv"
    return
  fi
  t0=$SECONDS
  echo "lease.sh: $name (at most $((left < PIECE_MAX ? left : PIECE_MAX))s)"
  # bash -c: a piece may be one of the functions below (exported with the variables they read)
  timeout --kill-after=5 "$((left < PIECE_MAX ? left : PIECE_MAX))" bash -c '"$@"' _ "$@" \
    || rc=$?
  if ((rc != 0)); then
    echo "lease.sh: $name failed or was cut (exit $rc)" | tee "$R/$name.failed"
  fi
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$R/lease.tsv"
}

cuda_tests() {
  local rc=0
  (cd "$ROOT/tests" && env -u TRITON_INTERPRET "$PY" -m pytest -m cuda -q -p no:cacheprovider .) \
    > "$R/pytest_cuda.txt" 2>&1 || rc=$?
  printf '{"cuda": %s, "suite": null, "interpreter": null}\n' "$rc" > "$R/pytest.json"
  return "$rc"
}

step_rows() {  # step_rows SHAPE [--systems A,B]: one JSON per shape, named as report.py reads
  local shape=$1 name=step_$1
  shift
  if [[ "${1:-}" == --graph ]]; then name=step_graph_$shape; shift; fi
  "$PY" "$ROOT/bench/gpu/step_overhead.py" --shape "$shape" "$R/$name.json" $CPU "$@"
}

update_kernel() {  # bench_update.py's CUDA rows at 64M params only (run.sh runs 64M-256M)
  cd "$ROOT/bench" && FUSEDZERO_BENCH_UPDATE_CUDA_SIZES=67108864 "$PY" -m pytest bench_update.py \
    -k cuda --benchmark-only -p no:cacheprovider -q --benchmark-json "$R/update.json"
}

controls() {  # controls ATTENTION OUT.json: one process per attention kernel, each capped
  FUSEDZERO_BENCH_MODEL=$BENCH_MODEL FUSEDZERO_BENCH_BATCH=$BENCH_BATCH \
  FUSEDZERO_BENCH_BUCKET=$BENCH_BUCKET FUSEDZERO_MULTI_SECTIONS=parity,graph \
  FUSEDZERO_PARITY_KINDS=fp32 FUSEDZERO_PARITY_ATTENTION=$1 FUSEDZERO_GRAPH_ATTENTION=$1 \
  STEPS=5 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
    "$ROOT/bench/gpu/multi.py" "$R/$2" $CPU
}

export R ROOT PY CPU BENCH_MODEL BENCH_BATCH BENCH_BUCKET
export -f cuda_tests step_rows controls update_kernel
cd "$RUNDIR"  # nothing below may import ./fusedzero of the source tree by accident
if [[ $DRY == 0 ]]; then
  piece install "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  piece cuda_tests cuda_tests
else
  echo "lease.sh: dry run: install and the cuda tests skipped"
fi
piece step_gpt2 step_rows gpt2-124m
piece step_llama step_rows llama-255m
piece controls_default controls default multi_w1_default.json
piece controls_math controls math multi_w1.json
if [[ $DRY == 0 ]]; then
  piece step_graph step_rows gpt2-124m --graph \
    --systems bare,bare+graph,fusedzero-2,fusedzero-2+graph
  piece update update_kernel
fi
"$PY" "$ROOT/bench/gpu/report.py" "$R" -o "$R/REPORT.md"
echo "lease.sh: ${SECONDS}s; results in $R, report $R/REPORT.md"
