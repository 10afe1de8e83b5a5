#!/usr/bin/env bash
# The default run with LoRA instead of full training, five seeds, and the table against the full-training seeds:
#   bash tools/lora_seeds.sh [OUT] [EXTRA gtpo-train flags...]
# (default OUT: results/trainer-cpu/lora-<date>). Keeps each run's config, metrics, summary, plot and printed end;
# the checkpoints and the adapter stay in runs/ (not committed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/trainer-cpu/lora-$(date +%F)}
shift || true
mkdir -p "$OUT"
for seed in 0 1 2 3 4; do
  run=runs/lora-r16-s$seed
  start=$(date +%s)
  python -m trainer --precision fp32 --lora-r 16 --learning-rate 2e-4 --seed "$seed" --output-dir "$run" \
    --save-every 0 --save-total-limit 1 "$@" > "$run.log" 2>&1
  echo "seed $seed: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
  mkdir -p "$OUT/8x4-fp32-lora16-s$seed"
  cp "$run"/{config.json,metrics.jsonl,summary.json,training.png} "$OUT/8x4-fp32-lora16-s$seed/"
  sed -n '/^held-out metric/,$p' "$run.log" > "$OUT/8x4-fp32-lora16-s$seed/end-of-run.txt"
done
python -m gtpo_train.offline.compare "$OUT"/8x4-fp32-lora16-s? results/trainer-cpu/default-2026-12-04/8x4-fp32-s? \
  --out "$OUT/compare"
