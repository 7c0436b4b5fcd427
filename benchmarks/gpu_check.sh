#!/usr/bin/env bash
# Every GPU test and GPU benchmark of the project in one run, for a lent CUDA machine that has
# torch and CuPy but no kvtier install: the extension built elsewhere (abi3, x86-64) is imported
# from python/. Logs go under $OUT (default /tmp/kvtier-gpu-check); a summary is printed last.
#
#   bash benchmarks/gpu_check.sh            # tests + benchmarks
#   GPU_CHECK_BENCH=0 bash benchmarks/gpu_check.sh   # tests only
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvtier-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Pure-Python wheels the machine lacks (redis-py), when they were carried along.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, cupy, kvtier; print("torch", torch.__version__, "cupy", cupy.__version__,
"kvtier", kvtier.__file__, torch.cuda.get_device_name())' 2>&1 | tee -a "$OUT/gpu.txt"

status=()
run() { # name, timeout (s), command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    status+=("$name: rc=$rc in $((SECONDS - t0)) s")
    tail -n 25 "$OUT/$name.log"
}

run pytest-gpu "${GPU_CHECK_PYTEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider \
    -o addopts="--strict-markers -ra" --continue-on-collection-errors -m gpu -q ${GPU_CHECK_TESTS:-tests}
if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
    run bench-codecs 100 python3 -m kvtier bench codecs --no-quanto --no-cpu
    run bench-attend 90 python3 -m kvtier bench attend --backend cuda
    run bench-manager 60 python3 -m kvtier bench manager --no-cpu
    run bench-vllm-paths 60 python3 benchmarks/vllm_paths.py --device cuda
fi
printf '%s\n' "${status[@]}" | tee "$OUT/summary.txt"
