"""Prefill speed probe (GPU): our paged causal prefill for bf16, kv8 (bf16 q over an e4m3 cache) and fp8 (e4m3 q
and cache), timing only, so kernel knobs that give up a contract can be measured. One line per (case, dtype):

    PYTHONPATH=$PWD python3 scripts/probe_prefill.py [--cases 1x8192,16x2048] [--kinds bf16,kv8,fp8]
        [--tiles "128,128,8,2;128,256,8,2"]   # sweeps SERVEATTN_PREFILL_TILES in one process
        [--ab "SERVEATTN_PREFILL_WS_QTMA=1;SERVEATTN_PREFILL_WS_QTMA=0" --rounds 3]   # A/B, settings in turn
        [--profile]   # each kernel's device time a call (transposed V copy, page copy, attention)

Knobs read from the environment: SERVEATTN_PREFILL_TILES=block_m,block_n,warps,stages, SERVEATTN_EARLY_V=0,
SERVEATTN_FP8_VT=0 (no transposed V copy), SERVEATTN_FAST_WIDEN=0 (Triton's fp8 -> bf16 conversion),
SERVEATTN_FP8_BOUNDARY=0 (see serveattn/kernels/common.py); for the warp-specialized kernel SERVEATTN_PREFILL_WS=0,
SERVEATTN_PREFILL_WS_FP8=1, SERVEATTN_PREFILL_WS_QTMA=0, SERVEATTN_PREFILL_WS_PERSISTENT=0, SERVEATTN_PREFILL_GATHER=0
(kernels/attention_ws.py, kernels/attention.py)."""
import argparse
import os

import torch
import triton.testing

import serveattn
import tile_sweep  # scripts/, beside this file

HQ, HKV, D, PS = 32, 8, 128, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x8192")
    ap.add_argument("--kinds", default="bf16,kv8,fp8")
    ap.add_argument("--tiles", default="", help="';'-separated SERVEATTN_PREFILL_TILES values to sweep")
    ap.add_argument("--ab", default="", help="';'-separated settings (NAME=value[,NAME=value]; the wrapper is "
                    "planned anew for each), e.g. SERVEATTN_PREFILL_WS_PERSISTENT=1;SERVEATTN_PREFILL_WS_PERSISTENT=0,"
                    " timed in turn, --rounds times each, on the same inputs in this process")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=D)
    ap.add_argument("--profile", action="store_true", help="also each kernel's device time a call (CUDA profiler)")
    ap.add_argument("--non-causal", action="store_true", help="every query sees every key (TFLOP/s counts them all)")
    ap.add_argument("--full-bf16", action="store_true", help="a bf16 cache of torch.randn values (default: the e4m3 "
                    "cache's values widened, so bf16 and fp8 kinds share inputs; fewer mantissa bits toggle)")
    args = ap.parse_args()
    tile_sweep.sweep("SERVEATTN_PREFILL_TILES", args.tiles, lambda: probe(args))


def probe(args):
    from serveattn.bench.common import raise_clocks
    raise_clocks()  # the first case timed on an idle GPU came out slow
    knobs = {k: v for k, v in os.environ.items() if k.startswith("SERVEATTN_")}
    e4m3 = torch.float8_e4m3fn
    for case in args.cases.split(","):
        batch, s = map(int, case.split("x"))
        pages = s // PS
        gen = torch.Generator(device="cuda").manual_seed(0)
        d = args.head_dim
        cache8 = torch.randn(batch * pages, 2, PS, HKV, d, device="cuda", generator=gen).to(e4m3)
        q = torch.randn(batch * s, HQ, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * s
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
        indices = torch.randperm(batch * pages, dtype=torch.int64).to(torch.int32)
        last = torch.full((batch,), PS, dtype=torch.int32)
        one = torch.ones(1, device="cuda")
        flops = (4 if args.non_causal else 2) * batch * s * s * HQ * d
        for kind in args.kinds.split(","):
            qd = e4m3 if kind == "fp8" else torch.bfloat16
            kd = torch.bfloat16 if kind == "bf16" else e4m3
            cache = cache8 if kd == e4m3 else cache8.to(kd)
            if kd != e4m3 and args.full_bf16:
                cache = torch.randn(cache8.shape, device="cuda", generator=gen).to(kd)
            qq = q.to(e4m3) if kind == "fp8" else q

            def make_fn():  # planned anew for each --ab setting (some knobs are read at plan time)
                w = serveattn.BatchPrefillWithPagedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), backend="triton")
                w.plan(qo_indptr, indptr, indices, last, HQ, HKV, d, PS, causal=not args.non_causal, q_data_type=qd,
                       kv_data_type=kd)
                if kind == "fp8":
                    return w, lambda: w.run(qq, cache, scale_q=one, scale_k=one, scale_v=one)
                return w, lambda: w.run(qq, cache)

            if args.ab:
                ab(case, kind, make_fn, flops, args.ab.split(";"), args.rounds)
                continue
            w, fn = make_fn()
            ms = bench(fn)
            print(f"{case} d{d} {kind:4s} {knobs}: {ms:.4f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            if args.profile:
                from probe_decode_profile import kernel_times  # scripts/, beside this file
                for name, (calls, us) in sorted(kernel_times(fn, 20).items(), key=lambda kv: -kv[1][0] * kv[1][1]):
                    print(f"    {calls:4.1f} x {us:8.1f} us  {name[:90]}", flush=True)


_timed_once = False


def bench(fn):
    """Median ms of fn; the first timing in this process is taken twice and its first result dropped (it came out
    slow even after raise_clocks: 322 against 546 TFLOP/s in the next round, H200 session 11)."""
    global _timed_once
    if not _timed_once:
        _timed_once = True
        triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def ab(case, kind, make_fn, flops, settings, rounds):
    """Each setting timed in turn, `rounds` times: one line per setting with every round's TFLOP/s, the median,
    and the first setting's median time over this one's (interleaving keeps clock drift out of the ratio).
    A setting's variables stay set for the next one: name every variable the settings vary in each of them."""
    times = {st: [] for st in settings}
    for _ in range(rounds):
        for st in settings:
            for one in st.split(","):  # NAME=value[,NAME=value...]
                name, value = one.split("=", 1)
                os.environ[name] = value
            _, fn = make_fn()
            fn()
            times[st].append(bench(fn))
    base = None
    for st in settings:
        med = sorted(times[st])[len(times[st]) // 2]
        base = base or med
        rates = " ".join(f"{flops / t / 1e9:.0f}" for t in times[st])
        print(f"{case} {kind:4s} {st}: {med:.4f} ms {flops / med / 1e9:.0f} TFLOP/s (rounds {rates}) "
              f"x{base / med:.3f}", flush=True)


if __name__ == "__main__":
    main()
