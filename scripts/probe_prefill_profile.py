"""Where paged prefill's GPU time goes against ragged (GPU): each kernel's device time from the CUDA profiler and
the time per call (CUDA events, L2 flushed before each call as in the bench), for the paged wrapper (whose 16-bit
pages may be copied into ragged rows first: kernels/gather.py) and the ragged wrapper on the same keys.

    PYTHONPATH=$PWD python3 scripts/probe_prefill_profile.py [--cases 16x2048,1x8192]

Session 11 left a gap unexplained: 16x2048 paged 1.271 ms against ragged 1.110 ms in one bench run, while the
page copy alone took 74 us. Per case this prints both wrappers' time per call, each kernel's calls and mean
device time per call, and the sum of kernel time: a per-call time above that sum is time the GPU sat idle
(host-bound launches, a synchronizing call) or spent on work outside our kernels.
"""
import argparse

import torch
import triton.testing

import serveattn
from probe_decode_profile import kernel_times  # scripts/, beside this file
from serveattn.bench.common import raise_clocks

HQ, HKV, D, PS = 32, 8, 128, 16


def report(label, fn, reps=20):
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = kernel_times(fn, reps)
    busy = sum(calls * us for calls, us in times.values())
    print(f"  {label}: {ms * 1e3:.1f} us a call (L2 flushed), kernels {busy:.1f} us a call", flush=True)
    for name, (calls, us) in sorted(times.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        print(f"    {calls:4.1f} x {us:8.1f} us  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16x2048,1x8192")
    args = ap.parse_args()
    raise_clocks()
    for case in args.cases.split(","):
        batch, s = map(int, case.split("x"))
        pages = s // PS
        dev = "cuda"
        cache = torch.randn(batch * pages, 2, PS, HKV, D, device=dev, dtype=torch.bfloat16)
        q = torch.randn(batch * s, HQ, D, device=dev, dtype=torch.bfloat16)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * s
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
        indices = torch.randperm(batch * pages).to(torch.int32)
        last = torch.full((batch,), PS, dtype=torch.int32)
        # the ragged wrapper reads the same keys, laid out request after request
        order = indices.to(dev).long()
        k = cache[order, 0].reshape(batch * s, HKV, D).contiguous()
        v = cache[order, 1].reshape(batch * s, HKV, D).contiguous()
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        paged = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
        paged.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PS, causal=True, q_data_type=torch.bfloat16)
        ragged = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty_like(ws), backend="triton")
        ragged.plan(qo_indptr, qo_indptr, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16)
        out_p, out_r = paged.run(q, cache), ragged.run(q, k, v)
        torch.cuda.synchronize()
        same = torch.equal(out_p, out_r)
        print(f"{case}: paged and ragged outputs bitwise equal: {same}", flush=True)
        report("paged ", lambda: paged.run(q, cache))
        report("ragged", lambda: ragged.run(q, k, v))


if __name__ == "__main__":
    main()
