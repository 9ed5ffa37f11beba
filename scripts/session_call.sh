export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv > $OUT/env.txt
timeout 240 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_gather.py tests/test_fast_launch_gpu.py tests/test_prefill_ws_gpu.py tests/test_prefill_ws.py tests/test_fp8_kv.py -rf 2>&1 | tail -25 > $OUT/tests.txt
tail -3 $OUT/tests.txt
#timeout 90 python3 scripts/probe_host.py --prefill 2>&1 | grep -v "backend='auto'" > $OUT/host.txt; cat $OUT/host.txt | head -12
SERVEATTN_PREFILL_GATHER=force timeout 100 python3 scripts/probe_prefill.py --cases 16x2048,1x8192 --kinds bf16,kv8 --profile 2>&1 | grep -v "backend='auto'\|Warn\|warn" > $OUT/profile.txt; cat $OUT/profile.txt
timeout 150 python3 scripts/probe_prefill.py --cases 16x2048,1x4096 --kinds bf16 --ab "SERVEATTN_PREFILL_GATHER=force;SERVEATTN_PREFILL_GATHER=0" --rounds 5 2>&1 | grep -v "backend='auto'" > $OUT/ab.txt; cat $OUT/ab.txt
