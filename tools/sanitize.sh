#!/usr/bin/env bash
# The sanitizer job of .ci/run: the CPU module built with AddressSanitizer + UndefinedBehavior-
# Sanitizer (+ float-cast-overflow, which GCC's `undefined` leaves out) into build/asan (not the
# normal build dir), next to a copy of the Python package, and the fault, pack, attention,
# selection and fuzz tests run against it. Fails when a test fails and on any sanitizer report.
#   tools/sanitize.sh [pytest args]     # default: the CI selection below; paths from the repo root
# Needs the test environment of .ci/run (jax, nanobind, pytest, hypothesis) and GCC's libasan.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
B=$ROOT/build/asan
PY=$(command -v python)
SAN="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all"

# 1. Build (-O1 -g: readable reports; the targets' own -O3 comes later on the line and wins
#    for the handlers, which keeps the vector code the users run).
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S ffi -B "$B" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PY" \
  -DCMAKE_CXX_FLAGS="$SAN -fno-omit-frame-pointer -g" \
  -DCMAKE_MODULE_LINKER_FLAGS="$SAN" -DCMAKE_SHARED_LINKER_FLAGS="$SAN" >/dev/null
cmake --build "$B" -j "$(nproc)" >/dev/null

# 2. A package directory with the sanitized module only (no editable-install hook, no build/).
SITE=$B/site
rm -rf "$SITE" && mkdir -p "$SITE"
cp -r jax_m3sparse "$SITE/"
find "$SITE" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
cp "$B"/_m3sparse_cpu.*.so "$SITE/jax_m3sparse/"

# 3. Run from outside the repository root: python -S skips site-packages' .pth files (the
#    editable install's import hook would bring back the normal module), so site-packages
#    goes on PYTHONPATH after the sanitized package.
SITE_PACKAGES=$("$PY" -c "import site; print(':'.join(site.getsitepackages()))")
export PYTHONPATH=$SITE:$SITE_PACKAGES
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export ASAN_OPTIONS=detect_leaks=0:exitcode=86
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=86
export JAX_M3SPARSE_REQUIRE_NATIVE=cpu   # a missing module must not test the fallback instead
export M3SPARSE_FUZZ_EXAMPLES=${M3SPARSE_FUZZ_EXAMPLES:-40}
RUN=$B/run && mkdir -p "$RUN" && cd "$RUN"
"$PY" -S -c "
import jax_m3sparse as m3, jax_m3sparse._m3sparse_cpu as cpu
assert m3.__file__.startswith('$SITE'), m3.__file__
assert cpu.__file__.startswith('$SITE') and 'cpu' in m3.native_platforms(), cpu.__file__
print('sanitized module:', cpu.__file__)"
args=()
for a in "$@"; do   # test paths relative to the repository root
  if [ -e "$ROOT/${a%%::*}" ]; then args+=("$ROOT/$a"); else args+=("$a"); fi
done
set -- ${args[@]+"${args[@]}"}
LOG=$B/sanitize.log
: > "$LOG"
status=0
pytest_logged() {
  # --capture=sys: pytest must not capture fd 2, where the sanitizers write (a process that
  # dies would take a captured report along with it). -o pythonpath=tests/support (relative to
  # pyproject.toml): the tests' shared modules only, not the repository root of pyproject.toml's
  # pythonpath, which would put its unbuilt jax_m3sparse before $SITE's.
  "$PY" -S -m pytest -q -p no:cacheprovider --capture=sys -o pythonpath=tests/support "$@" 2>&1 |
    tee -a "$LOG" || status=$?
}
if [ $# -eq 0 ]; then
  # The CI selection: the native implementation on small shapes (not the 2 GiB cache, not the
  # geometry grid, not the lowering/export checks, which run no handler).
  pytest_logged "$ROOT/tests/library/test_faults.py" "$ROOT/tests/library/test_reliability.py" \
    "$ROOT/tests/library/test_fuzz.py"
  pytest_logged "$ROOT/tests/library/test_pack.py" "$ROOT/tests/library/test_attention.py" \
    -k "native and not geometry_grid and not 2gib"
  pytest_logged "$ROOT/tests/library/test_select.py" -k "not sharded and not reference_gathers"
  pytest_logged "$ROOT/tests/library/test_index_keys.py" -k "not export"
  pytest_logged "$ROOT/tests/library/test_grouped_matmul.py" -k "not cuda"
else
  pytest_logged "$@"
fi
# A report must not scroll past: any report line fails the job and is repeated at the end.
if grep -qE "runtime error:|ERROR: AddressSanitizer|^SUMMARY: [A-Za-z]+Sanitizer" "$LOG"; then
  grep -nE -A3 "runtime error:|ERROR: AddressSanitizer|^SUMMARY: [A-Za-z]+Sanitizer" "$LOG" >&2
  echo "sanitize.sh: SANITIZER REPORT (above; full log $LOG)" >&2
  exit 1
fi
[ "$status" -eq 0 ] || { echo "sanitize.sh: pytest failed (exit $status)" >&2; exit "$status"; }
echo "sanitize.sh: no sanitizer report"
