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

--hot-l2 times back-to-back calls with no L2 flush between them (do_bench flushes before each): with a cache
that fits the L2 (an H100's 50 MB: e4m3 at 32x512 is 33.5 MB) the fp8 kernel is no longer bound by HBM, so an
H100 shows what an instruction-count change does where the kernel is compute-bound (as fp8 decode is on the
H200's faster memory). --pool-pages N does the same at the real shapes: every request's pages are drawn (with
repeats) from a pool of N pages (256: 8 MB of e4m3, 16 MB of bf16), so 64x8192 keeps its programs and loop lengths
but reads the L2.
"""
import argparse
import os

import torch
import triton.testing

import serveattn
import tile_sweep  # scripts/, beside this file
from serveattn.bench import common

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
    ap.add_argument("--pool-pages", type=int, default=0,
                    help="draw every request's pages from this many (0: each page its own); see above")
    ap.add_argument("--hot-l2", action="store_true", help="time back-to-back calls, no L2 flush between them")
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
        num_pages = args.pool_pages or batch * pages
        wide = torch.randn(num_pages, 2, PS, args.kv_heads, D, device="cuda", generator=gen) * 2
        wide = wide.to(torch.float8_e4m3fn)
        cache = {"fp8": wide, "16-bit": wide.to(args.q_dtype)}  # the 16-bit copy in the query's dtype
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
        # seeded, so that "same bits as the first tiles" compares runs on the same inputs
        cpu_gen = torch.Generator().manual_seed(1)
        indices = (torch.randint(num_pages, (batch * pages,), generator=cpu_gen) if args.pool_pages else
                   torch.randperm(batch * pages, dtype=torch.int64, generator=cpu_gen))
        indices = indices.to(torch.int32)
        last = torch.full((batch,), PS, dtype=torch.int32)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=args.q_dtype, generator=gen)
        ms, outs = {}, {}
        for name, c in cache.items():
            i32 = dict(dtype=torch.int32, device="cuda")
            graph_kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty(batch + 1, **i32),
                            paged_kv_indices_buffer=torch.empty(batch * pages, **i32),
                            paged_kv_last_page_len_buffer=torch.empty(batch, **i32)) if args.hot_l2 else {}
            w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                             use_tensor_cores=args.tc, backend=args.backend,
                                                             **graph_kw)
            w.plan(indptr, indices, last, HQ, args.kv_heads, D, PS, q_data_type=args.q_dtype, kv_data_type=c.dtype,
                   fixed_split_size=fixed_split)
            out = torch.empty_like(q)
            outs[name] = out
            call = lambda: w.run(q, c, out=out, k_scale=0.5, v_scale=2.0)  # noqa: E731
            ms[name] = (hot_l2_ms(call) if args.hot_l2 else
                        triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))
        block_n = os.environ.get(args.tiles_env, "16,0").split(",")[1]
        same = [torch.equal(args.seen.setdefault((case, args.kv_heads, name, block_n, fixed_split), out), out)
                for name, out in outs.items()]
        kv_bytes = 2 * batch * kv * args.kv_heads * D
        where = (" hot-L2" if args.hot_l2 else "") + (f" pool {num_pages}" if args.pool_pages else "")
        print(f"{case} g{HQ // args.kv_heads}{where} q {args.q_dtype} tc={args.tc} split={fixed_split} {knobs}: "
              f"16-bit {ms['16-bit']:.4f} ms ({2 * kv_bytes / ms['16-bit'] / 1e9:.2f} TB/s), "
              f"fp8 {ms['fp8']:.4f} ms ({kv_bytes / ms['fp8'] / 1e9:.2f} TB/s), fp8/16-bit speed "
              f"{ms['16-bit'] / ms['fp8']:.2f}x, bitwise {torch.equal(outs['fp8'], outs['16-bit'])}, "
              f"same bits as the first tiles with this block_n {all(same)}", flush=True)


def hot_l2_ms(call, calls=100, rounds=7):
    """Median over rounds of the time a call, `calls` calls back to back in one CUDA graph (no host gaps; the
    data stays in the L2). The wrapper is planned with use_cuda_graph=True."""
    graphs, _ = common.capture_cuda_graphs([lambda: [call() for _ in range(calls)]])
    times = []
    for _ in range(rounds + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs[0].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times[2:])[rounds // 2]


if __name__ == "__main__":
    main()
