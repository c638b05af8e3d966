#!/usr/bin/env bash
# One device call (nvidia-h200, 16 cores): Predict throughput and latency of `python -m serve`
# under locust, GPU against the CPU baseline on the same machine and load, with the server's
# stage profile and a py-spy GIL profile (bench/bench_serving.py), then the latency of a hot
# swap under traffic (bench/bench_swap.py). Run from the repo root on the
# GPU machine with $OUT set, after `python scripts/gpu_wheels.py` here (the lock's versions of
# locust, grpc, py-spy and the rest) and `carry: [".whl"]`. About 8 minutes; writes under $OUT:
# bench_serving.json, pyspy_raw.txt, bench_serving.log, swap_gpu.json, bench_swap.log.
set -x
. bench/device_env.sh
.site/bin/py-spy --version
# runs (500 candidates per request, candidate_columns; a synthetic format 3 bundle of 1.5M keys
# with the seed config's dense part taking the pairs, so CUDA servers can replay CUDA graphs),
# CUDA graphs on (graphs off was compared on 2026-12-01: bench/results/bench_serving_graphs_h200.json):
# one GPU process with FRONTENDS frontends (serve --frontends, #19's one-context design; 12 by
# default on these 16 cores: each locust user's connection stays on the frontend the kernel's
# SO_REUSEPORT hash gave it, so with 8 frontends some served 3-4 users while others idled, and
# 12 and 16 frontends served 16 users at 1.18M and 1.39M candidates/s against 0.99M, 2026-12-04)
# at 8, 12, 16, 32 and 64 closed-loop users; one process (no frontends) and the frontends at 1
# user, for the latency at about 100K candidates/s (#19's p99 <= 5 ms goal); the CPU baseline at 32
# users. The offline profile gives the kernel and graph launches of predict() of one
# 500-candidate batch and the graph stats. Extra arguments go to bench_serving (e.g.
# --max-wait-us 0, --handoff-inflight 1).
F=f${FRONTENDS:-12}
timeout "${BENCH_TIMEOUT:-420}" python3 -m bench.bench_serving --out "$OUT" --work /tmp/bench_serving \
  --run cuda:$F:500:8 --run cuda:$F:500:12 --run cuda:$F:500:16 --run cuda:$F:500:32 \
  --run cuda:$F:500:64 --run cuda:1:500:1 --run cuda:$F:500:1 --run cpu:1:500:32 \
  --cuda-graphs on --duration "${BENCH_DURATION:-10}" --warmup-s 2 --processes 6 "$@" \
  2>&1 | tee "$OUT/bench_serving.log"
# the hot swap under traffic (#19: p99 during <= 1.1x before), the server as deployed above
timeout 150 python3 -m bench.bench_swap --out "$OUT/swap_gpu.json" --device cuda --frontends 4 \
  2>&1 | tee "$OUT/bench_swap.log"
