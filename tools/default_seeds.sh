#!/usr/bin/env bash
# The default run (`gtpo-train` with no setting but the seed and the output folder), five seeds one at a time, and
# their table:
#   bash tools/default_seeds.sh OUT [EXTRA gtpo-train flags...]     e.g. OUT=results/trainer-cpu/default-<date>
# Each run's config, metrics, summary, plot, wall time and printed end are kept under OUT/8x4-PRECISION-sSEED/ (the
# precision the run took, from its first lines); checkpoints stay in runs/ (not committed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash tools/default_seeds.sh OUT [gtpo-train flags...]}
shift
mkdir -p "$OUT" runs
for seed in 0 1 2 3 4; do
  run=runs/default-seeds-s$seed
  rm -rf "$run"
  start=$(date +%s)
  python -m trainer --seed "$seed" --output-dir "$run" "$@" > "$run.log" 2>&1
  precision=$(sed -n 's/^precision: \([a-z0-9]*\) .*/\1/p' "$run.log" | head -1)
  kept="$OUT/8x4-${precision:-unknown}-s$seed"
  mkdir -p "$kept"
  echo "seed $seed: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
  cp "$run"/{config.json,metrics.jsonl,summary.json,training.png} "$kept/"
  grep -m1 '^precision: ' "$run.log" > "$kept/precision.txt" || true
  sed -n '/^held-out metric/,$p' "$run.log" > "$kept/end-of-run.txt"
done
python -m gtpo_train.offline.compare "$OUT"/8x4-*-s? --out "$OUT/compare"
