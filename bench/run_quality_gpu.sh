#!/usr/bin/env bash
# One device call (nvidia-h200) for issue #22's figures: full synthetic data (23.2M training rows)
# in /tmp/full (made here unless a complete one is already there, e.g. from bench/run_train_gpu.sh
# earlier in the same call or on the same warm machine), then bench_quality: the seed config
# trained one epoch without and with cold_backoff at seeds $SEEDS (0,1,2), two trainings at a
# time ($JOBS) with 6 loader workers each, all evaluated on the eval split, into
# $OUT/bench_quality_full.json (medians over the seeds and every run; log:
# $OUT/bench_quality_full.log, data: $OUT/data.log).
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]` (see
# bench/run_gpu_suite.sh). About 6 minutes: data 2.5 (when made), 3 pairs of epochs and evals
# about 1 each (2026-12-04). Arguments go to bench_quality, e.g. `bash bench/run_quality_gpu.sh
# --sparse-lr 0.03 --crosses cms_group_id:cate_id,cms_group_id:adgroup_id`.
# With SWEEP=bench/sweeps/NAME.toml it runs that sweep instead (bench/quality_sweep.py: several
# recipes over seeds, $JOBS at a time, no run started after $STOP_AFTER s, default 420) into
# $OUT/quality_sweep.json; RESUME=path/to/an/earlier/quality_sweep.json (carried: e.g. under
# out/) runs only the seeds it lacks. On a warm machine /tmp/full is still there.
# DATA_CONFIG=path builds the samples for that config's features instead of the seed config's
# (a config with a feature of its own name, e.g. a second embedding of one input, needs its
# column; the seed config's columns come out the same, row for row).
set -x
. bench/device_env.sh
FULL=${FULL_DIR:-/tmp/full}
t0=$(date +%s)
DATA_CONFIG=${DATA_CONFIG:-configs/multi_tower_din_taobao_dynamicemb.config}
if [ -f "$FULL/samples/_build_report.json" ] && [ -f "$FULL/generate_report.json" ] \
    && [ "$(cat "$FULL/data_config" 2>/dev/null)" = "$DATA_CONFIG" ]; then
  echo "reusing $FULL"
else
  python3 -m train.data all --size full --out "$FULL" --config "$DATA_CONFIG" \
    > "$OUT/data.log" 2>&1
  echo "data rc=$? in $(( $(date +%s) - t0 )) s"
  echo "$DATA_CONFIG" > "$FULL/data_config"
fi
if [ -n "$SWEEP" ]; then
  timeout ${BENCH_TIMEOUT:-580} python3 -m bench.quality_sweep "$SWEEP" --jobs ${JOBS:-2} \
    --stop-after ${STOP_AFTER:-420} ${RESUME:+--resume "$RESUME"} --out "$OUT/quality_sweep.json" \
    > "$OUT/quality_sweep.log" 2>&1
  echo "quality_sweep rc=$?"
  tail -20 "$OUT/quality_sweep.log"
  exit 0
fi
timeout ${BENCH_TIMEOUT:-480} python3 -m bench.bench_quality --samples "$FULL/samples" \
  --device cuda --num-workers ${NUM_WORKERS:-6} --seeds ${SEEDS:-0,1,2} --jobs ${JOBS:-2} "$@" \
  --out "$OUT/bench_quality_full.json" > "$OUT/bench_quality_full.log" 2>&1
echo "bench_quality rc=$?"
tail -20 "$OUT/bench_quality_full.log"
