# session 15, final call: the whole GPU suite on the session's main, then bench prefill with every peer
TESTS_TIMEOUT=400 BENCH_TIMEOUT=200 scripts/gpu_run.sh env tests fi-setup bench-prefill > /dev/null 2>&1
grep -E "passed|failed" $OUT/gpu-tests.log | tail -3; grep -E "FAILED" $OUT/gpu-tests.log | head; grep "^| " $OUT/bench-prefill.log | head -10; cat $OUT/summary.txt
