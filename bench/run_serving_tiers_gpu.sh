#!/usr/bin/env bash
# One device call (under 590 s): the wheels of scripts/gpu_wheels.py installed, the serving
# tiers' GPU tests (the UVA gather kernel eager and in a CUDA graph; a cached server's scores
# against the all-in-HBM one with graphs off and on; the bench's own modes on CUDA), then
# bench/bench_serving_tiers.py on the card: a bundle of the seed's shape (2,774,434 keys, the
# full Taobao vocabularies) served with every dynamic table at cache_load_factor 0.1 against all
# of it in HBM, CUDA graphs on, in one run (candidates/s and p99 of 800-candidate batches, hit
# rate, bytes per tier, build seconds), and then its scale mode (issue #52, Done-when 4b): a
# SCALE_KEYS-key bundle (default 200,000,000: 12.8 GB of dim-16 values, ~14.4 GB on disk) served
# CACHING only, its tables placed from an HBM budget of SCALE_BUDGET_GIB (default 8) as
# `python -m serve --hbm-budget-gib` places them: per table mode/factor/bytes, the tables' HBM
# bytes checked against the budget, the startup split, candidates/s and p99, the hit rate, and
# 20 batches' scores against a reference built from the bundle's rows.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes under $OUT:
# serving_tier_tests.log, bench_serving_tiers_gpu.json, bench_serving_tiers.log,
# bench_serving_scale_gpu.json, bench_serving_scale.log.
# KEYS / FACTOR / USERS override the comparison's sizes; TIER_TESTS=0 skips the tests;
# SCALE_KEYS=0 skips the scale mode, SCALE_ONLY=1 runs it alone (no tests, no comparison).
# Time of the scale mode at 200M keys (estimated from CPU runs, not yet measured on the card):
# the bundle's write 1-3 min (random keys and values, safetensors, sha256; peak RSS ~1.3x the
# values, ~16 GB), the load ~1 min (sha256 of 14.4 GB, the host tier's build and pinning; RSS
# ~30 GB then: the host copy and the mapped files), batches well under a minute. It gets the call's time left (SCALE_TIMEOUT, default: 580 s less
# what ran before it); with the tests and the comparison before it that may be too little: then
# run SCALE_ONLY=1 in a call of its own.
set -x
. bench/device_env.sh
if [ "${SCALE_ONLY:-0}" = 0 ]; then
  if [ "${TIER_TESTS:-1}" != 0 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_tiers.py \
      tests/shared/hashtable/test_cuda_tier_gather.py tests/shared/hashtable/test_host_store.py \
      tests/bench/test_bench_serving_tiers.py > "$OUT/serving_tier_tests.log" 2>&1
    echo "serving tier tests rc=$?"; tail -4 "$OUT/serving_tier_tests.log"
  fi
  timeout ${BENCH_TIMEOUT:-220} python3 -m bench.bench_serving_tiers --device cuda --cuda-graphs on \
    --keys "${KEYS:-2774434}" --factor "${FACTOR:-0.1}" --users "${USERS:-8}" --candidates 100 \
    --batches 200 --rounds 3 --work /tmp/bench_serving_tiers \
    --out "$OUT/bench_serving_tiers_gpu.json" > "$OUT/bench_serving_tiers.log" 2>&1
  echo "bench_serving_tiers rc=$?"; tail -4 "$OUT/bench_serving_tiers.log"
  rm -rf /tmp/bench_serving_tiers
fi
if [ "${SCALE_KEYS:-200000000}" != 0 ]; then
  scale_timeout=${SCALE_TIMEOUT:-$(( 580 - SECONDS ))}
  echo "scale mode: ${SCALE_KEYS:-200000000} keys, ${scale_timeout}s left"
  df -h /tmp | tail -1
  [ "$scale_timeout" -ge 60 ] || { echo "too little time left for the scale mode: SCALE_ONLY=1"; exit 1; }
  timeout "$scale_timeout" python3 -m bench.bench_serving_tiers --device cuda --cuda-graphs on \
    --keys "${SCALE_KEYS:-200000000}" --variants caching --hbm-budget-gib "${SCALE_BUDGET_GIB:-8}" \
    --users "${USERS:-8}" --candidates 100 --batches 200 --rounds 3 \
    --work /tmp/bench_serving_scale \
    --out "$OUT/bench_serving_scale_gpu.json" > "$OUT/bench_serving_scale.log" 2>&1
  echo "bench_serving_tiers scale rc=$?"; tail -6 "$OUT/bench_serving_scale.log"
  free -g | head -2
  rm -rf /tmp/bench_serving_scale
fi
