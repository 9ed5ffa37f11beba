"""A decode call to profile under Nsight Compute (GPU): plans one batch and runs it a few times, so that
`ncu -k regex:decode_kernel -s 2 -c 1` catches a warm launch. Measuring only; scripts/gpu_run.sh probe-ncu-decode
runs it under ncu and writes the reports' text.

    PYTHONPATH=$PWD python3 scripts/ncu_decode.py --case 64x8192 --cache fp8 [--pool-pages 256]

The inputs are probe_fp8.py's: GQA 32/8, head dim 128, page 16, bf16 query, every page its own (or drawn from a
pool of --pool-pages pages, which keeps the cache in the L2: the kernel's own floor rather than HBM's).
"""
import argparse

import torch

import serveattn

HQ, HKV, D, PS = 32, 8, 128, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="64x8192", help="batch x KV length")
    ap.add_argument("--cache", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--pool-pages", type=int, default=0)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    batch, kv = map(int, args.case.split("x"))
    pages = kv // PS
    num_pages = args.pool_pages or batch * pages
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = (torch.randn(num_pages, 2, PS, HKV, D, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    if args.cache == "bf16":
        cache = cache.to(torch.bfloat16)
    indices = (torch.randint(num_pages, (batch * pages,)) if args.pool_pages else torch.randperm(batch * pages))
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    last = torch.full((batch,), PS, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                     backend="triton")
    w.plan(indptr, indices.to(torch.int32), last, HQ, HKV, D, PS, q_data_type=torch.bfloat16, kv_data_type=cache.dtype)
    out = torch.empty_like(q)
    for _ in range(args.calls):
        w.run(q, cache, out=out, k_scale=0.5, v_scale=2.0)
    torch.cuda.synchronize()
    print(f"{args.case} {args.cache} pool {args.pool_pages}: {args.calls} calls done")


if __name__ == "__main__":
    main()
