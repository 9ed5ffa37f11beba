"""Batch decode: serveattn's paged decode wrapper against the peers, in one process, on the same data.

Shapes (H200 serving case): GQA 32 query heads / 8 KV heads, head dim 128, bf16, page size 16 with a
shuffled page table (``torch.randperm``), one query token per request. Workloads (batch x KV length): 1x8192,
8x4096, 32x2048, 64x1024, 64x8192, 128x4096 (``--cases`` also takes any other ``<batch>x<kv_len>``). Ragged
batches (``--cases 128xlognormal,...``, or ``--ragged``): ``<batch>x<lengths>`` with the KV lengths drawn from
``lognormal`` (median ~1800 keys, capped at 32768), ``uniform`` (1..8192) or ``outlier`` (1024 keys and one
request of 32768), one seeded draw per batch size; there only FlashInfer is a peer (SDPA, cuDNN and
FlexAttention take a [B, H, S, D] K/V of one length: they decline), and the reference is SDPA per request on K/V
gathered from the page table.

Ours: ``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=False)`` and ``=True``, each
timed eagerly (``run`` called from Python) and as the replay of a CUDA graph (wrapper built with
``use_cuda_graph=True`` and the three index buffers; one ``run`` per input set captured after a warm-up run):
at small batch the launch overhead is the larger part of a call.

Peers: torch SDPA with the cuDNN and the flash backends on contiguous K/V ``[B, Hkv, S, D]`` with q
``[B, Hq, 1, D]`` (``enable_gqa=True``; K/V repeated to 32 heads outside the timing where a backend refuses
GQA, and the table says so), cuDNN SDPA also replayed from a CUDA graph (``cudnn-graph``: its GPU time, where
the eager call is bound by its host launch), FlexAttention compiled (no block mask: a decode query sees every key), and
FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (CUDA-core and tensor-core, eager and CUDA graph) when
``import flashinfer`` works. Every runner is checked against SDPA (flash backend) before it is timed; ours
runs first into an ``out`` filled with NaN (for the graph forms: the captured output, filled with NaN before a
replay) and must be within a relative-norm error of 2e-2, or it is reported wrong and not timed.

Metric: bytes of K/V read per second, K/V bytes = 2 * batch * kv_len * Hkv * D * 2 (bf16; an fp8 cache would
read half), against the device copy ceiling (4.27 TB/s on the H200 unless ``--measure-ceilings``). The input
sets rotated among hold at least ``--l2-multiple`` (default 4) times the L2 in K/V, so the small cases use
several distinct caches.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Callable, List, Optional

from . import common

NAME = "decode"
HQ, HKV, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
KV_ELEMENT_BYTES = 2  # bf16
TOL = 2e-2
WORKSPACE_BYTES = 256 << 20
DEVICE = "cuda"  # a module variable only so that a CPU dry run of the plumbing can change it
L2_MULTIPLE = 4.0
MAX_SETS = 64

#: name -> (batch, kv_len).
WORKLOADS = {
    "1x8192": (1, 8192),
    "8x4096": (8, 4096),
    "32x2048": (32, 2048),
    "64x1024": (64, 1024),
    "64x8192": (64, 8192),
    "128x4096": (128, 4096),
}
QUICK_WORKLOADS = ("1x8192", "32x2048")
#: ``--ragged``'s cases: serving batches whose lengths differ (the split and order of the decode plan matter); those
#: of 8-32 requests do not fill the GPU, where the split cuts the longest request (sessions 49-50)
RAGGED_WORKLOADS = ("8xlognormal", "8xoutlier", "16xlognormal", "32xlognormal", "32xoutlier", "64xlognormal",
                    "128xlognormal", "256xlognormal", "128xuniform", "256xuniform", "64xoutlier", "256xoutlier")
RAGGED_DISTS = ("lognormal", "uniform", "outlier")

#: The issue's absolute targets, TB/s of K/V read (our best variant).
TARGET_TBPS = {"1x8192": 2.5, "64x8192": 4.3, "128x4096": 4.3}
#: "No slower than the faster of FlashInfer paged decode and cuDNN", eager forms and all forms.
TARGET_PEERS_EAGER = ("fi-cc", "fi-tc", "cudnn")
TARGET_PEERS_ALL = ("fi-cc", "fi-tc", "fi-cc-graph", "fi-tc-graph", "cudnn", "cudnn-graph")

BYTES_FORMULA = ("K/V bytes = 2 * batch * kv_len * Hkv * D * 2 (bf16; an fp8 cache reads half); q, o and the "
                 "page table (under 0.2% here) are not counted")
FLOPS_FORMULA = "flops = 4 * batch * kv_len * Hq * D (q.k and p.v); decode is memory-bound at every case here"

#: (key, title) of our runners and of the peers, in the order they run and appear in the tables.
OURS = (("cc", "serveattn CUDA-core, eager"), ("cc-graph", "serveattn CUDA-core, CUDA graph"),
        ("tc", "serveattn tensor-core, eager"), ("tc-graph", "serveattn tensor-core, CUDA graph"))
PEERS = (("flash", "torch flash SDPA"), ("cudnn", "cuDNN SDPA"), ("cudnn-graph", "cuDNN SDPA, CUDA graph"),
         ("flex", "FlexAttention (compiled)"),
         ("fi-cc", "FlashInfer CUDA-core"), ("fi-tc", "FlashInfer tensor-core"),
         ("fi-cc-graph", "FlashInfer CUDA-core, CUDA graph"), ("fi-tc-graph", "FlashInfer tensor-core, CUDA graph"))
OUR_KEYS = tuple(k for k, _ in OURS)
PEER_KEYS = tuple(k for k, _ in PEERS)


def add_arguments(parser) -> None:
    """Options of this family (the shared ones are added by __main__)."""
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated workloads, each <batch>x<kv_len>; decode's are {','.join(WORKLOADS)} "
                             f"(default: all; with --quick: {','.join(QUICK_WORKLOADS)}; under 'all' the list goes "
                             f"to every family: see each family's --help)")
    parser.add_argument("--ragged", action="store_true",
                        help=f"decode: the ragged batches {','.join(RAGGED_WORKLOADS)} instead of the default cases")
    parser.add_argument("--peers", default=None,
                        help=f"comma-separated peers, or 'none'; decode's are {','.join(PEER_KEYS)} (default: all; "
                             f"under 'all' the list goes to every family: flash,cudnn,flex are common to all)")
    parser.add_argument("--ours", default=None,
                        help=f"decode: comma-separated serveattn variants of {','.join(OUR_KEYS)} (default: all)")
    parser.add_argument("--l2-multiple", type=float, default=L2_MULTIPLE,
                        help="decode: raise --sets until the rotated input sets hold this many times the L2 in "
                             f"K/V bytes, at most {MAX_SETS} sets (default {L2_MULTIPLE:g}; 0: --sets as given)")


# ---------------------------------------------------------------- inputs

@dataclasses.dataclass
class Meta:
    """Page table of one workload (int32 index tensors on the GPU); shared by every input set."""

    batch: int
    kv_len: int            # the longest request's
    indptr: object         # [batch + 1]
    indices: object        # [num_pages], a shuffled permutation of the pages
    last_page_len: object  # [batch]
    num_pages: int
    page_of_token: object  # [batch * kv_len] int64: the page that holds each token (request-major)
    slot_of_token: object  # [batch * kv_len] int64: its slot in the page
    kv_lens: Optional[list] = None  # a ragged batch's lengths (no contiguous K/V, no token maps); None: equal


@dataclasses.dataclass
class InputSet:
    q: object      # [B, Hq, D]
    cache: object  # [pages, 2, PAGE_SIZE, Hkv, D], K/V scattered through the shuffled page table
    qb: object     # [B, Hq, 1, D] (a view of q)
    kb: object     # [B, Hkv, S, D] contiguous, the same values as the cache (None for a ragged batch)
    vb: object


def parse_case(name: str):
    """'64x8192' -> (64, 8192); '128xlognormal' -> (128, 'lognormal'); a sentence otherwise."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+|%s)\s*" % "|".join(RAGGED_DISTS), name)
    if not m or int(m.group(1)) < 1 or (m.group(2).isdigit() and int(m.group(2)) < 1):
        raise SystemExit(f"decode: case {name!r} is not <batch>x<kv_len> (e.g. 64x8192) or <batch>x<lengths> "
                         f"with lengths one of {list(RAGGED_DISTS)}; decode's cases are {list(WORKLOADS)}.")
    return int(m.group(1)), int(m.group(2)) if m.group(2).isdigit() else m.group(2)


def ragged_lengths(batch: int, dist: str) -> list:
    """A ragged batch's KV lengths: one draw seeded by the batch size (the same batch every run)."""
    import numpy as np

    rng = np.random.default_rng(batch)
    if dist == "uniform":
        return [int(x) for x in rng.integers(1, 8193, batch)]
    if dist == "outlier":
        return [int(x) for x in np.array([1024] * (batch - 1) + [32768])[rng.permutation(batch)]]
    return [int(x) for x in np.minimum(np.exp(rng.normal(7.5, 1.0, batch)).astype(np.int64) + 1, 32768)]


def case_lengths(name: str) -> list:
    """Every request's KV length for a case name."""
    batch, kv = parse_case(name)
    return [kv] * batch if isinstance(kv, int) else ragged_lengths(batch, kv)


def build_meta(batch: int, kv_len: int, seed: int = 0, device: Optional[str] = None,
               kv_lens: Optional[list] = None) -> Meta:
    """A shuffled page-16 table of `batch` requests of `kv_len` tokens (shared with bench verify), or of a ragged
    batch's `kv_lens` (then without the token maps that scatter a contiguous K/V)."""
    import torch

    dev = DEVICE if device is None else device
    if kv_lens is not None:
        pages = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in kv_lens]
        num_pages = sum(pages)
        g = torch.Generator().manual_seed(seed)
        i32 = dict(dtype=torch.int32, device=dev)
        return Meta(batch=len(kv_lens), kv_len=max(kv_lens),
                    indptr=torch.tensor([0] + list(itertools.accumulate(pages)), **i32),
                    indices=torch.randperm(num_pages, generator=g).to(**i32),
                    last_page_len=torch.tensor([n - PAGE_SIZE * (p - 1) if p else 0  # an empty request: 0
                                                for n, p in zip(kv_lens, pages)], **i32),
                    num_pages=num_pages, page_of_token=None, slot_of_token=None, kv_lens=list(kv_lens))
    per = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
    num_pages = batch * per
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)  # shuffled page table
    t = torch.arange(kv_len)
    logical = torch.arange(batch).repeat_interleave(kv_len) * per + (t // PAGE_SIZE).repeat(batch)
    i32 = dict(dtype=torch.int32, device=dev)
    return Meta(
        batch=batch, kv_len=kv_len,
        indptr=torch.arange(0, num_pages + 1, per, **i32),
        indices=perm.to(**i32),
        last_page_len=torch.full((batch,), kv_len - PAGE_SIZE * (per - 1), **i32),
        num_pages=num_pages,
        page_of_token=perm[logical].to(dev),
        slot_of_token=(t % PAGE_SIZE).repeat(batch).to(dev),
    )


def build_inputs(meta: Meta, seed: int) -> InputSet:
    """Random bf16 q/K/V; the paged cache starts random too (slots past a request's length are never zeros)."""
    import torch

    dev, bf = DEVICE, torch.bfloat16
    b, s = meta.batch, meta.kv_len
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(b, HQ, HEAD_DIM, dtype=bf, device=dev, generator=g)
    if meta.kv_lens is not None:  # ragged: the random cache is the K/V; no contiguous copy
        cache = torch.randn(meta.num_pages, 2, PAGE_SIZE, HKV, HEAD_DIM, dtype=bf, device=dev, generator=g)
        return InputSet(q=q, cache=cache, qb=q.view(b, HQ, 1, HEAD_DIM), kb=None, vb=None)
    kb = torch.randn(b, HKV, s, HEAD_DIM, dtype=bf, device=dev, generator=g)
    vb = torch.randn(b, HKV, s, HEAD_DIM, dtype=bf, device=dev, generator=g)
    cache = torch.randn(meta.num_pages, 2, PAGE_SIZE, HKV, HEAD_DIM, dtype=bf, device=dev, generator=g)
    for j, x in ((0, kb), (1, vb)):
        part = cache[:, j]
        part[meta.page_of_token, meta.slot_of_token] = x.transpose(1, 2).reshape(b * s, HKV, HEAD_DIM)
    # The scatter is the benchmark's own code: check it on the last request before anyone is measured on it.
    sl = slice((b - 1) * s, b * s)
    back = cache[:, 1][meta.page_of_token[sl], meta.slot_of_token[sl]]
    if not torch.equal(back, vb[b - 1].transpose(0, 1)):
        raise RuntimeError("decode bench: the paged cache does not hold the contiguous V (page scatter bug)")
    return InputSet(q=q, cache=cache, qb=q.view(b, HQ, 1, HEAD_DIM), kb=kb, vb=vb)


def kv_bytes(batch: int, kv_len: int) -> float:
    return float(2 * batch * kv_len * HKV * HEAD_DIM * KV_ELEMENT_BYTES)


def work(batch: int, kv_len: int) -> tuple:
    """(flops, bytes) of one run, by the formulas printed with the results (a ragged batch: batch 1 and its
    total keys as kv_len)."""
    return 4.0 * batch * kv_len * HQ * HEAD_DIM, kv_bytes(batch, kv_len)


def _contiguous_only(meta: Meta, who: str) -> None:
    if meta.kv_lens is not None:
        raise common.Declined(f"{who} takes K/V as [B, H, S, D] of one length; this batch's lengths differ "
                              f"(padding would read the longest request's bytes for every request).")


# ---------------------------------------------------------------- runners

def _squeeze_bh1d(out, meta):
    """[B, Hq, 1, D] -> [B, Hq, D]."""
    return out.reshape(meta.batch, HQ, HEAD_DIM)


def _decode_wrapper(cls, meta: Meta, tensor_cores: bool, graph: bool):
    """A planned decode wrapper (serveattn's or FlashInfer's: same constructor and plan arguments)."""
    import torch

    kwargs = {}
    if graph:
        i32 = dict(dtype=torch.int32, device=DEVICE)
        kwargs = dict(paged_kv_indptr_buffer=torch.empty(meta.batch + 1, **i32),
                      paged_kv_indices_buffer=torch.empty(meta.num_pages, **i32),
                      paged_kv_last_page_len_buffer=torch.empty(meta.batch, **i32))
    if cls.__module__.startswith("serveattn"):  # measure the route named by use_tensor_cores, not auto's choice
        kwargs["backend"] = "triton"
    w = cls(common.workspace(WORKSPACE_BYTES, DEVICE), "NHD", use_cuda_graph=graph, use_tensor_cores=tensor_cores,
            **kwargs)
    w.plan(meta.indptr, meta.indices, meta.last_page_len, HQ, HKV, HEAD_DIM, PAGE_SIZE,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return w


def _backend_note(w) -> str:
    note = f"backend={getattr(w, 'backend', '?')}"
    why = str(getattr(w, "backend_fallback_reason", None) or "").strip().splitlines()
    if why:
        note += f" (auto declined: {why[0] if len(why[0]) <= 100 else why[0][:97] + '...'})"
    return note


def _prepare_eager(cls, tensor_cores: bool, note: Callable, poison: bool, meta: Meta,
                   sets: List[InputSet]) -> common.Prepared:
    w = _decode_wrapper(cls, meta, tensor_cores, graph=False)
    fns = [functools.partial(w.run, s.q, s.cache) for s in sets]
    return common.Prepared(fns=fns, note=note(w), keep=w, poisoned=common.poisoned_call(
        w.run, (sets[0].q, sets[0].cache), sets[0].q) if poison else None)


def _prepare_graph(cls, tensor_cores: bool, note: Callable, meta: Meta, sets: List[InputSet]) -> common.Prepared:
    """One wrapper (use_cuda_graph=True), one graph per input set, each capturing ``run(q_i, cache_i, out=o_i)``
    after a warm-up run; the timed call is ``graph.replay()``. The check fills set 0's captured output with NaN,
    replays, and compares."""
    import torch

    w = _decode_wrapper(cls, meta, tensor_cores, graph=True)
    outs = [torch.empty_like(s.q) for s in sets]
    how = "run(q, cache, out=...) captured"
    try:
        graphs, results = common.capture_cuda_graphs(
            [functools.partial(w.run, s.q, s.cache, out=o) for s, o in zip(sets, outs)])
    except TypeError as exc:
        if "out" not in str(exc):
            raise
        graphs, results = common.capture_cuda_graphs([functools.partial(w.run, s.q, s.cache) for s in sets])
        how = f"run(q, cache) captured (out= refused: {common.one_line(exc, 80)})"
    results = [common.first(r) for r in results]
    poisoned = common.poisoned_replay(results[0], graphs[0])

    return common.Prepared(fns=[g.replay for g in graphs], poisoned=poisoned, poisoned_passes_out=False,
                           keep=(w, graphs, results, outs),
                           note=f"{note(w)}; {how}, one graph per input set, timed: graph.replay()")


def prepare_ours(tensor_cores: bool, graph: bool, meta: Meta, sets: List[InputSet]) -> common.Prepared:
    import serveattn

    cls = getattr(serveattn, "BatchDecodeWithPagedKVCacheWrapper", None)
    if cls is None:
        raise NotImplementedError("serveattn has no BatchDecodeWithPagedKVCacheWrapper")
    if graph:
        return _prepare_graph(cls, tensor_cores, _backend_note, meta, sets)
    return _prepare_eager(cls, tensor_cores, _backend_note, True, meta, sets)


def prepare_flashinfer(tensor_cores: bool, graph: bool, meta: Meta, sets: List[InputSet]) -> common.Prepared:
    fi = common.import_flashinfer()

    def note(w):
        return (f"flashinfer {getattr(fi, '__version__', '?')}, use_tensor_cores={tensor_cores}, "
                f"same shuffled page table")

    if graph:
        return _prepare_graph(fi.BatchDecodeWithPagedKVCacheWrapper, tensor_cores, note, meta, sets)
    return _prepare_eager(fi.BatchDecodeWithPagedKVCacheWrapper, tensor_cores, note, False, meta, sets)


def prepare_sdpa(backend_name: str, meta: Meta, sets: List[InputSet]) -> common.Prepared:
    """SDPA on contiguous [B, H, S, D] K/V, q [B, Hq, 1, D], no causal mask (the one decode query sees every key);
    enable_gqa=True, or K/V repeated if refused."""
    _contiguous_only(meta, "torch SDPA")
    fns, refused = common.sdpa_fns(backend_name, sets, HQ // HKV, causal=False)
    if refused is None:
        note = "GQA via enable_gqa=True, contiguous [B, Hkv, S, D] K/V"
    else:
        note = (f"K/V repeated to {HQ} heads, so it reads {HQ // HKV}x the bytes counted "
                f"(enable_gqa refused: {common.one_line(refused, 120)})")
    return common.Prepared(fns=fns, note=note, normalize=_squeeze_bh1d)


def prepare_sdpa_graph(backend_name: str, meta: Meta, sets: List[InputSet]) -> common.Prepared:
    """prepare_sdpa's calls captured in CUDA graphs (one per input set; timed: graph.replay()): at small batch an
    eager SDPA call's host launch outlasts the L2 flush, so its eager time is mostly launch; the graph shows the
    peer's GPU time, as our cc-graph does."""
    _contiguous_only(meta, "torch SDPA")
    eager = prepare_sdpa(backend_name, meta, sets)
    graphs, results = common.capture_cuda_graphs(eager.fns)
    return common.Prepared(fns=[g.replay for g in graphs], poisoned=common.poisoned_replay(results[0], graphs[0]),
                           poisoned_passes_out=False, keep=(eager, graphs, results), normalize=eager.normalize,
                           note=f"{eager.note}; one graph per input set, timed: graph.replay()")


def prepare_flex(meta: Meta, sets: List[InputSet]) -> common.Prepared:
    import torch

    _contiguous_only(meta, "FlexAttention")
    # Six decode shapes plus prefill's in one process exceed dynamo's default recompile limit (8), past which
    # flex_attention would silently run uncompiled; raise it for this process.
    flex = common.compiled_flex(NAME, recompile_limit=64)
    fns = [functools.partial(flex, x.qb, x.kb, x.vb, enable_gqa=True) for x in sets]
    return common.Prepared(fns=fns, note=f"torch.compile(flex_attention), no block mask, enable_gqa=True, "
                                         f"torch {torch.__version__}", normalize=_squeeze_bh1d)


PREPARE = {
    "cc": functools.partial(prepare_ours, False, False),
    "cc-graph": functools.partial(prepare_ours, False, True),
    "tc": functools.partial(prepare_ours, True, False),
    "tc-graph": functools.partial(prepare_ours, True, True),
    "flash": functools.partial(prepare_sdpa, "FLASH_ATTENTION"),
    "cudnn": functools.partial(prepare_sdpa, "CUDNN_ATTENTION"),
    "cudnn-graph": functools.partial(prepare_sdpa_graph, "CUDNN_ATTENTION"),
    "flex": prepare_flex,
    "fi-cc": functools.partial(prepare_flashinfer, False, False),
    "fi-tc": functools.partial(prepare_flashinfer, True, False),
    "fi-cc-graph": functools.partial(prepare_flashinfer, False, True),
    "fi-tc-graph": functools.partial(prepare_flashinfer, True, True),
}


def reference(meta: Meta, s0: InputSet):
    """SDPA output on set 0 as [B, Hq, D]: the flash backend, else memory-efficient, else cuDNN; for a ragged
    batch, SDPA (math backend, float32) per request on K/V gathered from the page table."""
    if meta.kv_lens is not None:
        return _ragged_reference(meta, s0), "torch SDPA per request, float32, K/V gathered from the page table"
    return common.sdpa_reference(prepare_sdpa, meta, s0)


def _ragged_reference(meta: Meta, s0: InputSet):
    import torch
    import torch.nn.functional as F

    indptr, indices = meta.indptr.tolist(), meta.indices.long()
    out = torch.empty(meta.batch, HQ, HEAD_DIM, dtype=torch.float32, device=s0.q.device)
    for i, n in enumerate(meta.kv_lens):
        pages = s0.cache[indices[indptr[i]:indptr[i + 1]]]  # [p, 2, PAGE_SIZE, Hkv, D]
        k, v = (pages[:, j].reshape(-1, HKV, HEAD_DIM)[:n].transpose(0, 1).float() for j in (0, 1))
        q = s0.q[i].float().view(HKV, HQ // HKV, HEAD_DIM)  # a KV head's query heads on the row axis
        out[i] = F.scaled_dot_product_attention(q, k, v).reshape(HQ, HEAD_DIM)
    return out.to(s0.q.dtype)


# ---------------------------------------------------------------- the run

def _selected(args):
    names = list(RAGGED_WORKLOADS) if getattr(args, "ragged", False) and not getattr(args, "cases", None) else \
        common.case_names(args, WORKLOADS, QUICK_WORKLOADS)
    for n in names:
        parse_case(n)
    peers = common.select_peers(args, NAME, PEER_KEYS)
    ours = common.split_list(getattr(args, "ours", None) or ",".join(OUR_KEYS))
    bad = [k for k in ours if k not in OUR_KEYS]
    if bad or not ours:
        raise SystemExit(f"decode: unknown serveattn variant(s) {bad or ours}; choose from {list(OUR_KEYS)}.")
    return names, [k for k in OUR_KEYS if k in ours], peers


def run(args, ceilings: "common.Ceilings", checkpoint: Callable[[dict], None] = lambda r: None) -> dict:
    """Runs the selected workloads; returns the family's result (``ok``, ``cases``, ``report``)."""
    common.require_cuda()
    names, ours, peers = _selected(args)
    timing = common.Timing.from_args(args)  # timing.sets: the least number of input sets
    l2_multiple = getattr(args, "l2_multiple", None)
    l2_multiple = L2_MULTIPLE if l2_multiple is None else l2_multiple
    l2 = common.l2_cache_bytes()

    runners = ours + peers
    titles = dict(OURS + PEERS)
    result = common.new_result(NAME, {
        "num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE,
        "dtype": "bfloat16", "kv_layout": "NHD", "page_table": "shuffled (torch.randperm)",
        "warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms, "passes": timing.passes,
        "min_input_sets": timing.sets, "l2_bytes": l2, "l2_multiple": l2_multiple, "max_sets": MAX_SETS,
        "tolerance": TOL, "ours": ours, "peers": peers,
        "workloads": {n: parse_case(n) for n in names}, "targets_tbps": TARGET_TBPS,
        "target_peers": {"eager": TARGET_PEERS_EAGER, "all": TARGET_PEERS_ALL}}, FLOPS_FORMULA, BYTES_FORMULA)
    common.run_cases(NAME, result, names, len(runners), timing.passes,
                     functools.partial(_run_case, runners=runners, titles=titles, ceilings=ceilings, timing=timing,
                                       l2=l2, l2_multiple=l2_multiple),
                     checkpoint)
    result["targets"] = targets(result)
    result["report"] = report(result, ceilings)
    return result


def _run_case(name, wi, bar, *, runners, titles, ceilings, timing, l2, l2_multiple) -> dict:
    kv_lens = case_lengths(name)
    batch, kv_len, ragged = len(kv_lens), max(kv_lens), len(set(kv_lens)) > 1
    flops, nbytes = work(1, sum(kv_lens))
    n_sets = common.rotation_sets(nbytes, timing.sets, l2, l2_multiple, MAX_SETS)
    meta = build_meta(batch, kv_len, seed=wi, kv_lens=kv_lens if ragged else None)
    sets = [build_inputs(meta, seed=100 * wi + i) for i in range(n_sets)]
    case = {"name": name, "batch": batch, "kv_len": kv_len, "num_pages": meta.num_pages,
            "kv_tokens": sum(kv_lens), "ragged": ragged,
            **common.floors(flops, nbytes, ceilings, "bf16"),
            "input_sets": n_sets, "rotation_bytes": n_sets * nbytes, "runners": {}, "ours_ok": True}
    ref = common.case_reference(case, reference, meta, sets[0])
    bar.log(f"[{name}] batch {batch} x kv {f'{sum(kv_lens)} in all, max {kv_len}' if ragged else kv_len}, "
            f"{meta.num_pages} pages, K/V {nbytes / 1e6:.1f} MB a set, "
            f"{n_sets} input set(s) rotated ({n_sets * nbytes / 1e6:.0f} MB, L2 {l2 / 2 ** 20:.0f} MiB); "
            f"reference: {case['reference']}")

    def measure(key, r, b2b_runs):
        r["tbps"] = nbytes / (r["ms"] * 1e-3) / 1e12
        r["of_ceiling"] = r["tbps"] * 1e12 / ceilings.bandwidth
        r["over_floor"] = r["ms"] / case["floor_ms"]
        r["b2b_ms_runs"] = b2b_runs
        r["b2b_ms"] = sum(b2b_runs) / len(b2b_runs) if b2b_runs else None
        return (f"{r['ms']:.4f} ms, {r['tbps']:.2f} TB/s" + common.spread_note(r)
                + (f", back to back {r['b2b_ms']:.4f} ms/call" if r["b2b_ms"] is not None else ""))

    common.run_runners(case, runners, lambda key: PREPARE[key](meta, sets), titles=titles, our_keys=OUR_KEYS,
                       meta=meta, ref=ref, tol=TOL, timing=timing, bar=bar, first_call_label="prepare + first call",
                       measure=measure, back_to_back=True)
    return case


# ---------------------------------------------------------------- targets

def _fastest(case: dict, keys) -> Optional[tuple]:
    """(key, runner) with the smallest time among ``keys`` that were measured, or None."""
    got = [(k, case["runners"][k]) for k in keys
           if k in case["runners"] and case["runners"][k].get("ms") is not None]
    return min(got, key=lambda kr: kr[1]["ms"]) if got else None


def _against(ours, peer) -> dict:
    """Our fastest against the peers' fastest: ratio, verdict, whether a miss is within the passes' spread."""
    if ours is None or peer is None:
        return {"ours": ours and ours[0], "ours_ms": ours and ours[1]["ms"], "peer": peer and peer[0],
                "peer_ms": peer and peer[1]["ms"], "ratio": None,
                "verdict": "no serveattn time" if ours is None else "no peer time"}
    ratio = peer[1]["ms"] / ours[1]["ms"]
    noise = max(ours[1].get("spread") or 0.0, peer[1].get("spread") or 0.0)
    verdict = "met" if ratio >= 1.0 else ("missed (within the spread)" if 1.0 - ratio <= noise else "missed")
    return {"ours": ours[0], "ours_ms": ours[1]["ms"], "peer": peer[0], "peer_ms": peer[1]["ms"],
            "ratio": ratio, "verdict": verdict}


def targets(result: dict) -> list:
    """Per case: ours (eager) vs the faster of FlashInfer/cuDNN (eager), ours (any form) vs them (any form),
    and the absolute TB/s target where the issue sets one."""
    out = []
    ours_eager = [k for k in ("cc", "tc") if k in result["config"]["ours"]]
    for c in result["cases"]:
        t = {"case": c["name"],
             "eager": _against(_fastest(c, ours_eager), _fastest(c, TARGET_PEERS_EAGER)),
             "all": _against(_fastest(c, OUR_KEYS), _fastest(c, TARGET_PEERS_ALL))}
        goal = TARGET_TBPS.get(c["name"])
        best = _fastest(c, OUR_KEYS)
        if goal is not None:
            tb = best[1]["tbps"] if best else None
            t["tbps"] = {"target": goal, "ours": best and best[0], "ours_tbps": tb,
                         "verdict": "no serveattn time" if tb is None else ("met" if tb >= goal else "missed")}
        out.append(t)
    return out


# ---------------------------------------------------------------- tables

def _metric(runner: dict) -> str:
    return f"{runner['tbps']:.2f} TB/s"


def _who(key: Optional[str]) -> str:
    return dict(OURS + PEERS).get(key, key or "-")


def report(result: dict, ceilings: "common.Ceilings") -> str:
    cases = result["cases"]
    cfg = result["config"]
    peers = cfg["peers"]
    titles = dict(PEERS)
    bw = ceilings.bandwidth / 1e12
    lines = [f"## decode: GQA {HQ}/{HKV} heads, head dim {HEAD_DIM}, bf16, page size {PAGE_SIZE}, shuffled page "
             f"table, one query token per request",
             "",
             f"- {BYTES_FORMULA}; TB/s = K/V bytes / time.",
             f"- floor = K/V bytes / {bw:.2f} TB/s (device copy, read + write: a read-only stream can pass it, "
             f"so '% of ceiling' can exceed 100%); 'ours/floor' is our time over it.",
             f"- {common.RATIO_NOTE}; peer cells: peer TB/s, ratio to the serveattn variant of the row.",
             f"- ms: median of {common.timing_phrase()}; warmup {cfg['warmup_ms']} "
             f"ms, rep {cfg['rep_ms']} ms), mean over {cfg['passes']} interleaved pass(es). 'b2b': mean ms per "
             f"call over a loop of calls back to back with no flush, which the host's launch cost bounds from "
             f"below: eager vs graph there is the launch overhead.",
             f"- each timed call rotates among distinct random input sets (q, paged cache, contiguous K/V) "
             f"holding at least {cfg['l2_multiple']:g}x the {cfg['l2_bytes'] / 2 ** 20:.0f} MiB L2 in K/V (at least "
             f"{cfg['min_input_sets']}, at most {cfg['max_sets']} sets; the count per case is in 'floors').",
             "- CUDA graph: one graph per input set, each capturing one run after a warm-up run; the timed call "
             "is graph.replay().",
             ""]

    headers = ["case", "ours", "ms", "TB/s", f"% of {bw:.2f}", "spread", "err", "ours/floor", "b2b ms"]
    headers += [titles[p] for p in peers]
    rows = common.ours_rows(cases, OUR_KEYS, peers, lambda o: [
        f"{o['ms']:.4f}", f"{o['tbps']:.2f}", f"{100 * o['of_ceiling']:.0f}%", common.spread_cell(o),
        common.fmt(o["err"], ".1e"), f"{o['over_floor']:.2f}x", common.fmt(o.get("b2b_ms"), ".4f")], 7, _metric)
    lines += ["### serveattn against the peers", "",
              "ours: cc = use_tensor_cores=False, tc = use_tensor_cores=True; -graph = CUDA graph replay.", "",
              common.markdown_table(headers, rows), ""]

    frows = [[c["name"], f"{c['batch']}, {c['kv_tokens']} keys (max {c['kv_len']})" if c.get("ragged") else
              f"{c['batch']} x {c['kv_len']}", f"{c['bytes'] / 1e6:.1f}", f"{c['bytes_floor_ms']:.4f}",
              f"{c['flops_floor_ms']:.4f}", c["input_sets"], f"{c['rotation_bytes'] / 1e6:.0f}"] for c in cases]
    lines += ["### floors and input sets", "",
              common.markdown_table(["case", "batch x KV", "K/V MB", f"floor ms (bytes / {bw:.2f} TB/s)",
                                     "flops floor ms", "input sets", "rotated K/V MB"], frows), ""]

    tr = []
    for t in result.get("targets", []):
        row = [t["case"]]
        for form in ("eager", "all"):
            a = t[form]
            row += [f"{_who(a['peer'])}, {a['peer_ms']:.4f} ms" if a["peer"] else "-",
                    f"{a['ours']}, {a['ours_ms']:.4f} ms" if a["ours"] else "-",
                    f"{a['ratio']:.2f}x, {a['verdict']}" if a["ratio"] is not None else a["verdict"]]
        if "tbps" in t:
            x = t["tbps"]
            row += [f">= {x['target']:g}", f"{common.fmt(x['ours_tbps'], '.2f')} ({x['ours'] or '-'}), {x['verdict']}"]
        else:
            row += ["-", "-"]
        tr.append(row)
    if tr:
        met = sum(1 for t in result["targets"] for f in ("eager", "all") if t[f]["verdict"] == "met")
        met += sum(1 for t in result["targets"] if t.get("tbps", {}).get("verdict") == "met")
        total = sum(2 + ("tbps" in t) for t in result["targets"])
        lines += ["### targets (issue: no slower than the faster of FlashInfer paged decode and cuDNN at every "
                  "case; >= 4.3 TB/s at 64x8192 and 128x4096, >= 2.5 TB/s at 1x8192)", "",
                  "eager: our faster eager variant against the fastest of FlashInfer CUDA-core / tensor-core "
                  "(eager) and cuDNN SDPA; any form: our fastest variant (graph included) against the fastest "
                  "of those and the graph forms (FlashInfer's, cuDNN's). TB/s: our fastest variant.", "",
                  common.markdown_table(["case", "fastest peer, eager", "ours, eager", "eager: peer/ours",
                                         "fastest peer, any form", "ours, any form", "any form: peer/ours",
                                         "TB/s target", "ours TB/s"], tr), "",
                  f"targets met: {met} of {total} measured here (a target whose peer was not measured counts "
                  f"as not met).", ""]

    prows = []
    for c in cases:
        for key in peers:
            p = c["runners"][key]
            prows.append([c["name"], titles[key], p["status"], common.fmt(p.get("ms"), ".4f"),
                          common.fmt(p.get("tbps"), ".2f"), common.fmt(p.get("b2b_ms"), ".4f"),
                          common.fmt(p.get("err"), ".1e"), common.fmt(p.get("first_call_s"), ".1f"),
                          p["reason"] or p.get("note", "")])
    if prows:
        lines += ["### peers", "",
                  common.markdown_table(["case", "peer", "status", "ms", "TB/s", "b2b ms", "err vs ref",
                                         "prepare + first call s", "how / reason"], prows), ""]
    notes = sorted({c["runners"][k].get("note", "") for c in cases for k in OUR_KEYS if k in c["runners"]} - {""})
    if notes:
        lines += ["serveattn: " + "; ".join(notes), ""]
    lines += common.report_footer(result, TOL)
    return "\n".join(lines)
