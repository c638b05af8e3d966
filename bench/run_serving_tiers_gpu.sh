#!/usr/bin/env bash
# One device call (under 400 s): the wheels of scripts/gpu_wheels.py installed, the serving
# tiers' GPU tests (the UVA gather kernel eager and in a CUDA graph; a cached server's scores
# against the all-in-HBM one with graphs off and on), then bench/bench_serving_tiers.py on the
# card: a bundle of the seed's shape (2,774,434 keys, the full Taobao vocabularies) served with
# every dynamic table at cache_load_factor 0.1 against all of it in HBM, CUDA graphs on, in one
# run (candidates/s and p99 of 800-candidate batches, hit rate, bytes per tier, build seconds).
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes under $OUT:
# serving_tier_tests.log, bench_serving_tiers_gpu.json, bench_serving_tiers.log.
# KEYS / FACTOR / USERS override the sizes; TIER_TESTS=0 skips the tests.
set -x
. bench/device_env.sh
if [ "${TIER_TESTS:-1}" != 0 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_tiers.py \
    tests/shared/hashtable/test_cuda_tier_gather.py tests/shared/hashtable/test_host_store.py \
    > "$OUT/serving_tier_tests.log" 2>&1
  echo "serving tier tests rc=$?"; tail -4 "$OUT/serving_tier_tests.log"
fi
timeout ${BENCH_TIMEOUT:-220} python3 -m bench.bench_serving_tiers --device cuda --cuda-graphs on \
  --keys "${KEYS:-2774434}" --factor "${FACTOR:-0.1}" --users "${USERS:-8}" --candidates 100 \
  --batches 200 --rounds 3 --work /tmp/bench_serving_tiers \
  --out "$OUT/bench_serving_tiers_gpu.json" > "$OUT/bench_serving_tiers.log" 2>&1
echo "bench_serving_tiers rc=$?"; tail -4 "$OUT/bench_serving_tiers.log"
