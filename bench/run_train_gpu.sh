#!/usr/bin/env bash
# One device call (nvidia-h200) for issue #18's figures: full synthetic data (23.2M training rows),
# then bench_train for the seed config and the all-num_buckets config (step figures, the trainer's
# loop over one epoch with its eval) and the loader alone, into $OUT/bench_train_full.json.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]` (see
# bench/run_gpu_suite.sh; py-spy's wheel in .whl adds the wall-clock stacks of each end-to-end run,
# --py-spy-s), and bench_static_step into $OUT/bench_static_step.json. About 7 minutes
# (2026-12-02): data 3 (the GPU tests can run beside it), bench_static_step 1, bench_train 3.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/.site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc
t0=$(date +%s)
python3 -m train.data all --size full --out /tmp/full \
  --config configs/multi_tower_din_taobao_dynamicemb.config > "$OUT/data.log" 2>&1
echo "data rc=$? in $(( $(date +%s) - t0 )) s"
# the static sparse step against the eager lookup, and its sections' GPU time (about 1 minute)
timeout 150 python3 -m bench.bench_static_step --device cuda --out "$OUT/bench_static_step.json" \
  > "$OUT/bench_static_step.log" 2>&1
echo "bench_static_step rc=$?"
timeout ${BENCH_TIMEOUT:-420} python3 -m bench.bench_train --samples /tmp/full/samples \
  --device cuda --num-workers ${NUM_WORKERS:-12} --steps 10 --warmup 5 --py-spy-s 10 \
  --out "$OUT/bench_train_full.json" > "$OUT/bench_train_full.log" 2>&1
echo "bench_train rc=$?"
tail -40 "$OUT/bench_train_full.log"
