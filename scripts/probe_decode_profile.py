"""Where small-batch decode's GPU time goes (GPU): each kernel's duration from the CUDA profiler, for our
CUDA-graph decode (the decode kernel and the split-KV merge) and cuDNN SDPA on the same shapes, next to the
replay's wall time per call (back-to-back replays, CUDA events).

    PYTHONPATH=$PWD python3 scripts/probe_decode_profile.py [--cases 1x8192,8x4096,32x2048] [--kv fp8]

Prints per case: the chunking the plan chose, the replay time, and each kernel's mean device time.
"""
import argparse
import collections

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import serveattn
from serveattn.bench import common

HQ, HKV, D, PS = 32, 8, 128, 16


def kernel_times(fn, reps):
    """{kernel name: (calls per fn call, mean us)} from the profiler's device events."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            acc[ev.name[:70]].append(ev.device_time_total)
    return {k: (len(v) / reps, sum(v) / len(v)) for k, v in acc.items()}


def event_us(fn):
    """Mean us per call back to back (the bench's own measure: CUDA events around a loop, no L2 flush)."""
    return common.back_to_back_ms(fn, warmup_ms=10, rep_ms=40) * 1e3


def case(batch, kv, kv_dtype):
    dev = "cuda"
    pages = -(-kv // PS)
    cache = torch.randn(batch * pages, 2, PS, HKV, D, device=dev, dtype=torch.bfloat16)
    if kv_dtype == "fp8":
        cache = (cache * 8).to(torch.float8_e4m3fn)
    i32 = dict(dtype=torch.int32, device=dev)
    indptr = torch.arange(batch + 1, **i32) * pages
    indices = torch.randperm(batch * pages, device=dev).to(torch.int32)
    last = torch.full((batch,), kv - (pages - 1) * PS, **i32)
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, indptr.clone(), indices.clone(), last.clone())
    w.plan(indptr.cpu(), indices.cpu(), last.cpu(), HQ, HKV, D, PS, q_data_type=torch.bfloat16,
           kv_data_type=cache.dtype)
    p = w._plan
    out = torch.empty_like(q)
    w.run(q, cache, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out)
    replay = event_us(g.replay)
    chunks = f"work items {p.num_work_host}, slots {p.num_slots}, tiles {p.tiles}"
    print(f"== {batch}x{kv} kv {kv_dtype}: {chunks}")
    print(f"   ours, graph replay back to back: {replay:.1f} us per call")
    for name, (n, us) in sorted(kernel_times(g.replay, 100).items(), key=lambda x: -x[1][1]):
        print(f"     {us:8.2f} us  x{n:.0f}  {name}")
    if kv_dtype == "bf16":
        k = cache[:, 0][indices.long()].reshape(batch, pages * PS, HKV, D)[:, :kv].transpose(1, 2).contiguous()
        v = cache[:, 1][indices.long()].reshape(batch, pages * PS, HKV, D)[:, :kv].transpose(1, 2).contiguous()
        qb = q.unsqueeze(2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qb, k, v, enable_gqa=True)

        print(f"   cuDNN SDPA eager, back to back: {event_us(cudnn):.1f} us per call")
        for name, (n, us) in sorted(kernel_times(cudnn, 100).items(), key=lambda x: -x[1][1]):
            print(f"     {us:8.2f} us  x{n:.0f}  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x8192,8x4096,32x2048")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"))
    args = ap.parse_args()
    torch.manual_seed(0)
    for c in args.cases.split(","):
        b, kv = (int(x) for x in c.split("x"))
        case(b, kv, args.kv)


if __name__ == "__main__":
    main()
