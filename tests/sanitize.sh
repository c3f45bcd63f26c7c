#!/usr/bin/env bash
# Runs dataecho under ThreadSanitizer, AddressSanitizer + UndefinedBehaviorSanitizer
# and valgrind memcheck. Any sanitizer report, failed test or hang fails the run.
#
# Usage: bash tests/sanitize.sh [PASS...] [options]
#   passes (default --all):
#     --tsan           --tsan-native and --tsan-python
#     --tsan-native    the native stress tests (cpp/tests) built with -fsanitize=thread
#     --tsan-python    the extension built with -fsanitize=thread; the Python stress and
#                      fault tests run in the real interpreter with libtsan preloaded
#     --asan           --asan-native and --asan-python (address + undefined)
#     --asan-native    native tests under ASan+UBSan, leak checking on
#     --asan-python    Python tests under ASan+UBSan (leak checking off: CPython's own
#                      allocations at exit are not ours)
#     --valgrind       memcheck of the native tests (plain build, fewer items)
#     --all            all of the above
#   options:
#     --seed N         seed for the native tests and DATAECHO_TEST_SEED for pytest
#     --items N        --items for the native sanitizer runs (default: the program's)
#     --valgrind-items N   (default 50000)
#     --work DIR       build here and keep it (later runs rebuild incrementally);
#                      default: a temporary directory, removed at exit
#   environment: PYTHON (default python3) picks the interpreter for the Python passes.
#
# Each pass first proves its sanitizer is live: a small canary program with a
# deliberate race / overflow / undefined behaviour / leak must be reported with the
# same options, or the pass fails. Reports also go to log files (log_path), so a
# report in a child process that a test does not look at still fails the pass.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cxx=${CXX:-g++}
python=${PYTHON:-python3}
seed=${DATAECHO_TEST_SEED:-20240611}
items=""
valgrind_items=50000
work=""
jobs=$(nproc 2>/dev/null || echo 2)
passes=()

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --tsan) passes+=(tsan-native tsan-python) ;;
    --asan) passes+=(asan-native asan-python) ;;
    --tsan-native | --tsan-python | --asan-native | --asan-python | --valgrind) passes+=("${1#--}") ;;
    --all) passes+=(tsan-native tsan-python asan-native asan-python valgrind) ;;
    --seed) seed=$2; shift ;;
    --items) items=$2; shift ;;
    --valgrind-items) valgrind_items=$2; shift ;;
    --work) work=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "sanitize.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[[ ${#passes[@]} -gt 0 ]] || passes=(tsan-native tsan-python asan-native asan-python valgrind)

if [[ -z $work ]]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/dataecho-sanitize.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"
work=$(cd "$work" && pwd)

tsan_flags="-fsanitize=thread -g -O1"
# UBSan checks stay recoverable (a suppression can only silence those); with
# halt_on_error=1 any report that is not suppressed still stops the run.
asan_flags="-fsanitize=address,undefined -fno-omit-frame-pointer -g -O1"
# RelWithDebInfo would append -O2 -DNDEBUG: keep the -O1 above (faster to build,
# clearer stacks) and the asserts.
relwithdebinfo="-g"
# Python files to run under the sanitizers: stress, blocking/Ctrl-C/fork, accounting, ragged values, faults.
python_tests=(tests/test_stress.py tests/test_blocking.py tests/test_accounting.py tests/test_ragged.py tests/test_hold.py)
[[ -f $repo/tests/test_faults.py ]] && python_tests+=(tests/test_faults.py)
pytest_args=(-x -q -p no:cacheprovider --timeout 600)

log() { printf '%s\n' "$*"; }
now() { date +%s.%N; }
# A fresh directory of sanitizer logs; `reports DIR` lists the non-empty ones.
fresh_logs() { rm -rf "$1" && mkdir -p "$1"; }
reports() { find "$1" -type f -size +0 | sort; }
show_reports() {
  local f
  for f in $(reports "$1"); do log "---- $f"; head -c 20000 "$f"; done
}

# Runs a command with output to $2 (and the last lines to the terminal on failure).
run_logged() {
  local what=$1 logfile=$2
  shift 2
  if ! "$@" >"$logfile" 2>&1; then
    log "  $what failed ($*); last lines of $logfile:"
    tail -n 60 "$logfile" | sed 's/^/    /'
    return 1
  fi
}

# ---------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------

build_native() {  # build_native DIR FLAGS
  local dir=$1 flags=$2
  run_logged "cmake configure" "$dir.configure.log" \
    cmake -S "$repo" -B "$dir" -DDATAECHO_CPP_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$relwithdebinfo"
  run_logged "cmake build" "$dir.build.log" cmake --build "$dir" -j"$jobs"
  [[ -x $dir/cpp/tests/dataecho_tests ]]
}

native_args() {
  local args=(--seed "$seed" --timeout-s 300)
  [[ -n $items ]] && args+=(--items "$items")
  printf '%s\n' "${args[@]}"
}

# A virtual environment on the real interpreter (not a shim script: the sanitizer
# runtime is preloaded into the process that runs Python), with dataecho built
# with FLAGS. Prints the venv's python, a symlink to that ELF binary.
python_env() {  # python_env NAME FLAGS
  local name=$1 flags=$2
  local real venv=$work/venv-$name
  real=$("$python" -c 'import os, sys; print(os.path.realpath(sys.executable))')
  if [[ $(head -c 4 "$real" | od -An -c | tr -d ' ') != 177ELF ]]; then
    log "  $real is not an ELF binary: cannot preload a sanitizer into it" >&2
    return 1
  fi
  if [[ ! -x $venv/bin/python ]]; then
    "$real" -m venv "$venv"
    local needs=(numpy pytest pytest-timeout hypothesis scikit-build-core pybind11)
    # Torch only if a selected test imports it (the pinned wheel comes from local disk).
    grep -qE '^\s*(import|from) torch' "${python_tests[@]/#/$repo/}" && needs+=(torch==2.13.0)
    grep -qE '^\s*(import|from) PIL' "${python_tests[@]/#/$repo/}" && needs+=(pillow)
    run_logged "pip install test dependencies" "$venv.deps.log" "$venv/bin/pip" install -q "${needs[@]}" >&2
  fi
  run_logged "building the extension with $flags" "$venv.build.log" \
    "$venv/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall "$repo" \
    --config-settings=build-dir="$work/pybuild-$name" \
    --config-settings=cmake.build-type=RelWithDebInfo \
    "--config-settings=cmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO=$relwithdebinfo" \
    --config-settings=cmake.define.CMAKE_CXX_COMPILER="$cxx" \
    "--config-settings=cmake.define.CMAKE_CXX_FLAGS=$flags" >&2
  printf '%s\n' "$venv/bin/python"
}

# Checks that PYTHON (run with LD_PRELOAD=PRELOAD) imports dataecho from its own
# venv, and that the extension is instrumented (has SYMBOL-prefixed imports).
check_extension() {  # check_extension PYTHON PRELOAD SYMBOL
  local so venv
  venv=$(dirname "$(dirname "$1")")
  so=$(LD_PRELOAD=$2 "$1" -c 'import dataecho._core as c; print(c.__file__)')
  case $so in "$venv"/*) ;; *) log "  imported $so, not the build in $venv"; return 1 ;; esac
  local symbols
  symbols=$(nm -D "$so")
  grep -q "$3" <<<"$symbols" || { log "  $so has no $3 symbols: not instrumented"; return 1; }
}

# ---------------------------------------------------------------------------
# Canaries: the sanitizer must catch a planted bug with the options we use.
# ---------------------------------------------------------------------------

write_canary() {
  cat >"$work/canary.cpp" <<'CPP'
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
int shared_value = 0;
int main(int argc, char** argv) {
  const char* what = argc > 1 ? argv[1] : "";
  if (!std::strcmp(what, "race")) {
    std::thread t([] { shared_value = 1; });
    shared_value = 2;
    t.join();
  } else if (!std::strcmp(what, "overflow")) {
    volatile char* p = static_cast<char*>(std::malloc(8 + argc));
    p[8 + argc] = 1;
    std::free(const_cast<char*>(p));
  } else if (!std::strcmp(what, "ub")) {
    volatile int big = INT_MAX;
    shared_value = big + argc;
  } else if (!std::strcmp(what, "leak")) {
    void* volatile p = std::malloc(64 + argc);
    p = nullptr;
  }
  return shared_value == 12345;
}
CPP
}

# Sanitizer options without log_path, for canaries and probes whose output we read.
without_log_path() {
  local t=${TSAN_OPTIONS:-} a=${ASAN_OPTIONS:-} u=${UBSAN_OPTIONS:-}
  env TSAN_OPTIONS="${t%:log_path=*}" ASAN_OPTIONS="${a%:log_path=*}" UBSAN_OPTIONS="${u%:log_path=*}" "$@"
}

canary() {  # canary NAME FLAGS BUG EXPECTED_TEXT  (sanitizer options already exported)
  local bin=$work/canary-$1 out
  [[ -f $work/canary.cpp ]] || write_canary
  # shellcheck disable=SC2086  # FLAGS is a list of flags
  [[ -x $bin ]] || "$cxx" -std=c++20 $2 "$work/canary.cpp" -o "$bin" -pthread
  if out=$(without_log_path "$bin" "$3" 2>&1); then
    log "  canary: a planted $3 was not reported (exit 0): the sanitizer is not live"
    return 1
  fi
  grep -q "$4" <<<"$out" || { log "  canary: planted $3 gave no '$4':"; head -20 <<<"$out"; return 1; }
  log "  canary: planted $3 reported ($4)"
}

# TSan maps its shadow at fixed addresses; on kernels with high mmap entropy it
# stops with "unexpected memory mapping". Disabling ASLR for the run avoids that.
tsan_launcher=()
tsan_probe() {  # tsan_probe COMMAND...: sets tsan_launcher, or fails with the reason
  local out
  if out=$(without_log_path "$@" 2>&1); then return 0; fi
  if grep -q "unexpected memory mapping" <<<"$out" && command -v setarch >/dev/null; then
    tsan_launcher=(setarch "$(uname -m)" -R)
    if out=$(without_log_path "${tsan_launcher[@]}" "$@" 2>&1); then
      log "  (TSan needs ASLR off on this kernel: running under setarch -R)"
      return 0
    fi
  fi
  log "  TSan cannot start here: $(grep -m1 -E 'FATAL|ERROR|unexpected' <<<"$out" || head -1 <<<"$out")"
  return 1
}

# Runs COMMAND with its output also in OUT; fails if it fails or if any sanitizer
# log appeared in LOGS (from it or from any process it started).
checked() {  # checked LOGS OUT COMMAND...
  local logs=$1 out=$2 rc=0
  shift 2
  "$@" 2>&1 | tee -a "$out" || rc=$?
  if [[ -n $(reports "$logs") ]]; then
    log "  sanitizer reports:"
    show_reports "$logs"
    return 1
  fi
  [[ $rc -eq 0 ]] || { log "  exit status $rc: $*"; return 1; }
}

# What a pass reports in the summary: its result, or the step it failed in.
note() { printf '%s' "$*" >"$work/$pass.note"; }
step() { note "failed in: $*"; }
skip() { note "SKIP: $*"; : >"$work/$pass.skip"; }

# ---------------------------------------------------------------------------
# Passes. Each runs in a subshell with `set -e`; a non-zero exit fails the pass.
# ---------------------------------------------------------------------------

pass_tsan_native() {
  local logs=$work/logs/tsan-native out=$work/tsan-native.out bin=$work/tsan-native/cpp/tests/dataecho_tests
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$logs/tsan"
  step canary
  canary tsan "$tsan_flags" race "data race"
  step build
  build_native "$work/tsan-native" "$tsan_flags"
  step "starting TSan"
  tsan_probe "$bin" --only rng
  fresh_logs "$logs" && : >"$out"
  mapfile -t args < <(native_args)
  step "dataecho_tests (output above)"
  checked "$logs" "$out" "${tsan_launcher[@]}" "$bin" "${args[@]}"
  note "$(tail -n 1 "$out")"
}

pass_tsan_python() {
  local logs=$work/logs/tsan-python out=$work/tsan-python.out py preload
  # tests/tsan.supp: frames outside dataecho only, each explained there.
  # report_thread_leaks=0: the Python layer leaks the native core on purpose in two
  # cases, so its assembler std::thread (already finished) is never joined and TSan
  # would call it a leak at exit: (1) the interpreter exits while a daemon thread
  # blocked in put() holds the buffer (CPython never frees it; atexit stop()s the
  # assembler), and (2) a forked child, where abandon_after_fork() leaks the core
  # because the assembler does not exist there. Neither is a race; the native pass
  # keeps thread-leak reports on and checks that every owner joins.
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:report_thread_leaks=0"
  TSAN_OPTIONS+=":suppressions=$repo/tests/tsan.supp:log_path=$logs/tsan"
  step canary
  canary tsan "$tsan_flags" race "data race"
  step "building the extension (logs in the work directory)"
  py=$(python_env tsan "$tsan_flags")
  preload=$("$cxx" -print-file-name=libtsan.so)
  if ! tsan_probe env LD_PRELOAD="$preload" "$py" -c pass; then
    skip "ThreadSanitizer cannot run this Python (reason above); the native TSan pass still runs"
    return 0
  fi
  step "checking the build"
  check_extension "$py" "$preload" __tsan_
  fresh_logs "$logs" && : >"$out"
  cd "$repo"
  step "pytest (output above)"
  # TSan cannot follow a process that starts threads after a multi-threaded fork
  # (it dies, or with die_after_fork=0 aborts on "dup thread with used id"), so the
  # fault scenarios of kind fork run only in the other passes and the plain suite.
  # The fault scenarios' time limits stretched 3x: TSan runs this code 5-15x slower.
  checked "$logs" "$out" env LD_PRELOAD="$preload" DATAECHO_TEST_SEED="$seed" DATAECHO_TIME_SCALE=3 \
    "${tsan_launcher[@]}" "$py" -m pytest "${pytest_args[@]}" -k "not fork:" "${python_tests[@]}"
  note "${python_tests[*]##*/} (no fork: scenarios): $(tail -n 1 "$out")"
}

pass_asan_native() {
  local logs=$work/logs/asan-native out=$work/asan-native.out
  export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:log_path=$logs/asan"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan"
  step canary
  canary asan "$asan_flags" overflow "heap-buffer-overflow"
  canary asan "$asan_flags" ub "signed integer overflow"
  canary asan "$asan_flags" leak "detected memory leaks"
  step build
  build_native "$work/asan-native" "$asan_flags"
  fresh_logs "$logs" && : >"$out"
  mapfile -t args < <(native_args)
  step "dataecho_tests (output above)"
  checked "$logs" "$out" "$work/asan-native/cpp/tests/dataecho_tests" "${args[@]}"
  note "$(tail -n 1 "$out")"
}

pass_asan_python() {
  local logs=$work/logs/asan-python out=$work/asan-python.out py preload
  export ASAN_OPTIONS="halt_on_error=1:detect_leaks=0:log_path=$logs/asan"
  # tests/ubsan.supp: frames outside dataecho only, each explained there.
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$repo/tests/ubsan.supp:log_path=$logs/ubsan"
  step canary
  canary asan "$asan_flags" overflow "heap-buffer-overflow"
  canary asan "$asan_flags" ub "signed integer overflow"
  step "building the extension (logs in the work directory)"
  py=$(python_env asan "$asan_flags")
  preload="$("$cxx" -print-file-name=libasan.so) $("$cxx" -print-file-name=libubsan.so)"
  # Python objects from malloc, not pymalloc's arenas, so that ASan sees their
  # lifetimes too (a reference dropped too early in the bindings, say).
  export PYTHONMALLOC=malloc
  step "checking the build"
  check_extension "$py" "$preload" __asan_
  fresh_logs "$logs" && : >"$out"
  cd "$repo"
  step "pytest (output above)"
  # GCC 12's libasan takes no lock on fork (LLVM's runtime does from version 17):
  # a child forked while another thread holds a lock of its allocator can block on
  # its first allocation of that size class, whatever the code under test does. So
  # the fault scenarios of kind fork, whose children start epochs (threads, memory),
  # run only in the plain suite; test_blocking's fork test, which only raises, stays.
  # The fault scenarios' time limits stretched 2x: ASan runs this code about 2x slower.
  checked "$logs" "$out" env LD_PRELOAD="$preload" DATAECHO_TEST_SEED="$seed" DATAECHO_TIME_SCALE=2 \
    "$py" -m pytest "${pytest_args[@]}" -k "not fork:" "${python_tests[@]}"
  note "${python_tests[*]##*/} (no fork: scenarios): $(tail -n 1 "$out")"
}

pass_valgrind() {
  command -v valgrind >/dev/null || { skip "valgrind is not installed"; return 0; }
  step build
  build_native "$work/plain-native" "-g -O1"
  step "valgrind (output above)"
  local out=$work/valgrind.log rc=0
  valgrind --leak-check=full --error-exitcode=1 --log-file="$out" \
    "$work/plain-native/cpp/tests/dataecho_tests" --seed "$seed" --items "$valgrind_items" --timeout-s 300 || rc=$?
  grep -E "definitely lost|All heap blocks were freed|ERROR SUMMARY" "$out" | sed 's/^==[0-9]*== /  valgrind: /'
  if [[ $rc -ne 0 ]] || ! grep -qE "ERROR SUMMARY: 0 errors" "$out" ||
    ! grep -qE "definitely lost: 0 bytes|All heap blocks were freed" "$out"; then
    cat "$out"
    return 1
  fi
  note "--items $valgrind_items: $(grep -m1 -oE "ERROR SUMMARY: 0 errors" "$out");" \
    "$(grep -m1 -oE "definitely lost: .*|All heap blocks were freed.*" "$out")"
}

# ---------------------------------------------------------------------------

results=()
failed=0
for pass in "${passes[@]}"; do
  log ""
  log "=== $pass ==="
  start=$(now)
  set +e
  (
    set -e
    "pass_${pass//-/_}"
  )
  rc=$?
  set -e
  seconds=$(awk -v a="$start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  note=$(cat "$work/$pass.note" 2>/dev/null || true)
  if [[ $rc -ne 0 ]]; then
    status=FAIL failed=1
  elif [[ -f $work/$pass.skip ]]; then
    status=SKIP
  else
    status=PASS
  fi
  rm -f "$work/$pass.note" "$work/$pass.skip"
  results+=("$(printf '%-4s  %-12s %7s s  %s' "$status" "$pass" "$seconds" "$note")")
  log "$status $pass in $seconds s"
done

log ""
log "=== dataecho sanitizer summary (seed $seed) ==="
printf '%s\n' "${results[@]}"
exit "$failed"
