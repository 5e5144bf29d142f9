#!/usr/bin/env bash
# One device call for the CUDA backend (H200, kind nvidia-h200): builds the standalone harness
# and the Python modules, runs correctness (harness + tests/cuda through the public API), then
# the timings. Logs go to $OUT (the device tool brings them back) or ./out.
#   tools/device_check.sh [quick|full|sanitize|profile|final|harness|race|tp|cpu|select|grouped|m3|fullattn]
#     fullattn: full_attention: pytest tests/cuda (PYK), bench.cuda --full (FULL_ARGS), the M3
#     example (M3_AFTER="<bench args>"), memcheck of its pytest (SANITIZE=0 skips);
#     m3: the M3 example at real size (python -m examples.minimax_m3.bench; M3_ARGS, M3_FORMATS
#     "bf16 mxfp8" for each experts' format in turn, and CUDA_BENCH=1 for bench.cuda --quick
#     --no-ref after it; PYK: pytest tests/cuda/test_gpu.py -k PYK before it);
#     quick: smaller benchmark set; sanitize: compute-sanitizer memcheck + racecheck on the
#     harness and memcheck on the public-API GPU tests (no timings); profile: ncu on the harness;
#     final: the bench.cuda table, sanitizers and the scan gap analysis in one call;
#     harness: harness only (correctness and timings, ncu of NCU_KERNELS; SANITIZE=1, PYTEST=1,
#     NCU_PIPES add steps); race: racecheck of the harness tests only;
#     cpu: the host CPU's attention paths (CPU module only): tests, then bench peak/decode/
#     prefill on 2 cores (CPU_STEPS picks from "test suite sanitize peak decode prefill"; CORES);
#     select: select_blocks: tests/cuda/select_harness.cu correctness and timings,
#     pytest tests/cuda -k select_blocks (PYTEST=0 skips), memcheck of the harness (SANITIZE=0 skips);
#     grouped: the same for grouped_matmul (tests/cuda/grouped_harness.cu); both take
#     HARNESS_ARGS, AB_OLD=<an older kernel source> (timings old, new, old, new in one call),
#     and M3_AFTER="<bench args>" runs python -m examples.minimax_m3.bench last;
#     tp: several GPUs (kind nvidia-h200-x2 and up): bench.cuda --tp N and the M3 example at
#     --tp 1 and N (N = TP, default every GPU; TP_STEPS picks from "bench example m3 pytest",
#     and "repeat": the M3-heads example 3 times at each tp, run-to-run token agreement)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
MODE=${1:-full}
B=${M3_BUILD_DIR:-${TMPDIR:-/tmp}/m3build}   # build outputs (M3_BUILD_DIR; default under $TMPDIR)
mkdir -p "$B"
export PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
nvcc --version | tail -1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1

# The standalone harness (attention.cu + pack.cu + tests/cuda/harness.cu) into $B/harness, the
# attention kernels' ptxas report into $OUT/ptxas.log; $1: extra nvcc flags. Waits for its own
# compiles only (a background CMake build may be running).
build_harness() {
  local flags="-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi/include -Iffi/cuda ${1:-}"
  nvcc $flags -Xptxas -v -c ffi/cuda/attention.cu -o "$B/attention.o" >"$OUT/ptxas.log" 2>&1 &
  local p1=$!
  nvcc $flags -c ffi/cuda/pack.cu -o "$B/pack.o" &
  local p2=$!
  nvcc $flags -c tests/cuda/harness.cu -o "$B/harness.o" &
  local p3=$!
  wait $p1 $p2 $p3
  nvcc $flags "$B/attention.o" "$B/pack.o" "$B/harness.o" -o "$B/harness" ||
    { echo "harness build failed"; return 1; }
}

# Both Python modules (CPU and CUDA) into jax_m3sparse/, or exit naming the failure.
build_modules() {
  cmake -S ffi -B "$B/cmake" -G Ninja -DM3SPARSE_ENABLE_CUDA=ON -DM3SPARSE_NATIVE=OFF \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/cmake.log" 2>&1 &&
    cmake --build "$B/cmake" -j 16 >>"$OUT/cmake.log" 2>&1 &&
    cp "$B"/cmake/_m3sparse_cpu.*.so "$B"/cmake/cuda/_m3sparse_cuda*.so jax_m3sparse/ ||
    { echo "module build failed"; tail -30 "$OUT/cmake.log"; exit 1; }
}

# M3_AFTER="<bench args>": the M3 example at real size with these arguments, last.
m3_after() {
  [ -n "${M3_AFTER:-}" ] || return 0
  echo "=== python -m examples.minimax_m3.bench $M3_AFTER"
  PYTHONPATH=$ROOT timeout ${M3_S:-300} python3 -m examples.minimax_m3.bench $M3_AFTER 2>&1 |
    grep -vE "^[WI][0-9]{4} " | tee "$OUT/m3_bench.log" | tail -${M3_TAIL:-80}
  date -u
}

if [ "$MODE" = tp ]; then  # several GPUs: tensor parallel over KV heads
  # NVLink multicast stays off (the device docs: it can take the host's GPUs out of service)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export PYTHONPATH=$ROOT
  TP=${TP:-$(nvidia-smi -L | wc -l)}
  STEPS=${TP_STEPS:-bench example m3 pytest}
  if ! ls jax_m3sparse/_m3sparse_cuda*.so >/dev/null 2>&1; then  # a warm machine keeps it
    # each module its own target: a half-edited CPU backend must not stop the CUDA one
    cmake -S ffi -B "$B/cmake" -G Ninja -DM3SPARSE_ENABLE_CUDA=ON -DM3SPARSE_NATIVE=OFF \
      -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/cmake.log" 2>&1
    (cmake --build "$B/cmake" -j 24 --target _m3sparse_cpu >>"$OUT/cmake.log" 2>&1 &&
      cp "$B"/cmake/_m3sparse_cpu.*.so jax_m3sparse/ || echo "CPU module build failed") &
    CPU_PID=$!
    cmake --build "$B/cmake" -j 24 --target _m3sparse_cuda >>"$OUT/cmake.log" 2>&1 &&
      cp "$B"/cmake/cuda/_m3sparse_cuda*.so jax_m3sparse/ ||
      { echo "CUDA module build failed"; tail -30 "$OUT/cmake.log"; exit 1; }
  fi
  echo "=== nvidia-smi topo -m; lscpu"
  nvidia-smi topo -m
  lscpu | head -16
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS TP=$TP"
  date -u
  if [[ " $STEPS " == *" bench "* ]]; then
    echo "=== python -m jax_m3sparse.bench.cuda --tp $TP"
    timeout 240 python3 -m jax_m3sparse.bench.cuda --tp "$TP" 2>&1 | tee "$OUT/bench_tp.log" |
      grep -vE "^[WI][0-9]{4} "
    date -u
  fi
  # The M3 example at --tp 1 and --tp N: the same tokens? per-device cache, step time.
  prompts=()  # the default prompts live in /usr/share/common-licenses; else this repo's docs
  [ -d /usr/share/common-licenses ] || prompts=(--prompt-file README.md --prompt-file BUILD.md
    --prompt-file docs/SPEC.md --prompt-file BENCHMARKS.md --max-prompt-tokens 1500)
  example() {  # $1: label; $2: tp; rest: model flags
    local label=$1 tp=$2; shift 2
    echo "--- $label: examples/minimax_m3_generate.py --platform cuda --tp $tp --no-compare $*" |
      tee -a "$OUT/example.log"
    timeout 200 python3 examples/minimax_m3_generate.py --platform cuda --tp "$tp" --no-compare \
      "${prompts[@]}" --tokens-json "$B/tokens_${label}_tp$tp.json" "$@" >>"$OUT/example.log" 2>&1
    echo "rc=$?"
    grep -E "^backend|^requests|^prefill:|^decode|^NVFP4 cache" "$OUT/example.log" | tail -6
  }
  same_tokens() {  # $1 $2: two --tokens-json files
    python3 - "$1" "$2" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
n = sum(len(v) for v in a.values())
eq = sum(x == y for k in a for x, y in zip(a[k], b.get(k, [])))
same = sum(a[k] == b.get(k) for k in a)
first = {k: next(i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y)
         for k in a if a[k] != b.get(k)}
print(f"tokens equal: {eq} of {n}; requests identical: {same} of {len(a)}; first differing "
      f"token per request: {first or 'none'}")
PY
  }
  for label in example m3; do
    [[ " $STEPS " == *" $label "* ]] || continue
    flags=(); [ $label = m3 ] && flags=(--heads 64 --kv-heads 4)  # M3's head counts
    echo "=== M3 example ($label) at --tp 1 and --tp $TP"
    example $label 1 "${flags[@]}"
    example $label "$TP" "${flags[@]}"
    same_tokens "$B/tokens_${label}_tp1.json" "$B/tokens_${label}_tp$TP.json"
    if [ $label = m3 ]; then  # run to run at tp N: is the difference deterministic?
      cp "$B/tokens_m3_tp$TP.json" "$B/tokens_m3_first.json"
      example $label "$TP" "${flags[@]}"
      same_tokens "$B/tokens_m3_first.json" "$B/tokens_m3_tp$TP.json"
    fi
    date -u
  done
  if [[ " $STEPS " == *" repeat "* ]]; then  # run to run: M3 heads REPEATS (3) x tp 1 and tp N
    for i in $(seq ${REPEATS:-3}); do for tp in 1 "$TP"; do example r$i "$tp" --heads 64 --kv-heads 4; done; done
    for i in $(seq ${REPEATS:-3}); do for tp in 1 "$TP"; do
      echo -n "r$i tp $tp vs r1 tp 1: "; same_tokens "$B/tokens_r1_tp1.json" "$B/tokens_r${i}_tp$tp.json"
    done; done
    date -u
  fi
  if [[ " $STEPS " == *" pytest "* ]]; then
    # tests/library/test_sharding.py needs 8 devices: it runs on the device machine's CPU (simulated
    # devices), which checks the partitioners under that image's jax version
    wait ${CPU_PID:-}
    echo "=== JAX_PLATFORMS=cpu pytest -q tests/library/test_sharding.py (jax of the device image)"
    JAX_PLATFORMS=cpu timeout 150 python3 -m pytest -q tests/library/test_sharding.py \
      -p no:cacheprovider 2>&1 | tee "$OUT/pytest_sharding.log" | tail -4
  fi
  date -u
  exit 0
fi

if [ "$MODE" = cpu ]; then  # the host CPU's attention paths (AVX-512 BF16, AMX)
  export PYTHONPATH=$ROOT JAX_PLATFORMS=cpu
  # -march=native, as a source install builds by default (the paths themselves are chosen at
  # run time either way)
  cmake -S ffi -B "$B/cpu" -G Ninja -DM3SPARSE_NATIVE=ON \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/cmake_cpu.log" 2>&1 &&
    cmake --build "$B/cpu" -j "$(nproc)" --target _m3sparse_cpu _m3sparse_cpu_bench >>"$OUT/cmake_cpu.log" 2>&1 &&
    cp "$B"/cpu/_m3sparse_cpu.*.so jax_m3sparse/ && cp "$B"/cpu/_m3sparse_cpu_bench.*.so jax_m3sparse/bench/ ||
    { echo "CPU module build failed"; tail -30 "$OUT/cmake_cpu.log"; exit 1; }
  lscpu | grep -E "Model name|^CPU\(s\)"
  grep -o -w -E "avx512f|avx512_bf16|amx_tile|amx_bf16" /proc/cpuinfo | sort | uniq -c
  python3 -c "from jax_m3sparse import _m3sparse_cpu as m; print('paths', m.cpu_paths(), 'now', m.cpu_path())"
  CORES=${CORES:-0,1}  # the timings on 2 cores, as on the development machine
  for step in ${CPU_STEPS:-test peak decode prefill}; do
    date -u
    if [ "$step" = test ]; then
      echo "=== pytest tests/library/test_cpu_paths.py (every path of this CPU)"
      timeout 300 python3 -m pytest -q tests/library/test_cpu_paths.py -p no:cacheprovider 2>&1 |
        tee "$OUT/pytest_cpu_paths.log" | tail -25
    elif [ "$step" = sanitize ]; then  # ASan + UBSan: every path's tests, the fuzz and
      # reliability tests on avx512 (its vdpbf16ps operands are instrumented loads over the
      # same regions the AMX tile loads read, which ASan cannot see)
      mkdir -p "$B/bin" && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$B/bin/python" &&
        chmod +x "$B/bin/python"  # sanitize.sh calls `python`; a link would lose the venv
      # (the wider selection, every path's tests plus fuzz and reliability, ran past a 330 s
      # call on 2026-12-01 and returned nothing: keep to the bf16 paths and a short fuzz)
      echo "=== M3SPARSE_CPU_ISA=avx512 tools/sanitize.sh (avx512/amx path tests, fuzz)"
      PATH="$B/bin:$PATH" M3SPARSE_CPU_ISA=avx512 M3SPARSE_FUZZ_EXAMPLES=10 timeout 240 \
        bash tools/sanitize.sh tests/library/test_cpu_paths.py -k "avx512 or amx" 2>&1 |
        tee "$OUT/sanitize.log" | tail -8
      PATH="$B/bin:$PATH" M3SPARSE_CPU_ISA=avx512 M3SPARSE_FUZZ_EXAMPLES=10 timeout 120 \
        bash tools/sanitize.sh tests/library/test_fuzz.py 2>&1 | tee -a "$OUT/sanitize.log" |
        tail -4
    elif [ "$step" = suite ]; then  # the attention suites on this CPU's default (widest) path
      echo "=== pytest (attention, faults, fuzz, reliability, sharding, API tour), path $(python3 -c \
        'from jax_m3sparse import _m3sparse_cpu as m; print(m.cpu_path())')"
      timeout 400 python3 -m pytest -q -n 8 -p no:cacheprovider tests/library/test_attention.py \
        tests/library/test_faults.py tests/library/test_fuzz.py tests/library/test_reliability.py \
        tests/library/test_sharding.py tests/library/test_api_tour.py 2>&1 | tee "$OUT/pytest_suite.log" | tail -25
    else
      echo "=== taskset -c $CORES python -m jax_m3sparse.bench $step --platform cpu"
      taskset -c "$CORES" timeout 300 python3 -m jax_m3sparse.bench "$step" --platform cpu \
        2>"$OUT/bench_$step.err" | tee "$OUT/bench_$step.log"
    fi
  done
  exit 0
fi

if [ "$MODE" = profile ]; then
  build_harness -lineinfo || exit 1
  cuobjdump -sass "$B/attention.o" > "$OUT/attention.sass"
  awk '/Function : .*nv_bfloat16/{f=1;next} /Function :/{f=0} f' "$OUT/attention.sass" |
    grep -oE '^ +/\*[0-9a-f]{4}\*/ +[A-Z0-9_.]+' | awk '{print $2}' | sed 's/\..*//' |
    sort | uniq -c | sort -rn | head -30
  cuobjdump -sass "$B/pack.o" > "$OUT/pack.sass"
  awk '/Function : .*pack_kernel.*nv_bfloat16/{f=1;next} /Function :/{f=0} f' "$OUT/pack.sass" |
    grep -oE '^ +/\*[0-9a-f]{4}\*/ +[A-Z0-9_.]+' | awk '{print $2}' | sed 's/\..*//' |
    sort | uniq -c | sort -rn | head -30 | tr '\n' ' '; echo
  M="smsp__inst_executed.sum,smsp__cycles_active.avg,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active"
  for st in long_scoreboard short_scoreboard math_pipe_throttle wait mio_throttle lg_throttle barrier not_selected dispatch_stall no_instruction branch_resolving drain membar misc tex_throttle; do
    M="$M,smsp__average_warps_issue_stalled_${st}_per_issue_active.ratio"
  done
  for k in pack_kernel sparse_attention; do
    timeout 200 ncu --clock-control none -k regex:$k --launch-skip 3 --launch-count 1 --metrics "$M" \
      "$B/harness" --profile > "$OUT/ncu_$k.txt" 2>&1
    grep -E "^\s+(smsp|sm__|dram)" "$OUT/ncu_$k.txt" | awk '{print $1, $NF}'
  done
  exit 0
fi

if [ "$MODE" = race ]; then  # harness build + racecheck of the harness tests only
  build_harness -lineinfo || exit 1
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 "$B/harness" --no-bench \
    >"$OUT/sanitize_racecheck.log" 2>&1
  echo "rc=$?"; grep -E "RACECHECK SUMMARY|FAIL |failure" "$OUT/sanitize_racecheck.log" | tail -3
  grep -c "^PASS" "$OUT/sanitize_racecheck.log"
  date -u
  exit 0
fi

if [ "$MODE" = m3 ]; then  # the M3 example at real size: one TP-8 rank (examples/minimax_m3/bench.py)
  # M3_ARGS: the bench's arguments (default --quick); CUDA_BENCH=1: bench.cuda --quick --no-ref
  # after it (the attention kernel at the TP-8 rank's shapes beside TP 1)
  # M3_FORMATS: the experts' formats to run it with, in turn (default bf16; "bf16 mxfp8")
  # PYK: pytest tests/cuda/test_gpu.py -k "$PYK" first (PYTEST_S, default 300 s)
  build_modules
  date -u
  if [ -n "${PYK:-}" ]; then
    echo "=== pytest tests/cuda/test_gpu.py -k '$PYK'"
    PYTHONPATH=$ROOT timeout ${PYTEST_S:-300} python3 -m pytest -q -x tests/cuda/test_gpu.py \
      -k "$PYK" -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/pytest_m3.log" | tail -15
    date -u
  fi
  for F in ${M3_FORMATS:-bf16}; do
    echo "=== python -m examples.minimax_m3.bench ${M3_ARGS:---quick} --expert-format $F"
    PYTHONPATH=$ROOT timeout ${M3_S:-420} python3 -m examples.minimax_m3.bench ${M3_ARGS:---quick} \
      --expert-format $F --json "$OUT/m3_bench_$F.json" 2>"$OUT/m3_bench_$F.err" |
      tee "$OUT/m3_bench_$F.log"
    echo "rc=${PIPESTATUS[0]}"; tail -5 "$OUT/m3_bench_$F.err"
    date -u
  done
  if [ "${CUDA_BENCH:-0}" = 1 ]; then
    echo "=== python -m jax_m3sparse.bench.cuda --quick --no-ref"
    PYTHONPATH=$ROOT timeout ${CUDA_S:-200} python3 -m jax_m3sparse.bench.cuda --quick --no-ref 2>&1 |
      tee "$OUT/bench_cuda.log" | grep -v "^  trace" | tail -20
    date -u
  fi
  exit 0
fi

if [ "$MODE" = fullattn ]; then  # full_attention: pytest, the bench rows, memcheck, the M3 step
  build_modules
  date -u
  echo "=== pytest tests/cuda/test_gpu.py -k '${PYK:-full or decode_matches or prefill_batch}'"
  PYTHONPATH=$ROOT timeout 200 python3 -m pytest -q tests/cuda/test_gpu.py \
    -k "${PYK:-full or decode_matches or prefill_batch}" -p no:cacheprovider 2>&1 |
    tee "$OUT/pytest_full.log" | tail -15
  date -u
  echo "=== python -m jax_m3sparse.bench.cuda --full ${FULL_ARGS:-}"
  PYTHONPATH=$ROOT timeout 240 python3 -m jax_m3sparse.bench.cuda --full ${FULL_ARGS:-} 2>&1 |
    grep -vE "^[WI][0-9]{4} " | tee "$OUT/bench_full.log"
  date -u
  m3_after
  if [ "${SANITIZE:-1}" = 1 ]; then
    echo "=== compute-sanitizer memcheck: pytest -k full_attention"
    PYTHONPATH=$ROOT XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MEM_S:-200} \
      compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
      tests/cuda/test_gpu.py -k full_attention -p no:cacheprovider >"$OUT/sanitize_full.log" 2>&1
    echo "rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_full.log" | tail -3
    grep -m 2 -A 8 -E "^========= (Invalid|Error)" "$OUT/sanitize_full.log"
  fi
  exit 0
fi

if [ "$MODE" = select ] || [ "$MODE" = grouped ]; then  # one op: harness, timings, pytest, memcheck
  case $MODE in
    select) KSRC=select; HSRC=select_harness; PYK=${PYK:-select_blocks} ;;
    grouped) KSRC=grouped_matmul; HSRC=grouped_harness; PYK=${PYK:-grouped_matmul} ;;
  esac
  # PYTEST=1 (default): the CUDA module too, then pytest tests/cuda -k $PYK;
  # SANITIZE=1 (default): compute-sanitizer memcheck of the harness tests, last
  if [ "${PYTEST:-1}" = 1 ]; then
    (cmake -S ffi -B "$B/cmake" -G Ninja -DM3SPARSE_ENABLE_CUDA=ON -DM3SPARSE_NATIVE=OFF \
      -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/cmake.log" 2>&1 &&
      cmake --build "$B/cmake" -j 12 --target _m3sparse_cuda >>"$OUT/cmake.log" 2>&1 &&
      cp "$B"/cmake/cuda/_m3sparse_cuda*.so jax_m3sparse/ && echo "CUDA module built" >>"$OUT/cmake.log"
      cmake --build "$B/cmake" -j 4 --target _m3sparse_cpu >>"$OUT/cmake.log" 2>&1 &&
      cp "$B"/cmake/_m3sparse_cpu.*.so jax_m3sparse/) &
    CMAKE_PID=$!
  fi
  flags="-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi/include -Iffi/cuda -lineinfo"
  nvcc $flags -Xptxas -v -c ffi/cuda/$KSRC.cu -o "$B/$KSRC.o" >"$OUT/ptxas_$MODE.log" 2>&1 &
  p1=$!
  nvcc $flags -c tests/cuda/$HSRC.cu -o "$B/$HSRC.o" || exit 1
  wait $p1 || { echo "$KSRC.cu build failed"; tail -20 "$OUT/ptxas_$MODE.log"; exit 1; }
  nvcc $flags "$B/$KSRC.o" "$B/$HSRC.o" -o "$B/$HSRC" || exit 1
  grep -E "registers|spill" "$OUT/ptxas_$MODE.log" | sort | uniq -c
  if [ -n "${AB_OLD:-}" ]; then  # AB_OLD=<an older $KSRC.cu>: the same harness on that kernel
    cp "$AB_OLD" "ffi/cuda/_ab_old_$KSRC.cu"
    nvcc $flags -Xptxas -v -c "ffi/cuda/_ab_old_$KSRC.cu" -o "$B/${KSRC}_old.o" \
      >"$OUT/ptxas_${MODE}_old.log" 2>&1 && rm "ffi/cuda/_ab_old_$KSRC.cu" &&
      nvcc $flags "$B/${KSRC}_old.o" "$B/$HSRC.o" -o "$B/${HSRC}_old" || exit 1
    echo "old kernel:"; grep -E "registers|spill" "$OUT/ptxas_${MODE}_old.log" | sort | uniq -c
  fi
  date -u
  echo "=== $MODE harness correctness"
  timeout 120 "$B/$HSRC" --no-bench >"$OUT/${MODE}_tests.log" 2>&1
  echo "rc=$? PASS $(grep -c '^PASS' "$OUT/${MODE}_tests.log")"
  grep -E "^FAIL|failure|error" "$OUT/${MODE}_tests.log" | cut -c1-400 | tail -12
  date -u
  echo "=== $MODE harness timings"
  if [ -n "${AB_OLD:-}" ]; then  # old, new, old, new: one line per case and run
    for run in old new old new; do
      bin="$B/$HSRC"; [ $run = old ] && bin="$B/${HSRC}_old"
      timeout 120 "$bin" --bench-only ${HARNESS_ARGS:-} >"$OUT/${MODE}_bench_$run.log" 2>&1
      echo "--- $run rc=$?"; grep -E "TABLE|error" "$OUT/${MODE}_bench_$run.log" | cut -c1-${AB_COLS:-160}
    done
  else
    timeout 120 "$B/$HSRC" --bench-only ${HARNESS_ARGS:-} >"$OUT/${MODE}_bench.log" 2>&1
    echo "rc=$?"; grep -E "TABLE|error" "$OUT/${MODE}_bench.log"; [ $MODE = grouped ] && cat "$OUT/${MODE}_bench.log"
  fi
  date -u
  if [ "${PYTEST:-1}" = 1 ]; then
    wait $CMAKE_PID; grep -E "CUDA module built|rror" "$OUT/cmake.log" | head -5
    echo "=== pytest tests/cuda/test_gpu.py -k $PYK"
    PYTHONPATH=$ROOT timeout ${PYTEST_S:-300} python3 -m pytest -q tests/cuda/test_gpu.py -k "$PYK" \
      -p no:cacheprovider 2>&1 | tee "$OUT/pytest_$MODE.log" | tail -15
    date -u
  fi
  if [ "${SANITIZE:-1}" = 1 ]; then
    echo "=== compute-sanitizer memcheck: $MODE harness --no-bench"
    timeout ${MEM_S:-100} compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$B/$HSRC" --no-bench >"$OUT/sanitize_$MODE.log" 2>&1
    echo "rc=$?"; grep -E "ERROR SUMMARY|^FAIL|failure" "$OUT/sanitize_$MODE.log" | tail -3
    grep -m 2 -A 8 -E "^========= (Invalid|Error)" "$OUT/sanitize_$MODE.log"
  fi
  date -u
  m3_after
  exit 0
fi

if [ "$MODE" = harness ]; then  # harness only: correctness, then the timings
  if [ -n "${PYTEST:-}" ]; then  # also the Python modules, for pytest tests/cuda at the end
    (cmake -S ffi -B "$B/cmake" -G Ninja -DM3SPARSE_ENABLE_CUDA=ON -DM3SPARSE_NATIVE=OFF \
      -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/cmake.log" 2>&1 &&
      cmake --build "$B/cmake" -j 12 >>"$OUT/cmake.log" 2>&1 &&
      cp "$B"/cmake/_m3sparse_cpu.*.so "$B"/cmake/cuda/_m3sparse_cuda*.so jax_m3sparse/) &
    CMAKE_PID=$!
  fi
  build_harness -lineinfo || exit 1
  date -u
  echo "=== harness correctness"
  timeout 150 "$B/harness" --no-bench >"$OUT/harness_tests.log" 2>&1
  echo "rc=$?"; grep -cE "PASS" "$OUT/harness_tests.log"; grep -E "FAIL|failure" "$OUT/harness_tests.log" | tail -12
  date -u
  echo "=== harness timings (--quick)"
  timeout 150 "$B/harness" --bench-only --quick >"$OUT/harness_bench.log" 2>&1
  grep -E "TABLE" "$OUT/harness_bench.log"
  date -u
  # ncu of the kernels named in NCU_KERNELS (mangled-name fragments) at decode T = 128
  M="smsp__inst_executed.sum,smsp__cycles_active.avg,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_lsu.sum"
  for st in long_scoreboard short_scoreboard math_pipe_throttle wait mio_throttle lg_throttle barrier not_selected dispatch_stall no_instruction selected; do
    M="$M,smsp__average_warps_issue_stalled_${st}_per_issue_active.ratio"
  done
  for kn in ${NCU_KERNELS:-sparse_attention_kernelI13__nv_bfloat16}; do
    [ "$kn" = none ] && continue
    echo "--- ncu $kn"
    timeout 90 ncu --clock-control none --kernel-name-base mangled -k regex:"$kn" \
      --launch-skip 2 --launch-count 1 --metrics "$M" "$B/harness" --profile >"$OUT/ncu_$kn.txt" 2>&1
    grep -E "^\s+(smsp|sm__|dram|l1tex)" "$OUT/ncu_$kn.txt" | awk '{print $1, $NF}'
  done
  # pipe utilization (ComputeWorkloadAnalysis, raw page) of the first kernel named
  if [ -n "${NCU_PIPES:-}" ]; then
    timeout 90 ncu --clock-control none --kernel-name-base mangled -k regex:"$NCU_PIPES" \
      --launch-skip 2 --launch-count 1 --section ComputeWorkloadAnalysis --section InstructionStats \
      --page raw "$B/harness" --profile >"$OUT/ncu_pipes.txt" 2>&1
    grep -E "pipe_.*(pct|sum )|inst_executed_pipe" "$OUT/ncu_pipes.txt" | awk '$NF != "0" {print $1, $NF}' | head -60
  fi
  if [ -n "${SANITIZE:-}" ]; then  # racecheck + memcheck of the harness tests
    for tool in racecheck memcheck; do
      echo "=== compute-sanitizer $tool: harness --no-bench"
      timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 "$B/harness" --no-bench \
        >"$OUT/sanitize_$tool.log" 2>&1
      echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL |failure" "$OUT/sanitize_$tool.log" | tail -3
      date -u
    done
  fi
  if [ -n "${PYTEST:-}" ]; then
    wait $CMAKE_PID; tail -2 "$OUT/cmake.log"
    echo "=== pytest tests/cuda (public API on the GPU)"
    PYTHONPATH=$ROOT timeout 300 python3 -m pytest -q tests/cuda -p no:cacheprovider 2>&1 |
      tee "$OUT/pytest.log" | tail -6
    date -u
  fi
  date -u
  exit 0
fi

# Python modules (_m3sparse_cpu, _m3sparse_cuda) in the background: CPU-only work.
(
  cmake -S ffi -B "$B/cmake" -G Ninja -DM3SPARSE_ENABLE_CUDA=ON -DM3SPARSE_NATIVE=OFF \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/cmake.log" 2>&1 &&
    cmake --build "$B/cmake" -j 12 >>"$OUT/cmake.log" 2>&1 &&
    cp "$B"/cmake/_m3sparse_cpu.*.so "$B"/cmake/cuda/_m3sparse_cuda*.so jax_m3sparse/ &&
    echo "modules built" >>"$OUT/cmake.log"
) &
CMAKE_PID=$!

# Standalone harness.
build_harness || exit 1
grep -E "registers|spill" "$OUT/ptxas.log" | sort | uniq -c
# opcode histogram of the bf16 attention kernel (static SASS)
cuobjdump -sass "$B/attention.o" > "$OUT/attention.sass" 2>/dev/null &&
  awk '/Function : .*sparse_attention_kernel.*nv_bfloat16/{f=1;next} /Function :/{f=0} f' "$OUT/attention.sass" |
  grep -oE '^ +/\*[0-9a-f]{4}\*/ +[A-Z0-9_.]+' | awk '{print $2}' | sed 's/\..*//' |
  sort | uniq -c | sort -rn | head -24 | tr '\n' ' '; echo

if [ "$MODE" = final ]; then  # one call: correctness, kernel and through-JAX tables, sanitizers
  # BENCH_ARGS=--quick: bench.cuda on decode T in {1, 32, 128} and dql 4 sharing 12 of 16 blocks;
  # SKIP_GAP=1: no scan gap analysis; SKIP_PYSAN=1: no memcheck of the pytest run; RACE_S /
  # MEM_S: the harness sanitizers' time limits; FINAL_SAN: which of them run (default both). The measurements come first, the sanitizers last.
  echo "=== harness correctness (oracle, invariance, pack)"
  timeout 60 "$B/harness" --no-bench >"$OUT/harness_tests.log" 2>&1
  echo "rc=$? PASS $(grep -c '^PASS' "$OUT/harness_tests.log")"
  grep -E "^FAIL|failure" "$OUT/harness_tests.log" | tail -5
  echo "=== harness --bench-only --quick"
  timeout 100 "$B/harness" --bench-only --quick >"$OUT/harness_bench.log" 2>&1
  grep -E "TABLE" "$OUT/harness_bench.log"
  # what binds: ncu of each measured shape (harness --profile-shape; NCU_SHAPES picks some):
  # decode T = 1 (cluster of 4), T = 32 (cluster of 2), T = 128 and dql 4 (one CTA per row),
  # prefill 2048 @ 8192 (correlated selections), pack T = 65536
  M="smsp__inst_executed.sum,smsp__cycles_active.avg,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio"
  for shape in ${NCU_SHAPES:-decode1 decode32 decode128 dql4 prefill pack}; do
    kn=sparse_attention_kernelI13__nv_bfloat16
    case $shape in
      decode1) kn="${kn}Lb0ELi4E" ;; decode32) kn="${kn}Lb0ELi2E" ;; pack) kn=pack_kernel ;;
      *) kn="${kn}Lb0ELi1E" ;;
    esac
    echo "--- ncu $shape ($kn)"
    timeout 90 ncu --clock-control none --kernel-name-base mangled -k regex:"$kn" \
      --launch-skip 2 --launch-count 1 --metrics "$M" "$B/harness" --profile \
      --profile-shape $shape >"$OUT/ncu_$shape.txt" 2>&1
    grep -E "^\s+(smsp|sm__|dram|gpu__|l1tex)" "$OUT/ncu_$shape.txt" | awk '{print $1, $NF}'
  done
  date -u
  wait $CMAKE_PID; tail -1 "$OUT/cmake.log"
  export PYTHONPATH=$ROOT
  echo "=== pytest tests/cuda (public API on the GPU, invariance included)"
  timeout 200 python3 -m pytest -q tests/cuda -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -4
  echo "=== python -m jax_m3sparse.bench.cuda ${BENCH_ARGS:-}"
  M3SPARSE_BENCH_TRACE=1 timeout 150 python3 -m jax_m3sparse.bench.cuda ${BENCH_ARGS:-} 2>&1 |
    tee "$OUT/bench_cuda.log" | grep -v "^  trace"
  date -u
  if [ -z "${SKIP_GAP:-}" ]; then
    echo "=== gap analysis"
    M3SPARSE_BENCH_TRACE=1 timeout 100 python3 -m jax_m3sparse.bench.cuda --gap 2>&1 |
      tee "$OUT/gap.log" | grep -v "^  trace"
  fi
  for tool in ${FINAL_SAN:-racecheck memcheck}; do
    echo "=== compute-sanitizer $tool: harness --no-bench"
    timeout $([ $tool = racecheck ] && echo ${RACE_S:-200} || echo ${MEM_S:-120}) compute-sanitizer --tool $tool --error-exitcode 9 "$B/harness" --no-bench \
      >"$OUT/sanitize_$tool.log" 2>&1
    echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL |failure" "$OUT/sanitize_$tool.log" | tail -3
    grep -m 4 -A 6 -E "^========= (Error|Warning)" "$OUT/sanitize_$tool.log"  # the first hazards
    date -u
  done
  if [ -z "${SKIP_PYSAN:-}" ]; then
    echo "=== compute-sanitizer memcheck: pytest tests/cuda/test_gpu.py -k 'small_group or decode_matches or invariant or large_batch or tile_mates'"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 compute-sanitizer --tool memcheck \
      --error-exitcode 9 python3 -m pytest -q -x tests/cuda/test_gpu.py -p no:cacheprovider \
      -k "small_group or decode_matches or invariant or large_batch or tile_mates" >"$OUT/sanitize_pytest.log" 2>&1
    echo "rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_pytest.log" | tail -3
  fi
  date -u
  exit 0
fi

if [ "$MODE" = sanitize ]; then
  for tool in memcheck racecheck; do
    echo "=== compute-sanitizer $tool: harness --no-bench"
    timeout 400 compute-sanitizer --tool $tool --error-exitcode 9 "$B/harness" --no-bench \
      >"$OUT/sanitize_$tool.log" 2>&1
    echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAILED|OK:" "$OUT/sanitize_$tool.log" | tail -3
  done
  wait $CMAKE_PID
  echo "=== compute-sanitizer memcheck: pytest tests/cuda/test_gpu.py"
  PYTHONPATH=$ROOT XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 400 compute-sanitizer \
    --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/cuda/test_gpu.py \
    -p no:cacheprovider >"$OUT/sanitize_pytest.log" 2>&1
  echo "rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_pytest.log" | tail -3
  date -u
  exit 0
fi

echo "=== harness correctness"
"$B/harness" --no-bench 2>&1 | tee "$OUT/harness_tests.log" | grep -E "FAIL|failure" | tail -15

wait $CMAKE_PID
tail -3 "$OUT/cmake.log"
if ls jax_m3sparse/_m3sparse_cuda*.so >/dev/null 2>&1; then
  echo "=== pytest tests/cuda (public API on the GPU)"
  PYTHONPATH=$ROOT timeout 400 python3 -m pytest -q tests/cuda -p no:cacheprovider 2>&1 |
    tee "$OUT/pytest.log" | tail -25
else
  echo "module build failed; see cmake.log"; tail -30 "$OUT/cmake.log"
fi

echo "=== harness timings"
if [ "$MODE" = quick ]; then
  "$B/harness" --bench-only --quick 2>&1 | tee "$OUT/harness_bench.log"
else
  "$B/harness" --bench-only 2>&1 | tee "$OUT/harness_bench.log"
fi
if [ -f jax_m3sparse/bench/cuda.py ] && ls jax_m3sparse/_m3sparse_cuda*.so >/dev/null 2>&1; then
  echo "=== python -m jax_m3sparse.bench.cuda"
  PYTHONPATH=$ROOT M3SPARSE_BENCH_TRACE=1 timeout 330 python3 -m jax_m3sparse.bench.cuda \
    $([ "$MODE" = quick ] && echo --quick) 2>&1 | tee "$OUT/bench_cuda.log" | grep -v "^  trace" | tail -24
fi
date -u
