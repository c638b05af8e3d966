#!/usr/bin/env bash
# One device call: install the carried wheels, GPU tests, a CUDA training smoke run, training and
# DIN benchmarks. Run on the GPU machine from the repo root with $OUT set (see ../shared/device).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/.site
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m train.data all --size small --out /tmp/small --config configs/multi_tower_din_taobao_dynamicemb.config > $OUT/data.log 2>&1
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests -x > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
timeout 60 python3 -m train train --config configs/multi_tower_din_taobao_dynamicemb.config --train /tmp/small/samples/train --eval /tmp/small/samples/eval --model-dir /tmp/m --device cuda --batch-size 8192 --num-workers 2 --max-steps 20 --no-progress > $OUT/train_smoke.log 2>&1; echo "train rc=$?"; tail -2 $OUT/train_smoke.log
timeout 120 python3 -m bench.bench_train --samples /tmp/small/samples --device cuda --batch 8192 --steps 10 --padded-steps 5 --warmup 3 --end-to-end-steps 20 --num-workers 4 --out $OUT/bench_train_gpu.json > $OUT/bench_train.log 2>&1; echo "bench_train rc=$?"; tail -25 $OUT/bench_train.log
timeout 60 python3 -m bench.bench_din --device cuda --out $OUT/bench_din_gpu.json > $OUT/bench_din.log 2>&1; echo "bench_din rc=$?"; tail -5 $OUT/bench_din.log
