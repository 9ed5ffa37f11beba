#!/usr/bin/env bash
# Alternating processes of scripts/probe_prefill.py under settings of switches read at import (compile-time
# switches such as SERVEATTN_PREFILL_WS_KNOCKOUT or SERVEATTN_PREFILL_WS_STAGES), `rounds` times each, so clock
# drift between processes shows as spread instead of as a difference.
#
#   scripts/probe_env_ab.sh "SERVEATTN_PREFILL_WS_STAGES=2;SERVEATTN_PREFILL_WS_STAGES=3" [rounds] [probe args...]
set -u
cd "$(dirname "$0")/.."
SETTINGS=$1; ROUNDS=${2:-3}; shift; shift
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
IFS=';' read -ra LIST <<< "$SETTINGS"
for r in $(seq "$ROUNDS"); do
  for st in "${LIST[@]}"; do
    echo "== $st, round $r"
    env ${st//,/ } timeout 150 python3 scripts/probe_prefill.py "$@" 2>&1 | grep -v Warn
  done
done
