"""Cold and warm first-call time of the decode and prefill kernels for one configuration (GPU; issue 6's host
target: cold under 30 s, warm start under 1 s).

Each measurement is a fresh Python process (so nothing is compiled or imported yet) that imports serveattn,
plans and runs one call, and synchronizes; the process reports the seconds from before `import serveattn` to
the end of the first call. "cold": an empty Triton cache directory; "warm": the same directory again (Triton's
on-disk cache present, as after a restart of a serving process). Configuration: bf16, GQA 32/8, head dim 128,
page 16, one request (decode: KV 4096 on both decode routes; prefill: 4096 causal tokens, paged).

    PYTHONPATH=$PWD python3 scripts/probe_compile.py
"""
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import torch
import serveattn
kind = sys.argv[1]
dev = "cuda"
HQ, HKV, D, PS, S = 32, 8, 128, 16, 4096
pages = S // PS
cache = torch.randn(pages, 2, PS, HKV, D, device=dev, dtype=torch.bfloat16)
indptr = torch.tensor([0, pages], dtype=torch.int32)
indices = torch.randperm(pages, dtype=torch.int64).to(torch.int32)
last = torch.tensor([PS], dtype=torch.int32)
ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
t1 = time.perf_counter()
if kind.startswith("decode"):
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=kind == "decode-tc", backend="triton")
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=torch.bfloat16)
    q = torch.randn(1, HQ, D, device=dev, dtype=torch.bfloat16)
else:
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    w.plan(torch.tensor([0, S], dtype=torch.int32), indptr, indices, last, HQ, HKV, D, PS, causal=True,
           q_data_type=torch.bfloat16)
    q = torch.randn(S, HQ, D, device=dev, dtype=torch.bfloat16)
w.run(q, cache)
torch.cuda.synchronize()
t2 = time.perf_counter()
print("RESULT", t2 - t0, t2 - t1)
"""


def measure(kind: str, cache_dir: str):
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", CHILD, kind], env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    if out.returncode or not line:
        return None, (out.stderr.strip().splitlines() or ["no output"])[-1]
    total, first_call = map(float, line[0].split()[1:])
    return (total, first_call), None


def main():
    rows = []
    for kind in ("decode", "decode-tc", "prefill"):
        with tempfile.TemporaryDirectory() as cache_dir:
            for state in ("cold", "warm"):
                res, err = measure(kind, cache_dir)
                if err:
                    print(f"{kind} {state}: failed: {err}", flush=True)
                    continue
                total, first = res
                rows.append(dict(kind=kind, state=state, total_s=round(total, 2), plan_and_first_run_s=round(first, 2)))
                print(f"{kind:9s} {state}: {total:6.2f} s from import to the first result "
                      f"({first:.2f} s of it plan + first run)", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
