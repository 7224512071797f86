#!/usr/bin/env bash
# Builds the stream-aware pool (allocator_ext/) with sanitizers and runs the sim tests under them:
#   1. AddressSanitizer + UndefinedBehaviorSanitizer: the C++ thread stress test, then the Python
#      sim tests (tests/memory, not gpu) with the sanitized library loaded through
#      WATERWAVE_HPO_POOL_LIBRARY and the ASan runtime preloaded into Python;
#   2. ThreadSanitizer: the C++ thread stress test (allocator_ext/tests/pool_stress.cpp).
# A memory pool with a use-after-free or a data race is not done: any report fails this script.
#
# Usage (from anywhere; needs cmake >= 3.18, g++ with libasan/libubsan/libtsan, and for the
# Python stage a Python environment with the package installed and pytest + hypothesis, whose
# python/pytest are on PATH):
#   bash .ci/sanitizers.sh [all|cpp|python]
# Stages: `cpp` builds both flavours and runs the C++ stress tests (no Python needed: CI runs it
# while its first venv installs); `python` runs the sim tests against the ASan+UBSan build in
# SANITIZER_BUILD_DIR (built there by `cpp`, or built now if absent); `all` (default) both.
# Environment: SANITIZER_BUILD_DIR (default: a fresh temporary directory, removed at exit),
#   CXX (default g++), STRESS_THREADS (8), STRESS_ITERATIONS (20000).
set -euo pipefail

stage="${1:-all}"
case "$stage" in
  all | cpp | python) ;;
  *)
    echo "usage: bash .ci/sanitizers.sh [all|cpp|python] (got stage '$stage')" >&2
    exit 2
    ;;
esac

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cxx="${CXX:-g++}"
threads="${STRESS_THREADS:-8}"
iterations="${STRESS_ITERATIONS:-20000}"
if [[ -n "${SANITIZER_BUILD_DIR:-}" ]]; then
  work="$SANITIZER_BUILD_DIR"
  mkdir -p "$work"
else
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
fi

build() {  # build <dir> <sanitizers>
  cmake -S "$repo/allocator_ext" -B "$1" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER="$cxx" -DWATERWAVE_POOL_TESTS=ON -DWATERWAVE_SANITIZE="$2" >/dev/null
  cmake --build "$1" -j "$(nproc)" >/dev/null
}

export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"

if [[ "$stage" != python ]]; then
  echo "== sanitizers: building with -fsanitize=address,undefined in $work/asan"
  build "$work/asan" address,undefined
  echo "== sanitizers: C++ thread stress test under ASan+UBSan"
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" "$work/asan/pool_stress" "$threads" 2000

  echo "== sanitizers: building with -fsanitize=thread in $work/tsan"
  build "$work/tsan" thread
  echo "== sanitizers: C++ thread stress test under TSan ($threads threads x $iterations)"
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" \
    "$work/tsan/pool_stress" "$threads" "$iterations"
fi

if [[ "$stage" != cpp ]]; then
  if [[ ! -f "$work/asan/libwaterwave_pool.so" ]]; then
    echo "== sanitizers: building with -fsanitize=address,undefined in $work/asan"
    build "$work/asan" address,undefined
  fi
  echo "== sanitizers: Python sim tests (tests/memory, not gpu) under ASan+UBSan"
  asan_runtime="$("$cxx" -print-file-name=libasan.so)"
  ubsan_runtime="$("$cxx" -print-file-name=libubsan.so)"
  (
    cd "$repo"
    # Python itself is not instrumented: leak checking would report the interpreter's own
    # memory. --capture=sys: C-level stderr (the sanitizer report) is not swallowed by pytest on
    # abort. One xdist worker per core: a worker that a report aborts is a failed test ("worker
    # crashed while running ...", exit 1), and its stderr, the report, reaches this log (checked
    # with a test that writes a report and aborts).
    WATERWAVE_HPO_POOL_LIBRARY="$work/asan/libwaterwave_pool.so" \
    LD_PRELOAD="$asan_runtime $ubsan_runtime" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:verify_asan_link_order=0" \
      pytest tests/memory -m "not gpu" -q -p no:cacheprovider --capture=sys -n "$(nproc)"
  )
fi

echo "== sanitizers ($stage): all clean"
