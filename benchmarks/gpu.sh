#!/usr/bin/env bash
# nbkv on a lent GPU, in one run: setup, versions, every test on the real CUDA device,
# the CUDA benchmark, compute-sanitizer on a small case. See ../shared/GPU.md and the
# "On a GPU" section of benchmarks/README.md.
#
# Usage, from the repository root, with the numpy wheel (and hypothesis, ml_dtypes) in
# .whl/ (see benchmarks/README.md for how to fill it):
#
#     bash benchmarks/gpu.sh                 # every stage, about 8 minutes at most
#     bash benchmarks/gpu.sh bench           # only some: setup env tests bench sanitize
#     NBKV_GPU_TEST_FILES="tests/test_attention.py" bash benchmarks/gpu.sh setup tests
#
# Everything is written under $OUT (the device machine sets it; ./gpu-out otherwise):
# summary.txt (a line per stage, test counts, the benchmark's targets), logs/ (each
# stage's full output), results/ (the benchmark's JSON/TXT, index.json, JUnit XML).
# Each stage runs under `timeout` within a total budget (NBKV_GPU_BUDGET_S, default 480 s);
# a stage that fails or runs out of time is recorded and the next one still runs. The
# exit status is 0 when every stage that ran passed, 1 otherwise.

set -u -o pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/gpu-out}
BUDGET=${NBKV_GPU_BUDGET_S:-480}  # seconds for the whole script
SHARDS=${NBKV_GPU_TEST_SHARDS:-4}  # parallel pytest processes (compiling is CPU-bound)
RESERVE=15                         # seconds kept for the summary at the end
PY=${PYTHON:-python3}
LOGS=$OUT/logs
RESULTS=$OUT/results
SUMMARY=$OUT/summary.txt
mkdir -p "$LOGS" "$RESULTS"
START=$SECONDS
FAILED=0

STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(setup env tests bench sanitize)

note() { echo "$*" | tee -a "$SUMMARY"; }

# seconds left for a stage capped at $1 (never below 0)
limit_for() {
    local left=$((BUDGET - (SECONDS - START) - RESERVE))
    local cap=$1
    ((left < cap)) && cap=$left
    ((cap < 0)) && cap=0
    echo "$cap"
}

status_of() {  # exit code -> word
    case $1 in
        0) echo ok ;;
        124 | 137) echo "TIMED OUT" ;;
        *) echo "FAILED (exit $1)" ;;
    esac
}

# run NAME CAP CMD...: CMD under timeout into logs/NAME.log, a summary line, its tail
run() {
    local name=$1 cap=$2
    shift 2
    local limit
    limit=$(limit_for "$cap")
    if ((limit < 20)); then
        note "$name: SKIPPED (only ${limit} s left of the ${BUDGET} s budget)"
        FAILED=1
        return 0
    fi
    local t0=$SECONDS rc=0
    echo "== $name (limit ${limit} s): $*"
    timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
    note "$name: $(status_of "$rc") in $((SECONDS - t0)) s (limit ${limit} s)"
    tail -n 8 "$LOGS/$name.log"
    ((rc == 0)) || FAILED=1
    return 0
}

stage_setup() {
    # numpy 2.4.6 first on the path: numba-cuda 0.30 compiles nothing under numpy 2.5
    # (GPU.md); hypothesis and ml_dtypes for the tests and the bfloat16 cases
    export PYTHONPATH=$PWD/.site:$PWD
    if PYTHONPATH=$PWD/.site $PY -c "import numpy, sys
sys.exit(numpy.__version__ != '2.4.6' or '/.site/' not in numpy.__file__)" 2>/dev/null; then
        note "setup: .site already holds numpy 2.4.6"
        return 0
    fi
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        note "setup: FAILED: no .whl/*.whl (carry .whl; see benchmarks/README.md)"
        FAILED=1
        return 0
    fi
    rm -rf .site
    run setup 120 "$PY" -m pip install -q --no-index --no-deps --target .site .whl/*.whl
}

stage_env() {
    {
        echo "date: $(date -u +%FT%TZ)"
        echo "PYTHONPATH=${PYTHONPATH:-}"
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,temperature.gpu,power.draw,power.limit,clocks.sm,clocks.max.sm --format=csv
        nvidia-smi | head -n 20
        command -v compute-sanitizer ptxas nvcc || true
        sha256sum nbkv/*.py nbkv/kernels/*.py benchmarks/*.py
    } >"$LOGS/nvidia-smi.log" 2>&1
    head -n 3 "$LOGS/nvidia-smi.log"
    run env 90 "$PY" - <<'EOF'
import importlib.metadata as md
import platform

import numpy
print("python", platform.python_version(), "numpy", numpy.__version__, numpy.__file__)
for dist in ("numba", "numba-cuda", "torch", "cupy", "cupy-cuda12x", "cupy-cuda13x",
             "hypothesis", "ml_dtypes", "pytest", "matplotlib", "transformers"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
from numba import cuda

print("cuda.is_available():", cuda.is_available())
dev = cuda.get_current_device()
print("device:", dev.name, "cc", dev.compute_capability, "SMs", dev.MULTIPROCESSOR_COUNT)
try:
    import torch
    print("torch.cuda.is_available():", torch.cuda.is_available(), "CUDA", torch.version.cuda)
except ImportError:
    pass
import nbkv

cache = nbkv.LayerKVCache(8, batch=1, num_kv_heads=2, head_dim=4, dtype="float32",
                          device="cuda")
k = numpy.ones((1, 2, 3, 4), numpy.float32)
cache.append(k, 2 * k)
out = nbkv.to_host(nbkv.attention(numpy.ones((1, 4, 1, 4), numpy.float32), cache))
assert numpy.allclose(out, 2.0), out
print("nbkv", nbkv.__version__, "from", nbkv.__file__, ": a CUDA append + attention ran")
EOF
}

stage_tests() {
    # every test file on the real device (conftest.py: NBKV_TEST_DEVICE=cuda, simulator
    # off); files dealt by size into parallel shards, since compiling kernels is CPU-bound
    local limit
    limit=$(limit_for 210)
    if ((limit < 20)); then
        note "tests: SKIPPED (only ${limit} s left)"
        FAILED=1
        return 0
    fi
    local files=() shard pids=() s i t0=$SECONDS
    if [ -n "${NBKV_GPU_TEST_FILES:-}" ]; then
        read -r -a files <<<"$NBKV_GPU_TEST_FILES"
    else
        mapfile -t files < <(ls -S tests/test_*.py)
    fi
    local threads=$(($(nproc) / SHARDS))
    ((threads < 1)) && threads=1
    echo "== tests: ${#files[@]} files in $SHARDS shards (limit ${limit} s)"
    for ((s = 0; s < SHARDS; s++)); do
        shard=()
        for ((i = s; i < ${#files[@]}; i += SHARDS)); do shard+=("${files[i]}"); done
        ((${#shard[@]})) || continue
        NBKV_TEST_DEVICE=cuda NUMBA_NUM_THREADS=$threads \
            timeout -k 10 "$limit" "$PY" -m pytest -p no:cacheprovider -v \
            -rfE --durations=10 --maxfail=40 --junitxml="$RESULTS/tests-$s.xml" "${shard[@]}" \
            >"$LOGS/tests-$s.log" 2>&1 &
        pids+=("$!:$s")
    done
    local entry rc
    for entry in "${pids[@]}"; do
        rc=0
        wait "${entry%%:*}" || rc=$?
        s=${entry##*:}
        # pytest exit 0: all passed; 5: nothing collected (cpu-only files) is fine too
        local word
        word=$(status_of "$rc")
        ((rc == 5)) && word="ok (nothing to run)"
        ((rc == 0 || rc == 5)) || FAILED=1
        local counts
        counts=$(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* in [0-9.]+s' \
            "$LOGS/tests-$s.log" | tail -n 1)
        note "tests shard $s: $word: ${counts:-no pytest summary (killed?)}"
        grep -E '^(FAILED|ERROR) ' "$LOGS/tests-$s.log" | head -n 20 | tee -a "$SUMMARY"
    done
    note "tests: $((SECONDS - t0)) s (limit ${limit} s)"
}

stage_bench() {
    # the suite runner, as anywhere: results/cuda-<gpu>.json and .txt, index.json; its
    # figures need matplotlib (redraw them later with --plots-only if it is missing here)
    run bench 270 "$PY" -m benchmarks --only cuda --only launch --out "$RESULTS"
    if grep -q "no figures: matplotlib is not installed" "$LOGS/bench.log"; then
        note "bench: (no matplotlib here, so no figure: a non-zero exit for that alone; draw it" \
            "later with python -m benchmarks --plots-only --only cuda)"
    fi
    grep -hE '^(PASS|MISS|SKIP) |^WRONG|^FAILED' "$RESULTS"/cuda-*.txt 2>/dev/null | tee -a "$SUMMARY"
}

stage_sanitize() {
    local cs
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
    if [ -z "$cs" ]; then
        note "sanitize: SKIPPED (no compute-sanitizer)"
        return 0
    fi
    local case=$LOGS/sanitize_case.py
    cat >"$case" <<'EOF'
# a small decode of every kind nbkv launches, for compute-sanitizer
import numpy as np

import nbkv

rng = np.random.default_rng(0)
for dtype in ("float16", "bfloat16", "float32"):
    cache = nbkv.LayerKVCache(300, batch=2, num_kv_heads=2, head_dim=128, dtype=dtype,
                              device="cuda")
    k = rng.standard_normal((2, 2, 257, 128)).astype(np.float32)
    if dtype == "bfloat16":
        import ml_dtypes
        k = k.astype(ml_dtypes.bfloat16)
    else:
        k = k.astype(dtype)
    cache.append(k, k)
    q = rng.standard_normal((2, 8, 1, 128)).astype("float16" if dtype == "float16" else "float32")
    nbkv.to_host(nbkv.attention(q, cache))
    nbkv.to_host(nbkv.append_and_attend(q, k[:, :, :1], k[:, :, :1], cache))
    nbkv.to_host(nbkv.attention(np.repeat(q, 3, axis=2), cache, window=100))
print("sanitize case done")
EOF
    run sanitize-memcheck 90 "$cs" --tool memcheck --error-exitcode 3 "$PY" "$case"
    run sanitize-racecheck 90 "$cs" --tool racecheck --error-exitcode 3 "$PY" "$case"
}

note "nbkv gpu.sh: stages ${STAGES[*]}, budget ${BUDGET} s, output in $OUT"
export PYTHONPATH=$PWD/.site:$PWD
for stage in "${STAGES[@]}"; do
    case $stage in
        setup | env | tests | bench | sanitize) "stage_$stage" ;;
        *)
            note "unknown stage '$stage' (setup env tests bench sanitize)"
            FAILED=1
            ;;
    esac
done
note "total: $((SECONDS - START)) s; $([ $FAILED -eq 0 ] && echo 'every stage passed' || echo 'some stage FAILED or was cut short')"
exit $FAILED
