#!/usr/bin/env bash
# One device call (about 8 minutes; TESTS="" saves ~100 s, so about 400 s): the wheels of
# scripts/gpu_wheels.py (the lock's versions) installed and imported, the GPU tests, the table
# plan against the card's free memory, then bench/bench_oip.py on CUDA: ModelInfer against
# Predict in mixed mode, both protocols in the same 10 s windows (N/2 calls each), 6 rounds at
# 16 and then 8 clients (about 40 s of bundle and server start, then ~105 s per concurrency).
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes under $OUT: gpu_tests.log,
# plan_cuda.txt, bench_oip_gpu.json, bench_oip.log. (The stream's device runs are
# bench/run_stream_gpu.sh.)
set -x
. bench/device_env.sh
python3 - 2>&1 <<'PY'  # the locked versions installed and importable
import importlib.metadata as md
for name in ("grpcio", "protobuf", "torchrec", "locust", "tritonclient", "fastapi", "uvicorn"):
    print(name, md.version(name))
import protos.grpc_predict_v2_pb2_grpc, protos.predict_pb2_grpc, torch  # noqa: E401,F401
print("torch", torch.__version__, torch.cuda.get_device_name())
PY
python3 -m train.data all --size small --out /tmp/small \
  --config configs/multi_tower_din_taobao_dynamicemb.config > /dev/null 2>&1
# CLIENTS: the concurrencies, even (default "16 8"; one of them saves ~105 s)
# TESTS: the GPU test paths ("" skips them, when another call of the session ran them)
TESTS=${TESTS-tests}
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086  # TESTS is a list of paths
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
fi
python3 -m train.tools plan --config configs/multi_tower_din_taobao_dynamicemb.config \
  --device cuda > "$OUT/plan_cuda.txt" 2>&1
cat "$OUT/plan_cuda.txt"
# shellcheck disable=SC2086  # CLIENTS is a list of numbers
timeout 330 python3 -m bench.bench_oip --device cuda --mode mixed --candidates 500 \
  --clients ${CLIENTS:-16 8} --procs 4 --keys 2000000 --rounds 6 --settle 10 --frontends 4 \
  --duration 10 --out "$OUT/bench_oip_gpu.json" > "$OUT/bench_oip.log" 2>&1
echo "bench_oip rc=$?"; tail -15 "$OUT/bench_oip.log"
