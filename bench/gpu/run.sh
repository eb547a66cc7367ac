#!/usr/bin/env bash
# Every GPU measurement of bench/gpu on one CUDA machine, then bench/gpu/REPORT.md.
#   bash bench/gpu/run.sh [RESULTS_DIR]     (default bench/gpu/results)
# Needs fusedzero installed with its bench extras (pytest-benchmark) and a CUDA GPU. The step
# bench's model: FUSEDZERO_BENCH_MODEL (layers,width,heads,tokens; default 12,768,12,1024 here).
# FUSEDZERO_COMMIT names the commit measured where the tree has no .git (a copied checkout).
set -euo pipefail
cd "$(dirname "$0")/../.."
R=${1:-bench/gpu/results}
mkdir -p "$R"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export FUSEDZERO_BENCH_MODEL=${FUSEDZERO_BENCH_MODEL:-12,768,12,1024}
export FUSEDZERO_BENCH_BUCKET=${FUSEDZERO_BENCH_BUCKET:-16777216}
commit=${FUSEDZERO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
machine=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
printf '{"commit": "%s", "date": "%s", "machine": "%s"}\n' "$commit" "$(date -u +%F)" \
  "$machine" > "$R/meta.json"
fusedzero doctor --json > "$R/doctor.json" || echo "doctor: a check failed (see its rows)"
"$PY" -m pytest bench/bench_update.py -k cuda --benchmark-only -p no:cacheprovider -q \
  --benchmark-json "$R/update.json"
"$PY" bench/gpu/update_modes.py "$R/update_modes.json" 1024x4,2048x8,4096x8
"$PY" bench/gpu/probe.py "$R/probe.json"
"$PY" bench/gpu/wire_kernels.py "$R/wire_kernels.json"  # docs/wire.md: quantize, dequantize-sum
"$PY" bench/gpu/step_overhead.py \
  bare,fusedzero-0,fusedzero-1,fusedzero-2,fusedzero-3,fusedzero-3-keep,ddp+adamw_fused,torch_zero1,fsdp2-keep,fsdp2-reshard \
  "$R/step_fp32.json"
"$PY" bench/gpu/step_overhead.py \
  bare-bf16,fusedzero-0-bf16-r32,fusedzero-1-bf16-r32,fusedzero-2-bf16-r32,fusedzero-3-bf16-r32,fusedzero-0-bf16-r16,fusedzero-2-bf16-r16,fusedzero-3-bf16-r16,fusedzero-3-keep-bf16-r16,fsdp2-keep-bf16-r32,fsdp2-reshard-bf16-r32,fsdp2-keep-bf16-r16,fsdp2-reshard-bf16-r16 \
  "$R/step_bf16.json"
"$PY" bench/gpu/report.py "$R" -o bench/gpu/REPORT.md
