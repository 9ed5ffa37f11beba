#!/usr/bin/env bash
# SERVEATTN_PREFILL_WS_Q_EARLY (session 22, prepared on the CPU: off path SASS byte-identical, on compiles without
# spills in fp8 and 5 more producer spill instructions in bf16), in one device call (~5 minutes):
#   1. timed against off in alternating processes (scripts/probe_env_ab.sh, kernel time),
#   2. held to the GPU tests of the kernel (tests/test_prefill_ws_gpu.py, tests/test_fp8_attention.py),
#   3. traced (scripts/probe_ws_trace.py: "to q ready" was ~600-1200 cycles a task in session 22's trace).
#
#   scripts/probe_q_early.sh [rounds] [cases] [kinds]     # defaults 2, 1x4096,16x2048, bf16,fp8
# Output: $OUT/q-early-*.txt (OUT defaults to ./out).
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
CASES=${2:-1x4096,16x2048}
KINDS=${3:-bf16,fp8}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/scripts"
E=SERVEATTN_PREFILL_WS_Q_EARLY
timeout 200 scripts/probe_env_ab.sh "$E=0;$E=1" "$ROUNDS" --cases "$CASES" --kinds "$KINDS" --profile \
  2>&1 | grep -v "warn" | tee "$OUT/q-early-ab.txt"
echo "== GPU tests, $E=1" | tee "$OUT/q-early-tests.txt"
env $E=1 timeout 120 python3 -m pytest -q -x -n 16 -p no:cacheprovider tests/test_prefill_ws_gpu.py \
  tests/test_fp8_attention.py 2>&1 | tail -3 | tee -a "$OUT/q-early-tests.txt"
echo "== trace, $E=1" | tee "$OUT/q-early-trace.txt"
env $E=1 timeout 80 python3 scripts/probe_ws_trace.py --cases "$CASES" --kinds "$KINDS" 2>&1 \
  | grep -v "Warn\|warn_once" | tee -a "$OUT/q-early-trace.txt"
