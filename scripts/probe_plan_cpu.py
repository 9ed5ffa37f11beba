"""Host cost of one decode plan() on this machine's CPU (no GPU needed): the CPU proxy of issue 6's plan target.

Batch 256 x KV 1024 (64 pages of 16 each, shuffled), GQA 32/8, head dim 128, bf16, backend="triton" so each
route is the one use_tensor_cores names; CPU tensors and device (the H200 host adds the device copy and its
own speed). 200 warm-up plans, then the best of 7 x 300. --profile adds a cProfile by cumulative time.

    python scripts/probe_plan_cpu.py [--profile]
"""
import argparse
import cProfile
import os
import pstats

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from host_timing import best_us  # noqa: E402  (scripts/, beside this file)

import serveattn  # noqa: E402


def print_profile(fn, calls: int, sort: str, rows: int) -> None:
    """cProfile of `calls` calls of fn, printed sorted by `sort`, `rows` rows."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats(sort).print_stats(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--batch", default="256x1024", help="requests x KV tokens each (pages of 16)")
    args = ap.parse_args()
    batch, kv = map(int, args.batch.split("x"))
    pages = kv // 16
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    last = torch.full((batch,), 16, dtype=torch.int32)
    for tc in (False, True):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8),
                                                         use_tensor_cores=tc, backend="triton")

        def plan():
            w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)

        best = best_us(plan, warmup=200, calls=300)
        print(f"decode plan, batch {batch} kv {kv}, {'tensor-core' if tc else 'bandwidth'} route: {best:.1f} us", flush=True)
        if args.profile:
            print_profile(plan, 1000, os.environ.get("PROBE_SORT", "cumtime"), int(os.environ.get("PROBE_ROWS", "20")))


if __name__ == "__main__":
    main()
