#!/usr/bin/env bash
# The torch version matrix, run on demand (not in CI: minutes of downloads and builds per version):
#
#   bash tools/torch_matrix.sh                     # the declared minimum, 2.11 (the GPU machine), 2.13 (CI), 2.14, 2.15
#   bash tools/torch_matrix.sh 2.15.0 2.8.0        # some versions
#   GTPO_MATRIX_DIR=/big/disk KEEP_VENVS=1 bash tools/torch_matrix.sh
#
# For each torch version: a fresh venv, the package installed as the README says with that torch in place of
# torch==2.13.0 (`pip install torch==V "setuptools>=70.1"`, then `pip install --no-build-isolation -e ".[train,dev]"` with torch held
# at V by a constraint, so no other requirement can replace it), from a copy of this working tree (each version
# builds its own C++ kernels; the checkout's are left alone), then the core tests: every kernel against the float64
# oracle on every backend that builds (C++ kernels; Triton under its CPU interpreter; torch), torch.compile, the
# fused hidden @ lm_head path, the API, the torch internals the operators need, and the failed-build install.
# Where there is no CPU build of a version on this machine's disk, PyPI's wheel (a CUDA build) is used: it runs on
# a CPU. The report, tools/torch-matrix.md, gets one row per version (rows of versions not run this time are kept),
# and each version's pip and pytest output goes to $GTPO_MATRIX_DIR/torch-V/.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DIR=${GTPO_MATRIX_DIR:-/tmp/gtpo-torch-matrix}
REPORT=tools/torch-matrix.md
DEFAULT_VERSIONS="2.6.0 2.11.0 2.13.0 2.14.1 2.15.0"
VERSIONS=${*:-$DEFAULT_VERSIONS}
CORE_TESTS=(
  tests/test_parity.py tests/test_fused_linear.py tests/test_cpu_backend.py tests/test_triton.py
  tests/test_compile.py tests/test_api.py tests/test_config.py tests/test_gradcheck.py
  tests/test_torch_internals.py tests/test_fused_memory.py tests/test_build.py
)
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' + uncommitted changes')"

row_for() {  # one version: prints its report row on stdout, everything else into its folder
  local v=$1 out="$DIR/torch-$v" start=$SECONDS when
  when="$(date -u '+%Y-%m-%d') at $commit"
  rm -rf "$out" && mkdir -p "$out"
  # A copy of the tree as git sees it (tracked and untracked, not ignored): no built kernels, no venv.
  mkdir "$out/src"
  git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$out/src" 2>/dev/null
  "$PYTHON" -m venv "$out/venv"
  local py="$out/venv/bin/python"
  echo "torch==$v" >"$out/constraint.txt"
  # Above this machine's pip cap (the releases on its disk), pip reads no config: PyPI's wheels.
  local pipenv=()
  if ! "$py" -m pip install -q "torch==$v" "setuptools>=70.1" >"$out/pip-torch.log" 2>&1; then
    pipenv=(env PIP_CONFIG_FILE=/dev/null)
    if ! "${pipenv[@]}" "$py" -m pip install -q "torch==$v" "setuptools>=70.1" >>"$out/pip-torch.log" 2>&1; then
      echo "| $v | - | - | torch did not install (\`$out/pip-torch.log\`) | - | - | - | $(( SECONDS - start )) s | $when |"
      return
    fi
  fi
  local install="installed"
  if ! (cd "$out/src" && PIP_CONSTRAINT="$out/constraint.txt" "${pipenv[@]}" "$py" -m pip install -v \
      --no-build-isolation -e ".[train,dev]" >"$out/pip-install.log" 2>&1); then
    install="**install failed** (\`$out/pip-install.log\`: $(grep -m1 -E 'ERROR|error:' "$out/pip-install.log" | cut -c1-120))"
  fi
  local versions built failed_variants
  versions=$("$py" -c "import torch, triton; print(torch.__version__, triton.__version__)" 2>/dev/null || echo "? ?")
  built=$(cd "$out/src/gtpo_kernels/backends" && ls _cpu_*.so 2>/dev/null | sed 's/^_cpu_//; s/\..*//' | sort | tr '\n' ' ')
  failed_variants=$(grep -o 'building the C++ CPU kernels (gtpo_kernels.backends._cpu_[a-z0-9]*) failed' \
    "$out/pip-install.log" 2>/dev/null | sed 's/.*_cpu_//; s/).*//' | sort -u | tr '\n' ' ')
  local summary="-"
  if [ "$install" = "installed" ]; then
    (cd "$out/src" && GTPO_KERNELS_CACHE="$out/jit-cache" timeout 1800 "$py" -m pytest -q -n 2 -p no:cacheprovider \
      "${CORE_TESTS[@]}" >"$out/pytest.log" 2>&1)
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|no tests ran' "$out/pytest.log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
    [ -n "$summary" ] || summary="no summary (\`$out/pytest.log\`)"
  fi
  set -- $versions
  echo "| $v | $1 | $2 | $install | ${built:-none} | ${failed_variants:-none} | $summary | $(( SECONDS - start )) s | $when |"
  [ -n "${KEEP_VENVS:-}" ] || rm -rf "$out/venv"
}

declare -A ROWS=()
if [ -f "$REPORT" ]; then  # the rows of earlier runs, by the version asked for
  while IFS= read -r line; do
    key=$(echo "$line" | cut -d'|' -f2 | tr -d ' ')
    [[ "$key" =~ ^[0-9]+\.[0-9]+ ]] && ROWS[$key]=$line
  done <"$REPORT"
fi
for v in $VERSIONS; do
  echo "torch $v ..." >&2
  ROWS[$v]=$(row_for "$v")
  echo "${ROWS[$v]}" >&2
done

{
  echo "# The torch version matrix"
  echo
  echo "\`bash tools/torch_matrix.sh [VERSION ...]\`: per torch version, a fresh venv, the README's install with that"
  echo "torch (PyPI's wheel, a CUDA build that runs on the CPU, where this machine has no CPU build on disk), and the"
  echo "core tests (\`${CORE_TESTS[*]}\`, on two workers, the Triton kernels under the interpreter)."
  echo "Last run on $cpu ($(nproc) cores), Python $("$PYTHON" -c 'import platform; print(platform.python_version())');"
  echo "each row says when and at which commit it ran (rows of versions not asked for are kept from earlier runs)."
  echo
  echo "| torch asked | torch | triton | install | C++ variants built | variants that failed | core tests | time | run |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for key in $(printf '%s\n' "${!ROWS[@]}" | sort -V); do echo "${ROWS[$key]}"; done
} >"$REPORT"
echo "wrote $REPORT" >&2
