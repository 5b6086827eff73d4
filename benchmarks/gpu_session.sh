#!/usr/bin/env bash
# Everything a GPU session needs, in as few device calls as possible (device time is scarce).
#   bash benchmarks/gpu_session.sh tests   # compiled-kernel correctness suite (~7 min)
#   bash benchmarks/gpu_session.sh bench   # benchmark tables + dequant + memory proof (~9 min;
#                                          # TAG=_x names the result files <gpu>-<date>_x.*)
#   bash benchmarks/gpu_session.sh bench-small  # the same protocol in two calls with torch and
#   bash benchmarks/gpu_session.sh bench-large  # bitsandbytes: M = 1, 16, 128 (+ dequant, memory)
#                                               # / M = 2048, 8192 (files <gpu>-<date>_small|_large.*)
#   bash benchmarks/gpu_session.sh train [1b|8b]  # end-to-end QLoRA step, jqlora vs torch (~2 / ~8 min)
#   bash benchmarks/gpu_session.sh scale-a  # 4 GPUs: decode profile 1B/8B (GPU 0) | 8B long context
#                                           # (GPU 1) | 70B fsdp=2 under 40 GB (GPUs 2,3)
#   bash benchmarks/gpu_session.sh scale-b  # 4 GPUs: one-GPU baseline, 8B data=4 and data=2,fsdp=2,
#                                           # 70B fsdp=4 at 2,048 and 16,384 tokens
#   bash benchmarks/gpu_session.sh rerun    # 4 GPUs: decode hoisted vs scanned, offload memory check,
#                                           # 70B fsdp=4 at 16,384 tokens
#   bash benchmarks/gpu_session.sh startup  # the product path's start-up profiled: 1B checkpoint,
#                                           # `jqlora generate`/`train` cold then warm (cProfile, compile log)
#   bash benchmarks/gpu_session.sh long-context  # one 8B step of 360,448 tokens, remat auto, on one
#                                                # card (an 80 GB H100: nvidia-h100-x1)
#   bash benchmarks/gpu_session.sh step-table  # the performance table: 8B step at 2048/4096 (NF4, bf16
#                                              # weights, torch) and decode 8B/1B, one call (~6 min)
#   bash benchmarks/gpu_session.sh product [1b|8b]  # the product path: `jqlora train`/`generate` with
#                                                   # defaults, cold and warm cache, vs torch (<= 9.5 min)
#   bash benchmarks/gpu_session.sh moe       # Qwen3-30B-A3B shape: jqlora vs transformers + PEFT + bnb in one
#                                            # call, the grouped kernels vs bf16 at the step's shapes (~8 min)
#   bash benchmarks/gpu_session.sh moe-2gpu  # 2 GPUs: the same jqlora step on GPU 0, then fsdp=2, then
#                                            # data=2 (one 2,048-token row a GPU; ~8 min)
#   bash benchmarks/gpu_session.sh decode    # decoding compiled (the attention and norm kernels through every
#                                            # family's generation tests), the norm kernel's num_warps against
#                                            # XLA's norm (decode_norm_bench), then decode 1B/8B: the defaults vs
#                                            # XLA's norms and vs the einsum path; with an adapter; and 8B after
#                                            # a 2,048-token prompt (~9 min); Gemma 3 1B decode is in check-x4
#                                            # (its programs take 50-85 s to compile)
#   bash benchmarks/gpu_session.sh surogate  # Surogate's published configuration on a Qwen3-8B shape:
#                                            # 2 x 2,048 tokens packed, LoRA r=16 alpha 32 on 7 projections;
#                                            # NF4 and bf16 weights (~3 min)
#   bash benchmarks/gpu_session.sh table-x4  # 4 GPUs, one job each: the step table (GPU 0), the product
#                                            # path 1B (GPU 1) and 8B without torch (GPU 2), the compiled
#                                            # decoding tests (GPU 3) (~7 min)
#   bash benchmarks/gpu_session.sh check-x4  # 4 GPUs: 70B fsdp=4 at 4 x 2,048, then the compiled kernel
#                                            # suite of `tests` over GPUs 0-2 beside Gemma 3 1B decode (~9.5 min)
# Carry `.whl` (bitsandbytes and flatbuffers wheels, see docs/benchmarks.md). Results land in $OUT.
set -u
OUT=${OUT:-/tmp/jqlora-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    # Several workers share the GPU (compiles are CPU-bound): no preallocation per process.
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python3 -m pytest -q -p no:cacheprovider -n 8 \
      --tb=short -rf tests/ops/test_ops.py tests/kernels/test_variants.py tests/ops/test_dispatch.py tests/kernels/test_kernels_4bit.py \
      tests/kernels/test_kernels_4bit_decoded_dot.py tests/kernels/test_kernels_4bit_mgpu.py tests/kernels/test_kernels_4bit_mgpu_gemv.py \
      tests/kernels/test_kernels_4bit_mgpu_mma.py tests/kernels/test_kernels_int8.py tests/kernels/test_decode_attention.py \
      tests/kernels/test_rms_norm.py tests/models/test_models.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
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
  step-table)
    # the 8B step (NF4, bf16 weights, torch) at 2048 and 4096 tokens and decode at 8B and 1B: about 350 s on an H200;
    # then Surogate's configuration (about 40 s a weight format); what does not fit, a second call adds with --into
    timeout 590 python3 -m benchmarks.step_table --budget-s 575 --out "$OUT" 2>&1 | tee "$OUT/step_table.log" | tail -30 ;;
  product)
    # every part has its own time limit inside a 560 s budget; what does not fit is recorded as skipped
    timeout 590 python3 -m benchmarks.product_bench --shape "${2:-1b}" --out "$OUT" --workdir /tmp 2>&1 \
      | tee "$OUT/product_${2:-1b}.log" | tail -20 ;;
  long-context)
    timeout 585 python3 -m benchmarks.train_bench --side jax --attention cudnn --shape 8b --seq 360448 --steps 0 \
      --remat auto > "$OUT/long_360k.jsonl" 2> "$OUT/long_360k.log"
    echo "rc $?"; grep -v "^  " "$OUT/long_360k.log" | tail -8; cat "$OUT/long_360k.jsonl"; free -g; nvidia-smi --query-gpu=name,memory.total --format=csv ;;
  startup)
    # where the seconds of a warm start go: cold runs fill the cache, then warm runs under cProfile
    # (profiles in $OUT/*.prof, top entries in startup.log) and one with JAX's compile log
    w=/tmp/startup; rm -rf $w; mkdir -p $w; log="$OUT/startup.log"; TIMEFORMAT="%R s wall"
    timeout 150 python3 -m benchmarks.product_bench checkpoint 1b $w/ckpt > "$log" 2>&1
    python3 -c "from pathlib import Path; from benchmarks.product_bench import write_data as w; w(Path('$w/data.jsonl'), 2048, 40)"
    export JQLORA_COMPILE_CACHE=$w/cache
    gen="-m jqlora.cli generate $w/ckpt --prompt-ids 5,12,19,26,33 --max-new-tokens 256 --timing"
    trn="-m jqlora.cli train --model $w/ckpt --data-path $w/data.jsonl --seq-len 2048 --batch-size 1 --steps 30 --log-every 1"
    for run in cold warm; do
      echo "== generate $run" >> "$log"; { time timeout 120 python3 $gen >> "$log" 2>&1; } 2>> "$log"
      echo "== train $run" >> "$log"; { time timeout 150 python3 $trn --out-dir $w/run-$run >> "$log" 2>&1; } 2>> "$log"
      cp $w/run-$run/loss.csv "$OUT/train_$run.csv"
    done
    timeout 60 python3 -m cProfile -o "$OUT/generate_warm.prof" $gen >> "$log" 2>&1
    timeout 100 python3 -m cProfile -o "$OUT/train_warm.prof" $trn --steps 8 --out-dir $w/run-prof >> "$log" 2>&1
    JAX_LOG_COMPILES=1 timeout 60 python3 $gen > "$OUT/generate_compiles.log" 2>&1
    JAX_LOG_COMPILES=1 timeout 100 python3 $trn --steps 4 --out-dir $w/run-log > "$OUT/train_compiles.log" 2>&1
    for f in generate_warm train_warm; do
      python3 -c "import pstats; s = pstats.Stats('$OUT/$f.prof'); s.sort_stats('cumulative').print_stats(80); s.sort_stats('tottime').print_stats(30)" > "$OUT/$f.txt"
    done
    grep -v "Loading weights\|Writing model" "$log" | tail -40; grep -c "Compiling\|compil" "$OUT"/*_compiles.log ;;
  scale-a)
    # three independent jobs on disjoint GPUs of one 4-GPU machine, each with its own time limit:
    # decode profile 1B and 8B (GPU 0) | 8B long context (GPU 1) | 70B fsdp=2 under 40 GB (GPUs 2,3)
    tb="python3 -m benchmarks.train_bench --side jax --attention cudnn"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 250 python3 -m benchmarks.profile.decode_profile --shape 1b --variants hoisted,scanned --timeout-s 120
     timeout 300 python3 -m benchmarks.profile.decode_profile --shape 8b --variants hoisted,scanned --timeout-s 140
     ) > "$OUT/decode.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     for r in nothing_saveable offload_layer_inputs; do timeout 150 $tb --shape 8b --seq 65536 --steps 1 --remat $r; done
     timeout 60 $tb --shape 8b --remat offload_layer_inputs --compile-only 65536
     timeout 240 $tb --shape 8b --remat auto --compile-only 65536,131072,262144,360448
     ) > "$OUT/long_context.jsonl" 2> "$OUT/long_context.log" &
    (export CUDA_VISIBLE_DEVICES=2,3
     total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 2)  # MiB
     export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(40e9 / ($total * 2**20), 3))")
     echo "mem fraction $XLA_PYTHON_CLIENT_MEM_FRACTION of $total MiB" >&2
     timeout 540 $tb --shape 70b --remat auto --mesh fsdp=2 --steps 3
     ) > "$OUT/scale_2gpu.jsonl" 2> "$OUT/scale_2gpu.log" &
    wait; tail -n 4 "$OUT"/*.log; cat "$OUT"/*.jsonl ;;
  rerun)
    # the decode fix (GPU 0) and the offload check (GPU 1) in parallel, then 70B fsdp=4 at 16,384
    tb="python3 -m benchmarks.train_bench --side jax --attention cudnn"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 150 python3 -m benchmarks.profile.decode_profile --shape 1b --variants hoisted,scanned --timeout-s 70
     timeout 200 python3 -m benchmarks.profile.decode_profile --shape 8b --variants hoisted,scanned --timeout-s 95
     ) > "$OUT/decode.log" 2>&1 &
    (CUDA_VISIBLE_DEVICES=1 timeout 100 $tb --shape 8b --remat offload_layer_inputs --compile-only 65536
     ) > "$OUT/long_context.jsonl" 2> "$OUT/long_context.log" &
    wait
    JAX_LOG_LEVEL=info timeout 230 $tb --shape 70b --remat auto --mesh fsdp=4 --steps 1 --seq 16384 \
      >> "$OUT/scale_4gpu.jsonl" 2>> "$OUT/scale_4gpu.log"
    grep -v "^WARNING" "$OUT/decode.log" | grep -v "^    "; cat "$OUT"/*.jsonl; grep "train_bench\|remat" "$OUT/scale_4gpu.log" ;;
  scale-b)
    # one-GPU baseline, then 8B data=4 and data=2,fsdp=2, 70B fsdp=4 at 2,048 and 16,384 tokens a row
    tb="python3 -m benchmarks.train_bench --side jax --attention cudnn --steps 5"
    (CUDA_VISIBLE_DEVICES=0 timeout 90 $tb --shape 8b --remat auto
     timeout 100 $tb --shape 8b --remat auto --mesh data=4
     timeout 100 $tb --shape 8b --remat auto --mesh data=2,fsdp=2
     timeout 150 $tb --shape 70b --remat auto --mesh fsdp=4 --steps 3
     timeout 140 $tb --shape 70b --remat auto --mesh fsdp=4 --steps 1 --seq 16384
     ) > "$OUT/scale_4gpu.jsonl" 2> "$OUT/scale_4gpu.log"
    grep -v "^  " "$OUT/scale_4gpu.log" | tail -12; cat "$OUT/scale_4gpu.jsonl" ;;
  moe)
    # both sides in one call (each in its own process), then the grouped products at the step's shapes
    timeout 330 python3 -m benchmarks.moe_bench --steps 3 --optimizer adamw8bit --out "$OUT" --tag _adamw8bit \
      2>&1 | tee "$OUT/moe.log" | grep -v "^  " | tail -8
    timeout 240 python3 -m benchmarks.grouped_bench --out "$OUT" --budget-s 200 2>&1 | tee "$OUT/grouped.log" | tail -24 ;;
  decode)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 --tb=short -rf \
      tests/kernels/test_decode_attention.py tests/kernels/test_rms_norm.py tests/models/test_decode_layers.py \
      tests/models/test_rollout.py tests/models/test_gemma.py tests/models/test_moe.py \
      -k "generat or decode or rollout or greedy or rms" 2>&1 \
      | tee "$OUT/gpu_decode_tests.log" | tail -8
    timeout 90 python3 -m benchmarks.decode_norm_bench --configs "num_warps=1;num_warps=2;num_warps=8" --out "$OUT" \
      2>&1 | tail -3
    dp="env OUT=$OUT python3 -m benchmarks.profile.decode_profile --tokens 256 --timeout-s 95"
    (timeout 200 $dp --shape 1b --variants default,xla_norm,einsum_attention,lora
     timeout 150 $dp --shape 8b --variants default,xla_norm
     timeout 150 $dp --shape 8b --prompt 2048 --variants default,einsum_attention
     ) > "$OUT/decode.log" 2>&1
    grep -v "^    " "$OUT/decode.log" | cut -c1-240 ;;
  surogate)
    # Qwen3-8B shape, batch 2 x 2,048 tokens, 4 documents packed in a row, remat auto, cuDNN attention
    tb="python3 -m benchmarks.train_bench --side jax --attention cudnn --shape qwen3-8b --rows 2 --packed --docs 4 --remat auto --steps 5"
    (timeout 120 $tb --weights nf4
     timeout 120 $tb --weights bf16
     ) > "$OUT/surogate.jsonl" 2> "$OUT/surogate.log"
    grep -v "^  " "$OUT/surogate.log" | tail -6; cat "$OUT/surogate.jsonl" ;;
  table-x4)
    # four independent jobs on disjoint GPUs of one machine, each with its own time limit
    (CUDA_VISIBLE_DEVICES=0 timeout 590 python3 -m benchmarks.step_table --budget-s 575 --out "$OUT" \
       > "$OUT/step_table.log" 2>&1) &
    (CUDA_VISIBLE_DEVICES=1 timeout 580 python3 -m benchmarks.product_bench --shape 1b --budget-s 560 --out "$OUT" \
       --workdir /tmp > "$OUT/product_1b.log" 2>&1) &
    (CUDA_VISIBLE_DEVICES=2 timeout 590 python3 -m benchmarks.product_bench --shape 8b --budget-s 575 --out "$OUT" \
       --workdir /tmp --skip torch_train,torch_generate > "$OUT/product_8b.log" 2>&1) &
    (export CUDA_VISIBLE_DEVICES=3
     XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 --tb=short -rf \
       tests/kernels/test_decode_attention.py tests/kernels/test_rms_norm.py tests/models/test_decode_layers.py \
       tests/models/test_rollout.py tests/models/test_gemma.py tests/models/test_moe.py \
       -k "generat or decode or rollout or greedy or rms" > "$OUT/gpu_decode_tests.log" 2>&1) &
    wait
    for f in step_table product_1b product_8b; do echo "== $f"; grep -v "^    " "$OUT/$f.log" | tail -14 | cut -c1-240; done
    echo "== decode tests"; tail -6 "$OUT/gpu_decode_tests.log" ;;
  check-x4)
    # 70B on all four GPUs, then the compiled kernel suite of `tests` in three parts (GPUs 0-2) beside
    # Gemma 3 1B decode (GPU 3; its compiles take longer than the 1B Llama's)
    JAX_LOG_LEVEL=info timeout 200 python3 -m benchmarks.train_bench --side jax --attention cudnn --shape 70b \
      --remat auto --mesh fsdp=4 --steps 3 > "$OUT/scale_70b.jsonl" 2> "$OUT/scale_70b.log"
    grep -v "^  " "$OUT/scale_70b.log" | grep -v "^WARNING" | tail -4; cat "$OUT/scale_70b.jsonl"
    k=tests/kernels
    parts=("tests/ops/test_ops.py $k/test_variants.py tests/ops/test_dispatch.py tests/models/test_models.py"
           "$k/test_kernels_4bit.py $k/test_kernels_4bit_decoded_dot.py $k/test_kernels_int8.py $k/test_rms_norm.py"
           "$k/test_kernels_4bit_mgpu.py $k/test_kernels_4bit_mgpu_gemv.py $k/test_kernels_4bit_mgpu_mma.py $k/test_decode_attention.py")
    for i in 0 1 2; do
      (CUDA_VISIBLE_DEVICES=$i XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 360 python3 -m pytest -q \
         -p no:cacheprovider -n 5 --tb=short -rf ${parts[$i]} > "$OUT/gpu_tests_$i.log" 2>&1) &
    done
    (CUDA_VISIBLE_DEVICES=3 OUT=$OUT timeout 365 python3 -m benchmarks.profile.decode_profile --tokens 256 \
       --timeout-s 175 --shape gemma3-1b --variants default,kernel_norm > "$OUT/decode_gemma.log" 2>&1) &
    wait; for i in 0 1 2; do tail -3 "$OUT/gpu_tests_$i.log"; done; grep -v "^    " "$OUT/decode_gemma.log" | cut -c1-300 ;;
  moe-2gpu)
    # a one-GPU baseline and the two meshes, one machine, one call
    mb="python3 -m benchmarks.moe_bench --side jax --steps 3 --optimizer adamw8bit --out $OUT"
    (CUDA_VISIBLE_DEVICES=0 timeout 170 $mb --tag _1gpu
     timeout 170 $mb --mesh fsdp=2 --tag _fsdp2
     timeout 170 $mb --mesh data=2 --tag _data2
     ) > "$OUT/moe_2gpu.log" 2>&1
    grep -v "^  " "$OUT/moe_2gpu.log" | grep -i "tokens_per_s\|error\|wrote" | tail -12 ;;
esac
