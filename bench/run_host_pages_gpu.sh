#!/usr/bin/env bash
# One device call (about 2 minutes) for issue #52's fill: bench/bench_host_pages.py on the card.
# The UVA gather of 64K and 256K random rows (random and sorted order) and the CPU's gather, over
# a host tier made three ways: torch.zeros + cudaHostRegister (today's), a 2-MiB-aligned mmap with
# MADV_HUGEPAGE + cudaHostRegister, cudaHostAlloc, and the driver's cuMemCreate host memory
# (vmm_host); 30M rows at dim 16, 10M at dim 128. ALLOCATIONS picks some of them.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`. Writes under $OUT:
# bench_host_pages_gpu.json (after each allocation and n), bench_host_pages.log.
. bench/device_env.sh
timeout "${BENCH_TIMEOUT:-270}" python3 -m bench.bench_host_pages --device cuda --dims ${DIMS:-16 128} \
  --rows "${ROWS:-30000000}" --rows-128 "${ROWS_128:-10000000}" --ns ${NS:-65536 262144} \
  --repeats "${REPEATS:-9}" ${ALLOCATIONS:+--allocations $ALLOCATIONS} --out "$OUT/bench_host_pages_gpu.json" > "$OUT/bench_host_pages.log" 2>&1
echo "bench_host_pages rc=$?"; tail -12 "$OUT/bench_host_pages.log"
grep -i huge /proc/meminfo
