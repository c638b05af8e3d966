#!/usr/bin/env bash
# One device call: every GPU test (`pytest -m gpu tests`, 416 on the H100 on 2026-12-07 in 96 s),
# each test named as it runs (-v) so that a call cut by its timeout still says where it stopped,
# and a test that runs past FAULT_S seconds (default 120) dumps every thread's stack into the
# log (pytest's faulthandler_timeout) without stopping the run: on the H200 on 2026-12-07 a
# `-q` run of the suite reached its 28th test and then nothing for 170 s, with no name to show
# for it. Failures and errors are summarized at the end (-rfE), with the 20 slowest tests.
# Run from the repo root on the GPU machine with $OUT set and `carry: [".whl"]`
# (`python scripts/gpu_wheels.py` here first). Writes $OUT/gpu_tests.log.
# TEST_TIMEOUT (s, default 400) caps the call; TESTS (default "tests") picks the paths, TESTS_K
# (pytest -k) the tests by name.
. bench/device_env.sh
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -p no:cacheprovider -m gpu -v -rfE \
  --durations=20 -o faulthandler_timeout="${FAULT_S:-120}" ${TESTS_K:+-k "$TESTS_K"} ${TESTS:-tests} \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"
grep -E "^(FAILED|ERROR)|Timeout|passed|failed" "$OUT/gpu_tests.log" | tail -30
tail -1 "$OUT/gpu_tests.log"
