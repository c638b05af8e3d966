#!/usr/bin/env bash
# One device call (about 6 minutes) for issue #52's item 1 at dim 16: does the host tier in the
# CUDA driver's memory (shared/hashtable/host_memory.py: cuMemCreate host memory, which the device
# may map in large pages) take away the device's cost per host row?
# 1. bench_host_pages at item 1's 100M rows (dim 16): the UVA gather of 131K random and sorted
#    rows and the CPU's gather over today's registered memory and the driver's (vmm_host);
# 2. bench_tiers at dim 16, 100M rows, static step, 10/50/100 % caches against HBM_ONLY, once
#    with registered host tiers and once with the driver's (--host-memory), each run with its
#    own HBM_ONLY baseline, so that each ratio is against HBM_ONLY in the same run.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes under $OUT: bench_host_pages_gpu.json,
# bench_host_pages.log, bench_tiers_{register,driver}.json and .log. ROWS, WARMUP, STEPS and
# TIERS_TIMEOUT (s a bench_tiers run, default 130) override the sizes. WARMUP 100 (as
# run_tiers_gpu.sh): a 10 % cache's 10M lines are full after about 92 steps of 108K misses, and
# a run of 60 (2026-12-07) timed the filling (2.12x) and the evicting (2.76x) steps together.
. bench/device_env.sh
ALLOCATIONS="register_4k vmm_host" DIMS=16 ROWS="${ROWS:-100000000}" NS=131072 REPEATS=5 \
  BENCH_TIMEOUT=120 bash bench/run_host_pages_gpu.sh
for memory in register driver; do
  timeout "${TIERS_TIMEOUT:-130}" python3 -m bench.bench_tiers --device cuda --dims 16 \
    --rows "${ROWS:-100000000}" --lookups 1000000 --warmup "${WARMUP:-100}" --steps "${STEPS:-20}" \
    --rounds 1 --static --host-memory "$memory" --out "$OUT/bench_tiers_$memory.json" \
    > "$OUT/bench_tiers_$memory.log" 2>&1
  echo "bench_tiers --host-memory $memory rc=$?"; grep "round 0" "$OUT/bench_tiers_$memory.log"
done
