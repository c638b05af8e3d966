#!/usr/bin/env bash
# One device call (nvidia-h200) for issue #18's figures: the GPU tests beside the generation of the
# full synthetic data (23.2M training rows), then bench_static_step and bench_train for the seed
# config and the all-num_buckets config (step figures, the trainer's loop over one epoch with its
# eval) and the loader alone, into $OUT/bench_train_full.json (+ the warm steps' kernel tables).
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]` (see
# bench/run_gpu_suite.sh; py-spy's wheel in .whl adds the wall-clock stacks of each end-to-end run
# with PY_SPY_S=10).
# TESTS: the GPU test paths ("" skips them; default tests/shared tests/train). About 5 minutes
# (2026-12-04): data 2.3 with the tests beside it, bench_static_step 0.2, bench_train 2.4.
. bench/device_env.sh
t0=$(date +%s)
(python3 -m train.data all --size full --out /tmp/full \
  --config configs/multi_tower_din_taobao_dynamicemb.config > "$OUT/data.log" 2>&1
 echo "data rc=$? in $(( $(date +%s) - t0 )) s") &
TESTS=${TESTS-tests/shared tests/train}
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086  # TESTS is a list of paths
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short \
    $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.log" | tail -20
fi
wait
# the static sparse step against the eager lookup, and its sections' GPU time (after the data:
# no CPU contention)
timeout 150 python3 -m bench.bench_static_step --device cuda --out "$OUT/bench_static_step.json" \
  > "$OUT/bench_static_step.log" 2>&1
echo "bench_static_step rc=$?"
py_spy=()
[ -n "${PY_SPY_S:-}" ] && py_spy=(--py-spy-s "$PY_SPY_S")
timeout ${BENCH_TIMEOUT:-420} python3 -m bench.bench_train --samples /tmp/full/samples \
  --device cuda --num-workers ${NUM_WORKERS:-12} --steps 10 --warmup 5 "${py_spy[@]}" \
  --out "$OUT/bench_train_full.json" > "$OUT/bench_train_full.log" 2>&1
echo "bench_train rc=$? at $(( $(date +%s) - t0 )) s"
tail -22 "$OUT/bench_train_full.log"
