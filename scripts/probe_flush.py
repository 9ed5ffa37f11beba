"""How the L2 flush before a timed call moves small calls' times: a plain read (torch.sum) and a device copy of
16-536 MB by default, each timed under the bench's two flushes (serveattn.bench.common.FLUSH: "zero", triton's do_bench,
which leaves the L2 dirty; "read", which leaves it clean), alternating in one process. A call that reads less
than a few L2 sizes pays the zero flush's write-back of dirty lines; a copy's own writes are the same either way.

    python3 scripts/probe_flush.py [--sizes-mb 16,33.5,64,134,268,536] [--rounds 3]
"""
import argparse

import torch

from serveattn.bench import common


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="16,33.5,64,134,268,536")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    l2 = common.l2_cache_bytes()
    print(f"{torch.cuda.get_device_name()}, L2 {l2 / 2 ** 20:.0f} MiB; median us of do_bench-style timing "
          f"(warm-up 25 ms, repetitions 100 ms), best of {args.rounds} rounds per flush")
    print("| op | MB | flush zero us | GB/s | flush read us | GB/s | zero / read |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mb in (float(x) for x in args.sizes_mb.split(",")):
        n = int(mb * 1e6) // 4
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        for op, fn, moved in (("sum (read)", lambda: torch.sum(x), 4 * n),
                              ("copy (read + write)", lambda: y.copy_(x), 8 * n)):
            best = {}
            for _ in range(args.rounds):
                for flush in common.FLUSHES:
                    common.FLUSH = flush
                    ms = common.bench_ms(fn, 25, 100)
                    best[flush] = min(best.get(flush, ms), ms)
            z, r = best["zero"], best["read"]
            print(f"| {op} | {mb:g} | {z * 1e3:.1f} | {moved / z / 1e6:.0f} | {r * 1e3:.1f} | {moved / r / 1e6:.0f} | "
                  f"{z / r:.2f} |", flush=True)
    common.FLUSH = "zero"


if __name__ == "__main__":
    main()
