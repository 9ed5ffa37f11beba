# session 15, call A: ring depth 2 vs 3 at 16x2048 (separate processes, alternating), host cost of run()
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for st in 2 3 2 3; do
  echo "== SERVEATTN_PREFILL_WS_STAGES=$st"
  SERVEATTN_PREFILL_WS_STAGES=$st timeout 90 python3 -m serveattn.bench prefill --cases 16x2048 --peers cudnn --passes 2 2>&1 | grep "^| 16x2048"
done 2>&1 | tee $OUT/stages-ab.txt
scripts/gpu_run.sh fi-setup probe-host > /dev/null 2>&1; cp out/probe-host.txt $OUT/ 2>/dev/null
timeout 90 python3 scripts/probe_host.py --prefill 2>&1 | grep -v "backend='auto'" > $OUT/host-prefill.txt
cat $OUT/probe-host.txt $OUT/host-prefill.txt | grep -v "backend='auto'" | head -40
