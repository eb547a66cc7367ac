#!/bin/sh
# Quality of the memory modes: `fusedzero train` (default config, 500 steps) once per
# (master, states) and seed, bf16 params; the summaries land in $OUT (default /tmp/fz_quality), and
# bench/quality_modes.py gathers their final val losses into bench/quality/quality.json.
# SEEDS (default "0") and COMBOS (default: all six) pick the runs; seed 0 writes
# $OUT/<master>-<states>.json, any other seed N $OUT/<master>-<states>-seedN.json, e.g.
#   SEEDS="1 2" COMBOS="fp32:fp32 bf16-kahan:int8 bf16-sr:int8 bf16:fp32" sh bench/quality_modes.sh
OUT=${OUT:-/tmp/fz_quality}
SEEDS=${SEEDS:-0}
COMBOS=${COMBOS:-"fp32:fp32 bf16-kahan:int8 bf16-kahan:fp32 bf16-sr:int8 bf16:fp32 fp32:int8"}
mkdir -p "$OUT"
for seed in $SEEDS; do
  for combo in $COMBOS; do
    m=${combo%%:*}; s=${combo##*:}
    if [ "$seed" = 0 ]; then name="$m-$s"; else name="$m-$s-seed$seed"; fi
    fusedzero train --param-dtype bf16 --master "$m" --states "$s" --seed "$seed" --no-progress \
      --sample-tokens 0 --out-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  done
done
