#!/bin/sh
# Quality of the memory modes: `fusedzero train` (default config, 500 steps, seed 0) once per
# (master, states), bf16 params; the summaries land in $OUT (default /tmp/fz_quality), and
# bench/quality_modes.py gathers their final val losses into bench/results/quality.json.
OUT=${OUT:-/tmp/fz_quality}
mkdir -p "$OUT"
for combo in fp32:fp32 bf16-kahan:int8 bf16-kahan:fp32 bf16-sr:int8 bf16:fp32 fp32:int8; do
  m=${combo%%:*}; s=${combo##*:}
  fusedzero train --param-dtype bf16 --master "$m" --states "$s" --no-progress \
    --sample-tokens 0 --out-json "$OUT/$m-$s.json" > "$OUT/$m-$s.log" 2>&1
done
