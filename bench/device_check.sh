#!/usr/bin/env bash
# One pass of the GPU checks on a machine with an NVIDIA GPU, each step bounded in time:
#   1. the numba.cuda cases on the hardware (pytest -m gpu);
#   2. the reduction kernels and the top-k codec against CuPy (bench/kernels.py --device cuda);
#   3. the device collectives against Gloo on CUDA tensors, 4 ranks (bench/collectives.py --device cuda);
#   4. host collectives with a core per rank against Gloo and Open MPI (HOST_N ranks).
# Logs go to $OUT (default bench/out/device); bench/results/device.md holds what they showed.
#
#   bash bench/device_check.sh                      # where numpy, numba-cuda, pytest-asyncio import
#   WHEELS=.whl bash bench/device_check.sh          # first installs the wheels in .whl into /tmp/site
#
# Each step's budget (seconds) can be set: T_TESTS, T_KERNELS, T_KERNELS_LARGE, T_LAUNCH, T_DEVICE, T_HOST
# (0: skip);
# HOST_N: ranks of step 4 (default 4).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

step() {  # step NAME SECONDS COMMAND...: runs COMMAND bounded, tees its log, prints its exit code
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-40}" "$OUT/$name.log"
    echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    lscpu | grep -m1 'Model name'
    echo "cores $(nproc), memory $(free -g | awk '/Mem:/ {print $2}') GiB, load $(cut -d' ' -f1-3 /proc/loadavg)"
    python3 - <<'PY'
import importlib.metadata as m, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"
print(sys.version.split()[0], *(f"{k} {version(k)}" for k in ("numpy", "numba", "numba-cuda", "torch", "cupy-cuda13x")))
from numba import cuda
print("numba.cuda sees a GPU:", cuda.is_available())
PY
} 2>&1 | tee "$OUT/machine.txt"

if [ "${T_TESTS:-180}" -gt 0 ]; then step gpu_tests "${T_TESTS:-180}" python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts= \
    tests/kernels tests/compress tests/compressed; fi
if [ "${T_KERNELS:-70}" -gt 0 ]; then step kernels "${T_KERNELS:-70}" python3 bench/kernels.py --device cuda --repeat 5; fi
if [ "${T_KERNELS_LARGE:-60}" -gt 0 ]; then  # 4x the elements: the kernels' bandwidth apart from launch costs
    step kernels_large "${T_KERNELS_LARGE:-60}" python3 bench/kernels.py --device cuda --repeat 5 --n 67108864
fi
if [ "${T_LAUNCH:-30}" -gt 0 ]; then step launch_cost "${T_LAUNCH:-30}" python3 bench/launch_cost.py; fi
[ "${T_DEVICE:-150}" -gt 0 ] && step device_coll "${T_DEVICE:-150}" python3 bench/collectives.py -n 4 --device cuda --compare gloo \
    --ops all_reduce,all_gather,reduce_scatter,broadcast --sizes 4K,1M,16M,64M --iters 10 \
    --out-dir "$OUT" --plot ''
if [ "${T_HOST:-60}" -gt 0 ]; then
    step host_coll "${T_HOST:-60}" python3 bench/collectives.py -n "${HOST_N:-4}" --compare gloo,mpi \
        --ops all_reduce --sizes 4,1K,1M,16M,64M --iters 10 --json "$OUT/host${HOST_N:-4}.json" --plot ''
fi
