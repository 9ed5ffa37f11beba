#!/usr/bin/env bash
# The one script to run on the H200 (the repository copied there, $OUT an output folder that comes back).
#
#   scripts/gpu_run.sh                       # env, GPU tests, prefill benchmark
#   scripts/gpu_run.sh tests                 # only the GPU tests
#   scripts/gpu_run.sh bench-prefill         # only the prefill benchmark
#   scripts/gpu_run.sh bench-decode          # only the decode benchmark (not in the default steps)
#   scripts/gpu_run.sh fi-setup bench-decode-ragged  # decode of ragged batches (bench decode --ragged): ours vs FlashInfer
#   scripts/gpu_run.sh bench-fp8             # only the fp8 benchmark (not in the default steps)
#   scripts/gpu_run.sh bench-crossover       # backend='auto' crossovers; writes $OUT/routing.md (copy to docs/)
#   scripts/gpu_run.sh bench-crossover-fp8   # the decode crossover for e4m3 / e5m2 caches; writes $OUT/routing-fp8.md
#   scripts/gpu_run.sh probe-fp8             # fp8 timings with each measuring switch on and off (~4 min)
#   scripts/gpu_run.sh probe-compile         # cold / warm first-call time of decode and prefill (~1-2 min)
#   scripts/gpu_run.sh probe-decode-tiles    # bf16 and fp8 bandwidth decode under candidate tiles, groups 1/4/8
#   scripts/gpu_run.sh probe-decode-split    # small-batch decode (eager and graph) under other split-KV targets
#   scripts/gpu_run.sh probe-decode-long     # 1-2 requests of 8K-32K keys: bandwidth kernel (split / merge settings) vs tensor-core route, compared (~1 min a setting)
#   scripts/gpu_run.sh bench-verify          # python -m serveattn.bench verify (chains, trees; ~1 min)
#   scripts/gpu_run.sh probe-ws-balance      # prefill's balanced persistent grid: its GPU tests, then causal crossover points off / on (~5 min)
#   scripts/gpu_run.sh probe-prefill-order   # prefill_kernel's tiles costliest first: its GPU tests, then head-dim-256 causal points off / on (~4 min)
#   scripts/gpu_run.sh probe-prefill-order-small  # the same under SERVEATTN_PREFILL_ORDER=cost-small (small batches only; ~5 min)
#   scripts/gpu_run.sh probe-decode-ragged   # ragged decode batches: request order unsplit vs the defaults (longest first, ragged split), eager and graph (~3 min)
#   scripts/gpu_run.sh probe-decode-ragged-tc  # the tensor-core decode route on ragged batches, SERVEATTN_PREFILL_RAGGED_SPLIT off / 2 (~3 min)
#   scripts/gpu_run.sh probe-chain-tiles     # chain verify k=8 (32-row bandwidth tiles) under candidate tiles
#   scripts/gpu_run.sh probe-fusion          # bf16/fp8 prefill with SERVEATTN_SOFTMAX_FMA / SERVEATTN_FP_FUSION
#   scripts/gpu_run.sh probe-gluon           # scripts/gluon_attention_probe.py --run: the Gluon async-wgmma probe
#   scripts/gpu_run.sh probe-decode-small-batch  # decode of one request: 7 stages against the usual tiles
#   scripts/gpu_run.sh probe-prefill-ws      # the warp-specialized prefill: its GPU tests, then an in-process A/B of the page copy and the persistent grid
#   scripts/gpu_run.sh probe-prefill-profile # paged vs ragged prefill: time per call and each kernel's device time (torch profiler)
#   scripts/gpu_run.sh probe-softmax-fma     # prefill GPU tests with SERVEATTN_SOFTMAX_FMA=1, then alternating processes 1/0
#   scripts/gpu_run.sh probe-fast-launch     # decode/prefill GPU tests with SERVEATTN_FAST_LAUNCH=1, then run() host us off/on (~6 min)
#   scripts/gpu_run.sh probe-fp8-key-order   # fp8 GPU tests with SERVEATTN_FP8_KEY_ORDER=1, then fp8 prefill 1/0 alternating (on since session 13)
#   scripts/gpu_run.sh fi-setup probe-host     # decode plan/run host us, ours and FlashInfer's, same process
#   scripts/gpu_run.sh probe-ws-trace          # warp-specialized prefill: a task's cycles by part (PROBE_ARGS: --cases, --kinds)
#   scripts/gpu_run.sh probe-flush             # the L2 flush: a plain read / copy and bench decode (FLUSH_CASES) under --flush zero / read (~1-2 min)
#   scripts/gpu_run.sh probe-table-warm        # 1x8192 / 8x4096 / 32x2048 decode, the plan's page table cold or warm in the L2 after a clean flush (~1 min)
#   scripts/gpu_run.sh probe-call-gap          # prefill calls: bench median vs kernels, host us a run(), syncs (PROBE_ARGS)
#   scripts/gpu_run.sh probe-decode-trace      # small-batch decode: a program's parts and the critical path (PROBE_ARGS)
#   scripts/gpu_run.sh probe-prefill-split     # split-KV on the prefill kernel, off / on, FlashInfer tc beside (carry .fi)
#   scripts/gpu_run.sh probe-batch-invariant   # vLLM's batch-invariant plans (fixed 2048 / 4096, disabled) against its ordinary ones
#   scripts/gpu_run.sh probe-k-operand         # decode GPU tests with SERVEATTN_DECODE_K_OPERAND=1, then fp8 / bf16 decode 0 vs 1
#   scripts/gpu_run.sh probe-off32             # fp8 / bf16 decode with SERVEATTN_KV_OFFSETS_32 0 vs 1, alternating processes (~3 min)
#   scripts/gpu_run.sh probe-f16-scores        # decode / fp8 GPU tests with SERVEATTN_DECODE_F16_SCORES=1, then fp8 / bf16 decode 0 vs 1 (~5 min)
#   scripts/gpu_run.sh probe-q-held            # decode GPU tests with SERVEATTN_DECODE_Q_HELD=1, then fp8 / bf16 decode 0 vs 1, HBM and L2 (~6 min)
#   scripts/gpu_run.sh probe-fold-call         # the fused fold called (default) / inlined: fp8 / bf16 decode at split shapes, then ragged batches (~5 min)
#   scripts/gpu_run.sh probe-one-item          # decode GPU tests, then SERVEATTN_DECODE_ONE_ITEM 0 / 1 at split shapes and ragged batches (~7 min)
#   scripts/gpu_run.sh probe-item-call         # decode GPU tests, then CUDA-graph bf16 decode SERVEATTN_DECODE_ITEM_CALL 1 / 0 at split shapes and ragged (~5 min)
#   scripts/gpu_run.sh probe-pending           # next/pending: decode / split GPU tests, small ragged batches' split new vs even, the graph fold rule (~6-8 min)
#   scripts/gpu_run.sh probe-small-merge       # the fold of small ragged batches (4-16 requests): auto vs fused vs merge_kernel a query head (~4 min)
#   scripts/gpu_run.sh probe-merge-rule        # decode.merge_kind re-read under the called fold: FUSED_MERGE auto / 0 / heads at split shapes, then ragged (~5 min)
#   scripts/gpu_run.sh probe-ncu-decode        # Nsight Compute on decode (fp8 / bf16, HBM / L2): details and stall summaries (NCU_CASES)
#   scripts/gpu_run.sh probe-fp8-hot-l2       # fp8 decode with the cache in the L2 (an H100 made compute-bound), defaults vs HOT_L2_SETTING (~1 min)
#   scripts/gpu_run.sh probe-prefill-off32     # prefill_kernel GPU tests with SERVEATTN_PREFILL_KV_OFFSETS_32=1, then tensor-core decode / prefill_kernel 0 vs 1 (~7 min)
#   scripts/gpu_run.sh probe-prefill-off32-rows  # the same offsets for prefill tiles only (MIN_ROWS=64) vs off and all (~5 min)
#   scripts/gpu_run.sh probe-fp8-split         # fp8-KV decode at large batches split into more programs (fixed_split_size x stages)
#   scripts/gpu_run.sh probe-widen             # fp8 GPU tests under SERVEATTN_FAST_WIDEN=3, then fp8 decode / kv8 prefill 1 vs 3
#   scripts/gpu_run.sh fuzz                    # fuzz.py --device cuda: FUZZ_SECONDS (240) from seed FUZZ_START (0), FUZZ_SCALE (1)
#   scripts/gpu_run.sh fi-setup fi-warm bench-prefill fi-save-cache  # FlashInfer as a peer in the same process (carry .fi)
#   scripts/gpu_run.sh env bench-prefill-quick
#   BENCH_ARGS="--peers flash,cudnn --measure-ceilings" scripts/gpu_run.sh bench-prefill
#
# Steps: env (GPU, versions), tests (the whole suite on the GPU: the grid at CUDA, plus the @gpu tests), bench-prefill (python -m serveattn.bench prefill),
# bench-prefill-quick (the same with --quick), bench-decode (python -m serveattn.bench decode), bench-decode-quick
# (the same with --quick), bench-fp8 (python -m serveattn.bench fp8), bench-fp8-quick (the same with --quick);
# BENCH_ARGS goes to every bench step. No network there: the package runs from PYTHONPATH, nothing is installed.
# Every step runs under `timeout` (TESTS_TIMEOUT, BENCH_TIMEOUT seconds) so the whole call stays well under the
# 10-minute limit; a failing step does not stop the next one, and the exit codes of all steps are printed at the end
# (and written to $OUT/summary.txt). Exit status: 0 only if every step passed.
set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
TESTS_TIMEOUT=${TESTS_TIMEOUT:-420}  # the whole suite: ~350 s with 16 workers (sessions 9, 10); cold Triton cache
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
BENCH_ARGS=${BENCH_ARGS:-}

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env tests bench-prefill)

declare -A RC=()
T0=$SECONDS

step_env() {
  {
    echo "== env ($(date -u +%FT%TZ), $(hostname))"
    nvidia-smi -L
    # Read-only query of the card's state as found (never change clocks, power, modes).
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,utilization.gpu \
      --format=csv
    python3 - <<'EOF'
import platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as e:
    print("torch: import failed:", e)
for mod in ("triton", "numpy", "pytest", "hypothesis", "tqdm", "flashinfer"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "not importable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
EOF
  } 2>&1 | tee "$OUT/env.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_fp8_key_order() {  # next/fp8-p-permute: fp8 P handed to P.V in the accumulator's key order
  {
    # the warp-specialized fp8 tests assert bitwise prefill_kernel's result: with the switch the two sum P.V's
    # keys in different orders inside a wgmma's 32-key chunk, so a failure there says the tensor cores round
    # by order (then those tests compare accuracy instead); test_fp8_attention.py must pass as it is
    SERVEATTN_FP8_KEY_ORDER=1 timeout 240 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill_ws_gpu.py \
      tests/test_fp8_attention.py tests/test_fp8_kv.py 2>&1 | grep -v Warning | tail -25
    for f in 1 0 1 0; do  # a module constant: one process per setting
      echo "== SERVEATTN_FP8_KEY_ORDER=$f"
      SERVEATTN_FP8_KEY_ORDER=$f timeout 80 python3 scripts/probe_prefill.py --cases 1x4096,1x8192,1x16384,16x2048 \
        --kinds fp8
    done
    for f in 1 0; do  # session 13: the first run lost 50-420 us a call with the switch on; which kernel
      echo "== SERVEATTN_FP8_KEY_ORDER=$f, kernel device times"
      SERVEATTN_FP8_KEY_ORDER=$f timeout 80 python3 scripts/probe_prefill.py --cases 1x4096,16x2048 --kinds fp8 --profile
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-fp8-key-order.txt"
  return "${PIPESTATUS[0]}"
}

FI_SITE=/tmp/fi-site  # FlashInfer unpacked here (fi-setup)
FI_WS=/tmp/fi-ws      # FLASHINFER_WORKSPACE_BASE: its JIT cache, <FI_WS>/.cache/flashinfer/<version>/<arch>/cached_ops

step_fi_setup() {  # FlashInfer 0.7.2 as a peer: .fi from ../shared/tools/flashinfer-bundle.sh (git-ignored; name
  # .fi in the device tool's carry). Exports stay for the later steps of this call. FlashInfer compiles each kernel
  # configuration at its first use (12 s to 2 min on the H200): the benches do that in their untimed first call;
  # fi-save-cache brings the compiled modules back, and a carried .fi/fi-jit-cache*.tgz is unpacked here.
  if [ ! -f .fi/fi.tgz ]; then
    echo "fi-setup: .fi/fi.tgz is not here: run ../shared/tools/flashinfer-bundle.sh at the repository root and carry .fi"
    return 1
  fi
  mkdir -p "$FI_SITE" "$FI_WS" && tar xzf .fi/fi.tgz -C "$FI_SITE" \
    && python3 -m pip install -q --no-index --no-deps --target "$FI_SITE" .fi/apache_tvm_ffi-*.whl || return 1
  # A carried cache's modules go where FlashInfer looks for ahead-of-time builds (<package>/data/aot/<name>/
  # <name>.so): its JIT path would hand a bare .so to ninja, which rebuilds without the object files (session 13:
  # fa3 prefill compiled again, 85 s).
  local f so name
  for f in .fi/fi-jit-cache*.tgz; do
    [ -f "$f" ] || continue
    tar xzf "$f" -C "$FI_WS" || return 1
    while IFS= read -r so; do
      name=$(basename "$so" .so)
      mkdir -p "$FI_SITE/flashinfer/data/aot/$name" && cp "$so" "$FI_SITE/flashinfer/data/aot/$name/" || return 1
      echo "fi-setup: $name from $f"
    done < <(find "$FI_WS/.cache" -name "*.so")
  done
  export PYTHONPATH="$FI_SITE:$PYTHONPATH" FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE="$FI_WS"
  python3 -c "import flashinfer; print('fi-setup: flashinfer', flashinfer.__version__, flashinfer.__file__)"
}

step_probe_host() {  # decode plan()/run() host us (and FlashInfer's, after fi-setup), the bare launch, staging
  timeout "${PROBE_HOST_TIMEOUT:-90}" python3 scripts/probe_host.py ${PROBE_HOST_ARGS:-} 2>&1 | tee "$OUT/probe-host.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_host_prefill() {  # prefill run() host us against its GPU time and the bare launch (PROBE_HOST_ARGS: --profile)
  timeout "${PROBE_HOST_TIMEOUT:-120}" python3 scripts/probe_host.py --prefill ${PROBE_HOST_ARGS:-} 2>&1 | tee "$OUT/probe-host-prefill.txt"
  return "${PIPESTATUS[0]}"
}

step_fuzz() {  # the differential fuzzer on the GPU: the compiled kernels, fast launch, replays, Gluon, cuDNN routes
  # --time-limit stops starting cases; the timeout's margin lets the last case (and a cold Triton compile) finish
  local seconds=${FUZZ_SECONDS:-240}
  timeout -k 10 $((seconds + 120)) python3 scripts/fuzz.py --device cuda --family all --time-limit "$seconds" \
    --start "${FUZZ_START:-0}" --seeds 1000000 --scale "${FUZZ_SCALE:-1}" 2>&1 | tee "$OUT/fuzz.txt"
  return "${PIPESTATUS[0]}"  # fuzz.py exits 1 when any case failed
}

step_probe_flush() {  # the L2 flush's part in small calls: a plain read / copy, then bench decode under both flushes
  local rc=0 f
  timeout "${PROBE_TIMEOUT:-90}" python3 scripts/probe_flush.py 2>&1 | grep -v "Warn\|warn" | tee "$OUT/probe-flush.txt"
  for f in zero read; do
    timeout "$BENCH_TIMEOUT" python3 -m serveattn.bench decode --flush "$f" --cases "${FLUSH_CASES:-1x8192,8x4096,32x2048,64x1024}" \
      --peers "${FLUSH_PEERS:-cudnn,cudnn-graph}" --ours cc,cc-graph $BENCH_ARGS --json "$OUT/bench-decode-flush-$f.json" \
      > "$OUT/bench-decode-flush-$f.log" 2>&1 || rc=1
    grep -A10 "^| case | ours | ms" "$OUT/bench-decode-flush-$f.log"
  done
  return $rc
}

step_probe_table_warm() {  # small decode steps: the plan's page table in the L2 after the flush or not (PROBE_ARGS)
  timeout "${PROBE_TIMEOUT:-150}" python3 scripts/probe_table_warm.py ${PROBE_ARGS:-} 2>&1 | grep -v "Warn\|warn" \
    | tee "$OUT/probe-table-warm.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_call_gap() {  # prefill: a call's time besides its kernels, the host's us a run(), syncs (per route)
  PYTHONPATH="$ROOT/scripts:$PYTHONPATH" timeout "${PROBE_TIMEOUT:-150}" python3 scripts/probe_call_gap.py ${PROBE_ARGS:-} 2>&1 \
    | grep -v "Warn\|warn" | tee "$OUT/probe-call-gap.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_decode_trace() {  # small-batch decode: SERVEATTN_DECODE_TRACE stamps (PROBE_ARGS: --cases, --calls, --save)
  timeout "${PROBE_TIMEOUT:-150}" python3 scripts/probe_decode_trace.py ${PROBE_ARGS:-} 2>&1 | grep -v "Warn\|warn" \
    | tee "$OUT/probe-decode-trace.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_ws_trace() {  # warp-specialized prefill: where a task's cycles go (SERVEATTN_PREFILL_WS_TRACE stamps)
  PYTHONPATH="$ROOT/scripts:$PYTHONPATH" timeout "${PROBE_TIMEOUT:-150}" python3 scripts/probe_ws_trace.py ${PROBE_ARGS:-} 2>&1 \
    | grep -v "Warn\|warn_once" | tee "$OUT/probe-ws-trace.txt"
  return "${PIPESTATUS[0]}"
}

step_fi_warm() {  # FlashInfer's bench configurations compiled side by side (scripts/fi_warm.py; FI_WARM_CONFIGS picks), after fi-setup
  timeout "${FI_WARM_TIMEOUT:-300}" python3 scripts/fi_warm.py ${FI_WARM_CONFIGS:+--configs "$FI_WARM_CONFIGS"} 2>&1 | grep -v "^ *warn\|Warning" | tail -40 \
    | tee "$OUT/fi-warm.txt"
  return "${PIPESTATUS[0]}"
}

step_fi_save_cache() {  # the compiled FlashInfer modules (.so only) as $OUT/fi-jit-cache-N.tgz, 15 MB pieces
  local cache="$FI_WS/.cache"
  if [ ! -d "$cache" ]; then echo "fi-save-cache: no FlashInfer JIT cache under $FI_WS"; return 1; fi
  (cd "$FI_WS" && find .cache -name "*.so" -print0 | tar czf /tmp/fi-jit-cache.tgz --null -T -) || return 1
  split -b 15m -d /tmp/fi-jit-cache.tgz /tmp/fi-jit-cache.part || return 1
  local part n=0
  for part in /tmp/fi-jit-cache.part*; do cp "$part" "$OUT/fi-jit-cache-$n.part"; n=$((n + 1)); done
  ls -la "$OUT"/fi-jit-cache-*.part
  echo "fi-save-cache: here: cat fi-jit-cache-*.part > .fi/fi-jit-cache.tgz (carried with .fi, under 64 MiB in all)"
}

step_tests() {
  echo "== tests: pytest, whole suite on the GPU (timeout ${TESTS_TIMEOUT}s)"
  if ! python3 -c "import pytest" 2>/dev/null; then
    echo "pytest is not importable on this machine; GPU tests not run." | tee "$OUT/gpu-tests.log"
    return 127
  fi
  # -v names every result as it lands: a run cut by its timeout still shows which tests failed.
  timeout -k 10 "$TESTS_TIMEOUT" python3 -m pytest tests -v --tb=line -rf --durations=40 -n ${TEST_WORKERS:-16} -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 \
    | tee "$OUT/gpu-tests.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "tests: stopped by the ${TESTS_TIMEOUT}s timeout"
  if [ "$rc" -eq 1 ]; then
    # On a 78 GiB H100, 16 workers' float64 references can run the card out of memory (session 31: 5-7 tests, all
    # passing alone): those failures run again on 3 workers; the step passes if they all pass and nothing else failed.
    local oom others
    oom=$(python3 scripts/oom_failures.py "$OUT/gpu-tests.xml"); others=$?
    if [ -n "$oom" ]; then
      echo "== tests: $(echo $oom | wc -w) failures were CUDA out of memory; rerunning them on 3 workers" \
        | tee -a "$OUT/gpu-tests.log"
      set -f  # the ids' [params] are not globs
      # shellcheck disable=SC2086
      timeout -k 10 "${OOM_RERUN_TIMEOUT:-240}" python3 -m pytest $oom -q --tb=line -n 3 -p no:cacheprovider 2>&1 \
        | tee -a "$OUT/gpu-tests.log" | tail -5
      rc=${PIPESTATUS[0]}
      set +f
      if [ "$others" -ne 0 ]; then
        echo "== tests: other failures stand (not out of memory): step fails" | tee -a "$OUT/gpu-tests.log"
        rc=1
      fi
    fi
  fi
  return "$rc"
}

step_probe_fp8() {  # fp8 A/B timings: every measuring switch of kernels/common.py and prefill.transposed_v
  {
    for widen in 1 2 0; do
      SERVEATTN_FAST_WIDEN=$widen timeout 90 python3 scripts/probe_fp8.py --cases 64x8192,128x4096,8x4096
    done
    timeout 120 python3 scripts/probe_prefill.py --cases 1x4096,1x8192,1x16384 --kinds bf16,kv8,fp8
    SERVEATTN_FP8_VT=0 timeout 90 python3 scripts/probe_prefill.py --cases 1x8192 --kinds fp8
    SERVEATTN_FP8_VT=0 SERVEATTN_EARLY_V=0 timeout 90 python3 scripts/probe_prefill.py --cases 1x8192 --kinds fp8
    SERVEATTN_FAST_WIDEN=0 timeout 90 python3 scripts/probe_prefill.py --cases 1x8192 --kinds kv8
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-fp8.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_compile() {  # cold / warm first call in fresh processes (scripts/probe_compile.py)
  timeout 300 python3 scripts/probe_compile.py 2>&1 | tee "$OUT/probe-compile.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_decode_tiles() {  # the bandwidth decode kernel (backend triton) under candidate tiles, per group
  local tiles="16,128,4,3;16,128,4,5;16,64,2,4;16,64,2,6;16,64,4,4"
  {
    for kv_heads in 32 8 4; do
      timeout 150 python3 scripts/probe_fp8.py --backend triton --kv-heads $kv_heads \
        --cases 64x8192,128x4096,8x4096,1x8192 --tiles "$tiles"
    done
    # the tensor-core route (prefill kernel, 16-row tiles for group 4), where an fp8 cache is 0.6-0.7x bf16
    timeout 150 python3 scripts/probe_fp8.py --backend triton --tc --cases 64x8192,8x4096,1x8192 \
      --tiles "16,128,4,2;16,128,4,4;16,64,4,4;16,64,2,6"
  } 2>&1 | tee "$OUT/probe-decode-tiles.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_decode_split() {  # split-KV at small batch under other split settings (bandwidth kernel)
  # SPLIT_SETTINGS: ";"-separated settings, each a space-separated list of VAR=value (one bench process each,
  # SPLIT_ROUNDS times in turn); SPLIT_CASES: the bench's --cases.
  local settings=${SPLIT_SETTINGS:-"SERVEATTN_DECODE_MIN_CHUNK=128;SERVEATTN_DECODE_MIN_CHUNK=256;SERVEATTN_DECODE_MIN_CHUNK=512"}
  local cases=${SPLIT_CASES:-1x8192,8x4096,32x2048}
  local list st r
  IFS=';' read -ra list <<< "$settings"
  {
    for r in $(seq "${SPLIT_ROUNDS:-1}"); do
      for st in "${list[@]}"; do
        echo "== $st (round $r)"
        env $st timeout 120 python3 -m serveattn.bench decode --cases "$cases" --peers cudnn-graph \
          --ours cc,cc-graph --passes 1
      done
    done
  } 2>&1 | grep -E "^==|^\| " | tee "$OUT/probe-decode-split.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_decode_long() {  # one or two long requests: the bandwidth kernel (under each setting) vs the tensor-core route
  # LONG_SETTINGS: ";"-separated settings, each a space-separated list of VAR=value (one crossover process each);
  # "-" is today's rule. The tensor-core route's column is the same kernel in every process: the yardstick.
  # Default: today's rule against session 34's (no slot cap, every fold fused). LONG_BATCHES / LONG_KV_LENS /
  # LONG_GROUPS widen the points.
  local settings=${LONG_SETTINGS:-"-;SERVEATTN_DECODE_MAX_SLOTS=0 SERVEATTN_DECODE_FUSED_MERGE=1"}
  local list st i=0 rc=0
  IFS=';' read -ra list <<< "$settings"
  {
    for st in "${list[@]}"; do
      i=$((i + 1))
      echo "== $st"
      [ "$st" = "-" ] && st=""
      env $st timeout 150 python3 -m serveattn.bench crossover --pairs decode-tc --dtypes bfloat16,float8_e4m3fn \
        --groups "${LONG_GROUPS:-1,4,8}" --decode-batches "${LONG_BATCHES:-1,2}" \
        --decode-kv-lens "${LONG_KV_LENS:-8192,16384,32768}" --no-write \
        --json "$OUT/probe-decode-long-$i.json" || rc=$?
    done
    [ "$rc" = 0 ]
  } 2>&1 | grep -E "^==|^\| (bfloat16|float8)" | tee "$OUT/probe-decode-long.txt"
  rc=${PIPESTATUS[0]}
  # the settings side by side: bandwidth / tensor-core per point and setting, the best and its gain
  python3 scripts/compare_decode_long.py "--settings=$settings" \
    $(for j in $(seq "${#list[@]}"); do echo "$OUT/probe-decode-long-$j.json"; done) | tee "$OUT/probe-decode-long-compare.md"
  # one archive: the device tool brings back a handful of files a call (session 35 lost the sixth JSON)
  (cd "$OUT" && tar czf probe-decode-long-json.tgz probe-decode-long-*.json && rm -f probe-decode-long-*.json)
  return "$rc"
}

prefill_switch_probe() {  # $1 name, $2 a switch read at plan time, $3 its off value, $4 its on value, $5 test files,
  # $6 crossover point options: the tests under the switch on, then the crossover's causal prefill points off and
  # on (cuDNN the yardstick in both), side by side in $OUT/$1-compare.md
  local name=$1 var=$2 off=$3 on=$4 rc=0 value
  # shellcheck disable=SC2086
  env "$var=$on" timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider $5 2>&1 | tail -3 | tee "$OUT/$name-tests.txt"
  rc=${PIPESTATUS[0]}
  for value in "$off" "$on"; do
    echo "== $var=$value"
    # shellcheck disable=SC2086
    env "$var=$value" timeout 240 python3 -m serveattn.bench crossover --pairs prefill-cudnn $6 --causal-modes causal \
      --no-write --json "$OUT/$name-$([ "$value" = "$on" ] && echo on || echo off).json" 2>&1 \
      | grep -E "^\| (bfloat16|float16)" || rc=1
  done
  python3 scripts/compare_prefill_grid.py "$OUT/$name-off.json" "$OUT/$name-on.json" | tee "$OUT/$name-compare.md"
  (cd "$OUT" && tar czf "$name-json.tgz" "$name-off.json" "$name-on.json" && rm -f "$name-off.json" "$name-on.json")
  return "$rc"
}

step_probe_ws_balance() {  # the warp-specialized prefill's balanced persistent grid (SERVEATTN_PREFILL_WS_BALANCE=1)
  prefill_switch_probe probe-ws-balance SERVEATTN_PREFILL_WS_BALANCE 0 1 \
    "tests/test_prefill_ws_gpu.py tests/test_prefill_gpu.py tests/test_batch_invariance_gpu.py" \
    "--groups ${BAL_GROUPS:-1,4,8} --prefill-batches ${BAL_BATCHES:-8,16} --seq-lens ${BAL_SEQ_LENS:-512,1024,2048,4096}"
}

step_probe_prefill_order() {  # prefill_kernel's eager tiles costliest first (SERVEATTN_PREFILL_ORDER=cost), at head dim
  # 256 (prefill_kernel's, not the warp-specialized kernel's)
  prefill_switch_probe probe-prefill-order SERVEATTN_PREFILL_ORDER "" cost \
    "tests/test_prefill_order.py tests/test_prefill_gpu.py tests/test_batch_invariance_gpu.py" \
    "--head-dims ${ORDER_HEAD_DIMS:-256} --groups ${ORDER_GROUPS:-1,4} --prefill-batches ${ORDER_BATCHES:-8,16} --seq-lens ${ORDER_SEQ_LENS:-512,1024,2048}"
}

step_probe_prefill_order_small() {  # the same, costliest first only under prefill.ORDER_COST_MAX_BYTES (=cost-small):
  # group 2 (Gemma's) added to session 36's points
  prefill_switch_probe probe-prefill-order-small SERVEATTN_PREFILL_ORDER "" cost-small \
    "tests/test_prefill_order.py tests/test_prefill_gpu.py" \
    "--head-dims 256 --groups ${ORDER_GROUPS:-1,2,4} --prefill-batches ${ORDER_BATCHES:-8,16} --seq-lens ${ORDER_SEQ_LENS:-512,1024,2048}"
}

step_probe_decode_ragged_tc() {  # the tensor-core decode route on ragged batches: SERVEATTN_PREFILL_RAGGED_SPLIT off / 2
  local rc
  SERVEATTN_PREFILL_RAGGED_SPLIT=2 timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_prefill_split.py \
    tests/test_decode_gpu.py tests/test_verify_gpu.py 2>&1 | tail -3 | tee "$OUT/probe-decode-ragged-tc-tests.txt"
  rc=${PIPESTATUS[0]}
  timeout 300 python3 scripts/probe_decode_ragged.py --tensor-cores --rounds 2 \
    --variants "off=;split=SERVEATTN_PREFILL_RAGGED_SPLIT:2" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe-decode-ragged-tc.md" \
    | grep -E "^\|" || rc=1
  return "$rc"
}

step_probe_decode_ragged() {  # ragged decode batches: request order unsplit against the defaults (longest first, ragged split)
  local rc
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_decode.py \
    tests/test_decode_gpu.py tests/test_batch_invariance_gpu.py 2>&1 | tail -3 | tee "$OUT/probe-decode-ragged-tests.txt"
  rc=${PIPESTATUS[0]}
  timeout 300 python3 scripts/probe_decode_ragged.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe-decode-ragged.md" \
    | grep -E "^\|" || rc=1
  return "$rc"
}

step_probe_chain_tiles() {  # chains of 8 drafts x group 4 = 32 rows: the bandwidth kernel's 32-row tiles
  # (the override moves k=1 to the same tiles, so compare the k=8 rows across configurations, not the ratios)
  {
    for t in 32,64,4,4 32,64,4,6 32,128,4,3 32,64,8,4 32,32,4,6; do
      echo "== SERVEATTN_DECODE_TILES=$t"
      SERVEATTN_DECODE_TILES=$t timeout 45 python3 -m serveattn.bench verify --chains 1,8 --trees none \
        --forms graph --verify-peers none --passes 1
    done
  } 2>&1 | grep -E "^==|^\| k=(1|8) \| cc-graph" | tee "$OUT/probe-chain-tiles.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_fusion() {  # what the no-contraction contract costs: explicit fma, then ptxas fusion (bits differ)
  {
    for e in SERVEATTN_SOFTMAX_FMA=0 SERVEATTN_SOFTMAX_FMA=1 SERVEATTN_FP_FUSION=1; do
      echo "== $e"
      env $e timeout 60 python3 scripts/probe_prefill.py --cases 1x8192,1x16384 --kinds bf16,fp8
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-fusion.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_gluon() {  # the Gluon attention probe (async wgmma overlap): correct? as fast as our Triton kernel?
  {
    for t in "--block-m 128 --block-n 64 --warps 8" "--block-m 128 --block-n 128 --warps 8"; do
      echo "== $t"
      timeout 90 python3 scripts/gluon_attention_probe.py --run --seq 8192 $t
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-gluon.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_prefill_ws() {  # the warp-specialized prefill kernel: right (its GPU tests), then A/B of its switches
  {
    timeout 200 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill_ws_gpu.py tests/test_fp8_attention.py \
      tests/test_gather.py 2>&1 | grep -v Warning | tail -25
    # settings timed in turn in one process (absolute rates drift between calls; ratios within one hold)
    local cases=1x4096,1x8192,1x16384,16x2048 g=SERVEATTN_PREFILL_GATHER p=SERVEATTN_PREFILL_WS_PERSISTENT
    timeout 120 python3 scripts/probe_prefill.py --cases "$cases" --kinds bf16 --ab "$g=1,$p=1;$g=0,$p=1;$g=1,$p=0" --rounds 3
    SERVEATTN_PREFILL_WS_FP8=1 timeout 90 python3 scripts/probe_prefill.py --cases "$cases" --kinds fp8
    SERVEATTN_PREFILL_WS=0 timeout 90 python3 scripts/probe_prefill.py --cases "$cases" --kinds bf16,fp8
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-prefill-ws.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_decode_small_batch() {  # decode.SMALL_BATCH (7 stages for one request) against the usual tiles
  {
    timeout 200 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode_gpu.py tests/test_decode.py \
      tests/test_fp8_kv.py -k "decode" 2>&1 | grep -v Warning | tail -15
    for sb in 1 0 1 0; do
      echo "== SERVEATTN_DECODE_SMALL_BATCH=$sb"
      SERVEATTN_DECODE_SMALL_BATCH=$sb timeout 100 python3 -m serveattn.bench decode --cases 1x8192,8x4096 \
        --peers cudnn --ours cc,cc-graph --passes 2
    done
  } 2>&1 | grep -E "^==|^\| (1|8)x|passed|failed" | tee "$OUT/probe-decode-small-batch.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_prefill_profile() {  # paged (page copy + ragged kernel) against ragged: where the gap goes
  timeout 120 python3 scripts/probe_prefill_profile.py --cases 16x2048,1x8192 2>&1 | grep -v "backend='auto'" \
    | tee "$OUT/probe-prefill-profile.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_softmax_fma() {  # scale and row max in one fma, in both prefill kernels (bits change, both alike)
  {
    SERVEATTN_SOFTMAX_FMA=1 timeout 240 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill_ws_gpu.py \
      tests/test_fp8_attention.py tests/test_prefill_gpu.py tests/test_prefill.py 2>&1 | grep -v Warning | tail -15
    for f in 1 0 1 0; do  # a module constant: one process per setting, alternating
      echo "== SERVEATTN_SOFTMAX_FMA=$f"
      # bf16: the warp-specialized kernel; fp8: prefill_kernel, then fp8 on the warp-specialized kernel
      SERVEATTN_SOFTMAX_FMA=$f timeout 80 python3 scripts/probe_prefill.py --cases 1x8192,1x16384,16x2048 --kinds bf16,fp8
      SERVEATTN_SOFTMAX_FMA=$f SERVEATTN_PREFILL_WS_FP8=1 timeout 80 python3 scripts/probe_prefill.py \
        --cases 1x8192,1x16384,16x2048 --kinds fp8
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-softmax-fma.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_fast_launch() {  # kernels/launch.py's fast path: bitwise Triton's launch path, then host time off/on
  {  # a subshell (the pipeline): exit with 1 if the tests or the probe failed
    rc=0
    echo "== GPU tests with SERVEATTN_FAST_LAUNCH=1 (test_fast_launch_gpu.py flips it per call itself)"
    SERVEATTN_FAST_LAUNCH=1 timeout 330 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_fast_launch_gpu.py \
      tests/test_fast_launch.py tests/test_decode_gpu.py tests/test_prefill_ws_gpu.py tests/test_prefill_gpu.py \
      > "$OUT/probe-fast-launch-tests.log" 2>&1 || rc=1
    grep -v Warning "$OUT/probe-fast-launch-tests.log" | tail -25
    echo "== run() host us, fast launch off/on alternating in one process, then cProfile of the fast path"
    timeout 180 python3 scripts/probe_host.py --fast-launch-ab --rounds 7 --profile || rc=1
    exit $rc
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-fast-launch.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_prefill_split() {  # split-KV on the prefill kernel: SERVEATTN_PREFILL_SPLIT=0/1 in turn (PROBE_ARGS: --cases)
  PYTHONPATH="$ROOT/scripts:$PYTHONPATH" timeout "${PROBE_TIMEOUT:-240}" python3 scripts/probe_prefill_split.py ${PROBE_ARGS:-} \
    2>&1 | grep -v "Warn\|warn" | tee "$OUT/probe-prefill-split.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_widen() {  # fp8 -> bf16 through fp16/fp32 (SERVEATTN_FAST_WIDEN=3, the default since session 28) against the integer
  # path (1): its GPU tests first (every code, fp8 = dequantized on every route), then alternating processes
  {
    if [ "${PROBE_TESTS:-1}" = 1 ]; then  # PROBE_TESTS=0: the tests step ran them this session
      SERVEATTN_FAST_WIDEN=3 timeout 300 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_fp8_kv.py \
        tests/test_gather.py tests/test_verify_gpu.py tests/test_decode_gpu.py
    fi
    for round in 1 2; do
      for widen in 1 3; do
        echo "== SERVEATTN_FAST_WIDEN=$widen, round $round"
        SERVEATTN_FAST_WIDEN=$widen timeout 90 python3 scripts/probe_fp8.py --cases 64x8192,128x4096,8x4096
        SERVEATTN_FAST_WIDEN=$widen timeout 120 python3 scripts/probe_prefill.py --cases 1x4096,16x2048 --kinds kv8 \
          --profile
      done
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-widen.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_k_operand() {  # fp8 K widened in the mma operand (common.K_OPERAND): bitwise tests, then 0/1 alternating
  {
    if [ "${PROBE_TESTS:-1}" = 1 ]; then
      SERVEATTN_DECODE_K_OPERAND=1 timeout 300 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_fp8_kv.py \
        tests/test_decode_gpu.py tests/test_verify_gpu.py tests/test_decode.py
    fi
    for round in 1 2; do
      for k_operand in 0 1; do
        echo "== SERVEATTN_DECODE_K_OPERAND=$k_operand, round $round"
        SERVEATTN_DECODE_K_OPERAND=$k_operand timeout 90 python3 scripts/probe_fp8.py --backend triton \
          --cases 64x8192,128x4096,8x4096,1x8192
      done
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-k-operand.txt"
  return "${PIPESTATUS[0]}"
}

ab_decode() {  # fp8 / bf16 decode (probe_fp8.py, bandwidth route) with switch $1 at 0 and 1 in alternating
  # processes, AB_ROUNDS rounds (2)
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for value in 0 1; do
      echo "== $1=$value, round $round"
      env "$1=$value" timeout 90 python3 scripts/probe_fp8.py --backend triton \
        --cases ${PROBE_CASES:-64x8192,128x4096,8x4096,1x8192}
    done
  done
}

step_probe_off32() {  # int32 K/V offsets in the decode kernel (SERVEATTN_KV_OFFSETS_32, on by default since
  # session 37): fp8 / bf16 decode off / on
  ab_decode SERVEATTN_KV_OFFSETS_32 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-off32.txt"
  return "${PIPESTATUS[0]}"
}

probe_decode_switch() {  # the decode GPU tests with switch $1=1 (SWITCH_TEST_WORKERS, 8: 16 ran a verify test out of
  # memory on an H100, session 38; SWITCH_TESTS_TIMEOUT, 240 s), then fp8 / bf16 decode 0 / 1 (ab_decode); the
  # output in $OUT/$2.txt
  {
    if [ "${PROBE_TESTS:-1}" = 1 ]; then
      env "$1=1" timeout "${SWITCH_TESTS_TIMEOUT:-240}" python3 -m pytest -q -n "${SWITCH_TEST_WORKERS:-8}" \
        -p no:cacheprovider tests/test_fp8_kv.py tests/test_decode_gpu.py tests/test_verify_gpu.py \
        tests/test_decode.py tests/test_batch_invariance_gpu.py 2>&1 | tail -5
    fi
    ab_decode "$1"
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/$2.txt"
  return "${PIPESTATUS[0]}"
}

# q.K^T in f16 for fp8 caches under a bf16 query (SERVEATTN_DECODE_F16_SCORES; the fp8 tests assert the dequantized
# run's bits)
step_probe_f16_scores() { probe_decode_switch SERVEATTN_DECODE_F16_SCORES probe-f16-scores; }

# q's operand held in registers over the decode KV loop (SERVEATTN_DECODE_Q_HELD): its GPU tests (the bits against
# the default's, the fp8 contract), fp8 / bf16 decode 0 / 1 on HBM, then with the cache in the L2 (the H200's fp8
# regime on any card)
step_probe_q_held() {
  probe_decode_switch SERVEATTN_DECODE_Q_HELD probe-q-held || return $?
  HOT_L2_SETTING=SERVEATTN_DECODE_Q_HELD=1 step_probe_fp8_hot_l2
}

ragged_fp8_bf16() {  # probe_decode_ragged.py on fp8 and bf16 caches (groups 4 / 8, 32 / 64 requests, two rounds)
  # under the variants $1
  local dtype
  for dtype in float8_e4m3fn bfloat16; do
    timeout 120 python3 scripts/probe_decode_ragged.py --kv-dtype $dtype --groups 4,8 --batches 32,64 --rounds 2 \
      --variants "$1"
  done
}

# the fused fold called or inlined (SERVEATTN_DECODE_FOLD_CALL, on by default since session 44, H100-measured): fp8 /
# bf16 decode 0 / 1 at shapes whose plans split and fold through the fused kernel (1x8192, 8x4096, 32x2048) and one
# that does not (64x8192), alternating processes; then ragged fp8 and bf16 batches, the fold inlined and through
# merge_kernel against the default
step_probe_fold_call() {
  {
    PROBE_CASES=${PROBE_CASES:-1x8192,8x4096,32x2048,64x8192} ab_decode SERVEATTN_DECODE_FOLD_CALL
    ragged_fp8_bf16 "call=;inline=decode.FOLD_CALL:0;kv_heads=decode.MERGE_MODE:0"
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-fold-call.txt"
  return "${PIPESTATUS[0]}"
}

# eager decode grids without the loop over the work list (SERVEATTN_DECODE_ONE_ITEM, on by default since session 49):
# the decode GPU tests, fp8 / bf16 decode 0 / 1 at shapes whose plans split and fold (1x8192, 8x4096, 32x2048) and
# one that does not (64x8192), alternating processes; then ragged batches, the loop and merge_kernel a query head
# against the default
step_probe_one_item() {
  PROBE_CASES=${PROBE_CASES:-1x8192,8x4096,32x2048,64x8192} probe_decode_switch SERVEATTN_DECODE_ONE_ITEM probe-one-item
  local rc=$?
  [ "${ONE_ITEM_RAGGED:-1}" = 1 ] || return $rc
  ragged_fp8_bf16 "one=;loop=decode.ONE_ITEM:0;heads=decode.MERGE_MODE:heads" 2>&1 | grep -v "backend='auto'" \
    | tee -a "$OUT/probe-one-item.txt"
  return $(( rc | PIPESTATUS[0] ))
}

# each item of a CUDA graph's loop over the work list in a called function where the fold is called inside it
# (SERVEATTN_DECODE_ITEM_CALL, bf16 caches; on by default since session 49): the decode GPU tests with it on (the
# graph tests run the loop), then bf16 decode under graphs (eager rows: ONE_ITEM's, the same code either way) at the
# split shapes 1x8192, 8x4096, 32x2048, groups 4 and 8, and ragged bf16 batches (ITEM_CALL_RAGGED=0: not), the
# item inlined against called
step_probe_item_call() {
  {
    if [ "${PROBE_TESTS:-1}" = 1 ]; then
      SERVEATTN_DECODE_ITEM_CALL=1 timeout "${SWITCH_TESTS_TIMEOUT:-240}" python3 -m pytest -q \
        -n "${SWITCH_TEST_WORKERS:-8}" -p no:cacheprovider tests/test_fp8_kv.py tests/test_decode_gpu.py \
        tests/test_verify_gpu.py tests/test_decode.py tests/test_batch_invariance_gpu.py 2>&1 | tail -5
    fi
    for shape in 1x8192 8x4096 32x2048; do
      timeout 120 python3 scripts/probe_decode_ragged.py --dists "keys${shape#*x}" --batches "${shape%x*}" \
        --groups 4,8 --rounds 3 --variants "call=;inline=decode.ITEM_CALL:0"
    done
    if [ "${ITEM_CALL_RAGGED:-1}" = 1 ]; then
      timeout 150 python3 scripts/probe_decode_ragged.py --groups 4,8 --batches 32,64 --rounds 2 \
        --variants "call=;inline=decode.ITEM_CALL:0"
    fi
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-item-call.txt"
  return "${PIPESTATUS[0]}"
}

# next/pending's two host-side changes in one call (landed in session 50): (1) a batch too small to fill the GPU takes the
# ragged cut where the even cut leaves a chunk over twice a program's share (session 49's line; one share plus a tile
# since session 50) (prefill.uneven_chunk; SERVEATTN_DECODE_RAGGED_SPLIT=0 and
# SERVEATTN_PREFILL_RAGGED_SPLIT=0 give the even cut back), (2) CUDA-graph plans choose the fold by the capacity's
# chunks (decode.capacity_chunks). The decode / split GPU tests, then ragged batches of 8-32 new against even (bf16,
# both routes), then (PENDING_MERGE=1, the default) the fold forced each way against auto, fp8 and bf16. ~6-8 min
step_probe_pending() {
  {
    timeout "${SWITCH_TESTS_TIMEOUT:-240}" python3 -m pytest -q -n "${SWITCH_TEST_WORKERS:-8}" -p no:cacheprovider \
      tests/test_decode_gpu.py tests/test_decode.py tests/test_prefill_split.py tests/test_fp8_kv.py \
      tests/test_verify_gpu.py tests/test_refusal_coverage_page_cascade.py 2>&1 | tail -5
    local rc=${PIPESTATUS[0]}  # the step's status: the tests' (this group is the pipeline's subshell)
    timeout 150 python3 scripts/probe_decode_ragged.py --groups 4,8 --batches 8,16,32 --rounds 2 \
      --variants "new=;even=SERVEATTN_DECODE_RAGGED_SPLIT:0"
    timeout 90 python3 scripts/probe_decode_ragged.py --tensor-cores --groups 4 --batches 4,8 --rounds 2 \
      --variants "new=;even=SERVEATTN_PREFILL_RAGGED_SPLIT:0"
    if [ "${PENDING_MERGE:-1}" = 1 ]; then
      ragged_fp8_bf16 "auto=;kv_heads=decode.MERGE_MODE:0;heads=decode.MERGE_MODE:heads;fused=decode.MERGE_MODE:1"
    fi
    exit "$rc"
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-pending.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_small_merge() {  # the fold of small ragged batches under the one-share cut (session 50): their long request
  # now takes many short chunks (lognormal 8: 18 of 256 keys), which from 16 chunks at group 8 takes merge_kernel a
  # query head, a second launch (fp8 lognormal 8 group 8: 0.65x eager, 0.93x graph against two shares' 8 chunks fused).
  # auto against the fused fold and merge_kernel a query head, fp8 and bf16, groups 4 / 8, 4-16 requests, two rounds.
  # Session 51 (H100): that row read auto 0.0254 / fused 0.0236 ms; auto within 7% of the faster fold in every row,
  # fused 1.06-1.18x auto's time at lognormal 4, group 8: merge_kind kept
  local dtype
  {
    for dtype in float8_e4m3fn bfloat16; do
      timeout 150 python3 scripts/probe_decode_ragged.py --kv-dtype $dtype --groups 4,8 --batches 4,8,16 --rounds 2 \
        --dists lognormal,outlier --variants "auto=;fused=decode.MERGE_MODE:1;heads=decode.MERGE_MODE:heads"
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-small-merge.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_merge_rule() {  # kernels/decode.merge_kind re-read with the called fold (its rule was measured with the fold
  # inlined, session 35): SERVEATTN_DECODE_FUSED_MERGE auto / 0 (merge_kernel a KV head) / heads at split shapes,
  # groups 4 and 8, fp8 and bf16 (probe_fp8 prints both), alternating processes, two rounds; then the ragged batches
  # (MERGE_RULE_FIXED=0: the ragged batches only)
  local round mode
  {
    [ "${MERGE_RULE_FIXED:-1}" = 0 ] || for round in 1 2; do
      for mode in auto 0 heads; do
        echo "== SERVEATTN_DECODE_FUSED_MERGE=$mode, round $round"
        SERVEATTN_DECODE_FUSED_MERGE=$mode timeout 90 python3 scripts/probe_fp8.py --backend triton \
          --cases ${PROBE_CASES:-1x8192,2x8192,8x4096,32x2048}
        SERVEATTN_DECODE_FUSED_MERGE=$mode timeout 90 python3 scripts/probe_fp8.py --backend triton --kv-heads 4 \
          --cases ${PROBE_CASES:-1x8192,2x8192,8x4096,32x2048}
      done
    done
    ragged_fp8_bf16 "auto=;kv_heads=decode.MERGE_MODE:0;heads=decode.MERGE_MODE:heads;fused=decode.MERGE_MODE:1"
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-merge-rule.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_fp8_hot_l2() {  # fp8 decode with the cache in the L2 (probe_fp8 --pool-pages: the real shapes' pages
  # drawn from a 256-page pool; PROBE_ARGS="--hot-l2 --cases 32x512" for small caches run back to back), defaults
  # against HOT_L2_SETTING (switches, space-separated; F16_SCORES unless named): HBM no longer bounds the kernel, so
  # an H100 shows what the H200's compute-bound fp8 decode would gain; alternating processes, two rounds
  local setting
  {
    for round in 1 2; do
      for setting in "" "${HOT_L2_SETTING:-SERVEATTN_DECODE_F16_SCORES=1}"; do
        echo "== ${setting:-defaults}, round $round"
        # shellcheck disable=SC2086
        env $setting timeout 90 python3 scripts/probe_fp8.py --backend triton \
          ${PROBE_ARGS:---pool-pages 256 --cases 64x8192,128x4096,8x4096}
      done
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-fp8-hot-l2.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_ncu_decode() {  # Nsight Compute on the decode kernel (scripts/ncu_decode.py): one warm launch a case,
  # --set full with source; NCU_CASE (batch x KV, 64x8192), NCU_CASES "cache:pool[:SWITCHES]" (space-separated;
  # switches ;-joined env settings). Writes each case's details page and scripts/ncu_stalls.py's summary of its
  # per-instruction SASS page; NCU_KEEP=1 keeps the report and that page too (large: fetch few at a time)
  local spec cache pool sw name rc=0
  for spec in ${NCU_CASES:-fp8:0 bf16:0 fp8:256 bf16:256}; do
    IFS=: read -r cache pool sw <<< "$spec"
    name="ncu-${NCU_CASE:-64x8192}-$cache-pool$pool${sw:+-${sw//[^A-Za-z0-9]/_}}"
    echo "== $name"
    # shellcheck disable=SC2046
    env ${sw//;/ } timeout 240 ncu --set full --clock-control none --import-source yes -k regex:decode_kernel \
      -s 2 -c 1 -f -o "$OUT/$name" \
      python3 scripts/ncu_decode.py --case "${NCU_CASE:-64x8192}" --cache "$cache" --pool-pages "$pool" 2>&1 | tail -4 \
      || rc=1
    ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/$name-details.txt" 2>&1 || rc=1
    ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name-sass.csv" 2>&1 || true
    python3 scripts/ncu_stalls.py "$OUT/$name-sass.csv" > "$OUT/$name-stalls.txt" 2>&1 || rc=1
    grep -E 'Duration|Throughput  |Issue Slots Busy|Executed Ipc Active|Achieved Occupancy|Registers Per' \
      "$OUT/$name-details.txt" | head -20
    head -12 "$OUT/$name-stalls.txt"
    [ "${NCU_KEEP:-0}" = 1 ] || rm -f "$OUT/$name.ncu-rep" "$OUT/$name-sass.csv"
  done
  return $rc
}

step_probe_prefill_off32() {  # prefill_kernel's int32 K/V offsets (SERVEATTN_PREFILL_KV_OFFSETS_32): its GPU tests
  # under it, then the tensor-core decode route (probe_fp8 --tc) and prefill_kernel's prefill (SERVEATTN_PREFILL_WS=0)
  # off / on in alternating processes, two rounds
  {
    if [ "${PROBE_TESTS:-1}" = 1 ]; then
      # 8 workers (16 ran an H100 out of memory, session 39: 15 failed, all passed at 8); the whole log beside. Its
      # =1 now takes the default MIN_ROWS (64): probe-prefill-off32-rows sets both
      SERVEATTN_PREFILL_KV_OFFSETS_32=1 timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short \
        tests/test_prefill_gpu.py tests/test_decode_gpu.py tests/test_verify_gpu.py tests/test_fp8_kv.py \
        tests/test_tree_verify.py tests/test_prefill.py > "$OUT/probe-prefill-off32-tests.txt" 2>&1
      tail -5 "$OUT/probe-prefill-off32-tests.txt"
    fi
    for round in 1 2; do
      for off32 in 0 1; do
        echo "== SERVEATTN_PREFILL_KV_OFFSETS_32=$off32, round $round"
        SERVEATTN_PREFILL_KV_OFFSETS_32=$off32 timeout 90 python3 scripts/probe_fp8.py --backend triton --tc \
          --cases 64x8192,8x4096,1x8192
        SERVEATTN_PREFILL_KV_OFFSETS_32=$off32 SERVEATTN_PREFILL_WS=0 timeout 90 python3 scripts/probe_prefill.py \
          --cases 1x8192,16x2048 --kinds bf16,kv8
      done
    done
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-prefill-off32.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_prefill_off32_rows() {  # int32 K/V offsets for prefill tiles only (..._MIN_ROWS=64) against off and all:
  # prefill_kernel's prefill at head dim 128 (SERVEATTN_PREFILL_WS=0) and 256, and the tensor-core decode route
  {
    for round in 1 2; do
      for setting in "0 0" "1 64" "1 0"; do
        set -- $setting
        echo "== SERVEATTN_PREFILL_KV_OFFSETS_32=$1 SERVEATTN_PREFILL_KV_OFFSETS_32_MIN_ROWS=$2, round $round"
        export SERVEATTN_PREFILL_KV_OFFSETS_32=$1 SERVEATTN_PREFILL_KV_OFFSETS_32_MIN_ROWS=$2
        timeout 90 python3 scripts/probe_fp8.py --backend triton --tc --cases 64x8192,8x4096
        SERVEATTN_PREFILL_WS=0 timeout 90 python3 scripts/probe_prefill.py --cases 1x8192,16x2048 --kinds bf16,kv8
        timeout 90 python3 scripts/probe_prefill.py --cases 1x4096,8x2048 --kinds bf16,kv8 --head-dim 256
      done
    done
    unset SERVEATTN_PREFILL_KV_OFFSETS_32 SERVEATTN_PREFILL_KV_OFFSETS_32_MIN_ROWS
  } 2>&1 | grep -v "backend='auto'" | tee "$OUT/probe-prefill-off32-rows.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_fp8_split() {  # fp8-KV decode vs bf16 at 64x8192 / 128x4096 with more, shorter programs: fixed
  # splits under fewer stages or smaller tiles (shared memory a CTA: 39 KB at 64 keys and 2-4 stages against 56 KB
  # at 6, so 5 CTAs an SM, not 4; 21 KB at 32 keys on one warp, 10)
  timeout 240 python3 scripts/probe_fp8.py --backend triton --cases 64x8192,128x4096 \
    --tiles "${SPLIT_TILES:-16,64,2,6;16,64,2,3;16,32,1,4}" --fixed-split "${FIXED_SPLITS:-none;4096;2048;1024}" 2>&1 \
    | grep -v "backend='auto'" | tee "$OUT/probe-fp8-split.txt"
  return "${PIPESTATUS[0]}"
}

step_probe_batch_invariant() {  # what batch-invariant plans cost (PROBE_ARGS: --cases, --rounds)
  PYTHONPATH="$ROOT/scripts:$PYTHONPATH" timeout "${PROBE_TIMEOUT:-240}" python3 scripts/probe_batch_invariant.py \
    ${PROBE_ARGS:-} 2>&1 | grep -v "Warn\|warn" | tee "$OUT/probe-batch-invariant.txt"
  return "${PIPESTATUS[0]}"
}

bench() {  # $1: extra arguments (--quick or empty), $2: file stem, $3: family (default prefill)
  local family=${3:-prefill}
  echo "== $2: python -m serveattn.bench $family $1 $BENCH_ARGS (timeout ${BENCH_TIMEOUT}s)"
  # shellcheck disable=SC2086  # word splitting of the argument strings is intended
  timeout -k 10 "$BENCH_TIMEOUT" python3 -m serveattn.bench "$family" $1 $BENCH_ARGS --json "$OUT/$2.json" 2>&1 \
    | tee "$OUT/$2.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "$2: stopped by the ${BENCH_TIMEOUT}s timeout (the JSON holds the cases finished)"
  return "$rc"
}

# The benches: one step each, through bench() (its arguments as in its comment)
step_bench_prefill() { bench "" bench-prefill; }
step_bench_prefill_quick() { bench "--quick" bench-prefill-quick; }
step_bench_decode() { bench "" bench-decode decode; }
step_bench_decode_ragged() { bench "--ragged" bench-decode-ragged decode; }
step_bench_decode_quick() { bench "--quick" bench-decode-quick decode; }
step_bench_fp8() { bench "" bench-fp8 fp8; }
step_bench_fp8_quick() { bench "--quick" bench-fp8-quick fp8; }
step_bench_crossover() { bench "--routing-md $OUT/routing.md" bench-crossover crossover; }
step_bench_crossover_quick() { bench "--quick --routing-md $OUT/routing.md" bench-crossover-quick crossover; }
# fp8 caches under a bf16 query, decode routes only (routing.TABLES' fp8 keys; its own docs file: a run of only these
# points would leave the section's 16-bit tables out, so copy its table sm90-decode-tc-fp8 into docs/routing.md)
step_bench_crossover_fp8() {
  bench "--pairs decode-tc --dtypes float8_e4m3fn,float8_e5m2 --decode-batches 1,8,32,64,128 --routing-md $OUT/routing-fp8.md" \
    bench-crossover-fp8 crossover
}
step_bench_verify() { bench "" bench-verify verify; }

# A step is a function step_<name, dashes as underscores>: a new step needs only its function.
known_step() { declare -F "step_${1//-/_}" > /dev/null; }

# every step checked before any runs (a typo must not cost a device call's other steps)
for s in "${STEPS[@]}"; do
  if ! known_step "$s"; then
    steps=$(declare -F | sed -n 's/^declare -f step_//p' | tr _ - | tr '\n' ' ')
    echo "gpu_run.sh: unknown step '$s'; steps are: $steps" >&2
    exit 2
  fi
done

for s in "${STEPS[@]}"; do
  t=$SECONDS
  "step_${s//-/_}"
  RC[$s]=$?
  echo "== $s: exit ${RC[$s]} after $((SECONDS - t)) s"
done

status=0
{
  echo "== summary ($((SECONDS - T0)) s in all; files in $OUT)"
  for s in "${STEPS[@]}"; do
    echo "$s: exit ${RC[$s]}"
  done
} | tee "$OUT/summary.txt"
for s in "${STEPS[@]}"; do [ "${RC[$s]}" -ne 0 ] && status=1; done
exit $status
