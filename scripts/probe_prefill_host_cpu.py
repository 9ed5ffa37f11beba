"""Host cost of one eager prefill run() on this machine's CPU (no GPU needed): the CPU proxy of the H200 host's
117 us for 512 ragged tokens (docs/runs/2026-12-03T1603-probe-host-prefill.txt).

Our Python only: the warp-specialized kernel's launch is replaced by a stub (Triton's launch path, about half of
run() on the H200 host, is not in this number), and attention_ws.serves by True (CPU tensors are not CUDA). Ragged
and paged (page copy off: it needs CUDA), 512 tokens, GQA 32/8, head dim 128, bf16; best of 7 x 2000 calls.
--fast-launch: the real Gluon JIT function and our fast launch path (kernels/launch.py: the argument key with its
three TMA descriptors, the entry lookup, the globals check) down to a no-op launcher in place of Triton's compiled
one, as scripts/probe_run_overhead.py --fast-launch does for decode (the descriptors' encoding, Triton's C launcher
and the launch itself are not in this number).

    python scripts/probe_prefill_host_cpu.py [--fast-launch] [--profile]
"""
import argparse
import os
import sys

FAST = "--fast-launch" in sys.argv
# --fast-launch needs JITFunctions (the interpreter would hand out InterpretedFunctions) with CPU tensors
os.environ["TRITON_INTERPRET"] = "0" if FAST else os.environ.get("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import serveattn  # noqa: E402
from probe_plan_cpu import best_us, print_profile  # noqa: E402  (scripts/, beside this file)
from probe_run_overhead_fakes import fast_launch_to_nothing  # noqa: E402
from serveattn.kernels import attention_ws  # noqa: E402
from serveattn.kernels import launch as fast  # noqa: E402


class _StubKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--fast-launch", action="store_true")
    args = ap.parse_args()
    attention_ws.serves = lambda *a, **k: True
    if args.fast_launch:
        fast_launch_to_nothing(attention_ws.prefill_ws_kernel)
    else:
        attention_ws.prefill_ws_kernel = _StubKernel()
    attention_ws._num_sms = lambda device: 132
    s, ws = 512, torch.empty(64 << 20, dtype=torch.uint8)
    q = torch.randn(s, 32, 128, dtype=torch.bfloat16)
    qo = torch.tensor([0, s], dtype=torch.int32)
    k, v = (torch.randn(s, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    ragged = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="triton")
    ragged.plan(qo, qo, 32, 8, 128, causal=True, q_data_type=torch.bfloat16)
    pages = s // 16
    cache = torch.randn(pages, 2, 16, 8, 128, dtype=torch.bfloat16)
    paged = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="triton")
    paged.plan(qo, torch.tensor([0, pages], dtype=torch.int32), torch.randperm(pages).to(torch.int32),
               torch.tensor([16], dtype=torch.int32), 32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    for name, call in (("ragged", lambda: ragged.run(q, k, v, out=out)),
                       ("paged", lambda: paged.run(q, cache, out=out))):
        best = best_us(call, warmup=200, calls=2000)
        if args.fast_launch and not fast._launches_of(attention_ws.prefill_ws_kernel).entries:
            sys.exit("the fast launch path kept no entry: the probe would time Triton's path")
        how = "through our fast launch to a no-op launcher" if args.fast_launch else "kernel launch stubbed"
        print(f"prefill {name} 1x{s} run(), our Python ({how}): {best:.1f} us")
        if args.profile:
            print_profile(call, 2000, "tottime", 18)


if __name__ == "__main__":
    main()
