"""Where small-batch decode's GPU time goes (GPU): each kernel's duration from the CUDA profiler, for our
CUDA-graph decode (the decode kernel and the split-KV merge) and cuDNN SDPA on the same shapes, next to the
replay's wall time per call (back-to-back replays, CUDA events).

    PYTHONPATH=$PWD python3 scripts/probe_decode_profile.py [--cases 1x8192,8x4096,32x2048] [--kv fp8] [--flush]

Prints per case: the chunking the plan chose, the replay time, and each kernel's mean device time. --flush: the
bench's conditions instead (the L2 flushed before every call, as triton.testing.do_bench does; the replay's time
is do_bench's median, the flush kernel listed with the others), cuDNN replayed from a CUDA graph too.
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


FLUSH = []  # [the L2-sized buffer zeroed before each profiled call] under --flush


def kernel_times(fn, reps):
    """{kernel name: (calls per fn call, mean us)} from the profiler's device events."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if FLUSH:
                FLUSH[0].zero_()
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            acc[ev.name[:70]].append(ev.device_time_total)
    return {k: (len(v) / reps, sum(v) / len(v)) for k, v in acc.items()}


def event_us(fn):
    """Mean us per call back to back (CUDA events around a loop, no L2 flush), or under --flush the bench's
    measure (do_bench's median, the L2 flushed before each call)."""
    if FLUSH:
        return common.bench_ms(fn, warmup_ms=10, rep_ms=40) * 1e3
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
    how = "after an L2 flush (median)" if FLUSH else "back to back"
    print(f"   ours, graph replay {how}: {replay:.1f} us per call")
    for name, (n, us) in sorted(kernel_times(g.replay, 100).items(), key=lambda x: -x[1][1]):
        print(f"     {us:8.2f} us  x{n:.0f}  {name}")
    if kv_dtype == "bf16":
        k = cache[:, 0][indices.long()].reshape(batch, pages * PS, HKV, D)[:, :kv].transpose(1, 2).contiguous()
        v = cache[:, 1][indices.long()].reshape(batch, pages * PS, HKV, D)[:, :kv].transpose(1, 2).contiguous()
        qb = q.unsqueeze(2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qb, k, v, enable_gqa=True)

        print(f"   cuDNN SDPA eager, {how}: {event_us(cudnn):.1f} us per call")
        for name, (n, us) in sorted(kernel_times(cudnn, 100).items(), key=lambda x: -x[1][1]):
            print(f"     {us:8.2f} us  x{n:.0f}  {name}")
        if FLUSH:
            cudnn()
            torch.cuda.synchronize()
            gc = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gc):
                cudnn()
            print(f"   cuDNN SDPA, graph replay {how}: {event_us(gc.replay):.1f} us per call")
            for name, (n, us) in sorted(kernel_times(gc.replay, 100).items(), key=lambda x: -x[1][1]):
                print(f"     {us:8.2f} us  x{n:.0f}  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x8192,8x4096,32x2048")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--flush", action="store_true", help="the L2 flushed before each call (the bench's way)")
    args = ap.parse_args()
    if args.flush:
        FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    torch.manual_seed(0)
    for c in args.cases.split(","):
        b, kv = (int(x) for x in c.split("x"))
        case(b, kv, args.kv)


if __name__ == "__main__":
    main()
