#!/usr/bin/env bash
# The GPU check: on a CUDA machine (e.g. the lent H200), run the Triton kernels' tests compiled on
# CUDA tensors, then the benchmark tables. Each step has a timeout; about 6 minutes in all.
#
#   bash bench/gpu_check.sh            # results in bench/results/, log in bench/results/gpu_check.log
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Liger-Kernel, for its comparison rows, can't be downloaded on an offline GPU machine: put its wheel
# in bench/wheels/ (ignored by git; `pip download --no-deps -d bench/wheels liger-kernel`) and carry it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
: > "$LOG"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  if ls bench/wheels/*.whl >/dev/null 2>&1; then $PY -m pip install -q --no-deps bench/wheels/*.whl; fi

  echo "== 1. CUDA tests: parity with the float64 reference, Triton specifics, fused linear (compiled kernels)"
  GTPO_TEST_CUDA=1 timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/test_parity.py tests/test_triton.py tests/test_fused_linear.py

  echo "== 2. Headline shape: T = 16384, V = 151936, bf16, every implementation incl. torch.compile"
  timeout 150 $PY -m bench logits --tokens 16384 --vocab 151936 --dtype bfloat16 --name logits-cuda-headline

  echo "== 3. Full logits table (no torch.compile rows: compiling every shape would not fit the budget)"
  timeout 120 $PY -m bench logits --no-compile --reps 3 --name logits-cuda

  echo "== 4. Fused hidden @ lm_head: T = 16384, H = 3584, V = 151936, bf16 (floor 6 T H V / 790 TFLOP/s)"
  timeout 90 $PY -m bench fused_linear --only fused-triton materialised-triton liger-fused-grpo \
    --name fused-linear-cuda
} 2>&1 | tee -a "$LOG"

# The device tool brings back at most 8 files: the log and these seven.
if [ "$OUT" != "bench/results" ]; then
  for f in logits-cuda-headline.md logits-cuda-headline.json logits-cuda.md logits-cuda.json logits-cuda.png \
           fused-linear-cuda.md fused-linear-cuda.json; do
    cp "bench/results/$f" "$OUT"/ 2>/dev/null
  done
fi
echo "results: $OUT"
