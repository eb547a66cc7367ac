#!/bin/sh
# Training quality of the grad wire formats (docs/wire.md): `fusedzero train` at W=2 gloo ranks,
# stage 2, fp32 params and grads, a GPT of 2 x 64 on 64-byte sequences, 16 per step (small: the
# 2 shared cores of the machine it was made on had a load of ~20), once per (seed, wire); fp32
# wire is the baseline (a plain fp32 reduce-scatter). Summaries land in $OUT (default /tmp/fz_wire_quality) as <wire>-seed<N>.json;
# `python bench/quality_wire.py $OUT` gathers them into bench/quality/wire.{json,md,png}.
#   OUT=/tmp/fz_wire_quality nice -n 10 sh bench/quality_wire.sh
# STEPS (default 1500: val loss near its plateau; at 200 it was still falling) and SEEDS (default "0 1 2") and WIRES (default "fp32 bf16 int8") pick runs.
OUT=${OUT:-/tmp/fz_wire_quality}
STEPS=${STEPS:-1500}
SEEDS=${SEEDS:-"0 1 2"}
WIRES=${WIRES:-"fp32 bf16 int8"}
mkdir -p "$OUT"
for seed in $SEEDS; do
  for w in $WIRES; do
    name="$w-seed$seed"
    fusedzero train --stage 2 --nproc 2 --steps "$STEPS" --eval-every 25 --wire "$w" \
      --n-embd 64 --block-size 64 --batch-size 16 --eval-seqs 32 --log-every 25 \
      --seed "$seed" --no-progress --sample-tokens 0 --out-json "$OUT/$name.json" \
      > "$OUT/$name.log" 2>&1
  done
done
