#!/usr/bin/env bash
# The checks of a GPU machine, as one prepared run (issue 52's and issue 50's GPU items): the default suite on
# the machine's own JAX with egglog 14 (CPU backend and GPU backend), JAX's own tests through the rewriter on the
# GPU, seed 000, attention and the LM head, the packs' loops, and this GPU's cost table.
#
# Run from the repository's root on the device machine, with the wheels the machine lacks in .whl/ (egglog 14 as
# a tarball of its installed files, egglog14.tgz, its library stripped of symbols: the wheel is over the 64 MiB a
# call carries) and JAX's tests in third_party/jax_tests/ (python -m benchmarks.jax_suite extract):
#
#     bash benchmarks/device_check.sh            # OUT=<a folder> for the logs (default /tmp/device_check)
#
# Wheels the H200 image lacked (2026-11-30): egglog and its graphviz, opentelemetry-api, black, platformdirs and
# pytokens; dm-haiku and jmp; gymnax, gymnasium and farama-notifications; jax-md, e3nn-jax, jraph, ml-collections and
# frozendict; distrax with tfp-nightly (the stable tensorflow-probability does not import on jax 0.11), dm-tree, gast
# and decorator; blackjax. DEVICE_CHECK_CPU_SUITE=0 leaves out the CPU-backend suite (it passed there on
# 2026-11-30) and gives its cores to the GPU-backend suite.
#
# Every part has its own time bound, so one that hangs costs only its share; logs are written as they go.
# DEVICE_CHECK_SCALE (default 1) multiplies every bound; DEVICE_CHECK_DRY=1 runs each part at toy sizes (a
# rehearsal of the script on any machine, CPU included).
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT" /tmp/dc_res
SCALE=${DEVICE_CHECK_SCALE:-1}
DRY=${DEVICE_CHECK_DRY:-0}
PY=${PYTHON:-python3}
LOG=$OUT/device.log
exec > >(tee -a "$LOG") 2>&1
b() { awk -v s="$SCALE" -v t="$1" 'BEGIN { printf "%d", s * t }'; }   # a bound, scaled
say() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }

say "start: $(uname -srm), $(nproc) cores"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || say "no nvidia-smi"
if ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | grep -v "^WARNING: Target directory" | tail -5
fi
[ -f .whl/egglog14.tgz ] && tar xzf .whl/egglog14.tgz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD JAX_REWRITE_CACHE_DIR=off PYTHONUNBUFFERED=1
$PY - << 'EOF'
import importlib, platform
print("python", platform.python_version())
for m in ("jax", "jaxlib", "egglog", "flax", "optax", "equinox", "diffrax", "numpyro", "haiku", "distrax",
          "jax_md", "gymnax", "blackjax", "lineax", "optimistix", "hypothesis", "pytest", "xdist", "absl"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m} {getattr(mod, '__version__', '?')}")
    except Exception as e:  # a missing package shows in the suite's skips and failures; say which here
        print(f"  {m} NOT IMPORTABLE: {type(e).__name__}: {e}")
import jax
print("devices", jax.devices())
EOF
say "setup done"

# 1. The default suite on the CPU backend, in the background, on some of the cores.
CPU_SUITE_ON=${DEVICE_CHECK_CPU_SUITE:-1}
CPU_N=$([ "$DRY" = 1 ] && echo 2 || echo 6)
SUITE=$([ "$DRY" = 1 ] && echo tests/test_jaxapi_compat.py || echo "tests rewrite rulesets")
[ "$CPU_SUITE_ON" = 1 ] && ( JAX_PLATFORMS=cpu timeout -s INT -k 30 "$(b 420)" $PY -m pytest -n "$CPU_N" -q -rfE --tb=line -p no:cacheprovider \
    $SUITE > "$OUT/suite_cpu.log" 2>&1; echo "suite_cpu rc=$?" >> "$OUT/suite_cpu.log" ) &
CPU_SUITE=$([ "$CPU_SUITE_ON" = 1 ] && echo $! || echo "")

# 2. GPU benchmarks, one at a time (each alone on the GPU).
bench() {  # bound, name, command...
    local bound=$1 name=$2; shift 2
    say "bench $name (bound ${bound}s): $*"
    timeout -s INT -k 10 "$bound" "$@" >> "$OUT/bench.log" 2>&1
    say "bench $name rc=$?"
    echo "=== end $name" >> "$OUT/bench.log"
}
if [ "$DRY" = 1 ]; then
    bench "$(b 60)" seed000 $PY -m benchmarks.derivatives --sizes 256 --rounds 1
    bench "$(b 60)" attention $PY -m benchmarks.attention_gpu --rounds 1 --shape 1,2,16 --sizes 128 --f32 0 --compiled 0
    bench "$(b 60)" lm_head $PY -m benchmarks.lm_head --rounds 1 --only 2
    bench "$(b 60)" loops $PY -m benchmarks.gpu_loops --rounds 1 --only 0
else
    bench "$(b 60)" seed000 $PY -m benchmarks.derivatives --sizes 2048,32768 --rounds 5
    bench "$(b 80)" attention $PY -m benchmarks.attention_gpu --rounds 5 --shape 4,16,64 --sizes 4096 --f32 0 --compiled 0
    bench "$(b 90)" lm_head $PY -m benchmarks.lm_head --rounds 5 --only 0,1
    bench "$(b 70)" loops $PY -m benchmarks.gpu_loops --rounds 5 --write /tmp/dc_res/gpu_loops.jsonl
    bench "$(b 25)" calibrate_call $PY -m benchmarks.calibrate --call-only --rounds 5 --write
fi
cp rewrite/cost/calibration.json "$OUT/calibration.json"

# 3. The suite on the GPU backend and JAX's own tests through the rewriter, side by side (timings are over).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
GPU_N=$([ "$DRY" = 1 ] && echo 2 || { [ "$CPU_SUITE_ON" = 1 ] && echo 8 || echo 14; })
LEFT=$(( $(b 500) - SECONDS )); [ "$LEFT" -lt 60 ] && LEFT=60
say "gpu suite and jax suite, ${LEFT}s"
[ "$DRY" = 1 ] && FIRST=tests/test_jaxapi_compat.py || FIRST="tests/test_attention_fused.py tests/test_attention.py tests/test_lm_head.py tests/test_grad.py tests/test_vjp.py
 tests/test_jaxapi_compat.py tests/test_scan.py tests/test_loops.py tests/test_nn.py tests/test_derivatives.py
 tests/test_mixed_precision.py tests/test_memory.py tests/test_wholestep.py tests/test_decorator.py"
( timeout -s INT -k 30 "$LEFT" $PY -m pytest -n "$GPU_N" -q -rfE --tb=line -p no:cacheprovider $FIRST \
    $([ "$DRY" = 1 ] || echo tests rewrite rulesets) > "$OUT/suite_gpu.log" 2>&1; echo "suite_gpu rc=$?" >> "$OUT/suite_gpu.log" ) &
GPU_SUITE=$!
if [ -d third_party/jax_tests/tests ]; then
    f=lax_numpy_reducers_test  # the file whose tests go through the rewriter most (69 of 85 on a CPU)
    ( timeout -s INT -k 10 "$LEFT" $PY -m benchmarks.jax_suite run "$f" --cases 1 \
        --timeout "$(( LEFT / 2 - 5 ))" --out /tmp/dc_res/jax_suite > "/tmp/dc_res/jax_suite_$f.log" 2>&1
      echo "jax_suite $f rc=$?" >> "/tmp/dc_res/jax_suite_$f.log" ) &
    JAX_SUITE=$!
fi
wait $GPU_SUITE
say "gpu suite done: $(tail -3 "$OUT/suite_gpu.log" | tr '\n' ' ')"
[ -n "${JAX_SUITE:-}" ] && wait "$JAX_SUITE"
if [ -n "$CPU_SUITE" ]; then
    wait "$CPU_SUITE"   # (a bare wait would wait for the log's tee too)
    say "cpu suite: $(tail -3 "$OUT/suite_cpu.log" | tr '\n' ' ')"
fi
cat /tmp/dc_res/jax_suite_*.log > "$OUT/jax_suite.log" 2>/dev/null
tar czf "$OUT/results.tgz" -C /tmp/dc_res . 2>/dev/null
say "end"
