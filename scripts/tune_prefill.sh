#!/usr/bin/env bash
# Tile sweep for the prefill kernel on the GPU: one benchmark run per configuration (no peers).
# Usage: scripts/tune_prefill.sh "128,64,8,3 128,128,8,3 ..." [bench args]
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
CONFIGS=${1:-"128,64,8,3 128,128,8,3 128,64,4,3 128,128,8,2 128,64,8,4 64,64,4,3"}
shift || true
for c in $CONFIGS; do
  echo "== tiles $c"
  SERVEATTN_PREFILL_TILES=$c python3 -m serveattn.bench prefill --peers none "$@" 2>&1 \
    | grep -E '^\| (1x|16x)' | cut -d'|' -f2-6
done
