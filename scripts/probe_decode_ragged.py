"""Decode of ragged batches (GPU): the bandwidth kernel's plan with its items in request order against the same
plan with the longest items first (SERVEATTN_DECODE_ORDER=cost, read at plan time), eager and replayed from a
CUDA graph, alternating in one process, the same inputs.

    PYTHONPATH=$PWD python3 scripts/probe_decode_ragged.py [--batches 64,128,256] [--groups 4,8] [--rounds 3]

A batch's KV lengths are drawn lognormal (median ~1800 keys, capped at 32768) or uniform in 1..8192, one draw a
(batch, distribution), on shuffled pages. The bench (`python -m serveattn.bench decode`) has equal lengths
only: there the order cannot matter. Prints a row a case: the two orders' do_bench medians (best of the rounds)
and cost / request order (below 1: the order helps), and whether the two outputs are bitwise equal.
"""
import argparse
import os

import numpy as np
import torch

import serveattn
from serveattn.bench import common

HKV, D, PS = 8, 128, 16


def lengths(dist: str, batch: int, rng) -> np.ndarray:
    if dist == "uniform":
        return rng.integers(1, 8193, batch)
    return np.minimum(np.exp(rng.normal(7.5, 1.0, batch)).astype(np.int64) + 1, 32768)


def inputs(kv_lens: np.ndarray, group: int, gen):
    pages = -(-kv_lens // PS)
    total = int(pages.sum())
    i32 = dict(dtype=torch.int32, device="cuda")
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), **i32)
    indices = torch.randperm(total + 7, generator=gen)[:total].to(**i32)
    last = torch.tensor(kv_lens - (pages - 1) * PS, **i32)
    cache = torch.randn(total + 7, 2, PS, HKV, D, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(kv_lens.size, HKV * group, D, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    return indptr, indices, last, cache, q


def runner(order: str, graph: bool, args_in, group: int):
    """(call, out) for the wrapper planned under SERVEATTN_DECODE_ORDER=order, eager or captured."""
    indptr, indices, last, cache, q = args_in
    os.environ["SERVEATTN_DECODE_ORDER"] = order
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kw = {}
    if graph:
        kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
                  paged_kv_indices_buffer=torch.empty_like(indices),
                  paged_kv_last_page_len_buffer=torch.empty_like(last))
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton", **kw)
    w.plan(indptr, indices, last, HKV * group, HKV, D, PS, q_data_type=torch.bfloat16)
    os.environ.pop("SERVEATTN_DECODE_ORDER")
    out = torch.empty_like(q)
    w.run(q, cache, out=out)
    if not graph:
        return (lambda: w.run(q, cache, out=out)), out
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out)
    return (lambda: (w, g.replay())), out  # the closure keeps the wrapper (its plan buffers) alive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--groups", default="4,8")
    ap.add_argument("--dists", default="lognormal,uniform")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    common.require_cuda()
    print("| dist | group | batch | KV keys (sum, max) | form | request order ms | costliest first ms | cost / request "
          "| bitwise |")
    print("| --- " * 9 + "|")
    for dist in args.dists.split(","):
        for batch in map(int, args.batches.split(",")):
            kv_lens = lengths(dist, batch, np.random.default_rng(batch))
            for group in map(int, args.groups.split(",")):
                data = inputs(kv_lens, group, torch.Generator().manual_seed(batch * 10 + group))
                for graph in (False, True):
                    calls = {order: runner(order, graph, data, group) for order in ("", "cost")}
                    for call, _ in calls.values():
                        call()
                    torch.cuda.synchronize()
                    same = torch.equal(calls[""][1], calls["cost"][1])
                    times = {"": [], "cost": []}
                    for _ in range(args.rounds):  # the two orders alternate
                        for order in times:
                            times[order].append(common.bench_ms(calls[order][0], 10, 50))
                    best = {order: min(ms) for order, ms in times.items()}
                    print(f"| {dist} | {group} | {batch} | {int(kv_lens.sum())}, {int(kv_lens.max())} | "
                          f"{'graph' if graph else 'eager'} | {best['']:.4f} | {best['cost']:.4f} | "
                          f"{best['cost'] / best['']:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
