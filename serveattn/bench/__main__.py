"""``python -m serveattn.bench {prefill,decode,fp8,verify,crossover,all} [--json PATH] [--plot DIR] [--quick]
[--measure-ceilings] ...``
and ``python -m serveattn.bench plot JSON [JSON ...] [--out docs/plots]`` (charts of saved runs, no GPU).

Each family is a module with ``run(args, ceilings, checkpoint) -> dict`` (keys ``ok`` and ``report``,
the markdown printed at the end) and optionally ``add_arguments(parser)``. Adding a family is one line
in ``FAMILIES``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from . import common
from . import plot as plotting

#: subcommand -> (module, one-line help). Order is the order of ``all``.
FAMILIES = {
    "prefill": ("serveattn.bench.prefill",
                "causal prefill (paged + ragged wrappers) vs cuDNN/flash SDPA, FlexAttention, FlashInfer"),
    "decode": ("serveattn.bench.decode",
               "batch decode (paged wrapper, CUDA-core / tensor-core, eager / CUDA graph) vs cuDNN/flash SDPA, "
               "FlexAttention, FlashInfer; K/V TB/s"),
    "fp8": ("serveattn.bench.fp8", "fp8 e4m3 KV decode, fp8 q+KV prefill vs our bf16 on the same data, cuDNN SDPA"),
    "verify": ("serveattn.bench.verify",
               "speculative verify: chain q_len_per_req 1..16 and 16/64-node trees vs k=1, eager / CUDA graph, "
               "vs FlashInfer, flash SDPA"),
    "crossover": ("serveattn.bench.crossover", "backend='auto' crossovers: cuDNN vs our prefill, bandwidth vs "
                  "tensor-core decode, split-KV; writes the docs/routing.md table"),
}


def _shared(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", default=None, help="write every number to this JSON file "
                        "(rewritten after each case, so a cut-short run still leaves one)")
    parser.add_argument("--plot", metavar="DIR", default=None,
                        help="after the run, write one PNG chart per family to DIR/<family>.png (needs matplotlib)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer cases, shorter timing, one pass, one input set (a smoke run)")
    parser.add_argument("--measure-ceilings", action="store_true",
                        help="measure copy bandwidth (1 GiB device copy) and the bf16 rate (8192^3 matmul) "
                             "in this run and use them for the floors, instead of the H200 defaults "
                             f"({common.DEFAULT_BANDWIDTH / 1e12:.2f} TB/s, "
                             f"{common.DEFAULT_BF16_RATE / 1e12:.0f} TFLOP/s)")
    parser.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up, ms (default 25; quick 10)")
    parser.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition time, ms (default 100; quick 40)")
    parser.add_argument("--passes", type=int, default=None,
                        help="interleaved timing passes per runner; the spread between them is the noise "
                             "(default 2; quick 1)")
    parser.add_argument("--flush", choices=common.FLUSHES, default="zero",
                        help="the L2 flush before each timed call: zero (do_bench's: 256 MB written, the L2 left "
                             "dirty, so a small call also pays its write-back) or read (256 MB read: a clean L2)")
    parser.add_argument("--sets", type=int, default=None,
                        help="random input sets to rotate among while timing (default 2; quick 1)")


def _family_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    module = importlib.import_module(FAMILIES[name][0])
    add = getattr(module, "add_arguments", None)
    if add is None:
        return
    group = parser.add_argument_group(f"{name} options")
    try:
        add(group)
    except argparse.ArgumentError:
        pass  # an option another family already added: shared by both


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serveattn.bench",
        description="serveattn benchmarks: our kernels against the peers in one process, on the same random "
                    "data, with floors (bytes / copy bandwidth, flops / matrix rate). Needs a CUDA GPU.")
    sub = parser.add_subparsers(dest="family", metavar="{" + ",".join(list(FAMILIES) + ["all", "plot"]) + "}")
    sub.required = True
    for name, (_, help_) in FAMILIES.items():
        p = sub.add_parser(name, help=help_, description=help_)
        _shared(p)
        _family_arguments(name, p)
    p = sub.add_parser("all", help="every family above, in order", description="every family, in order",
                       conflict_handler="resolve")
    _shared(p)
    for name in FAMILIES:
        _family_arguments(name, p)
    plotting.add_parser(sub)  # not a measuring family: not in FAMILIES, not in ``all``
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.family == "plot":
        return plotting.main(args)
    if args.plot:
        try:  # before any GPU time is spent
            plotting.require_matplotlib()
        except ImportError as exc:
            raise SystemExit(str(exc)) from None
    common.require_cuda()
    common.FLUSH = args.flush

    names = list(FAMILIES) if args.family == "all" else [args.family]
    env = common.environment()
    if args.measure_ceilings:
        common.log("measuring ceilings (1 GiB device copy, 8192^3 bf16 matmul, 8192^3 fp8 _scaled_mm)...")
        ceilings = common.measure_ceilings()
    else:
        ceilings = common.Ceilings()
    payload = {"command": ["python", "-m", "serveattn.bench"] + list(argv if argv is not None else sys.argv[1:]),
               "environment": env, "ceilings": ceilings.to_json(), "flush": args.flush, "families": {}}

    def checkpoint(name):
        def save(result):
            payload["families"][name] = {k: v for k, v in result.items() if k != "report"}
            common.write_json(args.json, payload)
        return save

    reports, ok = [], True
    for name in names:
        try:
            result = importlib.import_module(FAMILIES[name][0]).run(args, ceilings, checkpoint(name))
        except SystemExit:
            raise
        except Exception as exc:  # noqa: BLE001 - one family crashing must not hide the others' numbers
            traceback.print_exc()
            result = {"family": name, "ok": False, "error": common.one_line(exc, 500),
                      "report": f"## {name}\n\nFAILED: {common.one_line(exc, 500)}"}
        ok = ok and bool(result.get("ok"))
        reports.append(result.get("report", ""))
        checkpoint(name)(result)

    header = [
        f"# serveattn.bench {args.family}",
        "",
        f"device: {env.get('device')} (sm {env.get('capability')}, {env.get('sm_count')} SMs); "
        f"torch {env['torch']} (CUDA {env['cuda_runtime']}), triton {env['triton']}, python {env['python']}; "
        f"{env['date_utc']}",
        f"ceilings: {ceilings.describe()}",
        f"L2 flush before each timed call: {args.flush} (--flush)",
        "",
    ]
    print("\n".join(header + reports), flush=True)
    if args.json:
        print(f"\nJSON: {args.json}")
    if args.plot:
        plotting.plot_after_run(payload, args.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
