#!/usr/bin/env bash
# The default run (`gtpo-train` with no setting but the seed and the output folder), five seeds one at a time, and
# their table:
#   bash tools/default_seeds.sh OUT [EXTRA gtpo-train flags...]     e.g. OUT=results/trainer-cpu/default-<date>
# Each run's config, metrics, summary, plot, wall time and printed end are kept under OUT/8x4-PRECISION-sSEED/ (the
# precision the run took, from its first lines); checkpoints stay in runs/ (not committed).
# SEEDS="5 6 7" runs other seeds; CHECKOUT=DIR runs another checkout's trainer (a `git worktree add DIR REV` with its
# C++ kernels built or copied in), for seeds paired with an earlier commit's on the same machine.
set -euo pipefail
OUT=$(realpath -m "${1:?usage: bash tools/default_seeds.sh OUT [gtpo-train flags...]}")
shift
cd "${CHECKOUT:-$(dirname "$0")/..}"
mkdir -p "$OUT" runs
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
for seed in ${SEEDS:-0 1 2 3 4}; do
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
python -m gtpo_train.offline.compare "$OUT"/8x4-*-s* --out "$OUT/compare"
