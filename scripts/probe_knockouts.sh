#!/usr/bin/env bash
# Where the warp-specialized prefill's time goes (GPU; timing only, the results are wrong by design): the paged
# causal prefill probe with parts of the work dropped (SERVEATTN_PREFILL_WS_KNOCKOUT, kernels/attention_ws.py),
# one process per setting (the switch is read at import), the unchanged kernel first and last to show the drift.
#
#   scripts/probe_knockouts.sh [cases] [kinds]     # defaults 1x8192,16x2048 and bf16,fp8
set -u
cd "$(dirname "$0")/.."
CASES=${1:-1x8192,16x2048}
KINDS=${2:-bf16,fp8}
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
for ko in none exp rowstats exp,rowstats pv kv kv,pv none; do
  echo "== knockout: $ko"
  SERVEATTN_PREFILL_WS_KNOCKOUT=$([ "$ko" = none ] && echo "" || echo "$ko") \
    timeout 120 python3 scripts/probe_prefill.py --cases "$CASES" --kinds "$KINDS" 2>&1 | grep -v Warn
done
echo "== fp8 with a 3-stage K/V ring (SERVEATTN_PREFILL_WS_STAGES=3)"
SERVEATTN_PREFILL_WS_STAGES=3 timeout 120 python3 scripts/probe_prefill.py --cases "$CASES" --kinds fp8 2>&1 | grep -v Warn
