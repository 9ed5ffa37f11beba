# session 15, last call: does the probe's cache data (e4m3 values widened) make it faster than full bf16 values?
# Alternating processes; then the bench's 16x2048 row with 4 passes.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for r in 1 2; do
  for full in "" "--full-bf16"; do
    echo "== data ${full:-e4m3-widened}"
    timeout 50 python3 scripts/probe_prefill.py --cases 16x2048 --kinds bf16 $full 2>&1 | grep -v "backend='auto'"
  done
done 2>&1 | tee $OUT/probe-data.txt
timeout 70 python3 -m serveattn.bench prefill --cases 16x2048 --peers cudnn --passes 4 --json $OUT/b.json 2>&1 | grep "^| 16x2048" | tee $OUT/bench-4pass.txt
python3 -c "
import json; d=json.load(open('$OUT/b.json'))
for c in d['families']['prefill']['cases']:
    for k,r in c['runners'].items(): print(k, [round(x,4) for x in r.get('ms_runs',[])])" | tee -a $OUT/bench-4pass.txt
