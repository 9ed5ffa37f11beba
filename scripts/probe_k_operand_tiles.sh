#!/usr/bin/env bash
# The bandwidth decode kernel's tiles with SERVEATTN_DECODE_K_OPERAND off and on (GPU; session 33): fp8 and bf16
# decode under each tile, two rounds, processes alternating. Run from the repository root: bash scripts/probe_k_operand_tiles.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
T="16,64,2,3;16,64,2,4;16,64,2,5;16,64,2,6;16,64,2,8;16,64,4,4;16,64,4,6;16,128,4,3;16,128,4,4"
for r in 1 2; do
  echo "== K_OPERAND=0 round $r"; SERVEATTN_DECODE_K_OPERAND=0 timeout 100 python3 scripts/probe_fp8.py --backend triton --cases 64x8192,128x4096,8x4096 --tiles "16,64,2,4;16,64,2,6"
  echo "== K_OPERAND=1 round $r"; SERVEATTN_DECODE_K_OPERAND=1 timeout 200 python3 scripts/probe_fp8.py --backend triton --cases 64x8192,128x4096,8x4096 --tiles "$T"
done
