"""Decode of ragged batches (GPU): the bandwidth kernel's plans under settings read at plan time, eager and replayed
from a CUDA graph, alternating in one process on the same inputs; the first variant is the yardstick.

    PYTHONPATH=$PWD python3 scripts/probe_decode_ragged.py [--batches 64,128,256] [--groups 4,8] [--rounds 3]
        [--tensor-cores]
        [--variants "off=SERVEATTN_DECODE_ORDER:request,SERVEATTN_DECODE_RAGGED_SPLIT:0;default="]
        [--kv-dtype float8_e4m3fn]

A variant's settings are environment variables read at plan time, or `decode.NAME:value` for a switch of
serveattn.kernels.decode read once at import (Q_HELD, FOLD_CALL, MERGE_MODE, ...): set on the module while that
variant plans and makes its first call (which fills the plan's launch memo), then put back.

A batch's KV lengths are drawn lognormal (median ~1800 keys, capped at 32768), uniform in 1..8192, or 1024 keys
with one request of 32768 (outlier), one draw a (batch, distribution), or are all N keys (--dists keysN) or N +-10%
(jitterN), on shuffled pages: the lengths and page table of `python -m serveattn.bench decode --ragged` (which
times them against FlashInfer). Prints a row a case:
each variant's do_bench median (best of the rounds), its time over the first variant's (below 1: faster), and
whether every variant's output equals the first's bitwise (a split changes the bits, as a split plan's do; an order alone must not).
"""
import argparse
import os

import numpy as np
import torch

import serveattn
from serveattn.bench import common
from serveattn.bench import decode as decode_bench

HKV, D, PS = decode_bench.HKV, decode_bench.HEAD_DIM, decode_bench.PAGE_SIZE


def inputs(kv_lens: np.ndarray, group: int, seed: int, kv_dtype: torch.dtype = torch.bfloat16):
    """The bench's ragged page table (shuffled pages) with a random cache (of kv_dtype) and a bf16 q for `group`
    query heads a KV head."""
    meta = decode_bench.build_meta(kv_lens.size, int(kv_lens.max()), seed=seed, device="cuda",
                                   kv_lens=kv_lens.tolist())
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(meta.num_pages, 2, PS, HKV, D, generator=gen).to(device="cuda", dtype=kv_dtype)
    q = torch.randn(kv_lens.size, HKV * group, D, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    return meta.indptr, meta.indices, meta.last_page_len, cache, q


def runner(settings: dict, graph: bool, args_in, group: int, tensor_cores: bool = False):
    """(call, out) for the wrapper planned under the settings (environment variables), eager or captured."""
    from serveattn.kernels import decode as decode_kernel
    indptr, indices, last, cache, q = args_in
    switches = {k.split(".", 1)[1]: v for k, v in settings.items() if k.startswith("decode.")}
    env = {k: v for k, v in settings.items() if not k.startswith("decode.")}
    saved = {name: getattr(decode_kernel, name) for name in switches}
    for name, value in switches.items():
        setattr(decode_kernel, name, value == "1" if isinstance(saved[name], bool) else value)
    os.environ.update(env)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kw = {}
    if graph:
        kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
                  paged_kv_indices_buffer=torch.empty_like(indices),
                  paged_kv_last_page_len_buffer=torch.empty_like(last))
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton", use_tensor_cores=tensor_cores, **kw)
    w.plan(indptr, indices, last, HKV * group, HKV, D, PS, q_data_type=torch.bfloat16, kv_data_type=cache.dtype)
    for name in env:
        os.environ.pop(name)
    out = torch.empty_like(q)
    w.run(q, cache, out=out)
    for name, value in saved.items():
        setattr(decode_kernel, name, value)
    if not graph:
        return (lambda: w.run(q, cache, out=out)), out
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out)
    return (lambda: (w, g.replay())), out  # the closure keeps the wrapper (its plan buffers) alive


def parse_variants(text: str) -> dict:
    """"name=VAR:value,VAR:value;name=..." -> {name: {VAR: value}}"""
    variants = {}
    for part in text.split(";"):
        name, _, pairs = part.partition("=")
        variants[name] = dict(pair.split(":", 1) for pair in pairs.split(",") if pair)
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--groups", default="4,8")
    ap.add_argument("--dists", default="lognormal,uniform,outlier")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensor-cores", action="store_true",
                    help="the tensor-core route (the prefill kernel; e.g. with SERVEATTN_PREFILL_RAGGED_SPLIT:2)")
    ap.add_argument("--variants", default="off=SERVEATTN_DECODE_ORDER:request,SERVEATTN_DECODE_RAGGED_SPLIT:0;default=")
    ap.add_argument("--kv-dtype", default="bfloat16", help="the cache's dtype, e.g. float8_e4m3fn")
    args = ap.parse_args()
    common.require_cuda()
    kv_dtype = getattr(torch, args.kv_dtype)
    variants = parse_variants(args.variants)
    names = list(variants)
    print("| dist | group | batch | KV keys (sum, max) | form | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " | bitwise |")
    print("| --- " * (6 + 2 * len(names) - 1) + "|")
    for dist in args.dists.split(","):
        for batch in map(int, args.batches.split(",")):
            # keysN: every request N keys (the uniform-length rows of bench decode, e.g. 32 x keys2048); jitterN:
            # N keys +-10%, one draw a batch (near-equal lengths, where a cut by the batch's mean would cut them all)
            if dist.startswith("keys"):
                kv_lens = np.full(batch, int(dist[4:]))
            elif dist.startswith("jitter"):
                n = int(dist[6:])
                kv_lens = np.random.default_rng(batch).integers(n - n // 10, n + n // 10 + 1, batch)
            else:
                kv_lens = np.array(decode_bench.ragged_lengths(batch, dist))
            for group in map(int, args.groups.split(",")):
                data = inputs(kv_lens, group, batch * 10 + group, kv_dtype)
                for graph in (False, True):
                    calls = {n: runner(variants[n], graph, data, group, args.tensor_cores) for n in names}
                    for call, _ in calls.values():
                        call()
                    torch.cuda.synchronize()
                    same = [torch.equal(calls[names[0]][1], calls[n][1]) for n in names[1:]]
                    times = {n: [] for n in names}
                    for _ in range(args.rounds):  # the variants alternate
                        for n in names:
                            times[n].append(common.bench_ms(calls[n][0], 10, 50))
                    best = {n: min(ms) for n, ms in times.items()}
                    print(f"| {dist} | {group} | {batch} | {int(kv_lens.sum())}, {int(kv_lens.max())} | "
                          f"{'graph' if graph else 'eager'} | " + " | ".join(f"{best[n]:.4f}" for n in names)
                          + " | " + " | ".join(f"{best[n] / best[names[0]]:.3f}" for n in names[1:])
                          + f" | {'/'.join(str(x) for x in same)} |", flush=True)
                    del calls


if __name__ == "__main__":
    main()
