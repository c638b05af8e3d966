#!/usr/bin/env bash
# One device call (about 6 minutes) for issue #52's item 1 at dim 16: do the static step's
# write-backs, staged in the forward and written to the host tier beside the rest of the step
# (shared/hashtable/write_back_beside.py, bench_tiers --write-back-beside), take their cost off
# the step? On an H100 (2026-12-07) the 10 % cache's step took 2.12x HBM-only while the cache
# filled (no victims) and 2.76x once it evicted.
# 1. the GPU tests of the static cache (write-backs staged and not, by the device and by the
#    host's cores), of the trainer (train --cache-row-threads) and of the graphs;
# 2. bench_tiers at dim 16, 100M rows, static step, 10/50/100 % caches against HBM_ONLY: the fill
#    as today (fill), with --write-back-beside (262,144 staging rows: 32 MiB) written by the
#    device (beside) or by CORES host threads (cores_beside), and with the host-node fill
#    reading the rows too (node_beside, node_cores_beside), each run with its own HBM_ONLY
#    baseline, 100 warm-up steps (the 10 % cache is full after about 92).
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes under $OUT: gpu_tests.log,
# bench_tiers_$VARIANT.json and .log (7 files for three variants). VARIANTS picks some; ROWS,
# WARMUP, STEPS and TIERS_TIMEOUT (s a bench_tiers run, default 150) override the sizes; TESTS=0
# skips the tests, TESTS_K picks some by name (pytest -k). PROFILE=N profiles N steps of each
# variant after its timed run (bench_tiers --profile: one more file a variant,
# bench_tiers_$VARIANT.profiles.txt; with two VARIANTS the call stays within 8 files). The
# log line of a cache gives the host's cores' ms a step too (host node fill, write-backs by cores).
# 2026-12-08 (H100): beside (the device's scatter on a stream of its own) was slower than the
# fill's own write-backs (11.88 against 10.67 ms), so the default variants now are fill,
# cores_beside (the staged rows written by CORES host threads, default 8: --write-back-cores)
# and node_cores_beside (with the host-node fill's reads).
. bench/device_env.sh
if [ "${TESTS:-1}" != 0 ]; then
  TESTS="tests/shared/hashtable/test_row_cache_static.py tests/shared/hashtable/test_host_store.py tests/shared/hashtable/test_host_move.py tests/train/test_trainer.py tests/serve/test_graphs.py" \
    TEST_TIMEOUT=120 bash bench/run_gpu_tests.sh
fi
for variant in ${VARIANTS:-fill cores_beside node_cores_beside}; do
  case "$variant" in
    fill) extra=() ;;
    beside) extra=(--write-back-beside 262144) ;;
    node_beside) extra=(--host-node --write-back-beside 262144) ;;
    cores_beside) extra=(--write-back-beside 262144 --write-back-cores "${CORES:-8}") ;;
    node_cores_beside) extra=(--host-node --write-back-beside 262144 --write-back-cores "${CORES:-8}") ;;
    *) echo "unknown variant $variant (fill, beside, node_beside, cores_beside, node_cores_beside)"; exit 2 ;;
  esac
  timeout "${TIERS_TIMEOUT:-150}" python3 -m bench.bench_tiers --device cuda --dims 16 \
    --rows "${ROWS:-100000000}" --lookups 1000000 --warmup "${WARMUP:-100}" --steps "${STEPS:-20}" \
    --rounds 1 --static "${extra[@]}" ${PROFILE:+--profile "$PROFILE"} \
    --out "$OUT/bench_tiers_$variant.json" \
    > "$OUT/bench_tiers_$variant.log" 2>&1
  echo "bench_tiers ($variant) rc=$?"; grep "round 0" "$OUT/bench_tiers_$variant.log"
done
