#!/usr/bin/env python3
"""The support matrix (what each route serves, per dtype and option), generated from serveattn/policy.py (what is
refused everywhere) and the capability functions of serveattn/routing.py (what each route can serve), written into
README.md between the support-matrix markers.

    python scripts/support_matrix.py          # rewrite the README section
    python scripts/support_matrix.py --check  # exit 1 if the README section differs from what the code says (CI)
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from serveattn import policy, routing  # noqa: E402

README = ROOT / "README.md"
BEGIN = "<!-- support-matrix:begin -->"
END = "<!-- support-matrix:end -->"
F16, BF16, E4M3 = torch.float16, torch.bfloat16, torch.float8_e4m3fn

#: What the cells are computed on: a capable Hopper GPU (the cuDNN column is torch's cuDNN SDPA as serveattn
#: runs it; torch's own per-shape check is asked at plan() time on top of this).
PREFILL = routing.Request(kind="prefill", device_type="cuda", arch=(9, 0), num_sms=132, q_dtype=BF16, kv_dtype=BF16,
                          o_dtype=BF16, head_dim=128, num_qo_heads=32, num_kv_heads=8, causal=True, batch=2,
                          min_qo_len=4096, max_qo_len=4096, min_kv_len=4096, max_kv_len=4096)
DECODE = dataclasses.replace(PREFILL, kind="decode", paged=True, causal=False, min_qo_len=1, max_qo_len=1)

#: column title -> (families it serves, capability function)
ROUTES = {
    "`torch`": (("prefill", "decode"), routing.torch_declines),
    "`triton`: prefill kernel (tensor cores; also decode's tensor-core route)": (("prefill", "decode"),
                                                                                 routing.triton_declines),
    "`triton`: bandwidth decode kernel": (("decode",), routing.bandwidth_declines),
    "`cudnn`: torch cuDNN SDPA (CUDA)": (("prefill",), routing.cudnn_declines),
}


def _refused(check) -> bool:
    try:
        check()
    except (ValueError, NotImplementedError):
        return True
    return False


def _lens(qo: int, kv: int, qo_max=None, kv_max=None) -> dict:
    return dict(min_qo_len=qo, max_qo_len=qo_max or qo, min_kv_len=kv, max_kv_len=kv_max or kv)


#: (row label, policy check that raises for refused requests or None, changes to the request, families)
ROWS = [
    ("float16 q, K/V, output", None, dict(q_dtype=F16, kv_dtype=F16, o_dtype=F16), ("prefill", "decode")),
    ("bfloat16 q, K/V, output", None, {}, ("prefill", "decode")),
    ("fp8 KV cache (e4m3 / e5m2) under a 16-bit query", lambda: policy.check_kv_dtype("m", E4M3, BF16),
     dict(kv_dtype=E4M3), ("prefill", "decode")),
    ("fp8 query + fp8 KV (scale_q / scale_k / scale_v)", lambda: policy.check_q_dtype("m", E4M3, kv_dtype=E4M3),
     dict(q_dtype=E4M3, kv_dtype=E4M3), ("prefill", "decode")),
    ("float32, int8 / uint8, fnuz fp8 inputs; fp8 output", lambda: policy.check_q_dtype("m", torch.float32),
     {}, ("prefill", "decode")),
    ("head dim 64", None, dict(head_dim=64), ("prefill", "decode")),
    ("head dim 128", None, dict(head_dim=128), ("prefill", "decode")),
    ("head dim 256", None, dict(head_dim=256), ("prefill", "decode")),
    ("other head dims (e.g. 96), head_dim_vo != head_dim_qk", lambda: policy.check_head_dim("m", 96), {},
     ("prefill", "decode")),
    ("MHA / GQA / MQA", None, dict(num_qo_heads=8, num_kv_heads=1), ("prefill", "decode")),
    ("paged KV cache", None, dict(paged=True), ("prefill", "decode")),
    ("contiguous K/V (ragged batch, single request)", None, dict(paged=False), ("prefill", "decode")),
    ("requests of different lengths", None, _lens(1024, 1024, 4096, 4096), ("prefill", "decode")),
    ("causal, kv_len == qo_len", None, dict(causal=True), ("prefill",)),
    ("causal, kv_len > qo_len (bottom-right aligned)", None, dict(causal=True, **_lens(1024, 4096)), ("prefill",)),
    ("no mask", None, dict(causal=False), ("prefill", "decode")),
    ("custom_mask / packed_custom_mask", None, dict(custom_mask=True), ("prefill",)),
    ("window_left >= 0", None, dict(window_left=128), ("prefill", "decode")),
    ("logits_soft_cap > 0", None, dict(soft_cap=30.0), ("prefill", "decode")),
    ("pos_encoding_mode='ROPE_LLAMA'", None, dict(rope=True), ("prefill", "decode")),
    ("ALIBI", lambda: policy.check_pos_encoding("m", "ALIBI"), {}, ("prefill", "decode")),
    ("q_len_per_req > 1 (chain verify)", None, dict(q_len_per_req=4), ("decode",)),
    ("tree_parents (tree verify)", None, dict(tree=True), ("decode",)),
    ("use_cuda_graph=True", None, dict(use_cuda_graph=True), ("prefill", "decode")),
    ("return_lse (base 2), k_scale / v_scale, caller out / lse", None, {}, ("prefill", "decode")),
]


def cell(route: str, row) -> str:
    label, check, changes, families = row
    route_families, declines = ROUTES[route]
    if check is not None and _refused(check):
        return "refused"
    served = [f for f in families if f in route_families]
    if not served:
        return "n/a"
    for family in served:
        base = PREFILL if family == "prefill" else DECODE
        if declines(dataclasses.replace(base, **changes)) is None:
            return "yes"
    return "no"


def matrix() -> str:
    lines = [BEGIN,
             "<!-- generated by scripts/support_matrix.py from serveattn/policy.py and serveattn/routing.py; "
             "edit those, then run it (CI runs it with --check) -->",
             "| request / option | " + " | ".join(ROUTES) + " |",
             "| --- |" + " --- |" * len(ROUTES)]
    for row in ROWS:
        lines.append(f"| {row[0]} | " + " | ".join(cell(route, row) for route in ROUTES) + " |")
    lines += ["",
              "yes: the route serves it; no: it cannot, and `backend=\"auto\"` never routes such a plan there (the "
              "sentence is in `wrapper.backend_fallback_reason`); n/a: not an option of that route; refused: "
              "refused with a sentence on every route, before anything launches. Capable is not the same as "
              "chosen: among the capable routes `auto` takes the one measured fastest (docs/routing.md). `torch` runs anywhere, "
              "eagerly, in float32.",
              END]
    return "\n".join(lines)


def render(readme: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"support_matrix: {README} has no {BEGIN} ... {END} section.")
    head, rest = readme.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return head + matrix() + tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's section is out of date")
    parser.add_argument("--readme", default=str(README), help="the file to check or write (default README.md)")
    args = parser.parse_args(argv)
    path = pathlib.Path(args.readme)
    current = path.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print(f"support_matrix: the support matrix in {path} is out of date with serveattn/policy.py and "
                  f"serveattn/routing.py; run `python scripts/support_matrix.py` and commit the result.",
                  file=sys.stderr)
            return 1
        print(f"support_matrix: {path} is up to date.")
        return 0
    if wanted != current:
        path.write_text(wanted)
        print(f"support_matrix: wrote {path}.")
    else:
        print(f"support_matrix: {path} already up to date.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
