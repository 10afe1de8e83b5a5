#!/usr/bin/env bash
# The GPU check, one command: versions, the CUDA tests, kernel timings against the copy bandwidth, a
# BLOCK_V x num_warps x num_stages sweep, the logits and fused-linear benchmark rows (the torch.compile reference
# last, under its own timeout). Each step has a timeout and writes its results as it goes, so a run cut
# short keeps what it measured. Sized for 8 minutes on an H200, cold compiles included (the step
# timeouts add up to 470 s).
#
#   bash bench/gpu_check.sh              # results in $OUT (default bench/results/gpu-check/)
#   OUT=/some/dir bash bench/gpu_check.sh
#   bash bench/gpu_check.sh --dry-run    # every step on tiny CPU shapes under Triton's interpreter
#                                        # (results named *-dryrun, in bench/results/gpu-check-dryrun/)
#
# At most 8 files land in $OUT: gpu_check.log, tests.xml, kernels.json, logits-h200.md, logits-compile-h200.md,
# fused-linear-h200.md, layouts-h200.md, summary.md (whether the CUDA tests were green, in plain words). Exits
# non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-bench/results/gpu-check$([ $DRY -eq 1 ] && echo -dryrun)}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 GTPO_BENCH_OUT="$OUT"
: > "$LOG"
FAILED=()

step() {  # step NAME SECONDS COMMAND...: run with a timeout, log it, remember a failure
  local name=$1 seconds=$2; shift 2
  echo "== $name ($(date +%T), up to ${seconds}s): $*" | tee -a "$LOG"
  timeout "$seconds" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && FAILED+=("$name (exit $rc)") && echo "!! $name failed with exit $rc" | tee -a "$LOG"
}

if [ $DRY -eq 1 ]; then
  export TRITON_INTERPRET=1
  step versions 60 $PY -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, '(dry run: CPU, interpreter)')"
  step tests 150 $PY -m pytest -q -rfE -p no:cacheprovider --junitxml="$OUT/tests.xml" \
    tests/test_parity.py::test_vocab_sizes tests/test_fused_linear.py::test_temperature -k "triton and not 32003"
  step kernels 120 $PY -m bench kernels --dry-run --out "$OUT/kernels.json"
  step logits 120 $PY -m bench logits --device cpu --tokens 32 --vocab 500 --dtype bfloat16 --reps 1 --no-compile \
    --triton-rows --name logits-dryrun
  step fused-linear 120 $PY -m bench fused_linear --device cpu --tokens 32 --vocab 500 --hidden 16 --reps 1 \
    --gpu-rows --name fused-linear-dryrun
  step layouts 60 $PY -m bench layouts --device cpu --ranks 1 --tokens 64 --vocab 500 --reps 1 --name layouts-dryrun
else
  if ls bench/wheels/*.whl >/dev/null 2>&1; then $PY -m pip install -q --no-deps bench/wheels/*.whl; fi
  step versions 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv; $PY -c \"import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())\""
  # The whole CUDA suite: every test that puts the Triton kernels on CUDA tensors (GTPO_TEST_CUDA=1; the
  # torch and cpu backends' rows run on the CPU), no failure cap, the failures summarised at the end (-rfE).
  step tests 170 env GTPO_TEST_CUDA=1 $PY -m pytest -q -rfE -p no:cacheprovider --junitxml="$OUT/tests.xml" \
    tests -k "triton or cuda"
  step kernels 120 $PY -m bench kernels --out "$OUT/kernels.json"  # 36 launch configurations, compiled
  step logits 45 $PY -m bench logits --tokens 16384 --vocab 151936 --dtype bfloat16 --no-compile --name logits-h200
  step fused-linear 50 $PY -m bench fused_linear --only fused-triton materialised-triton liger-fused-grpo \
    --name fused-linear-h200
  # Packed and vocab-parallel calls against the padded one; one GPU: a vocab group of one rank (the
  # combination's own cost, no communication).
  step layouts 45 $PY -m bench layouts --ranks 1 --tokens 16384 --vocab 151936 --name layouts-h200
  step compile 40 $PY -m bench logits --tokens 16384 --vocab 151936 --dtype bfloat16 --only reference-compile \
    --name logits-compile-h200
fi
# Keep within the 8 files the device tool brings back: each table's .md holds every number of its .json.
rm -f "$OUT"/*.png "$OUT"/logits*.json "$OUT"/fused-linear*.json "$OUT"/layouts*.json
# The verdict first in summary.md (the 8th file): were the CUDA tests green, which steps failed.
$PY -m bench.gpu_summary "$OUT" $([ $DRY -eq 1 ] && echo --dry-run) "${FAILED[@]}" | tee -a "$LOG"
echo "results: $OUT"
if [ ${#FAILED[@]} -ne 0 ]; then
  echo "failed steps: ${FAILED[*]}" | tee -a "$LOG"
  exit 1
fi
