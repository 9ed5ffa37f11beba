#!/usr/bin/env bash
# Decode sweep on the GPU: tiles x minimum chunk, CUDA-graph replay of the bandwidth route, no peers.
# Usage: scripts/tune_decode.sh "16,128,4,3 16,64,4,4" "256 128" [bench args]
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
TILES=${1:-"16,128,4,3 16,64,4,4 16,64,4,3 16,128,8,3"}
CHUNKS=${2:-"256 128"}
shift 2 || true
for t in $TILES; do
  for c in $CHUNKS; do
    echo "== tiles $t min_chunk $c"
    SERVEATTN_DECODE_TILES=$t SERVEATTN_DECODE_MIN_CHUNK=$c python3 -m serveattn.bench decode --peers none \
      --ours cc-graph --passes 1 "$@" 2>&1 | grep -E '^\| [0-9]+x[0-9]+ \| cc' | cut -d'|' -f2-6
  done
done
