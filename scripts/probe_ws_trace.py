"""Where a warp-specialized prefill task's time goes (GPU): the kernel built with SERVEATTN_PREFILL_WS_TRACE=1
(kernels/attention_ws.py: each consumer group writes %clock64 stamps a task into the LSE buffer instead of the LSE),
one warm traced call a case, then per (task, group): the wait for q, the item's loads, the wait for K(0), S(0),
softmax(0), the steady block loop (per block), the last P.V, the epilogue, and the gap to the group's next task on the
same SM. Cycles, and us at
the clock the call implies (stamped cycles over the call's CUDA-event time).

    PYTHONPATH=$PWD python3 scripts/probe_ws_trace.py [--cases 1x4096,16x2048] [--kinds bf16,fp8] [--save DIR]

Each part: its mean, its median, and its mean over each (program, group)'s first task against the later ones (a
kernel's start, cold caches and descriptors, weighs on a mean of few tasks a program). --save writes the raw stamps
([tasks, group, slot] int64) and the call's ms as DIR/ws-trace-CASE-KIND.npz.

Paged causal prefill, GQA 32/8, head dim 128, page 16 (scripts/probe_prefill.py's inputs). Results are wrong by
design in this mode (no LSE); the output is not checked.
"""
import argparse
import os

os.environ["SERVEATTN_PREFILL_WS_TRACE"] = "1"  # read at import (a constexpr of the kernel)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import serveattn  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16
SLOTS = 10
# the stamps in time order (kernels/attention_ws.py TRACE) and the part each one closes
ORDER = (0, 8, 9, 1, 2, 3, 4, 5, 6)
PARTS = ("to q ready", "item loads", "K(0) wait", "S(0)", "softmax(0)", "block loop", "last P.V", "epilogue")
LOOP = PARTS.index("block loop")


def traced(case: str, kind: str):
    """(stamps int64 [tasks, 2 groups, 8], the call's ms) of one warm traced call."""
    batch, s = map(int, case.split("x"))
    pages = s // PS
    gen = torch.Generator(device="cuda").manual_seed(0)
    e4m3 = torch.float8_e4m3fn
    cache = torch.randn(batch * pages, 2, PS, HKV, D, device="cuda", generator=gen).to(e4m3)
    q = torch.randn(batch * s, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qd = e4m3 if kind == "fp8" else torch.bfloat16
    if kind == "bf16":
        cache = cache.to(torch.bfloat16)
    else:
        q = q.to(e4m3)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * s
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, dtype=torch.int64).to(torch.int32)
    last = torch.full((batch,), PS, dtype=torch.int32)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                      backend="triton")
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PS, causal=True, q_data_type=qd, kv_data_type=cache.dtype)
    one = torch.ones(1, device="cuda")
    lse = torch.empty(batch * s, HQ, device="cuda", dtype=torch.float32)
    kw = dict(scale_q=one, scale_k=one, scale_v=one) if kind == "fp8" else {}
    tasks = w._plan.num_work_host * HKV
    if tasks * 2 * SLOTS * 8 > lse.numel() * 4:
        raise SystemExit(f"{case}: {tasks} tasks' stamps do not fit the LSE buffer")
    for _ in range(3):  # compile, warm
        w.run(q, cache, lse=lse, **kw)
    lse.view(torch.int64).fill_(-1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    w.run(q, cache, lse=lse, **kw)
    end.record()
    torch.cuda.synchronize()
    stamps = lse.view(torch.int64).reshape(-1)[: tasks * 2 * SLOTS].view(tasks, 2, SLOTS).cpu().numpy()
    return stamps, start.elapsed_time(end)


def report(case: str, kind: str, stamps: np.ndarray, ms: float) -> None:
    n_blocks = stamps[:, :, 7] & 0xFFFFFFFF
    sm = stamps[:, :, 7] >> 32
    ran = (stamps[:, :, 0] >= 0) & (stamps[:, :, 6] >= 0)
    busy = (stamps[:, :, list(ORDER)] >= 0).all(axis=2) & ran & (n_blocks > 0)
    span = max(int((stamps[:, :, 6][ran & (sm == p)]).max() - (stamps[:, :, 0][ran & (sm == p)]).min())
               for p in np.unique(sm[ran]))
    ghz = span / (ms * 1e6)  # cycles a ns: the longest SM's stamped span over the call's time
    per = np.diff(stamps[:, :, list(ORDER)], axis=2)  # [tasks, groups, parts]
    print(f"{case} {kind}: {ms * 1e3:.1f} us a call, {int(ran.sum() // 2)} tasks on {len(np.unique(sm[ran]))} "
          f"programs; longest SM span {span} cycles -> {ghz:.2f} GHz", flush=True)
    sel = busy
    if not sel.any():
        return
    nb = n_blocks[sel]
    parts = per[sel]
    loop_blocks = np.maximum(nb - 1, 1)
    # each (program, group)'s first task: the earliest start among its tasks
    first = np.zeros_like(sel)
    for g in range(2):
        for p in np.unique(sm[ran[:, g], g]):
            mine = np.flatnonzero(ran[:, g] & (sm[:, g] == p))
            first[mine[np.argmin(stamps[mine, g, 0])], g] = True
    is_first = first[sel]
    print(f"    {'part':18s} {'mean cycles':>12s} {'mean us':>8s} {'share':>6s} {'median':>8s} {'1st tasks':>10s} "
          f"{'later':>8s}")
    total = parts.sum(axis=1).mean()
    for i, name in enumerate(PARTS):
        mean = parts[:, i].mean()
        firsts = parts[is_first, i].mean() if is_first.any() else float("nan")
        later = parts[~is_first, i].mean() if (~is_first).any() else float("nan")
        print(f"    {name:18s} {mean:12.0f} {mean / ghz / 1e3:8.3f} {mean / total:6.1%} {np.median(parts[:, i]):8.0f} "
              f"{firsts:10.0f} {later:8.0f}")
    per_block = (parts[:, LOOP][nb > 1] / loop_blocks[nb > 1])
    fixed = total - (nb - 1).mean() * np.median(per_block)
    print(f"    block loop: {np.median(per_block):.0f} cycles a block (median; {np.median(per_block) / ghz / 1e3:.3f} "
          f"us), {nb.mean():.2f} blocks a task; task {total:.0f} cycles, of which fixed (all but the loop's "
          f"blocks at the median) {fixed:.0f} = {fixed / ghz / 1e3:.3f} us", flush=True)
    # the gap between a group's task end and its next task's start on the same program
    gaps = []
    for g in range(2):
        for p in np.unique(sm[ran]):
            mine = ran[:, g] & (sm[:, g] == p)
            starts, ends = stamps[mine, g, 0], stamps[mine, g, 6]
            order = np.argsort(starts)
            gaps.append(starts[order][1:] - ends[order][:-1])
    gaps = np.concatenate(gaps) if gaps else np.zeros(1)
    print(f"    between tasks: {gaps.mean():.0f} cycles mean ({gaps.mean() / ghz / 1e3:.3f} us); groups' task "
          f"starts differ by {np.abs(stamps[ran[:, 0] & ran[:, 1], 0, 0] - stamps[ran[:, 0] & ran[:, 1], 1, 0]).mean():.0f}"
          f" cycles mean", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x4096,16x2048")
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--save", help="folder for the raw stamps (.npz a case and kind)")
    args = ap.parse_args()
    for case in args.cases.split(","):
        for kind in args.kinds.split(","):
            stamps, ms = traced(case, kind)
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                np.savez_compressed(os.path.join(args.save, f"ws-trace-{case}-{kind}.npz"), stamps=stamps, ms=ms)
            report(case, kind, stamps, ms)


if __name__ == "__main__":
    main()
