"""Compile FlashInfer's kernel configurations the benches use, all at once (GPU, after gpu_run.sh fi-setup).

    PYTHONPATH=$PWD python3 scripts/fi_warm.py [--configs prefill-fa2,prefill-fa3,decode-cc,decode-tc,fp8-fa3,fp8-tc8]

FlashInfer JIT-compiles each configuration at its first use (12 s to 2 min on the H200), and the benches meet
them one after another. Here each configuration is built in its own process, side by side, through the benches'
own prepare functions on a small case (the same plan arguments, so the same compiled module), and each process
prints how long its first call took. The modules land in FLASHINFER_WORKSPACE_BASE's cache for the benches of
this call, and for gpu_run.sh fi-save-cache to bring back.
"""
import argparse
import subprocess
import sys
import time

CONFIGS = ("prefill-fa2", "prefill-fa3", "decode-cc", "decode-tc", "fp8-fa3", "fp8-tc8")


def build(config: str) -> None:
    import torch

    t0 = time.perf_counter()
    if config.startswith("prefill-"):
        from serveattn.bench import prefill as bench
        meta = bench.build_meta([256])
        prepared = bench.prepare_flashinfer(config.split("-")[1], meta, [bench.build_inputs(meta, 0)])
    elif config.startswith("decode-"):
        from serveattn.bench import decode as bench
        meta = bench.build_meta(2, 256)
        prepared = bench.prepare_flashinfer(config == "decode-tc", False, meta, [bench.build_inputs(meta, 0)])
    elif config == "fp8-fa3":  # bench fp8's fi-fa3-fp8 peer (e4m3 q and cache)
        from serveattn.bench import fp8, prefill
        meta = prefill.build_meta([256])
        prepared = fp8.prepare_prefill_flashinfer(meta, [fp8.prefill_set(meta, 0)])
    else:  # fp8-tc8: bench fp8's fi-tc8 peer (tensor-core decode, bf16 q, e4m3 cache)
        from serveattn.bench import decode, fp8
        meta = decode.build_meta(2, 256)
        prepared = fp8.prepare_decode_peer("fi-tc8", meta, [fp8.decode_set(meta, 0)])
    prepared.fns[0]()
    torch.cuda.synchronize()
    print(f"fi_warm: {config}: first call {time.perf_counter() - t0:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS[:4]))  # the fp8 ones when asked (bench fp8's peers)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: build this configuration
    args = ap.parse_args()
    if args.one:
        build(args.one)
        return
    t0 = time.perf_counter()
    children = {c: subprocess.Popen([sys.executable, __file__, "--one", c]) for c in args.configs.split(",")}
    failed = [c for c, p in children.items() if p.wait() != 0]
    print(f"fi_warm: {len(children)} configurations in {time.perf_counter() - t0:.1f} s"
          + (f"; failed: {failed}" if failed else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
