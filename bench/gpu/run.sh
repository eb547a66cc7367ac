#!/usr/bin/env bash
# The GPU proof, one command (docs/gpu.md says what each result means):
#   bash bench/gpu/run.sh [RESULTS_DIR]            on a machine with N >= 1 CUDA GPUs; default
#                                                  bench/gpu/results, then bench/gpu/REPORT.md
#   bash bench/gpu/run.sh --dry-run [RESULTS_DIR]  CPU, gloo, a tiny model, W = 1..2: every
#                                                  script of the proof runs, nothing is measured
#                                                  (default: $TMPDIR/fusedzero-gpu-dry-run)
# Needs fusedzero installed (`pip install .` is enough: everything runs from a folder that does
# not shadow the installed package with the source tree, whose fusedzero.kernels only an
# editable install provides) with its bench extras. A real run needs a clean git tree (the
# results name the commit) unless FUSEDZERO_COMMIT names the commit of a copied checkout.
# FUSEDZERO_BENCH_MODEL (layers,width,heads,tokens) picks the model; default 12,768,12,1024.
# FUSEDZERO_GPU_SUITE=cuda runs only the cuda tests of the suite (default all: a lease of minutes
# has no room for the whole suite, which CI runs on CPU anyway).
set -euo pipefail
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
RUNDIR=$(mktemp -d)
trap 'rm -rf "$RUNDIR"' EXIT
export PYTHONUNBUFFERED=1
if [[ $DRY == 1 ]]; then
  R=${1:-${TMPDIR:-/tmp}/fusedzero-gpu-dry-run}
  N=2
  CPU=--cpu
  export FUSEDZERO_BENCH_MODEL=${FUSEDZERO_BENCH_MODEL:-1,32,2,16}
  export FUSEDZERO_BENCH_BATCH=${FUSEDZERO_BENCH_BATCH:-4}
  export FUSEDZERO_BENCH_BUCKET=${FUSEDZERO_BENCH_BUCKET:-4096}
  export ROUNDS=${ROUNDS:-1} STEPS=${STEPS:-2} WARMUP=${WARMUP:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  REPORT=$R/REPORT.md
else
  R=${1:-$ROOT/bench/gpu/results}
  CPU=
  if [[ -z "${FUSEDZERO_COMMIT:-}" && -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]]
  then
    echo "run.sh: error: the git tree has changes; commit them (the results name the commit)" \
         "or set FUSEDZERO_COMMIT for a copied checkout" >&2
    exit 2
  fi
  N=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if [[ "$N" -lt 1 ]]; then
    echo "run.sh: error: no CUDA GPU here; bash bench/gpu/run.sh --dry-run runs it on CPU" >&2
    exit 2
  fi
  export TRITON_INTERPRET=0
  export FUSEDZERO_BENCH_MODEL=${FUSEDZERO_BENCH_MODEL:-12,768,12,1024}
  export FUSEDZERO_BENCH_BUCKET=${FUSEDZERO_BENCH_BUCKET:-16777216}
  REPORT=$ROOT/bench/gpu/REPORT.md
fi
mkdir -p "$R"
R=$(cd "$R" && pwd)
cd "$RUNDIR"  # nothing below may import ./fusedzero of the source tree
# One interpreter for both questions (each start imports torch: seconds).
info=$("$PY" -c "import torch, fusedzero, fusedzero.kernels
print('run.sh: fusedzero from', fusedzero.__file__)
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu (dry run)')")
echo "${info%%$'\n'*}"
machine=${info#*$'\n'}
commit=${FUSEDZERO_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
printf '{"commit": "%s", "date": "%s", "machine": "%s", "gpus": %s, "dry_run": %s}\n' \
  "$commit" "$(date -u +%F)" "$machine" "$N" "$([[ $DRY == 1 ]] && echo true || echo false)" \
  > "$R/meta.json"
# One script of the proof: a failure or a hang (FUSEDZERO_RUN_TIMEOUT seconds) is named in
# $R/NAME.failed and the rest still runs. Most telling first, so a cut-short run keeps the most.
piece() {
  local name=$1
  shift
  timeout "${FUSEDZERO_RUN_TIMEOUT:-1800}" "$@" \
    || echo "run.sh: $name failed or hung (exit $?)" | tee "$R/$name.failed"
}
if [[ $DRY == 0 ]]; then
  fusedzero doctor --json > "$R/doctor.json" || echo "doctor: a check failed (see its rows)"
  (cd "$ROOT/bench" && piece update "$PY" -m pytest bench_update.py -k cuda --benchmark-only \
     -p no:cacheprovider -q --benchmark-json "$R/update.json")
else
  echo "run.sh: dry run: doctor, the kernel benchmark, probe, fp32 step overhead and pytest" \
       "skipped"
  export FUSEDZERO_BENCH_PHASES_STEPS=1 FUSEDZERO_BENCH_PHASES_HOOK_LAYERS=4
  export FUSEDZERO_BENCH_PHASES_HOOK_ROUNDS=1
fi
# Every world size W = 1..N, one process per GPU.
for W in $(seq 1 "$N"); do
  piece "multi_w$W" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$W" \
    "$ROOT/bench/gpu/multi.py" "$R/multi_w$W.json" $CPU
done
piece numerics "$PY" "$ROOT/bench/gpu/numerics.py" "$R/numerics.json" $CPU
piece fake_world "$PY" "$ROOT/bench/gpu/fake_world.py" "$R/fake_world.json" --world 8 $CPU
# Forward, backward, step and zero_grad apart (the Llama shape and the step bench's GPT), and our
# hooks' host time per param (CPU).
piece phases "$PY" "$ROOT/bench/bench_phases.py" --model "$([[ $DRY == 1 ]] && echo gpt || echo both)" \
  --json "$R/phases.json"
# The step rows per shape: bf16 GPT-2 124M and the 255M Llama, stages 0-3 beside bare, DDP +
# autocast and FSDP2 (bench/gpu/shape_systems.py); on CPU at a tiny size. They replace the bf16
# rows of the step bench's GPT (vocab 256), which were bound by the host and ranged 12-70%.
for shape in gpt2-124m llama-255m; do
  piece "step_$shape" env ROUNDS="${ROUNDS:-7}" STEPS="${STEPS:-10}" \
    "$PY" "$ROOT/bench/gpu/step_overhead.py" --shape "$shape" "$R/step_$shape.json" $CPU
done
if [[ $DRY == 0 ]]; then
  piece step_graph env ROUNDS="${ROUNDS:-7}" STEPS="${STEPS:-10}" \
    "$PY" "$ROOT/bench/gpu/step_overhead.py" --shape gpt2-124m \
    "$R/step_graph_gpt2-124m.json" --systems bare,bare+graph,fusedzero-2,fusedzero-2+graph
  piece step_fp32 "$PY" "$ROOT/bench/gpu/step_overhead.py" \
    bare,fusedzero-0,fusedzero-1,fusedzero-2,fusedzero-3,fusedzero-3-keep,ddp+adamw_fused,torch_zero1,fsdp2-keep,fsdp2-reshard \
    "$R/step_fp32.json"
  # The suite from tests/, not the repo root (see above), as docs/gpu_suite.md runs it. With the
  # GPU visible and TRITON_INTERPRET unset (the interpreter is for CPU tensors only; doctor and
  # the cuda tests refuse it): the cuda tests alone (compiled kernels), then the whole suite
  # (CPU tests pin the CPU, cuda tests again). Then the interpreter tests with the GPU hidden.
  # FUSEDZERO_GPU_SUITE=cuda runs the cuda tests alone (a short lease: CI runs the rest on CPU).
  set +e
  (cd "$ROOT/tests" && env -u TRITON_INTERPRET "$PY" -m pytest -m cuda -q -p no:cacheprovider .) \
    > "$R/pytest_cuda.txt" 2>&1
  rc_cuda=$? rc_suite=null rc_interpreter=null
  if [[ "${FUSEDZERO_GPU_SUITE:-all}" == all ]]; then
    # FUSEDZERO_GPU_SUITE_ARGS: extra pytest arguments for the whole suite, e.g. "-n 12 --dist
    # loadfile" to fit a lease of minutes (a file per worker: a docs page's blocks run in order).
    # shellcheck disable=SC2086
    (cd "$ROOT/tests" && env -u TRITON_INTERPRET "$PY" -m pytest -q -p no:cacheprovider \
       ${FUSEDZERO_GPU_SUITE_ARGS:-} .) > "$R/pytest_suite.txt" 2>&1
    rc_suite=$?
    (cd "$ROOT/tests" && CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$PY" -m pytest -m interpreter \
       -q -p no:cacheprovider .) > "$R/pytest_interpreter.txt" 2>&1
    rc_interpreter=$?
  fi
  set -e
  printf '{"cuda": %s, "suite": %s, "interpreter": %s}\n' "$rc_cuda" "$rc_suite" \
    "$rc_interpreter" > "$R/pytest.json"
  piece update_modes "$PY" "$ROOT/bench/gpu/update_modes.py" "$R/update_modes.json" \
    1024x4,2048x8,4096x8
  piece probe "$PY" "$ROOT/bench/gpu/probe.py" "$R/probe.json"
  piece wire_kernels "$PY" "$ROOT/bench/gpu/wire_kernels.py" "$R/wire_kernels.json"  # docs/wire.md
fi
"$PY" "$ROOT/bench/gpu/report.py" "$R" -o "$REPORT"
echo "run.sh: results in $R, report $REPORT"
