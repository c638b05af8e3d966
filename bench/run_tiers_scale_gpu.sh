#!/usr/bin/env bash
# One device call (under 550 s) for issue #52's scale goal: the row-arrays-on-the-host GPU tests,
# then bench/bench_tiers_scale.py on the card: 500M keys at dim 16 (625M slots), CACHING with the
# index's row arrays (key, table id, score) in mapped host memory and the cache the planner sizes
# for 16 GiB of HBM, populated in chunks of 4M keys, then 20 + 30 Zipf 1.05 steps of 1M lookups.
# The plan (shared/hashtable/placement.py, the insert kernels' scratch counted): cache factor 0.02
# (12.5M lines), 15.82 GiB (16.99 GB) of HBM: slot arrays 10.08 GB, line map 2.5 GB, lines 1.81 GB,
# insert scratch 2.6 GB (win 4 B a slot, 20 B a bucket; its stage, 8 B a slot, is with the row
# arrays on the host). Host memory: 625M slots x (128 B of payload + 20 B of row arrays + 8 B of
# stage) = 97.5 GB page-locked, of the machine's 128 GiB (137 GB); nothing else big runs beside
# it. Device: the plan's 16.99 GB, the kernels' rep_of (4 B a key of a 4M-key chunk), a step's
# work and, before the table is built, the Zipf CDF (4 GB): about 22 GB, so an 80 GB card.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes under $OUT: scale_tests.log,
# bench_tiers_scale_gpu.json (after the populate, then complete), bench_tiers_scale.log.
# KEYS / BUDGET_GIB / LOOKUPS / WARMUP / STEPS / CHUNK override the sizes; HOST_MEMORY=driver
# makes the host tier and the row arrays in the CUDA driver's memory (--host-memory); SCALE_TESTS=0 skips the
# tests (when another call of the session ran them).
set -x
. bench/device_env.sh
if [ "${SCALE_TESTS:-1}" != 0 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/shared/hashtable/test_layout.py tests/shared/hashtable/test_row_cache.py \
    > "$OUT/scale_tests.log" 2>&1
  echo "scale tests rc=$?"; tail -4 "$OUT/scale_tests.log"
fi
timeout ${BENCH_TIMEOUT:-380} python3 -m bench.bench_tiers_scale --device cuda \
  --scale-keys "${KEYS:-500000000}" --hbm-budget-gib "${BUDGET_GIB:-16}" --lookups "${LOOKUPS:-1000000}" \
  --warmup "${WARMUP:-20}" --steps "${STEPS:-30}" --chunk "${CHUNK:-4194304}" \
  --host-memory "${HOST_MEMORY:-register}" --out "$OUT/bench_tiers_scale_gpu.json" > "$OUT/bench_tiers_scale.log" 2>&1
echo "bench_tiers_scale rc=$?"; tail -12 "$OUT/bench_tiers_scale.log"
free -g | head -2
