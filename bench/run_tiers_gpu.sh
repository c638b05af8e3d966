#!/usr/bin/env bash
# One device call (about 8 minutes): the wheels of scripts/gpu_wheels.py installed, the storage
# tiers' GPU tests (CACHING against HBM_ONLY on CUDA, the mapped host tier and its UVA row
# kernels, the serving tier gather), then bench/bench_tiers.py
# on the card: the embedding step at Zipf 1.05, 1M lookups a step, dim 16 over 100M rows and
# dim 128 over 40M rows (HBM_ONLY's payload at dim 128 and 100M rows, 102 GB, fits no card
# here), caches of 10/50/100 % against HBM_ONLY in the same run.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes under $OUT: tier_tests.log,
# bench_tiers_gpu.json, bench_tiers.log. ROWS / ROWS_128 / LOOKUPS / DIMS override the sizes, WARMUP /
# STEPS the steps (100 untimed first: on 2026-12-06 20 left the caches filling, 0.59 hit rate at
# 10 % and 0.63 at 50 % with 105K-118K misses a step: a cold start, not the steady state).
# STATIC=1: every variant takes the static sparse step, captured in CUDA graphs (--static).
# PREFETCH=1: each step then prefetches the next batch's rows (--prefetch: with STATIC, the
# static prefetch on a side stream beside the backward), in both bench runs.
# HOST_MEMORY=driver: the caches' host tiers in the CUDA driver's memory (--host-memory), in the
# first bench run (the host-node run keeps registered memory).
# PROFILE=N: after the timed runs, each variant rebuilt, warmed and profiled over N steps
# (--profile: kernels and device ms a step in the JSON, the top kernels of every variant in ONE
# file, bench_tiers_gpu.profiles.txt, a section each; a build and WARMUP steps more per variant):
# 4 files in all (a device call returns at most 8; a file a variant made 10 on 2026-12-07 and
# lost the JSON). bench_tiers.log's line per variant carries the step ms and, for a cache, the
# hit rate and host rows read and written a step, so the log alone holds them.
set -x
. bench/device_env.sh
# TIER_TESTS=0 skips the tier tests (when another call of the session ran every GPU test)
if [ "${TIER_TESTS:-1}" != 0 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/shared/hashtable/test_row_cache.py tests/shared/hashtable/test_row_cache_static.py \
    tests/shared/hashtable/test_host_store.py \
    tests/shared/hashtable/test_static_step.py \
    tests/shared/hashtable/test_cuda_host_rows.py tests/shared/hashtable/test_cuda_tier_gather.py \
    tests/shared/hashtable/test_layout.py tests/shared/test_cuda_capture.py \
    > "$OUT/tier_tests.log" 2>&1
  echo "tier tests rc=$?"; tail -4 "$OUT/tier_tests.log"
fi
# HOST_NODE=1: first bench/run_host_node_gpu.sh (the host node against the device's reads, about
# 2 minutes; 3 files more; NODE_BENCH=0 leaves it out), and after the timed runs the caches
# again with --host-node (below)
if [ -n "${HOST_NODE:-}" ] && [ "${NODE_BENCH:-1}" != 0 ]; then
  bash bench/run_host_node_gpu.sh
fi
timeout ${BENCH_TIMEOUT:-420} python3 -m bench.bench_tiers --device cuda --dims ${DIMS:-16 128} --rows "${ROWS:-100000000}" \
  --rows-128 "${ROWS_128:-40000000}" --lookups "${LOOKUPS:-1000000}" --warmup "${WARMUP:-100}" --steps "${STEPS:-30}" --rounds 1 \
  ${STATIC:+--static} ${PREFETCH:+--prefetch} ${PROFILE:+--profile "$PROFILE"} --host-memory "${HOST_MEMORY:-register}" --out "$OUT/bench_tiers_gpu.json" > "$OUT/bench_tiers.log" 2>&1
echo "bench_tiers rc=$?"; tail -12 "$OUT/bench_tiers.log"
# HOST_NODE=1 also times the caches with the fill through a host node (--host-node, dim 16 by
# default: HOST_NODE_DIMS; HOST_NODE_THREADS: its host threads, default the cores), against
# HBM_ONLY again in the same run: 2 files more
if [ -n "${HOST_NODE:-}" ]; then
  timeout ${BENCH_TIMEOUT:-420} python3 -m bench.bench_tiers --device cuda --dims ${HOST_NODE_DIMS:-16} \
    --rows "${ROWS:-100000000}" --rows-128 "${ROWS_128:-40000000}" --lookups "${LOOKUPS:-1000000}" \
    --warmup "${WARMUP:-100}" --steps "${STEPS:-30}" --rounds 1 --static --host-node ${PREFETCH:+--prefetch} \
    ${HOST_NODE_THREADS:+--host-node-threads "$HOST_NODE_THREADS"} \
    --out "$OUT/bench_tiers_host_node_gpu.json" > "$OUT/bench_tiers_host_node.log" 2>&1
  echo "bench_tiers --host-node rc=$?"; grep "round 0" "$OUT/bench_tiers_host_node.log"
fi
