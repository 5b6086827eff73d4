#!/usr/bin/env bash
# Nsight Compute of the Hopper Mosaic GPU kernels (one device call, ~5 min): for each case the
# details page, the per-opcode SASS mix (benchmarks/profile/ncu_sass_mix.py) and the kernel list.
#   bash benchmarks/profile/ncu.sh                     # the cases below
#   bash benchmarks/profile/ncu.sh "mgpu 16 4096 14336" ...   # profile_small_m argument lists
#   NAMES=0 bash benchmarks/profile/ncu.sh "mgpu_mma 16 4096 14336"   # without the kernel list
# Results land in $OUT (ncu_<case>_details.txt, ncu_<case>_mix.txt).
set -u
OUT=${OUT:-/tmp/jqlora-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
NCU=${NCU:-ncu}
if [ $# -eq 0 ]; then
  set -- "mgpu 16 4096 14336" "mgpu 16 4096 4096" "mgpu 128 4096 14336" \
         "mgpu 2048 4096 4096 tile_m=256" "mgpu_t 128 4096 14336"
fi
# which kernels one call launches (names for -k); NAMES=0 skips this pass, which profiles every
# launch of a whole run (a 280 s call once ended inside it on a fresh machine)
if [ "${NAMES:-1}" != 0 ]; then
  $NCU --clock-control none --section LaunchStats python3 -m benchmarks.profile.profile_small_m $1 2>&1 \
    | grep -E '^  [A-Za-z_].*\(' | sed 's/(.*//' | sort | uniq -c > "$OUT/ncu_kernel_names.txt"
fi
for case in "$@"; do
  set -- $case
  mode=$1
  tag=$(echo "$case" | tr ' =,' '_-_')
  regex=matmul_4bit_mgpu_kernel
  [ "$mode" = mgpu_t ] && regex=matmul_4bit_mgpu_t_kernel
  [ "$mode" = mgpu_gemv ] && regex=matmul_4bit_mgpu_gemv_kernel
  [ "$mode" = mgpu_mma ] && regex=matmul_4bit_mgpu_mma_kernel
  [ "$mode" = dense ] && regex=.
  rep=/tmp/ncu_$tag
  timeout 240 $NCU --clock-control none -k regex:$regex --launch-skip 2 --launch-count 1 \
    --set full --import-source no -f -o "$rep" python3 -m benchmarks.profile.profile_small_m $case \
    > "$OUT/ncu_${tag}_run.log" 2>&1
  $NCU -i "$rep.ncu-rep" --page details > "$OUT/ncu_${tag}_details.txt" 2>&1
  $NCU -i "$rep.ncu-rep" --page source --csv --print-source sass > /tmp/sass_$tag.csv 2>&1
  weights=$(( $3 * $4 ))
  python3 -m benchmarks.profile.ncu_sass_mix /tmp/sass_$tag.csv $weights > "$OUT/ncu_${tag}_mix.txt" 2>&1
  echo "== $case"; grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Compute \(SM\) Throughput|Theoretical Occupancy" "$OUT/ncu_${tag}_details.txt" | head -12
  head -8 "$OUT/ncu_${tag}_mix.txt"
done
