"""Where a small-batch decode call's time goes (GPU): the bandwidth kernel built with SERVEATTN_DECODE_TRACE=1
(kernels/decode.py: each program stamps its first work item's timeline into the LSE buffer instead of the LSE), one
traced call after an L2 flush (the bench's conditions), several times a case. Per case: the kernel's span
(%globaltimer, first program's start to last program's end), when programs start (launch skew), and each part of a
program in cycles and us: its item's loads, the KV loop (q, the page table, K/V), its output or partial state with
the completion count, and the fold where it folded; then the critical path: the last program to finish.

    PYTHONPATH=$PWD python3 scripts/probe_decode_trace.py [--cases 1x8192,8x4096,32x2048] [--calls 5] [--save DIR]

GQA 32/8, head dim 128, bf16, page 16, shuffled pages (scripts/probe_host.py's inputs: KV lengths in whole pages),
eager run() (the fused fold included). Results are wrong by design in this mode (no LSE); the output is not checked. --save
writes the raw stamps ([calls, programs, 8] int64) as DIR/decode-trace-CASE.npz.
"""
import argparse
import os

os.environ["SERVEATTN_DECODE_TRACE"] = "1"  # read at import (a constexpr of the kernel)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import serveattn  # noqa: E402
from probe_host import _decode_inputs  # noqa: E402  (scripts/, beside this file: the same inputs)

HQ, HKV, D, PS = 32, 8, 128, 16
SLOTS = 8  # kernels/decode.py TRACE_SLOTS
G_START, C_START, C_ITEM, C_LOOP, C_OUT, C_FOLD, G_END, SMID = range(SLOTS)


def traced(batch: int, kv: int, calls: int):
    """(stamps int64 [calls, programs, SLOTS], programs a KV head, the plan's chunking)."""
    dev = "cuda"
    cache, indptr, indices, last, q, out = _decode_inputs(batch, kv, dev)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev),
                                                     backend="triton")
    w.plan(indptr.cpu(), indices.cpu(), last.cpu(), HQ, HKV, D, PS, q_data_type=torch.bfloat16)
    p = w._plan
    programs = p.num_work_host  # eager grid: one program a work item and KV head
    store = torch.zeros(max(batch * HQ, programs * HKV * SLOTS * 2), dtype=torch.float32, device=dev)
    lse = store[: batch * HQ].view(batch, HQ)  # a view: the stamps run past the LSE into the store
    stamps = store.view(torch.int64)[: programs * HKV * SLOTS].view(programs * HKV, SLOTS)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w.run(q, cache, out=out, lse=lse, return_lse=True)  # compile, warm
    runs = []
    for _ in range(calls):
        flush.zero_()
        store.zero_()
        torch.cuda.synchronize()
        w.run(q, cache, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        runs.append(stamps.cpu().numpy().copy())
    chunking = f"work items {p.num_work_host}, slots {p.num_slots}, chunk {p.chunk}, tiles {p.tiles}"
    return np.stack(runs), chunking


def stats(x: np.ndarray) -> str:
    return f"median {np.median(x):8.2f}  max {np.max(x):8.2f}" if x.size else "(none)"


def report(case: str, st: np.ndarray, chunking: str) -> None:
    print(f"== {case}: {chunking}, {st.shape[0]} traced calls, {st.shape[1]} programs")
    # the clock: cycles per ns from programs that folded (their stamps span most of their time)
    spans, ghz, first_starts, ends = [], [], [], []
    parts = {"item loads": [], "KV loop": [], "output / partial + count": [], "fold": []}
    crit = []
    for run in st:
        g0, g1 = run[:, G_START], run[:, G_END]
        live = run[:, C_LOOP] != 0
        t0 = g0.min()
        spans.append((g1.max() - t0) / 1e3)
        first_starts.append((g0 - t0) / 1e3)
        ends.append((g1 - t0) / 1e3)
        folded = live & (run[:, C_FOLD] != 0)
        cyc = np.where(folded, run[:, C_FOLD], run[:, C_OUT]) - run[:, C_START]
        ns = (g1 - g0).astype(np.float64)
        ok = live & (ns > 0)
        ghz.append(np.median(cyc[ok] / ns[ok]) if ok.any() else np.nan)
        parts["item loads"].append(run[live, C_ITEM] - run[live, C_START])
        parts["KV loop"].append(run[live, C_LOOP] - run[live, C_ITEM])
        parts["output / partial + count"].append(run[live, C_OUT] - run[live, C_LOOP])
        parts["fold"].append(run[folded, C_FOLD] - run[folded, C_OUT])
        last = int(np.argmax(np.where(live, g1, -1)))
        crit.append((last, (g0[last] - t0) / 1e3, (g1[last] - t0) / 1e3, run[last]))
    f = float(np.nanmedian(ghz))
    print(f"   kernel span (globaltimer) us: {stats(np.array(spans))}; clock ~{f:.2f} cycles/ns")
    starts = np.concatenate(first_starts)
    print(f"   program starts after the first, us: {stats(starts)}; ends: {stats(np.concatenate(ends))}")
    for name, values in parts.items():
        v = np.concatenate(values).astype(np.float64)
        print(f"   {name:26s} cycles {stats(v)}   us {stats(v / f / 1e3)}")
    print("   critical path (the last program to end), per call: start us, end us, item / loop / out / fold us")
    for last, start, end, row in crit:
        item = (row[C_ITEM] - row[C_START]) / f / 1e3
        loop = (row[C_LOOP] - row[C_ITEM]) / f / 1e3
        out = (row[C_OUT] - row[C_LOOP]) / f / 1e3
        fold = (row[C_FOLD] - row[C_OUT]) / f / 1e3 if row[C_FOLD] else 0.0
        print(f"     program {last:5d} (SM {row[SMID]:3d}): start {start:6.2f} end {end:6.2f}  "
              f"{item:5.2f} / {loop:6.2f} / {out:5.2f} / {fold:5.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x8192,8x4096,32x2048")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--save", default=None, help="folder for the raw stamps (npz a case)")
    args = ap.parse_args()
    torch.manual_seed(0)
    for case in args.cases.split(","):
        batch, kv = (int(x) for x in case.split("x"))
        st, chunking = traced(batch, kv, args.calls)
        report(case, st, chunking)
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            np.savez(os.path.join(args.save, f"decode-trace-{case}.npz"), stamps=st)


if __name__ == "__main__":
    main()
