"""Crossover of the routes ``backend='auto'`` chooses between, measured: the table serveattn/routing.py reads.

Pairs (ratio = first route's time / second route's time; above 1 the first route is slower):

- ``prefill-cudnn``: cuDNN SDPA as serveattn runs it (serveattn/vendor.py, forced through ``routing.forced``)
  against our prefill kernel (``backend="triton"``), through ``BatchPrefillWithRaggedKVCacheWrapper``: batch x
  sequence length (kv_len == qo_len, the shape class the cuDNN route serves) x group size x causal, per dtype and
  head dim; eager (cuDNN does not run under our CUDA graphs). The first call of each shape is timed apart: cuDNN
  builds an execution plan per new shape.
- ``decode-tc``: the bandwidth decode kernel against the tensor-core route (``BatchDecodeWithPagedKVCacheWrapper``,
  ``backend="triton"``, ``use_tensor_cores=False`` / ``True``), batch x KV length x group size, CUDA graph replay
  (the device time; eager decode at small batch is host-bound and says nothing about the kernels).
- ``decode-split``: the bandwidth kernel as planned (split-KV where ``decode.choose_chunk`` splits) against
  ``disable_split_kv=True``, at the points where the plan splits: a check of the split rule.

Both routes of a point are first checked against each other (relative-norm difference below 2e-2) and only then
timed, in ``--passes`` interleaved passes (``triton.testing.do_bench`` medians, L2 flushed). Heads: 8 KV heads,
``8 x group`` query heads; page size 16 with a shuffled page table for decode.

Output: the tables (markdown, and every number in ``--json``), the thresholds derived from them as the
``routing.TABLES`` entry to paste, and, on a GPU, the section of docs/routing.md for this architecture rewritten
(``--routing-md PATH`` to write elsewhere, ``--no-write`` not at all). The constants in routing.py change by hand,
from the printed entry, so that a noisy run never moves them silently.

CPU dry run of the plumbing: ``cpu_dry_run()`` (TRITON_INTERPRET=1) with tiny shapes, ``time.perf_counter`` for
do_bench and direct calls for graph replays; the cuDNN route is declined there (it needs CUDA) and shows so.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from . import common

NAME = "crossover"
DEVICE = "cuda"  # module variables so that the CPU dry run can change them
HKV, PAGE_SIZE = 8, 16
TOL = 2e-2
WORKSPACE_BYTES = 256 << 20
MAX_PREFILL_TOKENS = 1 << 16  # batch x seq per prefill point
MAX_DECODE_TOKENS = 1 << 21   # batch x kv_len per decode point

PAIRS = {"prefill-cudnn": ("cudnn", "triton"), "decode-tc": ("bandwidth", "tensor-core"),
         "decode-split": ("split", "no-split")}
DEFAULTS = dict(dtypes="bfloat16", head_dims="128", groups="1,4,8", prefill_batches="1,8",
                seq_lens="512,1024,2048,4096,8192", causal_modes="causal,none",
                decode_batches="1,4,8,16,24,32,48,64,128", decode_kv_lens="1024,4096,16384")
QUICK = dict(dtypes="bfloat16", head_dims="128", groups="4", prefill_batches="1", seq_lens="1024,4096",
             causal_modes="causal", decode_batches="1,8,32,128", decode_kv_lens="4096")
ROUTING_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "routing.md"


def add_arguments(parser) -> None:
    """Options of this family (the shared ones are added by __main__); names no other family uses."""
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"crossover: pairs to measure, of {','.join(PAIRS)}")
    for key, text in (("dtypes", "dtypes (bfloat16, float16; for the decode pairs also float8_e4m3fn, "
                                 "float8_e5m2: that KV cache under a bfloat16 query)"), ("head_dims", "head dims"),
                      ("groups", "query heads per KV head (8 KV heads)"),
                      ("prefill_batches", "prefill: requests per batch"),
                      ("seq_lens", "prefill: tokens per request (qo_len == kv_len)"),
                      ("causal_modes", "prefill: causal, none"), ("decode_batches", "decode: batches"),
                      ("decode_kv_lens", "decode: KV tokens per request")):
        parser.add_argument("--" + key.replace("_", "-"), default=None,
                            help=f"crossover: comma-separated {text} (default {DEFAULTS[key]}; quick {QUICK[key]})")
    parser.add_argument("--routing-md", default=None,
                        help=f"crossover: the docs file whose section for this architecture is rewritten (default "
                             f"{ROUTING_MD}; a missing file starts from that one)")
    parser.add_argument("--no-write", action="store_true", help="crossover: do not write the docs file")


def _list(args, key: str, cast=str) -> list:
    value = getattr(args, key, None) or (QUICK if getattr(args, "quick", False) else DEFAULTS)[key]
    return [cast(x) for x in common.split_list(value)]


# ---------------------------------------------------------------- the device

def arch_and_sms():
    """(compute capability, SM count) of the device the run measures; (None, 2) on the CPU dry run."""
    import torch

    if DEVICE != "cuda":
        return None, 2
    p = torch.cuda.get_device_properties(0)
    return (p.major, p.minor), p.multi_processor_count


def arch_name(arch) -> str:
    return f"sm{arch[0]}{arch[1]}" if arch else "cpu"


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], object], timing: "common.Timing") -> float:
    if DEVICE == "cuda":
        return common.bench_ms(fn, timing.warmup_ms, timing.rep_ms)
    t0 = time.perf_counter()  # the dry run: one call, warmed up already
    fn()
    return (time.perf_counter() - t0) * 1e3


def _first_call(fn: Callable[[], object]):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------- runners: each returns a call, or raises

def _prefill_runner(route: str, dtype, head_dim: int, group: int, causal: bool, batch: int, seq: int, seed: int):
    import torch
    import serveattn
    from serveattn import routing

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hq, n = HKV * group, batch * seq
    q = torch.randn(n, hq, head_dim, dtype=dtype, device=DEVICE, generator=g)
    k = torch.randn(n, HKV, head_dim, dtype=dtype, device=DEVICE, generator=g)
    v = torch.randn(n, HKV, head_dim, dtype=dtype, device=DEVICE, generator=g)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * seq
    backend = "auto" if route == "cudnn" else "triton"
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(common.workspace(WORKSPACE_BYTES, DEVICE), "NHD",
                                                       backend=backend)

    def plan_and_run():
        with routing.forced(prefill="cudnn" if route == "cudnn" else None):
            w.plan(indptr, indptr, hq, HKV, head_dim, causal=causal, q_data_type=dtype)
        if w.backend != ("cudnn" if route == "cudnn" else "triton"):
            raise RuntimeError(f"planned on {w.backend}, not {route}")
        return w.run(q, k, v)

    return plan_and_run, (lambda: w.run(q, k, v)), (w, q, k, v)


def _decode_runner(route: str, dtype, head_dim: int, group: int, batch: int, kv_len: int, seed: int):
    """dtype: the KV cache's; an fp8 cache is read under a bfloat16 query (unit scales)."""
    import torch
    import serveattn

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hq = HKV * group
    per = -(-kv_len // PAGE_SIZE)
    pages = batch * per
    q_dtype = torch.bfloat16 if dtype.itemsize == 1 else dtype
    cache = torch.randn(pages, 2, PAGE_SIZE, HKV, head_dim, dtype=q_dtype, device=DEVICE, generator=g).to(dtype)
    q = torch.randn(batch, hq, head_dim, dtype=q_dtype, device=DEVICE, generator=g)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    indptr = torch.arange(batch + 1, **i32) * per
    indices = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).to(**i32)
    last = torch.full((batch,), kv_len - (per - 1) * PAGE_SIZE, **i32)
    graph = DEVICE == "cuda"
    kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty(batch + 1, **i32),
              paged_kv_indices_buffer=torch.empty(pages, **i32),
              paged_kv_last_page_len_buffer=torch.empty(batch, **i32)) if graph else {}
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(common.workspace(WORKSPACE_BYTES, DEVICE), "NHD",
                                                     use_tensor_cores=route == "tensor-core", backend="triton", **kw)
    out = torch.empty_like(q)
    plan_kw = {"disable_split_kv": True} if route == "no-split" else {}
    state = {}

    def plan_and_run():
        w.plan(indptr, indices, last, hq, HKV, head_dim, PAGE_SIZE, q_data_type=q_dtype, kv_data_type=dtype,
               **plan_kw)
        if route == "split" and (w._plan is None or w._plan.chunk is None):
            raise LookupError("the plan does not split the KV here")
        if not graph:
            return w.run(q, cache, out=out)
        graphs, results = common.capture_cuda_graphs([lambda: w.run(q, cache, out=out)])
        state["graph"] = graphs[0]
        graphs[0].replay()
        return results[0]

    def replay():
        return state["graph"].replay() if graph else w.run(q, cache, out=out)

    return plan_and_run, replay, (w, q, cache, out, state)


# ---------------------------------------------------------------- points

def _points(args, pair: str, sms: int) -> List[dict]:
    from serveattn import routing

    dtypes, head_dims, groups = _list(args, "dtypes"), _list(args, "head_dims", int), _list(args, "groups", int)
    pts = []
    if pair == "prefill-cudnn":
        for dt in dtypes:
            if routing.is_fp8_name(dt):  # the cuDNN pair compares 16-bit prefill only
                continue
            for d in head_dims:
                for grp in groups:
                    for mode in _list(args, "causal_modes"):
                        for b in _list(args, "prefill_batches", int):
                            for s in _list(args, "seq_lens", int):
                                if b * s <= MAX_PREFILL_TOKENS:
                                    pts.append(dict(pair=pair, dtype=dt, head_dim=d, group=grp,
                                                    causal=mode == "causal", batch=b, qo_len=s, kv_len=s))
        return pts
    for dt in dtypes:
        for d in head_dims:
            for grp in groups:
                for b in _list(args, "decode_batches", int):
                    for kv in _list(args, "decode_kv_lens", int):
                        if b * kv <= MAX_DECODE_TOKENS:
                            pts.append(dict(pair=pair, dtype=dt, head_dim=d, group=grp, batch=b, qo_len=1, kv_len=kv,
                                            programs_per_sm=b * HKV / sms))
    return pts


def _runner(route: str, p: dict, seed: int):
    import torch

    dtype = getattr(torch, p["dtype"])
    if p["pair"] == "prefill-cudnn":
        return _prefill_runner(route, dtype, p["head_dim"], p["group"], p["causal"], p["batch"], p["qo_len"], seed)
    return _decode_runner(route, dtype, p["head_dim"], p["group"], p["batch"], p["kv_len"], seed)


def measure_point(p: dict, timing: "common.Timing", seed: int) -> dict:
    """Prepares both routes of a point, checks them against each other, times them; fills ``p``."""
    import torch

    first, second = PAIRS[p["pair"]]
    ready, outs = {}, {}
    p.update(status="ok", reason=None)
    for route in (first, second):
        try:
            plan_and_run, fn, keep = _runner(route, p, seed)
            out, secs = _first_call(plan_and_run)
            outs[route] = common.first(out).float().clone()
            ready[route] = (fn, keep)
            p[f"{route}_first_call_s"] = secs
        except LookupError as exc:  # not a point of this pair (no split planned)
            p.update(status="skipped", reason=str(exc))
            return p
        except Exception as exc:  # noqa: BLE001 - a route that cannot serve the point is a row, not a crash
            text = common.one_line(exc, 400)
            if isinstance(exc, NotImplementedError) and "cannot serve this plan: " in text:
                text = text.split("cannot serve this plan: ", 1)[1]  # routing's own sentence
            p.update(status="declined" if isinstance(exc, NotImplementedError) else "failed", reason=text)
    if len(outs) == 2:
        p["diff"] = common.rel_err(outs[first], outs[second])
        if not p["diff"] < TOL:
            p.update(status="mismatch", reason=f"relative difference {p['diff']:.3g} >= {TOL}")
            ready.clear()
    del outs
    runs = {route: [] for route in ready}
    for _ in range(timing.passes):
        for route, (fn, _) in ready.items():
            runs[route].append(_time_ms(fn, timing))
    for route in (first, second):
        if runs.get(route):
            p[f"{route}_ms"] = sum(runs[route]) / len(runs[route])
            p[f"{route}_spread"] = ((max(runs[route]) - min(runs[route])) / p[f"{route}_ms"]
                                    if len(runs[route]) > 1 else None)
    if p.get(f"{first}_ms") and p.get(f"{second}_ms"):
        p["ratio"] = p[f"{first}_ms"] / p[f"{second}_ms"]
    ready.clear()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return p


# ---------------------------------------------------------------- thresholds from the points

def _ok(p: dict) -> bool:
    return p.get("status") == "ok" and p.get("ratio") is not None


def _thresholds(points: List[dict], pair: str, key_fields: Tuple[str, ...], x_field: str,
                wins: Callable[[dict], bool]) -> Dict[tuple, Optional[float]]:
    """Per config (the points' key_fields): the smallest measured x_field from which `wins` held at every
    measured point at or above it; None where it never did. Configs with a point that was not measured
    (declined, failed) are left out: those stay unmeasured."""
    configs: Dict[tuple, List[dict]] = {}
    for p in points:
        if p["pair"] == pair:
            configs.setdefault(tuple(p[f] for f in key_fields), []).append(p)
    out = {}
    for key, pts in configs.items():
        if not all(_ok(p) for p in pts):
            continue
        threshold = None
        for x in sorted({p[x_field] for p in pts}, reverse=True):
            if not all(wins(p) for p in pts if p[x_field] >= x):
                break
            threshold = x
        out[key] = threshold
    return out


def derive_cudnn(points: List[dict]) -> Dict[tuple, Tuple[Optional[int], Optional[int]]]:
    """(dtype, head_dim, group, causal) -> (min rows, max rows): cuDNN serves lengths in [min, max). The longest
    run of consecutive measured lengths at which cuDNN was faster (ratio < 1) at every measured batch (the later
    run on a tie); max is the first measured length after it (None: the run reaches the longest measured one).
    (None, None) where cuDNN never won at every batch of one length. Configs with a point that was not
    measured (declined, failed) are left out: those stay unmeasured."""
    configs: Dict[tuple, List[dict]] = {}
    for p in points:
        if p["pair"] == "prefill-cudnn":
            configs.setdefault((p["dtype"], p["head_dim"], p["group"], p["causal"]), []).append(p)
    out = {}
    for key, pts in configs.items():
        if not all(_ok(p) for p in pts):
            continue
        lengths = sorted({p["qo_len"] for p in pts})
        wins = [all(p["ratio"] < 1 for p in pts if p["qo_len"] == n) for n in lengths]
        best, start = (0, None, None), None
        for i, won in enumerate(wins + [False]):
            if won and start is None:
                start = i
            elif not won and start is not None:
                if i - start >= best[0]:
                    best = (i - start, lengths[start], lengths[i] if i < len(lengths) else None)
                start = None
        out[key] = best[1:]
    return out


def derive_decode(points: List[dict]) -> Dict[tuple, Optional[float]]:
    """(kv dtype, head_dim, group) -> the smallest measured KV-head programs per SM from which the tensor-core route
    was not slower (bandwidth / tensor-core ratio >= 1) at every measured point at or above it."""
    return _thresholds(points, "decode-tc", ("dtype", "head_dim", "group"), "programs_per_sm",
                       lambda p: p["ratio"] >= 1)


def taken_route(p: dict, cudnn: dict, decode: dict) -> Optional[str]:
    """The route routing's rule (routing.cudnn_slower, routing.decode_tensor_cores with use_tensor_cores=False)
    takes at a measured point under the derived tables; None where they do not hold its config (or the pair has
    no table). tests/test_routing.py checks it against routing itself on a real run's points."""
    first, second = PAIRS[p["pair"]]
    if p["pair"] == "prefill-cudnn":
        key = (p["dtype"], p["head_dim"], p["group"], p["causal"])
        if key not in cudnn:
            return None
        lo, hi = cudnn[key]
        return first if lo is not None and p["qo_len"] >= lo and (hi is None or p["qo_len"] < hi) else second
    if p["pair"] == "decode-tc":
        key = (p["dtype"], p["head_dim"], p["group"])
        if key not in decode:
            return None
        return first if decode[key] is None or p["programs_per_sm"] < decode[key] else second
    return None


def slower_routes(points: List[dict], cudnn: dict, decode: dict) -> List[dict]:
    """The measured points where the derived table takes the slower route (ties excepted), worst first: the cost
    of keying prefill on length only and decode on a minimum programs per SM. Each: the point's pair and shape,
    the route taken, and how much slower it was (its time over the other's)."""
    out = []
    for p in points:
        taken = taken_route(p, cudnn, decode) if _ok(p) else None
        if taken is None:
            continue
        slower = p["ratio"] if taken == PAIRS[p["pair"]][0] else 1.0 / p["ratio"]
        if slower > 1.0:
            out.append(dict(pair=p["pair"], dtype=p["dtype"], group=p["group"], batch=p["batch"],
                            length=p["qo_len"] if p["pair"] == "prefill-cudnn" else p["kv_len"],
                            causal=p.get("causal"), taken=taken, slower=slower))
    return sorted(out, key=lambda m: -m["slower"])


def slower_lines(slower: List[dict], most: int = 12) -> List[str]:
    """slower_routes as a paragraph of the docs section (the `most` worst)."""
    if not slower:
        return ["The derived table takes the faster route at every measured point (ties aside).", ""]
    text = "; ".join(
        f"{m['pair']} {m['dtype']} g{m['group']}"
        + (f" {'causal' if m['causal'] else 'none'}" if m["pair"] == "prefill-cudnn" else "")
        + f" {m['batch']}x{m['length']}: {m['taken']} taken, {m['slower']:.2f}x" for m in slower[:most])
    shown = f", the {most} worst" if len(slower) > most else ""
    return [f"Where the derived table takes the slower route, {len(slower)} measured point(s) (the taken route's "
            f"time over the other's{shown}): {text}.", ""]


def table_literal(arch, measured: str, cudnn: dict, decode: dict) -> str:
    """The routing.TABLES entry the points give, as Python to paste."""
    name = arch_name(arch)
    lines = [f"    {tuple(arch) if arch else None}: ArchTable(",
             f"        arch={tuple(arch) if arch else None}, name={name!r},",
             f"        measured={measured!r},",
             f"        # docs/routing.md, table {name}-prefill-cudnn",
             "        cudnn_min_rows={"]
    lines += [f"            {k!r}: {lo!r}," for k, (lo, hi) in sorted(cudnn.items(), key=str)]
    lines += ["        },", "        cudnn_max_rows={"]
    lines += [f"            {k!r}: {hi!r}," for k, (lo, hi) in sorted(cudnn.items(), key=str) if hi is not None]
    lines += ["        },", f"        # docs/routing.md, table {name}-decode-tc (an fp8 cache's: {name}-decode-tc-fp8)",
              "        decode_tc_min_programs_per_sm={"]
    lines += [f"            {k!r}: {None if v is None else round(v, 3)!r}," for k, v in sorted(decode.items(), key=str)]
    lines += ["        },", "    ),"]
    return "\n".join(lines)


# ---------------------------------------------------------------- tables

def _fmt_ms(p: dict, route: str) -> str:
    ms = p.get(f"{route}_ms")
    return "-" if ms is None else f"{ms:.4f}"


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pair_tables(pair: str, points: List[dict]) -> List[Tuple[str, List[dict]]]:
    """(table name suffix, points) of a pair: fp8 KV caches in a table of their own ("-fp8"), as routing's
    ArchTable.decode_table_for names it."""
    from serveattn import routing

    mine = [p for p in points if p["pair"] == pair]
    fp8 = [p for p in mine if routing.is_fp8_name(p["dtype"])]
    tables = [(pair, [p for p in mine if not routing.is_fp8_name(p["dtype"])])]
    return [(suffix, pts) for suffix, pts in tables + [(pair + routing.FP8_TABLE_SUFFIX, fp8)]
            if pts or suffix == pair]


def pair_table(pair: str, points: List[dict]) -> str:
    first, second = PAIRS[pair]
    rows = []
    for p in points:
        if p["pair"] != pair:
            continue
        shape = [p["dtype"], p["head_dim"], p["group"]]
        if pair == "prefill-cudnn":
            shape += ["causal" if p["causal"] else "none", p["batch"], p["qo_len"]]
        else:
            shape += [p["batch"], p["kv_len"], f"{p['programs_per_sm']:.2f}"]
        first_call = p.get(f"{first}_first_call_s")
        rows.append(shape + [_fmt_ms(p, first), _fmt_ms(p, second), common.fmt(p.get("ratio"), ".3f"),
                             "-" if first_call is None else f"{first_call:.3f}",
                             p["status"] + (f": {_short(p['reason'])}" if p.get("reason") else "")])
    head = ["dtype", "head dim", "group"]
    head += ["mask", "batch", "qo_len = kv_len"] if pair == "prefill-cudnn" else \
        ["batch", "kv_len", "KV-head programs / SM"]
    head += [f"{first} ms", f"{second} ms", f"ratio {first}/{second}", f"{first} first call s", "status"]
    return common.markdown_table(head, rows)


def section(result: dict) -> str:
    """The docs/routing.md section of this run's architecture (between its markers)."""
    name = result["arch_name"]
    env = result["environment"]
    lines = [f"<!-- crossover:{name}:begin -->", f"### {name}: {env.get('device', 'no GPU (CPU dry run)')}", "",
             f"Measured {env.get('date_utc')} on {env.get('device', 'the CPU')} ({result['sms']} SMs), torch "
             f"{env.get('torch')}, triton {env.get('triton')}; command: `{' '.join(result['command'])}`. "
             f"Ratio = first route's time / second route's time (above 1: the first route is slower). {HKV} KV heads, "
             f"{HKV} x group query heads; decode: page size {PAGE_SIZE}, shuffled page table, CUDA graph replay; "
             f"prefill: ragged wrapper, eager. Times: mean of {result['config']['passes']} pass(es) of do_bench "
             f"medians (L2 flushed).",
             ""]
    for pair in result["config"]["pairs"]:
        first, second = PAIRS[pair]
        for suffix, pts in pair_tables(pair, result["points"]):
            lines += [f"#### Table {name}-{suffix}", "", f"{first} / {second}.", "", pair_table(pair, pts), ""]
    lines += slower_lines(result.get("slower_routes") or [])
    lines += ["Derived (`python -m serveattn.bench crossover` prints it; routing.TABLES is edited by hand from it):",
              "", "```python", result["table_literal"], "```", f"<!-- crossover:{name}:end -->"]
    return "\n".join(lines)


def write_section(path: pathlib.Path, text: str, name: str) -> None:
    """Replaces the section between this architecture's markers, or appends it before the append marker."""
    base = path if path.exists() else ROUTING_MD
    doc = base.read_text() if base.exists() else "# Routing\n\n<!-- crossover:append -->\n"
    begin, end = f"<!-- crossover:{name}:begin -->", f"<!-- crossover:{name}:end -->"
    if begin in doc and end in doc:
        doc = doc[: doc.index(begin)] + text + doc[doc.index(end) + len(end):]
    elif "<!-- crossover:append -->" in doc:
        doc = doc.replace("<!-- crossover:append -->", text + "\n\n<!-- crossover:append -->")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)


def report(result: dict) -> str:
    lines = [f"## crossover ({result['arch_name']}, {result['sms']} SMs)", "",
             "ratio = first route's time / second route's time (above 1: the first route is slower); "
             "first call: plan + first run of a new shape, synchronized.", ""]
    for pair in result["config"]["pairs"]:
        first, second = PAIRS[pair]
        for suffix, pts in pair_tables(pair, result["points"]):
            lines += [f"### {suffix}: {first} / {second}", "", pair_table(pair, pts), ""]
    lines += ["### derived routing.TABLES entry", "", "```python", result["table_literal"], "```", ""]
    if result.get("written"):
        lines.append(f"written: {result['written']}")
    if DEVICE != "cuda":
        lines.append("CPU dry run: the plumbing, not the speed (Triton interpreter, perf_counter, no graphs).")
    return "\n".join(lines)


# ---------------------------------------------------------------- the run

def run(args, ceilings: "common.Ceilings", checkpoint: Callable[[dict], None] = lambda r: None) -> dict:
    if DEVICE == "cuda":
        common.require_cuda()
    pairs = common.split_list(getattr(args, "pairs", None) or ",".join(PAIRS))
    bad = [p for p in pairs if p not in PAIRS]
    if bad:
        raise SystemExit(f"crossover: unknown pair(s) {bad}; choose from {list(PAIRS)}.")
    timing = common.Timing.from_args(args)
    arch, sms = arch_and_sms()
    env = common.environment()
    result = {"family": NAME, "ok": True, "arch": list(arch) if arch else None, "arch_name": arch_name(arch),
              "sms": sms, "environment": env, "command": ["python", "-m", "serveattn.bench"] + sys.argv[1:],
              "config": {"pairs": pairs, "passes": timing.passes, "warmup_ms": timing.warmup_ms,
                         "rep_ms": timing.rep_ms, "tolerance": TOL}, "points": []}
    if DEVICE != "cuda":
        result["command"] = ["python", "-m", "serveattn.bench", NAME, "(CPU dry run)"]
    points = [p for pair in pairs for p in _points(args, pair, sms)]
    bar = common.Progress(len(points), NAME)
    try:
        for i, p in enumerate(points):
            measure_point(p, timing, seed=i)
            result["points"].append(p)
            bar.log(f"[{p['pair']}] {p['dtype']} d{p['head_dim']} g{p['group']} b{p['batch']} "
                    f"q{p['qo_len']} kv{p['kv_len']}: {p['status']}"
                    + (f", ratio {p['ratio']:.3f}" if p.get("ratio") is not None else "")
                    + (f" ({p['reason']})" if p.get("reason") else ""))
            bar.update(1)
            result["ok"] = result["ok"] and p["status"] in ("ok", "skipped", "declined")
            checkpoint(result)
    finally:
        bar.close()
    cudnn, decode = derive_cudnn(result["points"]), derive_decode(result["points"])
    result["derived"] = {"cudnn_min_rows": {repr(k): lo for k, (lo, hi) in cudnn.items()},
                         "cudnn_max_rows": {repr(k): hi for k, (lo, hi) in cudnn.items()},
                         "decode_tc_min_programs_per_sm": {repr(k): v for k, v in decode.items()}}
    measured = (f"{env.get('device', 'CPU')} ({sms} SMs), torch {env.get('torch')}, triton {env.get('triton')}, "
                f"{str(env.get('date_utc', ''))[:10]}: {' '.join(result['command'])}")
    result["table_literal"] = table_literal(arch, measured, cudnn, decode)
    result["slower_routes"] = slower_routes(result["points"], cudnn, decode)
    target = getattr(args, "routing_md", None)
    if not getattr(args, "no_write", False) and (DEVICE == "cuda" or target):
        path = pathlib.Path(target) if target else ROUTING_MD
        write_section(path, section(result), result["arch_name"])
        result["written"] = str(path)
    result["report"] = report(result)
    return result


#: Tiny shapes of the CPU dry run.
DRY_ARGV = ("--dtypes", "bfloat16", "--head-dims", "64", "--groups", "2", "--prefill-batches", "2",
            "--seq-lens", "16", "--causal-modes", "causal", "--decode-batches", "1,2", "--decode-kv-lens", "300",
            "--passes", "1")


def cpu_dry_run(extra_argv=()) -> dict:
    """The whole flow once on the CPU (Triton interpreter) with tiny shapes: the plumbing, not the speed."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("cpu_dry_run needs TRITON_INTERPRET=1 set before triton is imported")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from .__main__ import build_parser

    g = globals()
    saved = {n: g[n] for n in ("DEVICE", "WORKSPACE_BYTES", "HKV")}
    g.update(DEVICE="cpu", WORKSPACE_BYTES=1 << 20, HKV=1)  # one KV head: the interpreter's 2 "SMs" split
    try:
        args = build_parser().parse_args([NAME, *DRY_ARGV, *extra_argv])
        return run(args, common.Ceilings())
    finally:
        g.update(saved)
