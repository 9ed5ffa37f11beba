#!/usr/bin/env bash
# fp8 attention's row sum on the tensor cores (docs/dev/fp8-rowsum-wgmma.patch, docs/fp8.md session 20), on the GPU
# without applying the patch here: a copy of the tree with it applied, then (1) alternating processes of the fp8
# prefill probe under SERVEATTN_FP8_ROWSUM_MMA=0 / 2 / 1, (2) the fp8 GPU tests with the switch at 2 (the
# warp-specialized kernel bitwise against prefill_kernel, both against the float64 reference).
#
#   scripts/probe_rowsum.sh [rounds] [cases]      # defaults 3 and 1x4096,1x8192,16x2048
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
CASES=${2:-1x4096,1x8192,16x2048}
W=$(mktemp -d)
cp -r serveattn scripts tests pyproject.toml "$W/" 2>/dev/null
(cd "$W" && patch -s -p1 < "$OLDPWD/docs/dev/fp8-rowsum-wgmma.patch") || { echo "probe_rowsum: the patch does not apply"; exit 2; }
cd "$W"
export PYTHONPATH="$W:$W/scripts"
for r in $(seq "$ROUNDS"); do
  for sw in 0 2 1; do
    echo "== SERVEATTN_FP8_ROWSUM_MMA=$sw, round $r"
    SERVEATTN_FP8_ROWSUM_MMA=$sw timeout 150 python3 scripts/probe_prefill.py --cases "$CASES" --kinds fp8 --profile 2>&1 \
      | grep -v "Warn\|warn_once\|transpose_v"
  done
done
echo "== fp8 GPU tests, SERVEATTN_FP8_ROWSUM_MMA=2"
SERVEATTN_FP8_ROWSUM_MMA=2 timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_prefill_ws_gpu.py \
  tests/test_fp8_attention.py 2>&1 | tail -15
cd / && rm -rf "$W"
