#!/usr/bin/env bash
# One device call (nvidia-h200, 16 cores): Predict throughput and latency of `python -m serve`
# under locust, GPU against the CPU baseline on the same machine and load, with the server's
# stage profile and a py-spy GIL profile (bench/bench_serving.py), then the latency of a hot
# swap under traffic (bench/bench_swap.py). Run from the repo root on the
# GPU machine with $OUT set, after fetching the wheels here and `carry: [".whl"]`:
#   ../shared/device/fetch-wheels.sh locust==2.47.0 gevent==26.9.0 geventhttpclient==2.6.1 \
#     greenlet==3.5.6 zope.event==6.2 zope.interface==8.7 flask==3.1.3 flask-cors==6.0.5 \
#     flask-login==0.6.3 blinker==1.9.0 itsdangerous==2.2.0 pyzmq==27.3.0 configargparse==1.9.0 \
#     brotli==1.2.1 python-engineio==4.15.1 python-socketio==5.18.1 bidict==0.24.1 \
#     simple-websocket==1.1.0 wsproto==1.3.2 websocket-client==1.9.2 py-spy==0.4.3
# (plus grpcio==1.85.3 grpcio-health-checking grpcio-reflection prometheus-client, already in .whl:
# the generated stubs want grpcio >= 1.85.1). About 8 minutes; writes under $OUT:
# bench_serving.json, pyspy_raw.txt, bench_serving.log, swap_gpu.json, bench_swap.log.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/.site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc
.site/bin/py-spy --version
# runs (500 candidates per request, candidate_columns; a synthetic format 3 bundle of 1.5M keys
# with the seed config's dense part taking the pairs, so CUDA servers can replay CUDA graphs),
# CUDA graphs on (graphs off was compared on 2026-12-01: bench/results/bench_serving_graphs_h200.json):
# one GPU process with 8 frontends (serve --frontends 8, #19's one-context design) at 8, 16, 32 and
# 64 closed-loop users; one process (no frontends) and the 8 frontends at 1 user, for the latency
# at about 100K candidates/s (#19's p99 <= 5 ms goal); the CPU baseline at 32 users. The offline
# profile gives the kernel and graph launches of predict() of one 500-candidate batch and the
# graph stats. Extra arguments go to bench_serving (e.g. --max-wait-us 0, --handoff-inflight 1).
timeout "${BENCH_TIMEOUT:-420}" python3 -m bench.bench_serving --out "$OUT" --work /tmp/bench_serving \
  --run cuda:f8:500:8 --run cuda:f8:500:16 --run cuda:f8:500:32 --run cuda:f8:500:64 \
  --run cuda:1:500:1 --run cuda:f8:500:1 --run cpu:1:500:32 \
  --cuda-graphs on --duration "${BENCH_DURATION:-10}" --warmup-s 2 --processes 6 "$@" \
  2>&1 | tee "$OUT/bench_serving.log"
# the hot swap under traffic (#19: p99 during <= 1.1x before), the server as deployed above
timeout 150 python3 -m bench.bench_swap --out "$OUT/swap_gpu.json" --device cuda --frontends 4 \
  2>&1 | tee "$OUT/bench_swap.log"
