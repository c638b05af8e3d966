#!/usr/bin/env bash
# One device call: install the carried wheels, GPU tests, a 1-GPU NCCL torchrun run, and the
# training/DIN/hash-table benchmarks. Run on the GPU machine from the repo root with $OUT set,
# after `../shared/device/fetch-wheels.sh` here and `carry: [".whl"]` (see ../shared/device).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/.site
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m train.data all --size small --out /tmp/small --config configs/multi_tower_din_taobao_dynamicemb.config > $OUT/data.log 2>&1
timeout 75 python3 -m pytest -q -p no:cacheprovider -m gpu tests > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
timeout 70 python3 -m bench.bench_distributed --device cuda --procs 1 --data /tmp/small/samples --batch-size 8192 --max-steps 25 --warmup 5 --num-workers 2 --out $OUT/bench_distributed_gpu1.json > $OUT/bench_distributed.log 2>&1; echo "dist rc=$?"; tail -4 $OUT/bench_distributed.log
timeout 75 python3 -m bench.bench_train --samples /tmp/small/samples --device cuda --batch 8192 --steps 8 --padded-steps 3 --warmup 3 --end-to-end-steps 20 --num-workers 4 --out $OUT/bench_train_gpu.json > $OUT/bench_train.log 2>&1; echo "bench_train rc=$?"; grep -A6 '"step"' $OUT/bench_train.log | head -8
