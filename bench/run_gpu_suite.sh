#!/usr/bin/env bash
# One device call (nvidia-h200): GPU tests, then the hash-table, DIN and training benchmarks and
# the training-step profile, each under its own timeout so the call ends inside 10 minutes.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]` (wheels from
# `python scripts/gpu_wheels.py`: the lock's versions of everything the machine lacks, grpc and
# locust included). Writes JSON and logs under $OUT.
# (at most 8 files come back: gpu_tests.log, suite.log, the JSONs, profile_train.txt.)
# The serving benchmark needs a call of its own: bench/run_serving_gpu.sh.
set -x
. bench/device_env.sh
python3 -m train.data all --size small --out /tmp/small \
  --config configs/multi_tower_din_taobao_dynamicemb.config > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
timeout 90 python3 -m bench.bench_gpu_hashtable --out "$OUT/bench_gpu_hashtable.json" \
  --sections find,insert --repeats 5 >> "$OUT/suite.log" 2>&1
echo "hashtable rc=$?"
timeout 90 python3 -m bench.bench_din --device cuda --compile off --out "$OUT/bench_din.json" \
  >> "$OUT/suite.log" 2>&1
echo "din rc=$?"
timeout 200 python3 -m bench.bench_train --samples /tmp/small/samples --device cuda --batch 8192 \
  --steps 10 --warmup 3 --padded-steps 3 --num-workers 8 --e2e-max-steps 25 --eval-max-batches 4 \
  --out "$OUT/bench_train.json" >> "$OUT/suite.log" 2>&1
echo "train rc=$?"
timeout 60 python3 -m bench.profile_train --samples /tmp/small/samples --device cuda \
  --out "$OUT/profile_train.json" >> "$OUT/suite.log" 2>&1
echo "profile rc=$?"
python3 -m bench.summarize_gpu_suite "$OUT"
