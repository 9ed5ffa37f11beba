"""Split-KV on the prefill kernel (GPU): the same plans with SERVEATTN_PREFILL_SPLIT=0 and =1 in one process,
timed in turn (do_bench median, the L2 flushed), beside FlashInfer's tensor-core decode where it imports.

    PYTHONPATH=$PWD python3 scripts/probe_prefill_split.py [--cases tc-1x8192,chunk-1x256x16384] [--rounds 3]
        [--chunks 256,512,1024]   # also the split forced to chunks of N keys (SERVEATTN_PREFILL_SPLIT_CHUNK)
        [--graph]                 # tc / tree cases captured in a CUDA graph and replayed (each wrapper its own
                                  # workspace: a captured work list lives in it)

Cases: tc-BxKV (the decode wrapper, use_tensor_cores=True, backend="triton": the prefill kernel, one row per
request), tree-BxKV (5-node trees on that route), chunk-BxQxKV (the paged prefill wrapper, causal, Q new
tokens per request over KV keys: chunked prefill); a "pN" suffix takes pages of N tokens (chunk-1x256x16384p1:
SGLang's page size 1, which the warp-specialized kernel reads only through a copy). GQA 32/8, head dim 128, bf16,
page 16 unless suffixed, shuffled pages.
"""
import argparse
import os

import torch

import serveattn
from serveattn.bench import common
from probe_inputs import chunked_prefill, shuffled_pages  # scripts/, beside this file

HQ, HKV, D, PS = 32, 8, 128, 16
DEFAULT = ("tc-1x8192,tc-8x4096,tc-32x2048,tree-1x8192,tree-8x4096,chunk-1x256x16384,chunk-1x512x32768,"
           "chunk-4x128x8192,chunk-1x256x16384p1,chunk-4x128x8192p1")


def _ours(case, ws, graph=False):
    """() -> None running the case once, after its plan (the plan is redone per setting: the switch is read there);
    graph: the decode wrapper's call captured and replayed."""
    kind, shape = case.split("-", 1)
    shape, _, ps = shape.partition("p")  # a "pN" suffix: pages of N tokens (SGLang's 1, say) instead of PS
    ps = int(ps) if ps else PS
    dims = list(map(int, shape.split("x")))
    batch, kv = dims[0], dims[-1]
    if kind == "chunk":
        w, q, cache = chunked_prefill(ws, batch, dims[1], kv, ps, (HQ, HKV, D))
        plan, indptr, indices, last = w._plan, None, None, None  # the table: the tc cases' FlashInfer peer only
    else:
        indptr, indices, last, cache = shuffled_pages(batch, kv, ps, HKV, D)
        kw = dict(tree_parents=[[-1, 0, 0, 1, 1]] * batch) if kind == "tree" else {}
        rows = 5 if kind == "tree" else 1
        q = torch.randn(batch * rows, HQ, D, dtype=torch.bfloat16, device="cuda")
        bufs = dict(paged_kv_indptr_buffer=torch.empty_like(indptr), paged_kv_indices_buffer=torch.empty_like(indices),
                    paged_kv_last_page_len_buffer=torch.empty_like(last)) if graph else {}
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton",
                                                         use_cuda_graph=graph, **bufs)
        w.plan(indptr, indices, last, HQ, HKV, D, ps, q_data_type=torch.bfloat16, **kw)
        plan = w._prefill._plan
    out = torch.empty_like(q)
    split = "no split" if not plan.num_merge else \
        f"{plan.num_work_host} items, {plan.split_rows} partial rows, {plan.num_merge} merged tokens"
    data = (indptr, indices, last, cache, q, kind, batch, kv)
    if graph and kind != "chunk":
        w.run(q, cache, out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, cache, out=out)
        return g.replay, split, data
    return (lambda: w.run(q, cache, out=out)), split, data


def _flashinfer(data):
    """FlashInfer's tensor-core decode on the same table (tc cases), or None."""
    indptr, indices, last, cache, q, kind, batch, kv = data
    if kind != "tc":
        return None
    try:
        import flashinfer
    except ImportError:
        return None
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=True)
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=torch.bfloat16)
    return lambda: w.run(q, cache)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", default="", help="forced chunk sizes to time beside the rule's")
    ap.add_argument("--graph", action="store_true", help="tc / tree cases replayed from a CUDA graph")
    args = ap.parse_args()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name(0)}; ms, do_bench median with the L2 flushed; settings in turn, "
          f"{args.rounds} rounds{'; tc / tree cases from CUDA graphs' if args.graph else ''}")
    settings = ["0", "1"] + [f"chunk={c}" for c in args.chunks.split(",") if c]
    for case in args.cases.split(","):
        runs = {}
        for setting in settings:
            os.environ["SERVEATTN_PREFILL_SPLIT"] = "0" if setting == "0" else "1"
            if setting.startswith("chunk="):
                os.environ["SERVEATTN_PREFILL_SPLIT_CHUNK"] = setting[6:]
            own = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if args.graph else ws
            runs[setting] = _ours(case, own, args.graph)
            os.environ.pop("SERVEATTN_PREFILL_SPLIT_CHUNK", None)
        os.environ.pop("SERVEATTN_PREFILL_SPLIT", None)
        fi = _flashinfer(runs["1"][2])
        times = {k: [] for k in settings + ["fi"]}
        for _ in range(args.rounds):
            for setting in settings:
                times[setting].append(common.bench_ms(runs[setting][0], warmup_ms=10, rep_ms=50))
            if fi is not None:
                times["fi"].append(common.bench_ms(fi, warmup_ms=10, rep_ms=50))
        best = {k: min(v) for k, v in times.items() if v}
        line = (f"{case}: unsplit {best['0']:.4f}  split {best['1']:.4f}  ({best['0'] / best['1']:.2f}x; "
                f"{runs['1'][1]})")
        for setting in settings[2:]:
            line += f"  {setting} {best[setting]:.4f}"
        if "fi" in best:
            line += (f"  flashinfer tc{' eager' if args.graph else ''} {best['fi']:.4f} "
                     f"(ours split / fi {best['1'] / best['fi']:.2f})")
        print(line, flush=True)


if __name__ == "__main__":
    main()
