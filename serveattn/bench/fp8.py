"""fp8: an e4m3 KV cache in decode and fp8 q + KV in prefill, each against our bf16 kernel on the same
(dequantized) data and cuDNN SDPA bf16. Shapes, page tables and random inputs are decode.py's and prefill.py's;
the runner loop, timing and checks are common.py's.

Quantization: per-tensor amax scaling (``s = amax / 448``, ``x8 = clamp(x / s)`` to e4m3), one scale each for q, K
and V (float32 ``[1]`` device tensors, so a CUDA graph reads them). "Dequantized" = ``(x8 * s)`` in float32 then bf16.

Decode (GQA 32/8, D128, page 16, shuffled pages): ``BatchDecodeWithPagedKVCacheWrapper`` with
``use_tensor_cores`` False and True, eager and CUDA graph, once on the bf16 cache ``cache8.to(bf16)`` and once on
``cache8`` (``plan(kv_data_type=e4m3)``), both ``run(q, cache, k_scale=, v_scale=)``. Each fp8 variant must be
**bitwise** equal to our bf16 decode on ``cache8.to(bf16)`` (docs/fp8.md), and every runner within 2e-2 of SDPA on
the dequantized K/V. TB/s counts the K/V bytes actually read (fp8: half of bf16).

Prefill (causal): the paged prefill wrapper with ``q_data_type=kv_data_type=e4m3`` and
``run(q8, cache8, scale_q=, scale_k=, scale_v=)`` against our bf16 paged prefill on the dequantized q and cache;
every runner within 6e-2 of SDPA on the dequantized inputs. TFLOP/s by prefill.py's convention; fp8 floors use the
fp8 rate.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Callable, List

from . import common, decode, prefill

NAME = "fp8"
FP8_MAX = 448.0  # e4m3fn
DECODE_TOL, PREFILL_TOL = 2e-2, 6e-2
DECODE_QUICK, PREFILL_QUICK = ("1x8192", "64x8192"), ("1x4096",)
#: issue targets: fp8/bf16 speed of our decode (FlashInfer's is 1.02-1.20x), of our prefill at >= 4096 tokens.
DECODE_TARGET = {"64x8192": 1.8, "128x4096": 1.8, "8x4096": 1.4}
PREFILL_TARGET = {"1x4096": 1.5, "1x8192": 1.5, "1x16384": 1.5}
#: FlashInfer 0.7.2 fa3, fp8 q + fp8 KV, TFLOP/s on the H200 (/work/shared/baselines/h200-2026-12-02.md).
FI_FA3_FP8_TFLOPS = {"1x4096": 598, "1x8192": 692, "1x16384": 746}
VARIANTS = (("cc", "CUDA-core, eager"), ("cc-graph", "CUDA-core, CUDA graph"), ("tc", "tensor-core, eager"),
            ("tc-graph", "tensor-core, CUDA graph"))
DECODE_OURS = ("cc", "cc8", "cc-graph", "cc8-graph", "tc", "tc8", "tc-graph", "tc8-graph")  # 8: the fp8 cache
DECODE_PEERS = ("cudnn", "flash", "fi-tc", "fi-tc8")
PREFILL_PEERS = ("cudnn", "flash", "fi-fa3-fp8")  # fi-fa3-fp8: FlashInfer's fa3 prefill, e4m3 q and cache
PEERS = tuple(dict.fromkeys(DECODE_PEERS + PREFILL_PEERS))
PREFILL_OURS = ("fp8", "kv8", "bf16")  # kv8: bf16 q over the e4m3 cache (k_scale/v_scale)


def fp8_key(v: str) -> str:
    return v[:2] + "8" + v[2:]


def add_arguments(parser) -> None:
    parser.add_argument("--fp8-decode-cases", default=None,
                        help=f"fp8: decode workloads <batch>x<kv_len>, or 'none' "
                             f"(default {','.join(decode.WORKLOADS)}; quick {','.join(DECODE_QUICK)})")
    parser.add_argument("--fp8-prefill-cases", default=None,
                        help=f"fp8: prefill workloads of {','.join(prefill.WORKLOADS)}, or 'none' (default all; "
                             f"quick {','.join(PREFILL_QUICK)})")
    parser.add_argument("--fp8-peers", default="cudnn",
                        help=f"fp8: peers of {','.join(PEERS)} or 'none' (default cudnn; fi-tc / fi-tc8 are FlashInfer's "
                             f"tensor-core decode on the bf16 / fp8 cache, fi-fa3-fp8 its fa3 prefill on e4m3 q and "
                             f"cache)")


# ---------------------------------------------------------------- quantization and inputs

def _scale(x):
    return (x.abs().amax().float() / FP8_MAX).clamp_min(1e-12).reshape(1)


def _quant(x, s):
    import torch

    return (x.float() / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _dequant(x8, s):
    import torch

    return (x8.float() * s).to(torch.bfloat16)


def _quant_cache(cache):
    """bf16 paged cache -> (e4m3 cache, k scale, v scale)."""
    import torch

    ks, vs = _scale(cache[:, 0]), _scale(cache[:, 1])
    c8 = torch.empty(cache.shape, dtype=torch.float8_e4m3fn, device=cache.device)
    c8[:, 0], c8[:, 1] = _quant(cache[:, 0], ks), _quant(cache[:, 1], vs)
    return c8, ks, vs


@dataclasses.dataclass
class DecodeSet:
    q: object
    qb: object
    kb: object      # dequantized contiguous K/V [B, Hkv, S, D] bf16 (SDPA)
    vb: object
    cache8: object  # e4m3 paged cache
    wide: object    # cache8.to(bf16): what our bf16 decode reads (scales passed to run, as for fp8)
    ks: object
    vs: object


def decode_set(meta, seed: int) -> DecodeSet:
    import torch

    s = decode.build_inputs(meta, seed)
    cache8, ks, vs = _quant_cache(s.cache)
    kb, vb = _dequant(_quant(s.kb, ks), ks), _dequant(_quant(s.vb, vs), vs)
    return DecodeSet(q=s.q, qb=s.qb, kb=kb, vb=vb, cache8=cache8, wide=cache8.to(torch.bfloat16), ks=ks, vs=vs)


@dataclasses.dataclass
class PrefillSet:
    q: object       # dequantized q, bf16 (prefill.prepare_ours_paged reads q and cache)
    cache: object   # dequantized paged cache, bf16
    qb: object
    kb: object
    vb: object
    q8: object
    cache8: object
    sq: object
    sk: object
    sv: object


def prefill_set(meta, seed: int) -> PrefillSet:
    import torch

    s = prefill.build_inputs(meta, seed)
    sq = _scale(s.q)
    q8 = _quant(s.q, sq)
    cache8, sk, sv = _quant_cache(s.cache)
    q, cache = _dequant(q8, sq), torch.empty_like(s.cache)
    cache[:, 0], cache[:, 1] = _dequant(cache8[:, 0], sk), _dequant(cache8[:, 1], sv)
    qb = kb = vb = None
    if meta.equal_lengths:
        b, n = len(meta.seq_lens), meta.seq_lens[0]
        k, v = _dequant(_quant(s.k, sk), sk), _dequant(_quant(s.v, sv), sv)
        qb, kb, vb = (x.view(b, n, -1, prefill.HEAD_DIM).transpose(1, 2).contiguous() for x in (q, k, v))
    return PrefillSet(q=q, cache=cache, qb=qb, kb=kb, vb=vb, q8=q8, cache8=cache8, sq=sq, sk=sk, sv=sv)


# ---------------------------------------------------------------- decode runners

def _decode_prepare(cls, tc: bool, graph: bool, fp8: bool, meta, sets, host_scales=False) -> common.Prepared:
    import torch

    kw = {}
    if graph:
        i32 = dict(dtype=torch.int32, device=decode.DEVICE)
        kw = dict(paged_kv_indptr_buffer=torch.empty(meta.batch + 1, **i32),
                  paged_kv_indices_buffer=torch.empty(meta.num_pages, **i32),
                  paged_kv_last_page_len_buffer=torch.empty(meta.batch, **i32))
    if cls.__module__.startswith("serveattn"):  # measure the route named by use_tensor_cores, not auto's choice
        kw["backend"] = "triton"
    w = cls(common.workspace(decode.WORKSPACE_BYTES, decode.DEVICE), "NHD", use_cuda_graph=graph,
            use_tensor_cores=tc, **kw)
    w.plan(meta.indptr, meta.indices, meta.last_page_len, decode.HQ, decode.HKV, decode.HEAD_DIM, decode.PAGE_SIZE,
           q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    runs = [functools.partial(w.run, k_scale=float(s.ks) if host_scales else s.ks,
                              v_scale=float(s.vs) if host_scales else s.vs) for s in sets]
    args = [(s.q, s.cache8 if fp8 else s.wide) for s in sets]
    note = f"backend={getattr(w, 'backend', '?')}, kv {'e4m3' if fp8 else 'bf16'}"
    if not graph:
        return common.Prepared(fns=[functools.partial(r, *a) for r, a in zip(runs, args)], note=note, keep=w,
                               poisoned=common.poisoned_call(runs[0], args[0], sets[0].q))
    outs = [torch.empty_like(s.q) for s in sets]
    graphs, results = common.capture_cuda_graphs([functools.partial(r, *a, out=o)
                                                  for r, a, o in zip(runs, args, outs)])
    poisoned = common.poisoned_replay(common.first(results[0]), graphs[0])

    return common.Prepared(fns=[g.replay for g in graphs], poisoned=poisoned, poisoned_passes_out=False,
                           keep=(w, graphs, results, outs), note=note + "; one CUDA graph per input set")


def prepare_decode_ours(key: str, meta, sets) -> common.Prepared:
    """Our variant ``key``; an fp8 one is first held to bitwise equality with our bf16 eager decode (same
    use_tensor_cores) on ``cache8.to(bf16)``, same scales: a difference is a failure, and it is not timed."""
    import torch
    import serveattn

    cls = serveattn.BatchDecodeWithPagedKVCacheWrapper
    fp8, tc, graph = "8" in key, key.startswith("tc"), key.endswith("graph")
    prep = _decode_prepare(cls, tc, graph, fp8, meta, sets)
    if fp8:
        out8 = common.first(prep.poisoned()).clone()
        w16 = _decode_prepare(cls, tc, False, False, meta, sets[:1])
        out16 = common.first(w16.fns[0]())
        torch.cuda.synchronize()
        if not torch.equal(out8, out16):
            diff = (out8.float() - out16.float()).abs()
            raise RuntimeError(f"fp8 KV decode is not bitwise equal to our bf16 decode on cache8.to(bf16): "
                               f"{int((diff != 0).sum()) if diff.isfinite().all() else 'non-finite'} of "
                               f"{diff.numel()} elements differ, max |diff| {float(diff.nan_to_num(1e9).max()):.3g}")
        prep.note += "; bitwise equal to bf16 decode on cache8.to(bf16)"
    return prep


def prepare_decode_peer(key: str, meta, sets) -> common.Prepared:
    if key in ("cudnn", "flash"):
        return decode.prepare_sdpa({"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}[key], meta, sets)
    fi = common.import_flashinfer()
    p = _decode_prepare(fi.BatchDecodeWithPagedKVCacheWrapper, True, False, key == "fi-tc8", meta, sets, True)
    p.note, p.poisoned = f"flashinfer {getattr(fi, '__version__', '?')}, tensor cores, " + p.note, None
    return p


def prepare_prefill(key: str, meta, sets) -> common.Prepared:
    import torch
    import serveattn

    if key in ("cudnn", "flash"):
        return prefill.prepare_sdpa({"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}[key], meta, sets)
    if key == "fi-fa3-fp8":
        return prepare_prefill_flashinfer(meta, sets)
    if key == "bf16":
        return prefill.prepare_ours_paged(meta, sets)
    e4m3 = torch.float8_e4m3fn
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(common.workspace(prefill.WORKSPACE_BYTES, prefill.DEVICE),
                                                      kv_layout="NHD")
    if key == "kv8":  # fp8 KV cache under a 16-bit query: the scales fold into the logits and the output
        w.plan(meta.qo_indptr, meta.page_indptr, meta.page_indices, meta.last_page_len, prefill.HQ, prefill.HKV,
               prefill.HEAD_DIM, prefill.PAGE_SIZE, causal=True, q_data_type=torch.bfloat16, kv_data_type=e4m3)
        runs = [functools.partial(w.run, k_scale=s.sk, v_scale=s.sv) for s in sets]
        return common.Prepared(fns=[functools.partial(r, s.q, s.cache8) for r, s in zip(runs, sets)], keep=w,
                               note=f"backend={getattr(w, 'backend', '?')}, q bf16, kv e4m3 (k_scale/v_scale tensors)",
                               poisoned=common.poisoned_call(runs[0], (sets[0].q, sets[0].cache8), sets[0].q))
    w.plan(meta.qo_indptr, meta.page_indptr, meta.page_indices, meta.last_page_len, prefill.HQ, prefill.HKV,
           prefill.HEAD_DIM, prefill.PAGE_SIZE, causal=True, q_data_type=e4m3, kv_data_type=e4m3)
    runs = [functools.partial(w.run, scale_q=s.sq, scale_k=s.sk, scale_v=s.sv) for s in sets]
    return common.Prepared(fns=[functools.partial(r, s.q8, s.cache8) for r, s in zip(runs, sets)], keep=w,
                           note=f"backend={getattr(w, 'backend', '?')}, q/kv e4m3, per-tensor descales",
                           poisoned=common.poisoned_call(runs[0], (sets[0].q8, sets[0].cache8), sets[0].q))


# ---------------------------------------------------------------- the run

def prepare_prefill_flashinfer(meta, sets) -> common.Prepared:
    """FlashInfer's fa3 paged prefill on the same e4m3 q and cache and the same dequantization factors as our
    descales (real value = fp8 * scale), bf16 output."""
    import torch

    fi = common.import_flashinfer()
    e4m3 = torch.float8_e4m3fn
    w = fi.BatchPrefillWithPagedKVCacheWrapper(common.workspace(prefill.WORKSPACE_BYTES, prefill.DEVICE),
                                               kv_layout="NHD", backend="fa3")
    w.plan(meta.qo_indptr, meta.page_indptr, meta.page_indices, meta.last_page_len, prefill.HQ, prefill.HKV,
           prefill.HEAD_DIM, prefill.PAGE_SIZE, causal=True, q_data_type=e4m3, kv_data_type=e4m3,
           o_data_type=torch.bfloat16)
    # its fp8 kernel's scales are per-head float32 tensors passed positionally (maybe_scale_q / _k / _v), read in
    # the kernel; the q_scale / k_scale / v_scale keywords instead fold floats into sm_scale on the host (a tensor
    # there fails: "Expected float but got ffi.Tensor") and scale the output in a second pass
    def per_head(x, heads):
        return x.float().reshape(1).expand(heads).contiguous()

    fns = [functools.partial(w.run, s.q8, s.cache8, per_head(s.sq, prefill.HQ), per_head(s.sk, prefill.HKV),
                             per_head(s.sv, prefill.HKV)) for s in sets]
    return common.Prepared(fns=fns, keep=w, note=f"flashinfer {getattr(fi, '__version__', '?')}, backend=fa3, "
                                                 f"q/kv e4m3, per-head scale tensors (the per-tensor scale "
                                                 f"repeated), same shuffled page table")


def _names(value, default, quick, args, check) -> List[str]:
    if value is not None and value.strip() == "none":
        return []
    names = common.split_list(value) if value else list(quick if getattr(args, "quick", False) else default)
    for n in names:
        check(n)
    return names


def _prefill_case(n):
    if n not in prefill.WORKLOADS:
        raise SystemExit(f"fp8: unknown prefill case {n!r}; choose from {list(prefill.WORKLOADS)} or 'none'.")


def run(args, ceilings: "common.Ceilings", checkpoint: Callable[[dict], None] = lambda r: None) -> dict:
    common.require_cuda()
    dnames = _names(getattr(args, "fp8_decode_cases", None), decode.WORKLOADS, DECODE_QUICK, args, decode.parse_case)
    pnames = _names(getattr(args, "fp8_prefill_cases", None), prefill.WORKLOADS, PREFILL_QUICK, args, _prefill_case)
    peers = common.select_peers(argparse.Namespace(peers=getattr(args, "fp8_peers", None) or "cudnn"), NAME, PEERS)
    timing = common.Timing.from_args(args)
    l2 = common.l2_cache_bytes()
    l2_mult = getattr(args, "l2_multiple", None)
    l2_mult = decode.L2_MULTIPLE if l2_mult is None else l2_mult
    result = common.new_result(NAME, {
        "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": 16, "fp8": "float8_e4m3fn",
        "scaling": "per tensor, amax / 448", "warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms,
        "passes": timing.passes, "min_input_sets": timing.sets, "l2_multiple": l2_mult, "peers": peers,
        "decode_tolerance": DECODE_TOL, "prefill_tolerance": PREFILL_TOL, "decode_targets": DECODE_TARGET,
        "prefill_targets": PREFILL_TARGET, "fi_fa3_fp8_baseline_tflops": FI_FA3_FP8_TFLOPS},
        "decode: 4 * batch * kv_len * Hq * D; prefill: " + prefill.FLOPS_FORMULA,
        "decode: K/V bytes read = 2 * batch * kv_len * Hkv * D * (2 bf16, 1 fp8)")
    save = lambda r: checkpoint(result)  # noqa: E731
    titles = {k: k for k in DECODE_OURS + PREFILL_OURS + PEERS}
    if dnames:
        sub = result["decode"] = {"ok": True, "cases": []}
        runners = list(DECODE_OURS) + [p for p in peers if p in DECODE_PEERS]
        common.run_cases(NAME + " decode", sub, dnames, len(runners), timing.passes, functools.partial(
            _decode_case, runners=runners, titles=titles, ceilings=ceilings, timing=timing, l2=l2, l2_mult=l2_mult),
            save)
    if pnames:
        sub = result["prefill"] = {"ok": True, "cases": []}
        runners = list(PREFILL_OURS) + [p for p in peers if p in PREFILL_PEERS]
        common.run_cases(NAME + " prefill", sub, pnames, len(runners), timing.passes, functools.partial(
            _prefill_case_run, runners=runners, titles=titles, ceilings=ceilings, timing=timing), save)
    result["ok"] = all(result[p]["ok"] for p in ("decode", "prefill") if p in result)
    result["report"] = report(result, ceilings)
    return result


def _decode_case(name, wi, bar, *, runners, titles, ceilings, timing, l2, l2_mult) -> dict:
    batch, kv_len = decode.parse_case(name)
    flops, nbytes = decode.work(batch, kv_len)  # bf16 bytes
    n_sets = common.rotation_sets(nbytes / 2, timing.sets, l2, l2_mult, decode.MAX_SETS)
    meta = decode.build_meta(batch, kv_len, seed=wi)
    sets = [decode_set(meta, seed=100 * wi + i) for i in range(n_sets)]
    case = {"name": name, "batch": batch, "kv_len": kv_len, "bytes_bf16": nbytes, "bytes_fp8": nbytes / 2,
            "floor_ms_bf16": nbytes / ceilings.bandwidth * 1e3, "floor_ms_fp8": nbytes / 2 / ceilings.bandwidth * 1e3,
            "input_sets": n_sets, "runners": {}, "ours_ok": True}
    ref = common.case_reference(case, decode.reference, meta, sets[0])
    bar.log(f"[decode {name}] {n_sets} input set(s); reference: {case['reference']}")

    def measure(key, r, _):
        r["bytes"] = nbytes / 2 if "8" in key else nbytes
        r["tbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e12
        return f"{r['ms']:.4f} ms, {r['tbps']:.2f} TB/s" + common.spread_note(r)

    prep = lambda k: (prepare_decode_ours if k in DECODE_OURS else prepare_decode_peer)(k, meta, sets)  # noqa: E731
    common.run_runners(case, runners, prep, titles=titles, our_keys=DECODE_OURS, meta=meta, ref=ref, tol=DECODE_TOL,
                       timing=timing, bar=bar, first_call_label="prepare + first call", measure=measure)
    return case


def _prefill_case_run(name, wi, bar, *, runners, titles, ceilings, timing) -> dict:
    meta = prefill.build_meta(prefill.WORKLOADS[name], seed=wi)
    sets = [prefill_set(meta, seed=100 * wi + i) for i in range(timing.sets)]
    flops, _ = prefill.work(meta)
    case = {"name": name, "seq_lens": meta.seq_lens, "flops": flops,
            "floor_ms_fp8": flops / ceilings.fp8_rate * 1e3, "floor_ms_bf16": flops / ceilings.bf16_rate * 1e3,
            "runners": {}, "ours_ok": True}
    ref = common.case_reference(case, prefill.reference, meta, sets[0])
    bar.log(f"[prefill {name}] {meta.total} tokens; reference: {case['reference']}")

    def measure(key, r, _):
        r["tflops"] = common.tflops(flops, r["ms"])
        r["over_floor"] = r["ms"] / case["floor_ms_fp8" if key == "fp8" else "floor_ms_bf16"]
        return f"{r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s" + common.spread_note(r)

    common.run_runners(case, runners, lambda k: prepare_prefill(k, meta, sets), titles=titles, our_keys=PREFILL_OURS,
                       meta=meta, ref=ref, tol=PREFILL_TOL, timing=timing, bar=bar,
                       first_call_label="plan + first call", measure=measure)
    return case


# ---------------------------------------------------------------- report

def _ms(r):
    return r.get("ms") if r and r["status"] in ("ok", "unchecked") else None


def _best(rs, keys):
    times = [_ms(rs.get(k)) for k in keys if _ms(rs.get(k))]
    return min(times) if times else None


def _ratio(slow, fast):
    return slow / fast if slow and fast else None


def _verdict(x, goal):
    if goal is None:
        return "-"
    return f">= {goal:g}: " + ("no time" if x is None else ("met" if x >= goal else "missed"))


def report(result: dict, ceilings: "common.Ceilings") -> str:
    cfg = result["config"]
    lines = ["## fp8: e4m3, per-tensor amax scaling, GQA 32/8, head dim 128, page size 16, shuffled pages", "",
             f"- ms: median of do_bench (warmup {cfg['warmup_ms']} ms, rep {cfg['rep_ms']} ms), mean of "
             f"{cfg['passes']} interleaved pass(es); 'fp8/bf16' = bf16 time / fp8 time (above 1: fp8 faster); "
             f"{common.RATIO_NOTE}.", ""]
    bad = []
    if "decode" in result:
        bw = ceilings.bandwidth / 1e12
        lines += ["### decode: fp8 KV cache vs our bf16 decode on cache8.to(bf16) (same scales)", "",
                  f"- {result['bytes_formula']}; TB/s = those bytes / time; floor: bytes / {bw:.2f} TB/s.",
                  f"- fp8 rows are checked bitwise against bf16 eager decode; all rows within {DECODE_TOL} of SDPA "
                  f"on the dequantized K/V. Target: fp8/bf16 >= 1.8 at 64x8192, 128x4096, >= 1.4 at 8x4096 "
                  f"(FlashInfer: 1.02-1.20x).",
                  ""]
        peers = [p for p in cfg["peers"] if p in DECODE_PEERS]
        rows, trows = [], []
        for c in result["decode"]["cases"]:
            rs = c["runners"]
            for v, title in VARIANTS:
                b, f = rs.get(v), rs.get(fp8_key(v))
                row = [c["name"], title, common.fmt(_ms(b), ".4f"),
                       common.fmt(b.get("tbps") if _ms(b) else None, ".2f"),
                       common.fmt(_ms(f), ".4f"), common.fmt(f.get("tbps") if _ms(f) else None, ".2f"),
                       common.fmt(_ratio(_ms(b), _ms(f)), ".2f"), common.fmt(f.get("err"), ".1e")]
                row += [f"{rs[p]['tbps']:.2f} TB/s, {_ms(rs[p]) / _ms(f):.2f}x" if _ms(rs[p]) and _ms(f)
                        else common.fmt(rs[p].get("tbps") if _ms(rs[p]) else None, ".2f") for p in peers]
                rows.append(row)
            b16 = _best(rs, [v for v, _ in VARIANTS])
            b8 = _best(rs, [fp8_key(v) for v, _ in VARIANTS])
            x = _ratio(b16, b8)
            trows.append([c["name"], common.fmt(b16, ".4f"), common.fmt(b8, ".4f"), common.fmt(x, ".2f"),
                          _verdict(x, DECODE_TARGET.get(c["name"])), f"{c['floor_ms_fp8']:.4f}", c["input_sets"]])
            bad += [(f"decode {c['name']}", k, r) for k, r in rs.items() if r["status"] != "ok"]
        lines += [common.markdown_table(["case", "variant", "bf16 ms", "bf16 TB/s", "fp8 ms", "fp8 TB/s", "fp8/bf16",
                                         "fp8 err"] + [f"{p} (peer/fp8)" for p in peers], rows), "",
                  common.markdown_table(["case", "best bf16 ms", "best fp8 ms", "fp8/bf16", "target",
                                         "fp8 floor ms", "input sets"], trows), ""]
    if "prefill" in result:
        lines += ["### prefill: fp8 q + KV (fp8) and bf16 q over the fp8 cache (kv8) vs our bf16 paged prefill on the "
                  "dequantized q / cache (causal)", "",
                  f"- {prefill.FLOPS_FORMULA}; fp8 floor: flops / {ceilings.fp8_rate / 1e12:.0f} TFLOP/s, bf16 "
                  f"floor: flops / {ceilings.bf16_rate / 1e12:.0f}.",
                  f"- all rows within {PREFILL_TOL} of SDPA on the dequantized inputs. Targets: fp8/bf16 >= 1.5 "
                  f"(single requests >= 4096 tokens); fp8 no slower than FlashInfer fa3 fp8 (in this run as "
                  f"peer fi-fa3-fp8 when asked for; its baseline run: 598/692/746 TFLOP/s).", ""]
        speers = [p for p in cfg["peers"] if p in PREFILL_PEERS]
        rows = []
        for c in result["prefill"]["cases"]:
            rs = c["runners"]
            f, b, k8 = rs["fp8"], rs["bf16"], rs.get("kv8", {})
            x = _ratio(_ms(b), _ms(f))
            xk = _ratio(_ms(b), _ms(k8)) if k8 else None
            fi = FI_FA3_FP8_TFLOPS.get(c["name"])
            row = [c["name"], common.fmt(_ms(f), ".3f"), common.fmt(f.get("tflops") if _ms(f) else None, ".0f"),
                   common.fmt(f.get("over_floor") if _ms(f) else None, ".2f"), common.fmt(f.get("err"), ".1e"),
                   common.fmt(b.get("tflops") if _ms(b) else None, ".0f"), common.fmt(b.get("err"), ".1e"),
                   common.fmt(x, ".2f"), _verdict(x, PREFILL_TARGET.get(c["name"])),
                   f"{fi}, " + (f"{f['tflops'] / fi:.2f}x" if _ms(f) else "-") if fi else "-",
                   common.fmt(k8.get("tflops") if k8 and _ms(k8) else None, ".0f"), common.fmt(xk, ".2f"),
                   _verdict(xk, 1.0)]
            row += [f"{rs[p]['tflops']:.0f}, {_ms(rs[p]) / _ms(f):.2f}x" if _ms(rs[p]) and _ms(f)
                    else common.fmt(rs[p].get("tflops") if _ms(rs[p]) else None, ".0f") for p in speers]
            rows.append(row)
            bad += [(f"prefill {c['name']}", k, r) for k, r in rs.items() if r["status"] != "ok"]
        lines += [common.markdown_table(["case", "fp8 ms", "fp8 TFLOP/s", "fp8/floor", "fp8 err", "bf16 TFLOP/s",
                                         "bf16 err", "fp8/bf16", "target", "FI fa3 fp8 (baseline), ours/it",
                                         "kv8 TFLOP/s", "kv8/bf16", "kv8 target >= 1"]
                                        + [f"{p} TFLOP/s, peer/fp8" for p in speers], rows), ""]
    if bad:
        lines += ["### not timed", "", common.markdown_table(
            ["case", "runner", "status", "reason"], [[c, k, r["status"], r["reason"]] for c, k, r in bad]), ""]
    notes = sorted({r.get("note", "") for p in ("decode", "prefill") if p in result
                    for c in result[p]["cases"] for r in c["runners"].values()} - {""})
    lines += ["notes: " + "; ".join(notes), ""] if notes else []
    refs = sorted({c.get("reference", "") for p in ("decode", "prefill") if p in result for c in result[p]["cases"]})
    lines += [f"references: {'; '.join(refs)}."]
    if not result["ok"]:
        lines += ["", "**serveattn failed or was wrong in at least one case: see 'not timed'.**"]
    return "\n".join(lines)
