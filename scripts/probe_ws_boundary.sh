#!/usr/bin/env bash
# The warp-specialized prefill's task boundary, in one device call (docs/performance.md session 21: a task's fixed
# part is 15-29% of the kernel): SERVEATTN_PREFILL_WS_EPILOGUE_SMEM (on main) and SERVEATTN_PREFILL_WS_FLATTEN
# (branch next/ws-flatten, applied here from docs/dev/ws-flatten.patch in a copy of the tree), each
#   1. timed against the other settings in alternating processes (scripts/probe_env_ab.sh, kernel time),
#   2. held to the GPU tests of the kernel (tests/test_prefill_ws_gpu.py: bitwise prefill_kernel; fp8 attention),
#   3. traced (scripts/probe_ws_trace.py: cycles a task by part; the baseline's trace is session 21's).
# ~9 minutes at most (each step under its own timeout): run it alone in a device call.
#
#   scripts/probe_ws_boundary.sh [rounds] [cases] [kinds]     # defaults 2, 1x4096,16x2048, bf16,fp8
# Output: $OUT/ws-boundary-*.txt (OUT defaults to ./out).
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
CASES=${2:-1x4096,16x2048}
KINDS=${3:-bf16,fp8}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
W=$(mktemp -d)
cp -r serveattn scripts tests pyproject.toml "$W/" 2>/dev/null
(cd "$W" && patch -s -p1 < "$OLDPWD/docs/dev/ws-flatten.patch") || { echo "probe_ws_boundary: the patch does not apply"; exit 2; }
cd "$W"
export PYTHONPATH="$W:$W/scripts"
E=SERVEATTN_PREFILL_WS_EPILOGUE_SMEM
F=SERVEATTN_PREFILL_WS_FLATTEN
SETTINGS=("$E=0,$F=0" "$E=1,$F=0" "$E=0,$F=1" "$E=1,$F=1")
# the A/B first (what decides), then the tests (the same compiled kernels), then the traces (kernels of their own)
timeout 240 scripts/probe_env_ab.sh "$(IFS=';'; echo "${SETTINGS[*]}")" "$ROUNDS" --cases "$CASES" --kinds "$KINDS" --profile \
  2>&1 | grep -v "transpose_v\|warn" | tee "$OUT/ws-boundary-ab.txt"
for st in "$E=1,$F=0" "$E=0,$F=1"; do
  echo "== GPU tests, $st"
  env ${st//,/ } timeout 90 python3 -m pytest -q -x -n 16 -p no:cacheprovider tests/test_prefill_ws_gpu.py \
    tests/test_fp8_attention.py 2>&1 | tail -3
done 2>&1 | tee "$OUT/ws-boundary-tests.txt"
for st in "$E=1,$F=0" "$E=0,$F=1"; do
  echo "== trace, $st"
  env ${st//,/ } timeout 80 python3 scripts/probe_ws_trace.py --cases "$CASES" --kinds "$KINDS" 2>&1 | grep -v "Warn\|warn_once"
done 2>&1 | tee "$OUT/ws-boundary-trace.txt"
cd / && rm -rf "$W"
