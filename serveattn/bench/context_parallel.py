"""Context-parallel decode on N GPUs of one host against one GPU:

    torchrun --nproc-per-node 2 -m serveattn.bench.context_parallel [--json PATH] [--quick] ...
    python -m serveattn.bench.context_parallel ...        # without torchrun: one GPU, world size 1

Workloads (``--cases``, ``<batch>x<kv_len>``): 1x1048576 (one request with 1M tokens of KV) and 8x262144 (8
requests of 256k). GQA 32 query heads / 8 KV heads, head dim 128, page size 16, bf16 q and KV (``--kv-dtype e4m3``:
an fp8 cache, k_scale = v_scale = 1), one query row per request (``--q-len-per-req k``: chain verify).

Data: one full paged cache is generated with the same CUDA seed on every rank (the pages shuffled by a
``torch.randperm`` page table); ``shard_page_table`` cuts each request's pages into even contiguous runs, and
each rank copies its own pages into a cache of its own (shuffled again) and frees the rest. Rank 0 keeps the
full cache for the one-GPU baseline: ``BatchDecodeWithPagedKVCacheWrapper`` on the whole page table, timed
while the other GPUs idle, and the reference that the context-parallel output is checked against (relative
norm error, reported; more than 2e-2 marks the case wrong).

Timing: a step is ``ContextParallelDecode.run(q, cache, return_lse=True)``: local decode, one all_gather of the
partial outputs and LSEs (NCCL), merge_states. Every rank runs the same fixed number of warm-up and timed
steps (no do_bench: its adaptive repetition count could differ between ranks and deadlock the collective),
the ranks start together (a barrier on a gloo group after a device synchronize), CUDA events bracket the
timed loop, and the reported step time is the maximum over ranks. A second loop records CUDA events at the
phase boundaries of every step (``phase_marker``) for the breakdown: local attention (min and max over
ranks: the imbalance), the all_gather inside the step (which includes waiting for the slowest rank) and its
share of the step, and merge; a third loop times the all_gather alone. No L2 flush: each rank's share of the
K/V (GiB) dwarfs the L2.

Nothing here touches CUDA at import time: ``--help`` works on any machine.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from typing import List, Optional, Tuple

from . import common

HQ, HKV, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
WORKSPACE_BYTES = 256 << 20
TOL = 2e-2
CASES = ("1x1048576", "8x262144")
QUICK_CASES = ("1x131072", "8x32768")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m serveattn.bench.context_parallel",
        description="Context-parallel decode (serveattn.distributed.ContextParallelDecode) on the N GPUs of a "
                    "torchrun job against BatchDecodeWithPagedKVCacheWrapper on one GPU: step time, speedup, and "
                    "the all_gather's share of the step. GQA 32/8, head dim 128, page size 16, bf16. Needs CUDA "
                    "GPUs (NCCL); without torchrun it runs one process on one GPU.")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated <batch>x<kv_len> (default {','.join(CASES)}; --quick: "
                        f"{','.join(QUICK_CASES)})")
    p.add_argument("--q-len-per-req", type=int, default=1, help="query rows per request (k > 1: chain verify)")
    p.add_argument("--kv-dtype", choices=("bf16", "e4m3"), default="bf16", help="KV cache dtype (q stays bf16)")
    p.add_argument("--tensor-cores", action="store_true",
                   help="use_tensor_cores=True for the decode wrappers (default: the bandwidth kernel)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per loop (default 50; quick 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before each loop (default 10; quick 3)")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-GPU run (and the output check)")
    p.add_argument("--no-gloo-metadata", action="store_true",
                   help="plan()'s small exchanges and the timing barriers through NCCL instead of a gloo group")
    p.add_argument("--json", metavar="PATH", default=None, help="write every number to this JSON file (rank 0)")
    p.add_argument("--quick", action="store_true", help="smaller cases, fewer steps (a smoke run)")
    return p


def parse_case(text: str) -> Tuple[int, int]:
    try:
        batch, kv_len = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--cases: {text!r} is not <batch>x<kv_len> (e.g. 8x262144).") from None
    if batch < 1 or kv_len < 1:
        raise SystemExit(f"--cases: {text!r} needs a positive batch and kv_len.")
    return batch, kv_len


# ---------------------------------------------------------------- process group

def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(use_gloo_metadata: bool):
    """(rank, world, device, nccl group, metadata group or None); torchrun's environment, else one process."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    meta = dist.new_group(backend="gloo") if use_gloo_metadata else None
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank), dist.group.WORLD, meta


class Sync:
    """Barriers and max/min reductions over ranks, on the gloo group when there is one (no device work)."""

    def __init__(self, group, device):
        self.group, self.device = group, device

    def _tensor(self, values):
        import torch

        return torch.tensor(values, dtype=torch.float64, device="cpu" if self.group is not None else self.device)

    def barrier(self) -> None:
        import torch
        import torch.distributed as dist

        torch.cuda.synchronize()
        dist.all_reduce(self._tensor([0.0]), group=self.group)

    def reduce(self, values: List[float], op: str) -> List[float]:
        import torch.distributed as dist

        t = self._tensor(values)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=self.group)
        return t.cpu().tolist()


# ---------------------------------------------------------------- one case

def make_case(batch: int, kv_len: int, k: int, kv_dtype, rank: int, world: int, device, keep_full: bool):
    """Every rank: (q, its shard table with local page ids, its cache); rank 0 also the full table and cache."""
    import torch

    from ..distributed import shard_page_table

    pages = -(-kv_len // PAGE_SIZE)
    total = batch * pages
    i32 = dict(dtype=torch.int32)
    indptr = torch.arange(batch + 1, **i32) * pages
    indices = torch.randperm(total, generator=torch.Generator().manual_seed(7)).to(torch.int32)
    last = torch.full((batch,), kv_len - (pages - 1) * PAGE_SIZE, **i32)
    gen = torch.Generator(device=device).manual_seed(1234)  # the same data on every rank
    full = torch.randn(total, 2, PAGE_SIZE, HKV, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=gen)
    if kv_dtype != torch.bfloat16:
        full = full.to(kv_dtype)
    q = torch.randn(batch * k, HQ, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=gen)
    s_indptr, s_indices, s_last = shard_page_table(indptr, indices, last, PAGE_SIZE, world, rank)
    n_local = s_indices.numel()
    local_ids = torch.randperm(n_local, generator=torch.Generator().manual_seed(100 + rank)).to(torch.int32)
    mine = torch.empty((max(n_local, 1),) + tuple(full.shape[1:]), dtype=full.dtype, device=device)
    if n_local:
        mine[local_ids.to(device).long()] = full[s_indices.to(device).long()]
    shard = (s_indptr, local_ids, s_last)
    whole = (indptr, indices, last, full) if keep_full else None
    if not keep_full:
        del full
        torch.cuda.empty_cache()
    return q, shard, mine, whole


def loop_ms(fn, iters: int, warmup: int, sync: Optional[Sync]) -> float:
    """Mean ms per call over `iters` back-to-back calls (CUDA events), after `warmup` calls; with a Sync the
    ranks start together (None: this rank alone)."""
    import torch

    for _ in range(warmup):
        fn()
    if sync is not None:
        sync.barrier()
    else:
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def phases_ms(cp, step, iters: int, warmup: int, sync: Sync) -> dict:
    """Mean ms of each phase of a step, from CUDA events recorded at the boundaries run() marks."""
    import torch

    for _ in range(warmup):
        step()
    marks: List[Tuple[str, object]] = []

    def marker(name):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((name, e))

    sync.barrier()
    cp.phase_marker = marker
    try:
        for _ in range(iters):
            step()
    finally:
        cp.phase_marker = None
    torch.cuda.synchronize()
    totals = {"attention": 0.0, "all_gather": 0.0, "merge": 0.0}
    for i in range(0, len(marks), 4):
        (_, a), (_, g), (_, m), (_, e) = marks[i:i + 4]
        totals["attention"] += a.elapsed_time(g)
        totals["all_gather"] += g.elapsed_time(m)
        totals["merge"] += m.elapsed_time(e)
    return {key: value / iters for key, value in totals.items()}


def run_case(name: str, args, rank: int, world: int, device, group, meta, sync: Sync) -> dict:
    import torch
    import torch.distributed as dist

    from .. import BatchDecodeWithPagedKVCacheWrapper
    from ..distributed import ContextParallelDecode, _all_gather

    batch, kv_len = parse_case(name)
    k = args.q_len_per_req
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "e4m3" else torch.bfloat16
    scales = dict(k_scale=1.0, v_scale=1.0) if kv_dtype != torch.bfloat16 else {}
    iters = args.iters or (10 if args.quick else 50)
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    baseline = not args.no_baseline
    q, shard, cache, whole = make_case(batch, kv_len, k, kv_dtype, rank, world, device,
                                       keep_full=baseline and rank == 0)
    result = {"case": name, "batch": batch, "kv_len": kv_len, "q_len_per_req": k, "kv_dtype": args.kv_dtype,
              "gpus": world, "iters": iters, "warmup": warmup}

    ref = None
    if baseline:  # one GPU, the whole table, while the other GPUs wait
        if rank == 0:
            indptr, indices, last, full = whole
            w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device),
                                                   "NHD", use_tensor_cores=args.tensor_cores)
            w.plan(indptr, indices, last, HQ, HKV, HEAD_DIM, PAGE_SIZE, q_data_type=torch.bfloat16,
                   kv_data_type=kv_dtype, q_len_per_req=k)
            ref = w.run(q, full, return_lse=True, **scales)
            result["one_gpu_ms"] = loop_ms(lambda: w.run(q, full, **scales), iters, warmup, None)
            del w, full, whole
            torch.cuda.empty_cache()
        sync.barrier()

    cp = ContextParallelDecode(group, torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD",
                               use_tensor_cores=args.tensor_cores, metadata_group=meta)
    cp.plan(*shard, HQ, HKV, HEAD_DIM, PAGE_SIZE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
            q_len_per_req=k)
    out, lse = cp.run(q, cache, return_lse=True, **scales)
    if ref is not None:
        result["rel_err_vs_one_gpu"] = common.rel_err(out, ref[0])
        finite = torch.isfinite(ref[1])
        result["lse_max_abs_diff"] = float((lse[finite] - ref[1][finite]).abs().max()) if finite.any() else 0.0
        result["ok"] = result["rel_err_vs_one_gpu"] < TOL
    del ref

    def step():
        return cp.run(q, cache, return_lse=True, **scales)

    step_ms = loop_ms(step, iters, warmup, sync)
    phases = phases_ms(cp, step, iters, warmup, sync)
    plan = cp._plan
    gather_ms = loop_ms(lambda: _all_gather(plan.recv, plan.send, group), iters, warmup, sync)
    local_kv_bytes = int(shard[0][-1]) * PAGE_SIZE * HKV * HEAD_DIM * 2 * cache.element_size()
    hi = sync.reduce([step_ms, phases["attention"], phases["all_gather"], phases["merge"], gather_ms], "max")
    lo = sync.reduce([phases["attention"]], "min")
    result.update(step_ms=hi[0], attention_ms_max=hi[1], attention_ms_min=lo[0], all_gather_in_step_ms=hi[2],
                  merge_ms=hi[3], all_gather_alone_ms=hi[4], exchange_bytes_per_rank=plan.send.numel(),
                  local_kv_bytes_rank0=local_kv_bytes)
    result["all_gather_share"] = result["all_gather_in_step_ms"] / result["step_ms"]
    if "one_gpu_ms" in result:
        result["speedup"] = result["one_gpu_ms"] / result["step_ms"]
        result["efficiency"] = result["speedup"] / world
    result["kv_tbps_per_gpu_rank0"] = local_kv_bytes / (phases["attention"] * 1e-3) / 1e12
    sync.barrier()
    return result


# ---------------------------------------------------------------- report

def report(results: List[dict], world: int, args) -> str:
    f = common.fmt
    headers = ["case", "GPUs", "1 GPU ms", "step ms", "speedup", "efficiency", "attention ms (min..max)",
               "all_gather in step ms", "share", "all_gather alone ms", "merge ms", "rank 0 K/V TB/s",
               "rel err vs 1 GPU"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["case"], world, "FAILED: " + r["error"]] + [""] * (len(headers) - 3))
            continue
        rows.append([r["case"], r["gpus"], f(r.get("one_gpu_ms")), f(r["step_ms"]), f(r.get("speedup"), ".2f"),
                     f(r.get("efficiency"), ".2f"), f"{f(r['attention_ms_min'])}..{f(r['attention_ms_max'])}",
                     f(r["all_gather_in_step_ms"]), f"{100 * r['all_gather_share']:.1f}%",
                     f(r["all_gather_alone_ms"]), f(r["merge_ms"]), f(r["kv_tbps_per_gpu_rank0"], ".2f"),
                     f(r.get("rel_err_vs_one_gpu"), ".1e") + ("" if r.get("ok", True) else " WRONG")])
    lines = [f"## context-parallel decode on {world} GPU(s)", "",
             f"GQA {HQ}/{HKV}, head dim {HEAD_DIM}, page size {PAGE_SIZE}, q bf16, KV {args.kv_dtype}, "
             f"q_len_per_req {args.q_len_per_req}, {'tensor-core' if args.tensor_cores else 'bandwidth'} route; "
             f"times are the max over ranks of the mean of back-to-back steps.", "",
             common.markdown_table(headers, rows)]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    common.require_cuda()
    import torch.distributed as dist

    names = common.split_list(args.cases) if args.cases else list(QUICK_CASES if args.quick else CASES)
    for name in names:
        parse_case(name)
    rank, world, device, group, meta = init_distributed(not args.no_gloo_metadata)
    sync = Sync(meta, device)
    payload = {"command": sys.argv, "environment": common.environment(), "world_size": world, "cases": []}
    ok = True
    try:
        for name in names:
            if rank == 0:
                common.log(f"context_parallel: {name} on {world} GPU(s)...")
            try:
                result = run_case(name, args, rank, world, device, group, meta, sync)
            except Exception as exc:  # noqa: BLE001 - a collective failing on one rank fails the job
                if world > 1:
                    raise
                result = {"case": name, "error": common.one_line(exc, 300), "ok": False}
            ok = ok and bool(result.get("ok", True))
            payload["cases"].append(result)
            if rank == 0:
                common.write_json(args.json, payload)
        if rank == 0:
            env = payload["environment"]
            print(f"# serveattn.bench.context_parallel\n\ndevice: {env.get('device')} x {world}; torch "
                  f"{env['torch']} (CUDA {env['cuda_runtime']}), triton {env['triton']}; {env['date_utc']}\n")
            print(report(payload["cases"], world, args), flush=True)
            if args.json:
                print(f"\nJSON: {args.json}")
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
