#!/usr/bin/env bash
# One device call (under 300 s; about 2 minutes expected) for issue #52's fill design:
# bench/bench_host_rows.py on the card. n = 64K, 256K and 1M random distinct rows of the host
# tier (page-locked, mapped; rows of values + Adagrad accumulators), 30M rows at dim 16 (3.8 GB)
# and 10M at dim 128 (10.2 GB), each way in the same run: the UVA gather (host_rows.gather), the
# line fill's read (host_rows.fill_slots over 1,048,576 positions, alone and with a write-back),
# the CPU's index_select into pinned staging (all cores, and one) with a bulk copy after (apart,
# together, in 4 overlapped chunks), the UVA scatter, and a bulk contiguous copy each way (the
# ceiling). Every method's rows are checked against the rows' pattern (rows_equal).
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes under $OUT: bench_host_rows_gpu.json (after
# each n), bench_host_rows.log (a line per dim and n with each method's ms, rows/s and GB/s).
# ROWS / ROWS_128 / NS / DIMS / REPEATS / POSITIONS override the sizes.
set -x
. bench/device_env.sh
timeout ${BENCH_TIMEOUT:-270} python3 -m bench.bench_host_rows --device cuda --dims ${DIMS:-16 128} \
  --rows "${ROWS:-30000000}" --rows-128 "${ROWS_128:-10000000}" --ns ${NS:-65536 262144 1048576} \
  --positions "${POSITIONS:-1048576}" --repeats "${REPEATS:-9}" \
  --out "$OUT/bench_host_rows_gpu.json" > "$OUT/bench_host_rows.log" 2>&1
echo "bench_host_rows rc=$?"; tail -8 "$OUT/bench_host_rows.log"
free -g | head -2
