"""What batch-invariant plans cost (GPU): the same calls planned as vLLM plans them in its two modes, timed in turn.

vLLM's FlashInfer backend passes fixed_split_size=-1 / disable_split_kv=False normally, and a fixed chunk (2048
for prefill, 4096 for decode; pages, FlashInfer's unit, so 32768 / 65536 keys at page 16 since session 54, when
serveattn stopped reading them as keys) or disable_split_kv=True in its batch-invariant mode. Under either, our prefill
tiles are the any-length ones (128 rows, not sized to the batch's longest request) and decode never chooses its
split from the batch. This prints each case's time under each setting and the ratio to the ordinary plan.

    PYTHONPATH=$PWD python3 scripts/probe_batch_invariant.py [--cases prefill-32x16x2048,decode-1x8192] [--rounds 3]

Cases: prefill-BxQxKV (the paged prefill wrapper, causal, B requests of Q new tokens over KV keys each),
decode-BxKV (the decode wrapper, bandwidth route), tc-BxKV (its tensor-core route). GQA 32/8, head dim 128, bf16,
page 16, shuffled pages; backend="triton" (auto's batch-invariant choices are the routing tests' concern).
"""
import argparse

import torch

import serveattn
from serveattn.bench import common
from probe_inputs import chunked_prefill, shuffled_pages  # scripts/, beside this file

HQ, HKV, D, PS = 32, 8, 128, 16
DEFAULT = ("prefill-32x16x2048,prefill-8x128x4096,prefill-4x512x8192,prefill-1x2048x2048,"
           "decode-1x8192,decode-8x4096,decode-64x1024,tc-1x8192,tc-16x2048")
SETTINGS = {"ordinary": dict(fixed_split_size=-1, disable_split_kv=False),
            "fixed 2048": dict(fixed_split_size=2048), "fixed 4096": dict(fixed_split_size=4096),
            "disabled": dict(disable_split_kv=True)}


def _call(case, ws, setting):
    """() -> None: the case's run() after its plan under the setting's split arguments."""
    kind, shape = case.split("-", 1)
    dims = list(map(int, shape.split("x")))
    batch, kv = dims[0], dims[-1]
    if kind == "prefill":
        w, q, cache = chunked_prefill(ws, batch, dims[1], kv, PS, (HQ, HKV, D), **setting)
    else:
        indptr, indices, last, cache = shuffled_pages(batch, kv, PS, HKV, D)
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=kind == "tc", backend="triton")
        w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=torch.bfloat16, **setting)
    out = torch.empty_like(q)
    return lambda: w.run(q, cache, out=out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)}; ms, do_bench median with the L2 flushed, best of {args.rounds} rounds "
          f"(settings in turn); ratio = ordinary / setting (below 1: the batch-invariant plan is slower)")
    for case in args.cases.split(","):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        calls = {}
        for name, setting in SETTINGS.items():
            try:
                calls[name] = _call(case, ws if name == "ordinary" else torch.empty_like(ws), setting)
            except (ValueError, NotImplementedError) as exc:  # a refusal is a result here, printed
                calls[name] = str(exc).split(": ", 1)[-1][:80]
        times = {name: [] for name, fn in calls.items() if callable(fn)}
        for _ in range(args.rounds):
            for name in times:
                times[name].append(common.bench_ms(calls[name], warmup_ms=10, rep_ms=50))
        base = min(times["ordinary"])
        cells = [f"ordinary {base:.4f}"]
        for name in list(SETTINGS)[1:]:
            cells.append(f"{name} {min(times[name]):.4f} ({base / min(times[name]):.2f}x)" if name in times
                         else f"{name} refused: {calls[name]}")
        print(f"{case}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
