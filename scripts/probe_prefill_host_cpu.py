"""Host cost of one eager prefill run() on this machine's CPU (no GPU needed): the CPU proxy of the H200 host's
117 us for 512 ragged tokens (docs/runs/2026-12-03T1603-probe-host-prefill.txt).

Our Python only: the warp-specialized kernel's launch is replaced by a stub (Triton's launch path, about half of
run() on the H200 host, is not in this number), and attention_ws.serves by True (CPU tensors are not CUDA). Ragged
and paged (page copy off: it needs CUDA), 512 tokens, GQA 32/8, head dim 128, bf16; best of 7 x 2000 calls.

    python scripts/probe_prefill_host_cpu.py [--profile]
"""
import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import serveattn  # noqa: E402
from probe_plan_cpu import best_us, print_profile  # noqa: E402  (scripts/, beside this file)
from serveattn.kernels import attention_ws  # noqa: E402


class _StubKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    attention_ws.serves = lambda *a, **k: True
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
        print(f"prefill {name} 1x{s} run(), our Python (kernel launch stubbed): {best:.1f} us")
        if args.profile:
            print_profile(call, 2000, "tottime", 18)


if __name__ == "__main__":
    main()
