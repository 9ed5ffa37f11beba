"""Causal prefill: serveattn's paged and ragged wrappers against the peers, in one process, on the same data.

Shapes (H200 serving case): GQA 32 query heads / 8 KV heads, head dim 128, bf16, page size 16 with a
shuffled page table (``torch.randperm``). Workloads: one causal request of 4096, 8192 and 16384 tokens, and a
batch of 16 causal requests of 2048 tokens, each through ``BatchPrefillWithPagedKVCacheWrapper`` and
``BatchPrefillWithRaggedKVCacheWrapper``.

Peers: torch SDPA with the cuDNN and the flash backends on contiguous ``[B, H, S, D]`` K/V (``enable_gqa=True``;
K/V repeated to 32 heads where a backend refuses GQA, and the table says so), FlexAttention compiled with a
causal block mask, and FlashInfer's paged prefill wrapper (``fa2``, ``fa3``) when ``import flashinfer`` works.
Every runner is checked against SDPA (flash backend) before it is timed; ours must be within a relative-norm
error of 2e-2 and write every output element, or it is reported wrong and not timed.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, List

from . import common

NAME = "prefill"
HQ, HKV, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
TOL = 2e-2
WORKSPACE_BYTES = 128 * 1024 * 1024
DEVICE = "cuda"  # a module variable only so that a CPU dry run of the plumbing can change it

#: name -> sequence lengths of the requests (all causal, qo_len == kv_len).
WORKLOADS = {
    "1x4096": [4096],
    "1x8192": [8192],
    "1x16384": [16384],
    "16x2048": [2048] * 16,
}
QUICK_WORKLOADS = ("1x4096", "16x2048")

FLOPS_FORMULA = ("causal flops = 2 * s^2 * Hq * D per request of s tokens, summed over requests "
                 "(FlashInfer's convention: 4 * Hq * D * s^2 / 2, the diagonal's extra s/2 pairs not counted)")
BYTES_FORMULA = ("bytes = q + o (2 * tokens * Hq * D * 2) + K + V (2 * tokens * Hkv * D * 2) "
                 "+ the page table (4 bytes a page), each read or written once")

#: (key, title) of our runners and of the peers, in the order they run and appear in the tables.
OURS = (("paged", "serveattn paged"), ("ragged", "serveattn ragged"))
PEERS = (("flash", "torch flash SDPA"), ("cudnn", "cuDNN SDPA"), ("fi-fa2", "FlashInfer fa2"),
         ("fi-fa3", "FlashInfer fa3"), ("flex", "FlexAttention (compiled)"))
OUR_KEYS = tuple(k for k, _ in OURS)
PEER_KEYS = tuple(k for k, _ in PEERS)


def add_arguments(parser) -> None:
    """Options of this family (the shared ones are added by __main__)."""
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated workloads to run, of {','.join(WORKLOADS)} "
                             f"(default: all; with --quick: {','.join(QUICK_WORKLOADS)})")
    parser.add_argument("--peers", default=",".join(PEER_KEYS),
                        help=f"comma-separated peers to run, of {','.join(PEER_KEYS)}, or 'none' "
                             f"(default: all)")


# ---------------------------------------------------------------- inputs

@dataclasses.dataclass
class Meta:
    """Page table and index tensors of one workload (int32, on the GPU); shared by every input set."""

    seq_lens: List[int]
    qo_indptr: object
    kv_indptr: object
    page_indptr: object
    page_indices: object
    last_page_len: object
    num_pages: int
    page_of_token: object  # [total] int64: the page that holds each token
    slot_of_token: object  # [total] int64: its slot in the page

    @property
    def total(self) -> int:
        return sum(self.seq_lens)

    @property
    def equal_lengths(self) -> bool:
        return len(set(self.seq_lens)) == 1


@dataclasses.dataclass
class InputSet:
    q: object       # [total, Hq, D]
    k: object       # [total, Hkv, D]
    v: object       # [total, Hkv, D]
    cache: object   # [pages, 2, PAGE_SIZE, Hkv, D], K/V scattered through the shuffled page table
    qb: object      # [B, Hq, S, D] contiguous (None when the lengths differ)
    kb: object      # [B, Hkv, S, D]
    vb: object


def build_meta(seq_lens: List[int], seed: int = 0) -> Meta:
    import torch

    dev = DEVICE
    pages_per = [(s + PAGE_SIZE - 1) // PAGE_SIZE for s in seq_lens]
    num_pages = sum(pages_per)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)  # shuffled page table
    qo = [0]
    pi = [0]
    for s, n in zip(seq_lens, pages_per):
        qo.append(qo[-1] + s)
        pi.append(pi[-1] + n)
    last = [s - PAGE_SIZE * (n - 1) for s, n in zip(seq_lens, pages_per)]
    page_of, slot_of = [], []
    for i, s in enumerate(seq_lens):
        t = torch.arange(s)
        page_of.append(perm[pi[i] + t // PAGE_SIZE])
        slot_of.append(t % PAGE_SIZE)
    i32 = dict(dtype=torch.int32, device=dev)
    return Meta(
        seq_lens=list(seq_lens),
        qo_indptr=torch.tensor(qo, **i32),
        kv_indptr=torch.tensor(qo, **i32),
        page_indptr=torch.tensor(pi, **i32),
        page_indices=perm.to(**i32),
        last_page_len=torch.tensor(last, **i32),
        num_pages=num_pages,
        page_of_token=torch.cat(page_of).to(dev),
        slot_of_token=torch.cat(slot_of).to(dev),
    )


def build_inputs(meta: Meta, seed: int) -> InputSet:
    """Random bf16 q/k/v; the paged cache starts random too (unused slots are never zeros)."""
    import torch

    dev, bf = DEVICE, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    n = meta.total
    q = torch.randn(n, HQ, HEAD_DIM, dtype=bf, device=dev, generator=g)
    k = torch.randn(n, HKV, HEAD_DIM, dtype=bf, device=dev, generator=g)
    v = torch.randn(n, HKV, HEAD_DIM, dtype=bf, device=dev, generator=g)
    cache = torch.randn(meta.num_pages, 2, PAGE_SIZE, HKV, HEAD_DIM, dtype=bf, device=dev, generator=g)
    kc, vc = cache[:, 0], cache[:, 1]
    kc[meta.page_of_token, meta.slot_of_token] = k
    vc[meta.page_of_token, meta.slot_of_token] = v
    qb = kb = vb = None
    if meta.equal_lengths:
        b, s = len(meta.seq_lens), meta.seq_lens[0]
        qb = q.view(b, s, HQ, HEAD_DIM).transpose(1, 2).contiguous()
        kb = k.view(b, s, HKV, HEAD_DIM).transpose(1, 2).contiguous()
        vb = v.view(b, s, HKV, HEAD_DIM).transpose(1, 2).contiguous()
    return InputSet(q=q, k=k, v=v, cache=cache, qb=qb, kb=kb, vb=vb)


def work(meta: Meta) -> tuple:
    """(flops, bytes) of one run, by the formulas printed with the results."""
    flops = sum(2.0 * s * s * HQ * HEAD_DIM for s in meta.seq_lens)
    n = meta.total
    nbytes = 2 * n * HQ * HEAD_DIM * 2 + 2 * n * HKV * HEAD_DIM * 2 + 4 * meta.num_pages
    return flops, float(nbytes)


def bhsd_to_ragged(out, meta: Meta):
    """[B, Hq, S, D] -> [total, Hq, D]."""
    return out.transpose(1, 2).reshape(meta.total, HQ, HEAD_DIM)


# ---------------------------------------------------------------- runners

def prepare_ours_paged(meta: Meta, sets: List[InputSet]) -> common.Prepared:
    import torch
    import serveattn

    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(common.workspace(WORKSPACE_BYTES, DEVICE), kv_layout="NHD")
    w.plan(meta.qo_indptr, meta.page_indptr, meta.page_indices, meta.last_page_len, HQ, HKV, HEAD_DIM,
           PAGE_SIZE, causal=True, q_data_type=torch.bfloat16)
    fns = [functools.partial(w.run, s.q, s.cache) for s in sets]
    return common.Prepared(fns=fns, note=f"backend={getattr(w, 'backend', '?')}",
                           poisoned=common.poisoned_call(w.run, (sets[0].q, sets[0].cache), sets[0].q))


def prepare_ours_ragged(meta: Meta, sets: List[InputSet]) -> common.Prepared:
    import torch
    import serveattn

    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(common.workspace(WORKSPACE_BYTES, DEVICE), kv_layout="NHD")
    w.plan(meta.qo_indptr, meta.kv_indptr, HQ, HKV, HEAD_DIM, causal=True, q_data_type=torch.bfloat16)
    fns = [functools.partial(w.run, s.q, s.k, s.v) for s in sets]
    return common.Prepared(fns=fns, note=f"backend={getattr(w, 'backend', '?')}",
                           poisoned=common.poisoned_call(w.run, (sets[0].q, sets[0].k, sets[0].v), sets[0].q))


def prepare_sdpa(backend_name: str, meta: Meta, sets: List[InputSet]) -> common.Prepared:
    """SDPA on contiguous [B, H, S, D], causal; enable_gqa=True, or K/V repeated to Hq heads if that is refused."""
    if not meta.equal_lengths:
        raise NotImplementedError("SDPA peer needs requests of one length (dense [B, H, S, D] tensors)")
    fns, refused = common.sdpa_fns(backend_name, sets, HQ // HKV, causal=True)
    note = "GQA via enable_gqa=True" if refused is None else \
        f"K/V repeated to {HQ} heads (enable_gqa refused: {common.one_line(refused, 120)})"
    return common.Prepared(fns=fns, note=note, normalize=bhsd_to_ragged)


def prepare_flex(meta: Meta, sets: List[InputSet]) -> common.Prepared:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    if not meta.equal_lengths:
        raise NotImplementedError("FlexAttention peer here needs requests of one length")
    flex = common.compiled_flex(NAME)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    s = meta.seq_lens[0]
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=s, KV_LEN=s, device=DEVICE)
    fns = [functools.partial(flex, x.qb, x.kb, x.vb, block_mask=mask, enable_gqa=True) for x in sets]
    return common.Prepared(fns=fns, note=f"torch.compile(flex_attention), causal block mask, enable_gqa=True, "
                                         f"torch {torch.__version__}", normalize=bhsd_to_ragged)


def prepare_flashinfer(backend: str, meta: Meta, sets: List[InputSet]) -> common.Prepared:
    import torch

    fi = common.import_flashinfer()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(common.workspace(WORKSPACE_BYTES, DEVICE), kv_layout="NHD",
                                               backend=backend)
    w.plan(meta.qo_indptr, meta.page_indptr, meta.page_indices, meta.last_page_len, HQ, HKV, HEAD_DIM,
           PAGE_SIZE, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    fns = [functools.partial(w.run, s.q, s.cache) for s in sets]
    return common.Prepared(fns=fns, note=f"flashinfer {getattr(fi, '__version__', '?')}, backend={backend}, "
                                         f"same shuffled page table")


PREPARE = {
    "paged": prepare_ours_paged,
    "ragged": prepare_ours_ragged,
    "flash": functools.partial(prepare_sdpa, "FLASH_ATTENTION"),
    "cudnn": functools.partial(prepare_sdpa, "CUDNN_ATTENTION"),
    "fi-fa2": functools.partial(prepare_flashinfer, "fa2"),
    "fi-fa3": functools.partial(prepare_flashinfer, "fa3"),
    "flex": prepare_flex,
}


def reference(meta: Meta, s0: InputSet):
    """SDPA output on set 0 as [total, Hq, D]: the flash backend, else memory-efficient, else cuDNN."""
    if not meta.equal_lengths:
        raise NotImplementedError("the SDPA reference needs requests of one length")
    return common.sdpa_reference(prepare_sdpa, meta, s0)


# ---------------------------------------------------------------- the run

def _selected(args):
    names = common.case_names(args, WORKLOADS, QUICK_WORKLOADS)
    bad = [c for c in names if c not in WORKLOADS]
    if bad:
        raise SystemExit(f"prefill: unknown case(s) {bad}; choose from {list(WORKLOADS)}.")
    return names, common.select_peers(args, NAME, PEER_KEYS)


def run(args, ceilings: "common.Ceilings", checkpoint: Callable[[dict], None] = lambda r: None) -> dict:
    """Runs the selected workloads; returns the family's result (``ok``, ``cases``, ``report``)."""
    common.require_cuda()
    names, peers = _selected(args)
    timing = common.Timing.from_args(args)

    runners = list(OUR_KEYS) + peers
    titles = dict(OURS + PEERS)
    result = common.new_result(NAME, {
        "num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE,
        "dtype": "bfloat16", "causal": True, "page_table": "shuffled (torch.randperm)",
        "warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms, "passes": timing.passes, "input_sets": timing.sets,
        "tolerance": TOL, "peers": peers, "workloads": {n: WORKLOADS[n] for n in names}}, FLOPS_FORMULA, BYTES_FORMULA)
    common.run_cases(NAME, result, names, len(runners), timing.passes,
                     functools.partial(_run_case, runners=runners, titles=titles, ceilings=ceilings, timing=timing),
                     checkpoint)
    result["report"] = report(result, ceilings)
    return result


def _run_case(name, wi, bar, *, runners, titles, ceilings, timing) -> dict:
    seq_lens = WORKLOADS[name]
    meta = build_meta(seq_lens, seed=wi)
    sets = [build_inputs(meta, seed=100 * wi + i) for i in range(timing.sets)]
    flops, nbytes = work(meta)
    case = {"name": name, "seq_lens": seq_lens, **common.floors(flops, nbytes, ceilings, "bf16"),
            "runners": {}, "ours_ok": True}
    ref = common.case_reference(case, reference, meta, sets[0])
    bar.log(f"[{name}] {len(seq_lens)} request(s), {meta.total} tokens, {meta.num_pages} pages; "
            f"reference: {case['reference']}")

    def measure(key, r, b2b_runs):
        r["tflops"] = common.tflops(flops, r["ms"])
        r["over_floor"] = r["ms"] / case["floor_ms"]
        return f"{r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s" + common.spread_note(r)

    common.run_runners(case, runners, lambda key: PREPARE[key](meta, sets), titles=titles, our_keys=OUR_KEYS,
                       meta=meta, ref=ref, tol=TOL, timing=timing, bar=bar, first_call_label="plan + first call",
                       measure=measure)
    return case


# ---------------------------------------------------------------- tables

def _metric(runner: dict) -> str:
    return f"{runner['tflops']:.0f} TFLOP/s"


def report(result: dict, ceilings: "common.Ceilings") -> str:
    cases = result["cases"]
    peers = result["config"]["peers"]
    titles = dict(PEERS)
    rate = ceilings.bf16_rate
    lines = [f"## prefill: causal, GQA {HQ}/{HKV} heads, head dim {HEAD_DIM}, bf16, page size {PAGE_SIZE}, "
             f"shuffled page table",
             "",
             f"- {FLOPS_FORMULA}.",
             f"- {BYTES_FORMULA}.",
             f"- floors: flops / {rate / 1e12:.0f} TFLOP/s and bytes / {ceilings.bandwidth / 1e12:.2f} TB/s; "
             f"'ours/floor' is our time over the larger of the two.",
             f"- {common.RATIO_NOTE}; peer cells: peer TFLOP/s, ratio.",
             f"- times: median of triton.testing.do_bench (warmup {result['config']['warmup_ms']} ms, "
             f"rep {result['config']['rep_ms']} ms), mean over {result['config']['passes']} interleaved "
             f"pass(es), rotating over {result['config']['input_sets']} random input set(s).",
             ""]

    headers = ["case", "ours", "ms", "TFLOP/s", f"% of {rate / 1e12:.0f}", "spread", "err", "ours/floor"]
    headers += [titles[p] for p in peers]
    rows = common.ours_rows(cases, OUR_KEYS, peers, lambda o: [
        f"{o['ms']:.3f}", f"{o['tflops']:.0f}", f"{100 * o['tflops'] * 1e12 / rate:.0f}%", common.spread_cell(o),
        common.fmt(o["err"], ".1e"), f"{o['over_floor']:.2f}x"], 6, _metric)
    lines += ["### serveattn against the peers", "", common.markdown_table(headers, rows), ""]

    frows = [[c["name"], f"{len(c['seq_lens'])} x {c['seq_lens'][0]}" if len(set(c["seq_lens"])) == 1
              else "+".join(str(s) for s in c["seq_lens"]),
              f"{c['flops'] / 1e12:.3f}", f"{c['bytes'] / 1e6:.1f}", f"{c['flops_floor_ms']:.3f}",
              f"{c['bytes_floor_ms']:.4f}", f"{c['floor_ms']:.3f}", c["bound"]] for c in cases]
    lines += ["### floors", "",
              common.markdown_table(["case", "requests x tokens", "TFLOP", "MB", "flops floor ms",
                                     "bytes floor ms", "floor ms", "bound"], frows), ""]

    prows = []
    for c in cases:
        for key in peers:
            p = c["runners"][key]
            prows.append([c["name"], titles[key], p["status"], common.fmt(p.get("ms")),
                          common.fmt(p.get("tflops"), ".0f"), common.fmt(p.get("err"), ".1e"),
                          common.fmt(p.get("first_call_s"), ".1f"), p["reason"] or p.get("note", "")])
    if prows:
        lines += ["### peers", "",
                  common.markdown_table(["case", "peer", "status", "ms", "TFLOP/s", "err vs ref",
                                         "plan + first call s", "how / reason"], prows), ""]
    lines += common.report_footer(result, TOL)
    return "\n".join(lines)
