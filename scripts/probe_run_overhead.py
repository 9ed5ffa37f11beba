"""Our own Python cost of one decode run(), without Triton's launch (CPU; no GPU needed).

The decode and merge kernels are replaced by no-ops, so what is timed is run()'s checks, the cache split, the
argument assembly and Triton's entry point up to the launch: issue 6's "run() Python overhead". Batch 256,
KV 1024, GQA 32/8, head dim 128, bf16, page 16; best of 9 x 3000 calls.

    python scripts/probe_run_overhead.py
"""
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import serveattn  # noqa: E402
from serveattn.kernels import decode as decode_kernels  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main():
    decode_kernels.decode_kernel = decode_kernels.merge_kernel = _NoLaunch()
    batch, pages = 256, 64
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages).to(torch.int32)
    last = torch.full((batch,), 16, dtype=torch.int32)
    cache = torch.randn(batch * pages, 2, 16, 8, 128, dtype=torch.bfloat16)
    q = torch.randn(batch, 32, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8), backend="triton")
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    for _ in range(300):
        w.run(q, cache, out=out)
    best = float("inf")
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(3000):
            w.run(q, cache, out=out)
        best = min(best, (time.perf_counter() - t) / 3000 * 1e6)
    print(f"decode run() at batch 256 without Triton's launch: {best:.1f} us")


if __name__ == "__main__":
    main()
