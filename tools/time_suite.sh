#!/usr/bin/env bash
# Times the README's test command on this machine and writes what it measured to tools/suite-time.md: the
# machine (CPU model, cores, bf16 units or not), the date and commit, pytest's closing line, the wall time and the
# slowest tests. Run it alone on the machine (the suite uses both cores):   bash tools/time_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=tools/suite-time.md
LOG=$(mktemp)
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
flags=$(grep -m1 -o -w -E 'avx512_bf16|amx_bf16|avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')
state="commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
start=$(date +%s)
python -m pytest -q -n 2 -p no:cacheprovider --durations=15 >"$LOG" 2>&1
rc=$?
seconds=$(( $(date +%s) - start ))
{
  echo "# The test suite's time"
  echo
  echo "\`bash tools/time_suite.sh\` (the README's test command, \`python -m pytest -q -n 2\`, with \`--durations=15\`)."
  echo
  echo "- machine: $cpu, $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; CPU flags seen: ${flags:-none of avx2/avx512f/avx512_bf16/amx_bf16}"
  echo "- when: $(date -u '+%Y-%m-%d %H:%M UTC'), $state"
  echo "- installed: $(python -c 'import torch, importlib.util as u; print("torch", torch.__version__, "| trl", "yes" if u.find_spec("trl") else "no", "| verl", "yes" if u.find_spec("verl") else "no")')"
  echo "- pytest exit status: $rc; wall time: $((seconds / 60)) min $((seconds % 60)) s"
  echo
  echo '```'
  grep -E "slowest|^[0-9.]+s (call|setup|teardown)" "$LOG" | head -16
  tail -1 "$LOG"
  echo '```'
} >"$OUT"
cat "$OUT"
rm -f "$LOG"
exit $rc
