#!/usr/bin/env bash
# One device call (about 2 minutes) for issue #52's fill at scale: bench/bench_host_node.py on the
# card. 107K and 262K random rows of a 100M-row tier at dim 16 (12.8 GB, item 1's size and its
# 10 % cache's misses a step) and of a 10M-row tier at dim 128, each way in one run: the device's
# UVA reads (random and sorted) against a host node in the graph (the native mover on every core,
# then one read of the staged rows), with and without write-backs.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`. Writes under $OUT:
# bench_host_node_16.json, bench_host_node_128.json, bench_host_node.log. NODE_TIMEOUT (s a dim,
# default 150), ROWS, ROWS_128, NS, REPEATS override.
. bench/device_env.sh
for spec in "16 ${ROWS:-100000000}" "128 ${ROWS_128:-10000000}"; do
  set -- $spec
  timeout "${NODE_TIMEOUT:-150}" python3 -m bench.bench_host_node --device cuda --dims "$1" \
    --rows "$2" --ns ${NS:-107000 262144} --repeats "${REPEATS:-9}" \
    --out "$OUT/bench_host_node_$1.json" >> "$OUT/bench_host_node.log" 2>&1
  echo "bench_host_node dim $1 rc=$?"
done
tail -6 "$OUT/bench_host_node.log"
