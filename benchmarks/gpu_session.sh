#!/usr/bin/env bash
# Everything a GPU session needs, in as few device calls as possible (device time is scarce).
#   bash benchmarks/gpu_session.sh tests   # compiled-kernel correctness suite (~7 min)
#   bash benchmarks/gpu_session.sh bench   # benchmark tables + dequant + memory proof (~9 min;
#                                          # TAG=_x names the result files <gpu>-<date>_x.*)
#   bash benchmarks/gpu_session.sh bench-small  # the same protocol in two calls with torch and
#   bash benchmarks/gpu_session.sh bench-large  # bitsandbytes: M = 1, 16, 128 (+ dequant, memory)
#                                               # / M = 2048, 8192 (files <gpu>-<date>_small|_large.*)
#   bash benchmarks/gpu_session.sh train [1b|8b]  # end-to-end QLoRA step, jqlora vs torch (~2 / ~8 min)
#   bash benchmarks/gpu_session.sh scale-a  # 4 GPUs: product path 1B (GPU 0) | 8B remat policies
#                                           # (GPU 1) | 8B data=2, 70B fsdp=2 under 40 GB (GPUs 2,3)
#   bash benchmarks/gpu_session.sh scale-b  # 4 GPUs: 8B data=4 and data=2,fsdp=2; 70B fsdp=4
#   bash benchmarks/gpu_session.sh product [1b|8b]  # the product path: `jqlora train`/`generate` with
#                                                   # defaults, cold and warm cache, vs torch (<= 9.5 min)
# Carry `.whl` (bitsandbytes wheel, see docs/benchmarks.md). Results land in $OUT.
set -u
OUT=${OUT:-/tmp/jqlora-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    # Several workers share the GPU (compiles are CPU-bound): no preallocation per process.
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python3 -m pytest -q -p no:cacheprovider -n 8 \
      --tb=short -rf tests/test_ops.py tests/test_variants.py tests/test_dispatch.py tests/test_kernels_4bit.py \
      tests/test_kernels_4bit_decoded_dot.py tests/test_kernels_4bit_mgpu.py tests/test_kernels_4bit_mgpu_gemv.py \
      tests/test_kernels_4bit_mgpu_mma.py tests/test_kernels_int8.py \
      tests/test_models.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
  bench)
    # variants at M = 1, 16, 2048 only and a matmul time budget: the whole run fits one 10-minute call
    timeout 570 python3 -m benchmarks.run --iterations 10 --variant-ms 1,16,2048 --budget-s 270 \
      --tag "${TAG:-}" --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^  M=" | tail -20 ;;
  bench-small|bench-large)
    # the protocol in two calls, each within a 10-minute call (about 450-500 s and 120 s), torch
    # and bitsandbytes included:
    # M = 1, 16, 128 with dequant and the memory proof, then M = 2048, 8192 (no variant sweep;
    # matmul cells started after 360 s are skipped so that torch and the files still come out)
    if [ "$1" = bench-small ]; then args="--ms 1,16,128"; else args="--ms 2048,8192 --skip dequant,memory"; fi
    timeout 570 python3 -m benchmarks.run --iterations 10 --variants none --budget-s 360 $args \
      --tag "${TAG:-}_${1#bench-}" --out "$OUT" 2>&1 | tee "$OUT/bench_${1#bench-}.log" | grep -v "^  M=" | tail -20 ;;
  train)
    # end-to-end QLoRA step, both sides in this one call (protocol); `train 8b` for the 8B shape
    shape=${2:-1b}
    timeout 280 python3 -m benchmarks.train_bench --side jax --attention cudnn --shape "$shape" --steps 5 | tee -a "$OUT/train_$shape.jsonl"
    timeout 300 python3 -m benchmarks.train_bench --side torch --shape "$shape" --steps 5 | tee -a "$OUT/train_$shape.jsonl" ;;
  product)
    # every part has its own time limit inside a 560 s budget; what does not fit is recorded as skipped
    timeout 590 python3 -m benchmarks.product_bench --shape "${2:-1b}" --out "$OUT" --workdir /tmp 2>&1 \
      | tee "$OUT/product_${2:-1b}.log" | tail -20 ;;
  scale-a)
    # three independent jobs on disjoint GPUs of one 4-GPU machine, each with its own time limit
    tb="python3 -m benchmarks.train_bench --side jax --attention cudnn --steps 5"
    (CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m benchmarks.product_bench --shape 1b --out "$OUT" \
       --workdir /tmp --budget-s 540 > "$OUT/product_1b.log" 2>&1) &
    (export CUDA_VISIBLE_DEVICES=1
     for r in auto nothing_saveable; do timeout 200 $tb --shape 8b --remat $r; done
     timeout 150 $tb --shape 8b --seq 16384 --remat auto) > "$OUT/scale_1gpu.jsonl" 2> "$OUT/scale_1gpu.log" &
    (export CUDA_VISIBLE_DEVICES=2,3
     timeout 220 $tb --shape 8b --remat auto --mesh data=2
     XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 330 $tb --shape 70b --remat auto --mesh fsdp=2
     ) > "$OUT/scale_2gpu.jsonl" 2> "$OUT/scale_2gpu.log" &
    wait; tail -3 "$OUT"/*.log; cat "$OUT"/*.jsonl ;;
  scale-b)
    tb="python3 -m benchmarks.train_bench --side jax --attention cudnn --steps 5"
    (timeout 200 $tb --shape 8b --remat auto --mesh data=4
     timeout 200 $tb --shape 8b --remat auto --mesh data=2,fsdp=2
     timeout 330 $tb --shape 70b --remat auto --mesh fsdp=4
     ) > "$OUT/scale_4gpu.jsonl" 2> "$OUT/scale_4gpu.log"
    tail -5 "$OUT/scale_4gpu.log"; cat "$OUT/scale_4gpu.jsonl" ;;
esac
