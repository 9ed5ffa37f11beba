"""Where a prefill call's time goes besides its kernels (H200): the bench's do_bench median (L2 flushed before each
call) against the sum of the call's kernels (profiler) and the host's time per run(), and whether run() ever
synchronizes with the device (torch's sync debug mode). A gap between the median and the kernels that the host's
time explains is the host's, not the GPU's.

    python3 scripts/probe_call_gap.py [--cases 1x4096,16x2048] [--kinds bf16,ragged,fp8,fp8-full,kv8,kv8-nows]
    python3 scripts/probe_call_gap.py --cprofile --cases 1x4096 --kinds fp8     # the host's time by function
"""
import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serveattn  # noqa: E402
from serveattn.bench import common  # noqa: E402
from serveattn.kernels import replay  # noqa: E402
from probe_decode_profile import kernel_times  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16


def host_us(fn, n=40):
    """Mean host time of one fn() while the device is busy (a long sleep queued first, so no call waits on it)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time ahead of the calls
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def syncs(fn):
    """'none' if fn() runs under sync debug mode 'error', else the error's first line."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as e:
        return str(e).splitlines()[0][:160]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def make(kind, batch, s, gen):
    e4m3 = torch.float8_e4m3fn
    pages = s // PS
    cache8 = torch.randn(batch * pages, 2, PS, HKV, D, device="cuda", generator=gen).to(e4m3)
    q = torch.randn(batch * s, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * s
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    if kind == "ragged":
        k = torch.randn(batch * s, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(batch * s, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="triton")
        w.plan(qo_indptr, qo_indptr.clone(), HQ, HKV, D, causal=True, q_data_type=torch.bfloat16)
        return lambda: w.run(q, k, v)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, dtype=torch.int64).to(torch.int32)
    last = torch.full((batch,), PS, dtype=torch.int32)
    base = kind.split("-")[0]  # fp8-full: every call on the full path (its replay dropped first); kv8-nows: the
    # fp8 cache on prefill_kernel (SERVEATTN_PREFILL_WS=0 for the call: no page copy)
    qd = e4m3 if base == "fp8" else torch.bfloat16
    kd = torch.bfloat16 if base == "bf16" else e4m3
    cache = cache8 if kd == e4m3 else cache8.to(kd)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PS, causal=True, q_data_type=qd, kv_data_type=kd)
    if base == "fp8":
        one = torch.ones(1, device="cuda")
        q8 = q.to(e4m3)
        if kind == "fp8-full":
            return lambda: (w._plan.launch_memo.pop(replay.KEY, None), w.run(q8, cache, scale_q=one, scale_k=one,
                                                                            scale_v=one))
        return lambda: w.run(q8, cache, scale_q=one, scale_k=one, scale_v=one)
    if kind == "kv8-nows":
        def run():
            os.environ["SERVEATTN_PREFILL_WS"] = "0"
            try:
                return w.run(q, cache, k_scale=0.5, v_scale=2.0)
            finally:
                del os.environ["SERVEATTN_PREFILL_WS"]
        return run
    if kind == "kv8":
        return lambda: w.run(q, cache, k_scale=0.5, v_scale=2.0)
    return lambda: w.run(q, cache)


def host_profile(args):
    """cProfile of 40 run() calls a (case, kind), the device kept busy (host_us): the top functions by own time."""
    import cProfile
    import pstats
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(","):
        batch, s = map(int, case.split("x"))
        for kind in args.kinds.split(","):
            fn = make(kind, batch, s, gen)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(40):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            st = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim calls, tottime, cumtime, callers)}
            total = sum(v[2] for v in st.values())
            print(f"== {case} {kind}: {total / 40 * 1e6:.1f} us a run() under cProfile; by own time, us a run():",
                  flush=True)
            for (f, line, name), v in sorted(st.items(), key=lambda kv: -kv[1][2])[:16]:
                print(f"    {v[2] / 40 * 1e6:7.1f} own {v[3] / 40 * 1e6:7.1f} cum {v[0] / 40:5.1f} calls  "
                      f"{os.path.basename(f)}:{line} {name}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x4096,16x2048")
    ap.add_argument("--kinds", default="bf16,ragged,fp8,kv8")
    ap.add_argument("--cprofile", action="store_true", help="instead: the host's time in run() by function")
    args = ap.parse_args()
    if args.cprofile:
        return host_profile(args)
    common.raise_clocks()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("case kind: do_bench median us | kernels us (each) | median - kernels | host us a run() | b2b us | syncs")
    runs = []
    for case in args.cases.split(","):
        batch, s = map(int, case.split("x"))
        for kind in args.kinds.split(","):
            fn = make(kind, batch, s, gen)
            fn()
            triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            med = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            runs.append((case, kind, fn, med, host_us(fn), common.back_to_back_ms(fn, 10, 60) * 1e3, syncs(fn)))
    for case, kind, fn, med, h, b2b, sy in runs:  # the profiler last: its hooks may stay and slow later launches
        kt = kernel_times(fn, 10)
        ksum = sum(c * us for c, us in kt.values())
        each = ", ".join(f"{name.split('(')[0][:24]} {c * us:.1f}" for name, (c, us) in kt.items())
        print(f"{case} {kind}: {med:.1f} | {ksum:.1f} ({each}) | {med - ksum:.1f} | {h:.1f} | {b2b:.1f} | {sy}",
              flush=True)

if __name__ == "__main__":
    main()
