# session 15, call B: the producer's shared page rows (SERVEATTN_PREFILL_WS_SHARED_ROWS): GPU tests, then an A/B
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_prefill_ws_gpu.py tests/test_prefill_ws.py tests/test_fast_launch_gpu.py tests/test_prefill_gpu.py tests/test_gather.py -rf 2>&1 | tail -8 > $OUT/tests.txt
cat $OUT/tests.txt
timeout 200 python3 scripts/probe_prefill.py --cases 16x2048,1x8192,1x4096 --kinds bf16 --ab "SERVEATTN_PREFILL_WS_SHARED_ROWS=1;SERVEATTN_PREFILL_WS_SHARED_ROWS=0" --rounds 5 2>&1 | grep -v "backend='auto'" > $OUT/ab.txt; cat $OUT/ab.txt
