#!/usr/bin/env bash
# The device check: on a GPU machine (one GPU, many cores, no network), builds and
# installs dataecho, runs the CUDA tests, then the benchmarks that need a GPU or many
# cores, and writes $OUT/device-check.md and $OUT/device-check.json (with its log,
# $OUT/device-check.log). It ends within about 8 minutes there and prints progress.
#
#   bash bench/device_check.sh          # on the GPU machine
#   bash bench/device_check.sh --cpu    # every part on the CPU at small sizes (CI: under 2 minutes)
#
# --cpu does not build: it checks the installed package (add --build to build too).
# Each part runs under a time limit; a part that fails or overruns is reported, and
# the check goes on. Exit status: 1 if the build, a test or a part failed.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
BUILD=1
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu; BUILD=0 ;;
    --build) BUILD=1 ;;
    *) echo "usage: bash bench/device_check.sh [--cpu] [--build]" >&2; exit 2 ;;
  esac
done
if [[ "$MODE" == cpu && " $* " == *" --build "* ]]; then BUILD=1; fi

PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d -t device-check.XXXXXX)}"
PARTS="$(mktemp -d -t device-check-parts.XXXXXX)"  # not under $OUT: at most 8 files come back from there
LOG="$OUT/device-check.log"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
START=$(date +%s)

say() { echo "[device-check ${MODE} $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# Budgets in seconds (the benchmark's own --budget-s, then the hard limit): about 8 minutes on the GPU machine.
if [[ "$MODE" == gpu ]]; then
  BUDGETS=(handoff:35:60 gpu_step:90:130 paper:110:150 scaling:65:100 device_echo:45:80)
  SIZE=()
  TEST_LIMIT=120
else
  BUDGETS=(handoff:15:40 gpu_step:25:60 paper:25:60 scaling:25:60 device_echo:25:60)
  SIZE=(--cpu)
  TEST_LIMIT=120
fi

machine() {
  {
    echo "cores: $(nproc)"
    echo "python: $("$PY" --version 2>&1)"
    echo "compiler: $(g++ --version 2>/dev/null | head -1 || echo 'no g++')"
    echo "cmake: $(cmake --version 2>/dev/null | head -1 || echo 'no cmake')"
    "$PY" - <<'EOF' 2>/dev/null || echo "torch: not importable"
import numpy, torch
print(f"torch: {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
print(f"numpy: {numpy.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, {torch.cuda.device_count()} device(s)")
else:
    print("gpu: none (torch.cuda.is_available() is False)")
EOF
    if command -v nvidia-smi >/dev/null; then
      echo "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
    fi
  } > "$PARTS/machine.txt"
  sed 's/^/  /' "$PARTS/machine.txt" | tee -a "$LOG"
}

build() {
  if [[ "$BUILD" == 0 ]]; then
    echo "not built (--cpu): checked the installed dataecho $("$PY" -c 'import dataecho; print(dataecho.__version__)' 2>&1)" \
      > "$PARTS/build.txt"
    return 0
  fi
  local started=$(date +%s)
  if timeout 300 "$PY" -m pip install --no-build-isolation --no-deps --no-input -q . >> "$LOG" 2>&1; then
    echo "built and installed in $(($(date +%s) - started)) s (pip install --no-build-isolation --no-deps .)" > "$PARTS/build.txt"
  else
    echo "FAILED to build or install (see device-check.log)" > "$PARTS/build.txt"
    return 1
  fi
}

cuda_tests() {
  # The tests of the CUDA paths: on a GPU they run on it; on the CPU the ones that need it say so and skip.
  timeout "$TEST_LIMIT" "$PY" -m pytest -q -p no:cacheprovider -k "cuda or pinned or device or mover" \
    --junitxml="$PARTS/cuda-tests.xml" tests/test_torch_tensors.py tests/test_loader.py tests/test_device_paths.py \
    tests/test_device_echo.py \
    >> "$LOG" 2>&1
}

benchmark() {  # name:budget:limit
  local name="${1%%:*}" rest="${1#*:}"
  local budget="${rest%%:*}" limit="${rest#*:}"
  say "$name (budget ${budget} s) ..."
  timeout "$limit" "$PY" "bench/bench_${name}.py" "${SIZE[@]}" --budget-s "$budget" --json "$PARTS/$name.json" \
    > "$PARTS/$name.log" 2>&1
  local status=$?
  echo "$status" > "$PARTS/$name.status"
  tail -n 25 "$PARTS/$name.log" >> "$LOG"
  say "$name: exit $status"
  return "$status"
}

failed=0
say "machine"
machine
say "build"
build || failed=1
say "$(cat "$PARTS/build.txt")"
say "CUDA tests ..."
cuda_tests
tests_status=$?
[[ "$tests_status" == 0 ]] || failed=1
say "CUDA tests: exit $tests_status"
for part in "${BUDGETS[@]}"; do
  benchmark "$part" || failed=1
done
"$PY" bench/device_report.py "$PARTS" "$OUT/device-check.md" "$OUT/device-check.json" --mode "$MODE" \
  --seconds "$(($(date +%s) - START))" || failed=1
say "report: $OUT/device-check.md"
cat "$OUT/device-check.md"
rm -rf "$PARTS"
exit "$failed"
