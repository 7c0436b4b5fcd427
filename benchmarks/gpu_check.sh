#!/usr/bin/env bash
# Every GPU test and GPU benchmark of the project in one run of at most 8 minutes, for a lent
# CUDA machine (an H100 or H200) that has torch and CuPy but no kvtier install: the extension
# built elsewhere (abi3, x86-64) is imported from python/. The steps:
#
#   pytest-gpu      every `gpu` test but the vLLM engine's (kernels, attention, manager, stores,
#                   the connector's paged caches on CUDA)
#   pytest-vllm     the `gpu and vllm` tests: a vLLM engine with KVTierConnector on FLASH_ATTN,
#                   and one with vLLM's native offloading under KvtierCachePolicy with KvtierTier
#                   behind it, whose loads generate what the recompute did, at bf16 (tests/test_vllm_gpu.py;
#                   it skips, and says so below, where vLLM's CUDA build or the model is absent)
#   bench-codecs, bench-attend, bench-manager: `kvtier bench ...` on the GPU
#   bench-vllm-paths: the connector's save and load paths, benchmarks/vllm_paths.py --device cuda
#
# Each step has its own timeout (445 s in all), and the whole run stops at GPU_CHECK_TOTAL
# seconds (default 450, counted from the start, the wheel and nvidia-smi steps included): a step
# that would pass it gets what is left, or does not run. A step stopped at its timeout has 5 s to
# exit before it is killed, so the run ends within 455 s: under 8 minutes. Logs go under $OUT
# (default /tmp/kvtier-gpu-check); one summary is printed last (and to $OUT/summary.txt).
#
#   bash benchmarks/gpu_check.sh                     # tests + benchmarks
#   GPU_CHECK_BENCH=0 bash benchmarks/gpu_check.sh   # tests only
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvtier-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
TOTAL=${GPU_CHECK_TOTAL:-450}
DEADLINE=$((SECONDS + TOTAL))
GRACE=5 # seconds a stopped step has to exit before it is killed

# Pure-Python wheels the machine lacks (redis-py), when they were carried along.
if compgen -G ".whl/*.whl" >/dev/null; then
    timeout -k 2 20 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
timeout -k 2 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
    tee "$OUT/gpu.txt"

status=()
run() { # name, timeout (s), command...
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 10 ]; then
        status+=("$(printf '%-17s not run: the %d s of the check were spent' "$name" "$TOTAL")")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    timeout -k "$GRACE" "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local what="rc=$rc"
    [ "$rc" = 0 ] && what="ok"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && what="TIMED OUT after $limit s"
    # pytest's own last line says how many passed, failed and skipped
    local tally
    tally=$(grep -E '[0-9]+ (passed|failed|skipped|error|deselected)' "$OUT/$name.log" | tail -n 1)
    status+=("$(printf '%-17s %-24s %4d s  %s' "$name" "$what" $((SECONDS - t0)) "$tally")")
    echo "=== $name ($what)"
    tail -n 25 "$OUT/$name.log"
}

PYTEST=(python3 -m pytest -p no:cacheprovider -o addopts="--strict-markers -ra"
    --continue-on-collection-errors -q)
# Budgets (s), 445 in all; the vLLM step is mostly vLLM's import and its engine's start.
run env 20 python3 -c 'import torch, cupy, kvtier; print("torch", torch.__version__, "cupy",
cupy.__version__, "kvtier", kvtier.__file__, torch.cuda.get_device_name())'
run pytest-gpu "${GPU_CHECK_PYTEST_TIMEOUT:-170}" "${PYTEST[@]}" -m "gpu and not vllm" \
    ${GPU_CHECK_TESTS:-tests}
run pytest-vllm "${GPU_CHECK_VLLM_TIMEOUT:-140}" "${PYTEST[@]}" -m "gpu and vllm" -rs \
    ${GPU_CHECK_TESTS:-tests}
if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
    # each benchmark also saves its result with its provenance under $OUT/results, for the docs
    # (docs/results/) to quote: a GPU figure with no saved file is not put in a doc
    run bench-codecs 35 python3 -m kvtier bench codecs --no-quanto --no-cpu \
        --save "$OUT/results/bench-codecs.json"
    run bench-attend 35 python3 -m kvtier bench attend --backend cuda \
        --save "$OUT/results/bench-attend.json"
    run bench-manager 25 python3 -m kvtier bench manager --no-cpu \
        --save "$OUT/results/bench-manager.json"
    run bench-vllm-paths 20 python3 benchmarks/vllm_paths.py --device cuda \
        --save "$OUT/results/vllm-paths.json"
fi
{
    echo "=== summary ($(head -n 1 "$OUT/gpu.txt" 2>/dev/null), $SECONDS s in all)"
    printf '%s\n' "${status[@]}"
} | tee "$OUT/summary.txt"
