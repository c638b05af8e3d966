#!/usr/bin/env bash
# One device call for issue #53: the shipped configs side by side on full data. The GPU tests of
# the cold-ids step's modules (graphed == eager for the cold-ids config's step with backoff,
# crosses, item tower and dense EMA; the fused EMA; a table at its own rate) beside the
# generation of the full synthetic data (~140 s), then bench_train for the seed config, the
# all-num_buckets config and the cold-ids config, each at its own batch size (8192, 8192, 4096):
# step figures (ms, launches and syncs a step, GPU busy), the trainer's loop over one epoch with
# its eval, and the ratios cold/dynamic, into $OUT/bench_train_configs.json (written after each
# config, so a stopped run keeps the configs it finished; + the warm steps' kernel tables).
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]` (the wheels of
# scripts/gpu_wheels.py, as bench/run_train_gpu.sh). Everything within ~590 s: the benchmark
# gets what the data and tests left (BENCH_TIMEOUT caps it lower).
# TESTS: the GPU test paths ("" skips them). CONFIGS: bench_train's --configs (default
# dynamic,buckets,cold); CONFIGS=dynamic,cached,cold also runs issue #52's item 2 (the seed config
# with cache_load_factor 0.1 on every dynamic table against the seed config: cached/dynamic).
# STATIC_PREFETCH=1: the cached config's tables prefetch the next batch's rows beside the step
# (bench_train --static-prefetch, train --static-prefetch). CONFIGS=dynamic,cached,cached_prefetch
# runs the cached config both ways in one call (cached_prefetch: always with the prefetch).
# HOST_MEMORY=driver: the cached tables' host tiers in the CUDA driver's memory (--host-memory).
# CACHE_ROW_THREADS=N: N host threads move the cached tables' rows between the tiers (the
# host-node fill and the write-backs by cores: --cache-row-threads; 12 loader workers share the
# 16 cores, so N=4 is a start).
# E2E_ROUNDS=N: each config's end-to-end run N times, the configs in turn (--e2e-rounds; on the
# H100 on 2026-12-08 one end-to-end run took about 45 s and a config's first pass about 110 s:
# CONFIGS=dynamic,cached E2E_ROUNDS=3 fits the call).
. bench/device_env.sh
t0=$(date +%s)
(python3 -m train.data all --size full --out /tmp/full \
  --config configs/multi_tower_din_taobao_dynamicemb.config > "$OUT/data.log" 2>&1
 echo "data rc=$? in $(( $(date +%s) - t0 )) s") &
TESTS=${TESTS-tests/train/model/test_graphed.py tests/train/test_dense_ema.py tests/train/model/test_backoff.py tests/train/model/test_sparse_arch.py tests/shared/hashtable/test_embedding.py}
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086  # TESTS is a list of paths
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short \
    $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -20
fi
wait
left=$(( ${DEADLINE_S:-590} - ($(date +%s) - t0) ))
budget=$(( left < ${BENCH_TIMEOUT:-480} ? left : ${BENCH_TIMEOUT:-480} ))
echo "bench_train: ${budget} s left"
timeout "$budget" python3 -m bench.bench_train --samples /tmp/full/samples \
  --configs "${CONFIGS:-dynamic,buckets,cold}" --device cuda --num-workers ${NUM_WORKERS:-12} \
  --steps 10 --warmup 5 --e2e-rounds "${E2E_ROUNDS:-1}" ${STATIC_PREFETCH:+--static-prefetch} \
  ${CACHE_ROW_THREADS:+--cache-row-threads "$CACHE_ROW_THREADS"} --host-memory "${HOST_MEMORY:-register}" --out "$OUT/bench_train_configs.json" \
  > "$OUT/bench_train_configs.log" 2>&1
echo "bench_train rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "^[a-z_]+: batch|^(cold|cached|cached_prefetch)/dynamic: |^error" "$OUT/bench_train_configs.log" \
  || tail -20 "$OUT/bench_train_configs.log"
