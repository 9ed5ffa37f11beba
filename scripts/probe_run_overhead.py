"""Our own Python cost of one decode run(), without Triton's launch (CPU; no GPU needed).

Default: the decode and merge kernels are replaced by no-ops, so what is timed is run()'s checks, the cache split,
the argument assembly and Triton's entry point up to the launch: issue 6's "run() Python overhead".
--fast-launch: the real kernels' JIT functions and our fast launch path (kernels/launch.py: the argument key,
the entry lookup, the globals check) down to a no-op launcher in place of Triton's compiled C launcher; on the
H200's host the C launcher adds its own ~10 us. Batch 256, KV 1024 (--batch, --kv), GQA 32/8, head dim 128, bf16, page 16; best of
9 x 3000 calls; --profile adds a cProfile by own time.

    python scripts/probe_run_overhead.py [--fast-launch] [--profile] [--batch 1 --kv 8192] [--tensor-cores]
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--fast-launch", action="store_true")
ap.add_argument("--profile", action="store_true")
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--kv", type=int, default=1024, help="keys a request (a multiple of 16)")
ap.add_argument("--tensor-cores", action="store_true", help="use_tensor_cores=True: the prefill kernel's route")
ARGS = ap.parse_args()
# --fast-launch needs JITFunctions (the interpreter would hand out InterpretedFunctions) with CPU tensors
os.environ["TRITON_INTERPRET"] = "0" if ARGS.fast_launch else os.environ.get("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import serveattn  # noqa: E402
from serveattn.kernels import decode as decode_kernels  # noqa: E402
from probe_run_overhead_fakes import fast_launch_to_nothing  # noqa: E402  (scripts/, beside this file)
from serveattn.kernels import launch as fast  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main():
    if ARGS.fast_launch:
        from serveattn.kernels import attention
        fast_launch_to_nothing(decode_kernels.decode_kernel, decode_kernels.merge_kernel, attention.prefill_kernel,
                               attention.split_merge_kernel)
    else:
        decode_kernels.decode_kernel = decode_kernels.merge_kernel = _NoLaunch()
    batch, pages = ARGS.batch, ARGS.kv // 16
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages).to(torch.int32)
    last = torch.full((batch,), 16, dtype=torch.int32)
    cache = torch.randn(batch * pages, 2, 16, 8, 128, dtype=torch.bfloat16)
    q = torch.randn(batch, 32, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8), backend="triton",
                                                     use_tensor_cores=ARGS.tensor_cores)
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    for _ in range(300):
        w.run(q, cache, out=out)
    if ARGS.fast_launch and not ARGS.tensor_cores and not fast._launches_of(decode_kernels.decode_kernel).entries:
        sys.exit("the fast launch path kept no entry: the probe would time Triton's path")
    best = float("inf")
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(3000):
            w.run(q, cache, out=out)
        best = min(best, (time.perf_counter() - t) / 3000 * 1e6)
    how = "through our fast launch to a no-op launcher" if ARGS.fast_launch else "without Triton's launch"
    route = "tensor-core" if ARGS.tensor_cores else "bandwidth"
    print(f"decode run() ({route} route) at batch {batch}, kv {ARGS.kv} {how}: {best:.1f} us")
    if ARGS.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3000):
            w.run(q, cache, out=out)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
