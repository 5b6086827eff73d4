#!/usr/bin/env bash
# Everything a GPU session needs, in as few device calls as possible (device time is scarce).
#   bash benchmarks/gpu_session.sh tests   # compiled-kernel correctness suite (~3-4 min)
#   bash benchmarks/gpu_session.sh bench   # benchmark tables + dequant + memory proof (~5 min)
#   bash benchmarks/gpu_session.sh train   # end-to-end QLoRA step, jqlora vs torch, 1B shape
# Carry `.whl` (bitsandbytes wheel, see shared/GPU.md). Results land in $OUT.
set -u
OUT=${OUT:-/tmp/jqlora-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    # Several workers share the GPU (compiles are CPU-bound): no preallocation per process.
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 \
      --tb=short -rf tests/test_ops.py tests/test_kernels_4bit.py tests/test_kernels_int8.py \
      tests/test_models.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
  bench)
    # variants at M = 1, 16, 2048 only and a matmul time budget: the whole run fits one 10-minute call
    timeout 450 python3 -m benchmarks.run --iterations 10 --variant-ms 1,16,2048 --budget-s 250 \
      --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^  M=" | tail -20 ;;
  train)
    timeout 200 python3 -m benchmarks.train_bench --side jax --attention cudnn --shape 1b --steps 5 | tee -a "$OUT/train_1b.jsonl"
    timeout 200 python3 -m benchmarks.train_bench --side jax --attention einsum --shape 1b --steps 5 | tee -a "$OUT/train_1b.jsonl"
    timeout 200 python3 -m benchmarks.train_bench --side torch --shape 1b --steps 5 | tee -a "$OUT/train_1b.jsonl" ;;
esac
