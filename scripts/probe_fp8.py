"""fp8-KV decode speed probe (GPU): our decode on an e4m3 cache against the same call on its 16-bit copy (bf16,
or fp16 with --q-dtype float16).

Timing only (no bitwise check, unlike `python -m serveattn.bench fp8`), so that variants which give up the
bitwise contract can be measured, e.g. SERVEATTN_FP8_BOUNDARY=0 (no operand boundary after widening) or
SERVEATTN_DECODE_TILES=16,256,8,3 (another tile). Prints one line per case:

    PYTHONPATH=$PWD python3 scripts/probe_fp8.py [--cases 64x8192,128x4096] [--tc] [--tiles "16,128,4,3;16,128,4,5"]
        [--backend triton] [--kv-heads 4] [--q-dtype float16] [--fixed-split "none;4096;2048"]

--tiles sweeps decode tile configurations in one process (each sets SERVEATTN_DECODE_TILES, with --tc
SERVEATTN_PREFILL_TILES, for both plans) and says whether the fp8 output equals, bitwise, the 16-bit run on the
dequantized cache under the same tiles.

--fixed-split sweeps plan(fixed_split_size=...) for both plans ("none": the plan's own split), inside each tile
configuration: at large batches (64x8192: 512 programs, ~4 a SM) it gives the fp8 loop more, shorter programs to
hide its widening's latency behind (both dtypes get the same split, so the bits still agree).
"""
import argparse
import os

import torch
import triton.testing

import serveattn
import tile_sweep  # scripts/, beside this file

HQ, HKV, D, PS = 32, 8, 128, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x8192,8x4096")
    ap.add_argument("--tc", action="store_true", help="use_tensor_cores=True")
    ap.add_argument("--tiles", default="", help="';'-separated SERVEATTN_DECODE_TILES values to sweep")
    ap.add_argument("--backend", default="auto", help="auto, or triton: the route --tc names for both caches")
    ap.add_argument("--kv-heads", type=int, default=HKV, help="KV heads for the 32 query heads (group = 32 / this)")
    ap.add_argument("--fixed-split", default="none",
                    help="';'-separated fixed_split_size values for both plans, 'none' for the plan's own")
    ap.add_argument("--q-dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="the query's dtype, and the 16-bit cache's (e4m3 widens to fp16 in one cvt a pair, to bf16 "
                         "by the exact integer path)")
    args = ap.parse_args()
    args.q_dtype = getattr(torch, args.q_dtype)
    args.seen = {}  # (case, dtype, block_n) -> first output: do warps and stages change the bits?
    # the tensor-core route runs the prefill kernel: its override (block_m first: the override skips the
    # table's clamp of block_m to the request's rows)
    args.tiles_env = "SERVEATTN_PREFILL_TILES" if args.tc else "SERVEATTN_DECODE_TILES"
    tile_sweep.sweep(args.tiles_env, args.tiles, lambda: probe(args))


def probe(args):
    knobs = {k: v for k, v in os.environ.items() if k.startswith("SERVEATTN_")}
    for split in args.fixed_split.split(";"):
        probe_split(args, knobs, None if split == "none" else int(split))


def probe_split(args, knobs, fixed_split):
    for case in args.cases.split(","):
        batch, kv = map(int, case.split("x"))
        pages = kv // PS
        gen = torch.Generator(device="cuda").manual_seed(0)
        wide = torch.randn(batch * pages, 2, PS, args.kv_heads, D, device="cuda", generator=gen) * 2
        wide = wide.to(torch.float8_e4m3fn)
        cache = {"fp8": wide, "16-bit": wide.to(args.q_dtype)}  # the 16-bit copy in the query's dtype
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
        # seeded, so that "same bits as the first tiles" compares runs on the same inputs
        indices = torch.randperm(batch * pages, dtype=torch.int64, generator=torch.Generator().manual_seed(1))
        indices = indices.to(torch.int32)
        last = torch.full((batch,), PS, dtype=torch.int32)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=args.q_dtype, generator=gen)
        ms, outs = {}, {}
        for name, c in cache.items():
            w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                             use_tensor_cores=args.tc, backend=args.backend)
            w.plan(indptr, indices, last, HQ, args.kv_heads, D, PS, q_data_type=args.q_dtype, kv_data_type=c.dtype,
                   fixed_split_size=fixed_split)
            out = torch.empty_like(q)
            outs[name] = out
            ms[name] = triton.testing.do_bench(lambda: w.run(q, c, out=out, k_scale=0.5, v_scale=2.0), warmup=25,
                                               rep=100, return_mode="median")
        block_n = os.environ.get(args.tiles_env, "16,0").split(",")[1]
        same = [torch.equal(args.seen.setdefault((case, args.kv_heads, name, block_n, fixed_split), out), out)
                for name, out in outs.items()]
        kv_bytes = 2 * batch * kv * args.kv_heads * D
        print(f"{case} g{HQ // args.kv_heads} q {args.q_dtype} tc={args.tc} split={fixed_split} {knobs}: "
              f"16-bit {ms['16-bit']:.4f} ms ({2 * kv_bytes / ms['16-bit'] / 1e9:.2f} TB/s), "
              f"fp8 {ms['fp8']:.4f} ms ({kv_bytes / ms['fp8'] / 1e9:.2f} TB/s), fp8/16-bit speed "
              f"{ms['16-bit'] / ms['fp8']:.2f}x, bitwise {torch.equal(outs['fp8'], outs['16-bit'])}, "
              f"same bits as the first tiles with this block_n {all(same)}", flush=True)


if __name__ == "__main__":
    main()
