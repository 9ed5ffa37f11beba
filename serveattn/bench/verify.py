"""Speculative verify: what k draft rows per request cost the decode wrapper, relative to plain decode (k = 1).

Shape (the issue's): GQA 32 query heads / 8 KV heads, head dim 128, bf16, batch 16, KV length 8192 per request
(the draft tokens included: they are the last rows' positions), page size 16 with a shuffled page table
(``torch.randperm``). Every case reads the same paged cache; only the query rows differ.

Ours, all on serveattn's ``BatchDecodeWithPagedKVCacheWrapper``:

- k = 1 (plain decode): the wrapper in its default form (``use_tensor_cores=False``, the bandwidth kernel, what a
  serving engine runs for decode) and with ``use_tensor_cores=True``; the best of the two is the baseline of the
  ratios, per form (eager / graph), and the tables say which it was.
- chain verify, k in 1, 2, 4, 8, 16: ``plan(..., q_len_per_req=k)``, rows bottom-right causal among the last k KV
  positions; with ``use_tensor_cores=True`` (the prefill kernel) always, and with ``False`` (the bandwidth
  kernel, split-KV included) where k x 4 query heads per KV head fit its 32-row tile (k <= 8).
- tree verify: ``plan(..., tree_parents=...)``, one random tree per request (fixed seed) of 16 nodes (depth 4) and
  64 nodes (depth 6), compared with a chain of the same depth (k = depth) and a chain of the same node count
  (k = nodes); those chains are added to the chain cases when not already there.

Tree shapes (``make_tree``, EAGLE-2-like): nodes by level (breadth-first order, so a parent always precedes its
children); level widths start at 1 per level (so the depth is exact) and the other nodes go one at a time to a
level drawn with weight ``depth - level`` (wider near the root), at most ``TREE_TOP_K`` children per node (and
at most ``TREE_TOP_K`` nodes at the first level); each node's parent is drawn from the level above with weight
``1 / (rank + 1)`` (earlier, likelier nodes get more children). Seed ``TREE_SEED + 1000 * nodes + request``.

Forms: eager (``run`` called from Python, ``common.bench_ms`` over a rotating set of inputs, as decode.py does)
and CUDA graph (the wrapper with ``use_cuda_graph=True`` and the three index buffers, as
``CUDAGraphBatchDecodeWithPagedKVCacheWrapper`` builds it; planned before capture, one graph per input set
capturing ``run(q_i, cache_i, out=o_i)`` after a warm-up run; the timed call is ``graph.replay()``).

Peers (eager only): FlashInfer when ``import flashinfer`` works (its decode wrapper, CUDA-core and tensor-core, at
k = 1; ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` for chains and with the dense ``custom_mask``
of ``serveattn.tree_parents_to_mask`` for trees), else a row saying why not; torch SDPA with the flash backend on
contiguous ``[B, H, S, D]`` K/V for k = 1 (no mask) and for chains (``torch.nn.attention.bias.causal_lower_right``:
SDPA's ``is_causal`` is top-left aligned, which is wrong for q_len < kv_len; that bias dispatches to the flash
kernel with bottom-right alignment, and the runner refuses to run when ``can_use_flash_attention`` says it would
not); no SDPA peer for trees (flash takes no arbitrary mask).

Check before timing: every runner's output (ours into an ``out`` filled with NaN; graphs: the captured output
filled with NaN before a replay) against the float64 oracle ``serveattn.reference.batch_paged`` on input set 0
(chains: ``causal=True``, bottom-right; trees: ``custom_mask`` from ``tree_parents_to_mask``), relative-norm
error below 2e-2, or the runner is reported wrong and not timed.

Metric: ms (median of do_bench, mean over passes), ratio to the best k = 1 of the same form, K/V TB/s (K/V bytes
= 2 * batch * kv_len * Hkv * D * 2, the same at every k), the bandwidth floor (K/V bytes / 4.27 TB/s unless
``--measure-ceilings``) and the flop floor (4 * batch * rows * kv_len * Hq * D / bf16 rate). Target (issue):
k = 4 at most 1.10x of k = 1, eager and graph.

CPU dry run of the plumbing (no GPU): ``cpu_dry_run()`` (under ``TRITON_INTERPRET=1``) sets ``DEVICE = "cpu"``
and tiny shapes, replaces do_bench / CUDA events by ``time.perf_counter`` and graph capture by a replay of the
call, and runs the whole flow once; tests/test_bench_verify.py runs it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
import types
from typing import Callable, Dict, List, Optional

from ..routing import BANDWIDTH, TENSOR_CORE, fits_bandwidth_tile

from . import common
from . import decode as decode_bench
from .decode import Meta

NAME = "verify"
# Module variables so that a CPU dry run of the plumbing can change them (cpu_dry_run).
DEVICE = "cuda"
BACKEND = "auto"  # serveattn's backend argument; the CPU dry run sets "triton" (the kernels, interpreted)
HQ, HKV, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
BATCH, KV_LEN = 16, 8192
KV_ELEMENT_BYTES = 2  # bf16
TOL = 2e-2
WORKSPACE_BYTES = 256 << 20
L2_MULTIPLE = 4.0
MAX_SETS = 16

CHAINS = (1, 2, 4, 8, 16)
QUICK_CHAINS = (1, 4)
TREES = ((16, 4), (64, 6))  # (nodes, depth)
QUICK_TREES = ((16, 4),)
TREE_TOP_K = 10  # at most this many children per node (EAGLE-2's top_k)
TREE_SEED = 2024
MAX_TREE_NODES = 64  # the decode wrapper's native tree mode

#: The issue's target: chain k = TARGET_K costs at most TARGET_RATIO x of k = 1 (eager, and under CUDA graph).
TARGET_K, TARGET_RATIO = 4, 1.10

BYTES_FORMULA = ("K/V bytes = 2 * batch * kv_len * Hkv * D * 2 (bf16), the same at every k: every row of a request "
                 "reads that request's K/V; q, o and the page table are not counted")
FLOPS_FORMULA = ("flops = 4 * batch * rows * kv_len * Hq * D (q.k and p.v of every row over the whole KV; the "
                 "masked draft-draft pairs, under rows^2 per request, are not subtracted)")

FORMS = ("eager", "graph")
#: (key, title) of our runners: cc = use_tensor_cores=False (chains that fit the bandwidth kernel),
#: tc = use_tensor_cores=True.
OURS = (("cc", "serveattn CUDA-core (default decode), eager"), ("cc-graph", "serveattn CUDA-core, CUDA graph"),
        ("tc", "serveattn tensor-core, eager"), ("tc-graph", "serveattn tensor-core, CUDA graph"))
PEERS = (("fi-cc", "FlashInfer decode CUDA-core (k=1)"), ("fi-tc", "FlashInfer decode tensor-core (k=1)"),
         ("fi-prefill", "FlashInfer paged prefill (chains: causal; trees: custom_mask)"),
         ("flash", "torch flash SDPA (k=1: no mask; chains: causal_lower_right)"))
OUR_KEYS = tuple(k for k, _ in OURS)
PEER_KEYS = tuple(k for k, _ in PEERS)

def add_arguments(parser) -> None:
    """Options of this family (the shared ones are added by __main__); all verify-only names, so that under
    ``all`` they reach no other family."""
    parser.add_argument("--batch", type=int, default=None, help=f"verify: requests (default {BATCH})")
    parser.add_argument("--kv-len", type=int, default=None,
                        help=f"verify: KV length per request, draft tokens included (default {KV_LEN})")
    parser.add_argument("--chains", default=None,
                        help=f"verify: comma-separated q_len_per_req values (default {','.join(map(str, CHAINS))}; "
                             f"quick {','.join(map(str, QUICK_CHAINS))}); the trees add their depth and node count")
    parser.add_argument("--trees", default=None,
                        help="verify: comma-separated trees, each <nodes> or <nodes>:<depth> (at most "
                             f"{MAX_TREE_NODES} nodes; depth defaults to round(log2(nodes))), or 'none' "
                             f"(default {_tree_list(TREES)}; quick {_tree_list(QUICK_TREES)})")
    parser.add_argument("--forms", default=None,
                        help="verify: comma-separated forms of ours, of eager,graph (default both)")
    parser.add_argument("--verify-peers", default=None,
                        help=f"verify: comma-separated peers of {','.join(PEER_KEYS)}, or 'none' (default all)")
    parser.add_argument("--l2-multiple", type=float, default=L2_MULTIPLE,
                        help="raise --sets until the rotated input sets hold this many times the L2 in K/V "
                             f"bytes (default {L2_MULTIPLE:g}; 0: --sets as given)")


def _tree_list(trees) -> str:
    return ",".join(f"{n}:{d}" for n, d in trees)


# ---------------------------------------------------------------- trees

def make_tree(nodes: int, depth: int, seed: int, top_k: int = TREE_TOP_K) -> List[int]:
    """A parent array (-1 = child of the prefix) of ``nodes`` draft tokens and exactly ``depth`` levels, in
    breadth-first order; see the module docstring for the shape. Deterministic in ``seed``."""
    import numpy as np

    if not 1 <= depth <= nodes:
        raise ValueError(f"a tree of {nodes} nodes cannot have depth {depth}")
    rng = np.random.RandomState(seed)
    widths = [1] * depth

    def cap(level):
        return top_k if level == 0 else widths[level - 1] * top_k

    for _ in range(nodes - depth):
        open_ = [lv for lv in range(depth) if widths[lv] < cap(lv)]
        if not open_:
            raise ValueError(f"a tree of {nodes} nodes does not fit in depth {depth} with at most {top_k} "
                             f"children per node")
        w = np.array([depth - lv for lv in open_], dtype=float)
        widths[int(rng.choice(open_, p=w / w.sum()))] += 1
    parents: List[int] = []
    prev: List[int] = []
    start = 0
    for level, width in enumerate(widths):
        if level == 0:
            parents += [-1] * width
        else:
            children = {p: 0 for p in prev}
            chosen = []
            for _ in range(width):
                cand = [p for p in prev if children[p] < top_k]
                w = np.array([1.0 / (prev.index(p) + 1) for p in cand])
                p = int(cand[int(rng.choice(len(cand), p=w / w.sum()))])
                children[p] += 1
                chosen.append(p)
            parents += sorted(chosen)  # children grouped under their parent, parents in order
        prev = list(range(start, start + width))
        start += width
    return parents


def tree_depths(parents: List[int]) -> List[int]:
    """Depth of every node (a child of the prefix has depth 1)."""
    d: List[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def level_widths(parents: List[int]) -> List[int]:
    depths = tree_depths(parents)
    return [depths.count(lv) for lv in range(1, max(depths) + 1)] if depths else []


def make_trees(batch: int, nodes: int, depth: int) -> List[List[int]]:
    trees = [make_tree(nodes, depth, TREE_SEED + 1000 * nodes + i) for i in range(batch)]
    for t in trees:
        got = max(tree_depths(t))
        if len(t) != nodes or got != depth:  # the generator is the benchmark's own code: check it
            raise RuntimeError(f"verify bench: tree generator gave {len(t)} nodes / depth {got}, "
                               f"asked {nodes} / {depth}")
    return trees


# ---------------------------------------------------------------- inputs

@dataclasses.dataclass
class InputSet:
    q_all: object  # [B, max_rows, Hq, D]: the query of a request's last max_rows positions
    cache: object  # [pages, 2, PAGE_SIZE, Hkv, D]
    kb: object     # [B, Hkv, S, D] contiguous, the same values (None without an SDPA peer)
    vb: object


def build_meta(batch: int, kv_len: int, seed: int = 0) -> "Meta":
    """decode's shuffled page table, on this family's DEVICE."""
    return decode_bench.build_meta(batch, kv_len, seed, device=DEVICE)


def build_inputs(meta: Meta, max_rows: int, seed: int, contiguous: bool) -> InputSet:
    """Random bf16 q / K / V, K / V scattered into the paged cache through the shuffled page table."""
    import torch

    dev, bf = DEVICE, torch.bfloat16
    b, s = meta.batch, meta.kv_len
    g = torch.Generator(device=dev).manual_seed(seed)
    q_all = torch.randn(b, max_rows, HQ, HEAD_DIM, dtype=bf, device=dev, generator=g)
    cache = torch.randn(meta.num_pages, 2, PAGE_SIZE, HKV, HEAD_DIM, dtype=bf, device=dev, generator=g)
    xs = []
    for j in (0, 1):
        x = torch.randn(b, HKV, s, HEAD_DIM, dtype=bf, device=dev, generator=g)
        part = cache[:, j]
        part[meta.page_of_token, meta.slot_of_token] = x.transpose(1, 2).reshape(b * s, HKV, HEAD_DIM)
        xs.append(x)
    # The scatter is the benchmark's own code: check it on the last request before anyone is measured on it.
    sl = slice((b - 1) * s, b * s)
    back = cache[:, 1][meta.page_of_token[sl], meta.slot_of_token[sl]]
    if not torch.equal(back, xs[1][b - 1].transpose(0, 1)):
        raise RuntimeError("verify bench: the paged cache does not hold the contiguous V (page scatter bug)")
    kb, vb = xs if contiguous else (None, None)
    del xs
    return InputSet(q_all=q_all, cache=cache, kb=kb, vb=vb)


def case_q(s: InputSet, rows: int):
    """[batch * rows, Hq, D]: request i's rows are the queries of its last ``rows`` positions (the same tensor
    values at every k for the same position)."""
    b, m = s.q_all.shape[0], s.q_all.shape[1]
    return s.q_all[:, m - rows:].reshape(b * rows, HQ, HEAD_DIM).contiguous()


def kv_bytes(batch: int, kv_len: int) -> float:
    return float(2 * batch * kv_len * HKV * HEAD_DIM * KV_ELEMENT_BYTES)


def work(batch: int, rows: int, kv_len: int) -> tuple:
    """(flops, bytes) of one run, by the formulas printed with the results."""
    return 4.0 * batch * rows * kv_len * HQ * HEAD_DIM, kv_bytes(batch, kv_len)


# ---------------------------------------------------------------- the cases

@dataclasses.dataclass
class Case:
    name: str
    kind: str  # "chain" or "tree"
    rows: int  # rows per request: k for a chain, the node count for a tree
    depth: int
    trees: Optional[List[List[int]]] = None
    why: str = ""  # "asked", or which tree added this chain


def plan_cases(chains, trees, batch: int, kv_len: int) -> List[Case]:
    cases: Dict[int, Case] = {}
    for k in chains:
        cases[k] = Case(f"k={k}", "chain", k, k, why="asked")
    tree_cases = []
    for n, d in trees:
        try:
            t = Case(f"tree{n}", "tree", n, d, trees=make_trees(batch, n, d))
        except ValueError as exc:
            raise SystemExit(f"verify: tree {n}:{d}: {exc}.") from None
        tree_cases.append(t)
        for k, role in ((d, "depth"), (n, "nodes")):
            if k not in cases:
                cases[k] = Case(f"k={k}", "chain", k, k, why=f"same {role} as {t.name}")
    out = [cases[k] for k in sorted(cases)] + tree_cases
    for c in out:
        if c.rows > kv_len:
            raise SystemExit(f"verify: {c.name} has {c.rows} rows per request, more than --kv-len {kv_len}.")
    return out


def case_runners(case: Case, forms, peers) -> List[str]:
    ours = []
    bandwidth = case.kind == "chain" and fits_bandwidth_tile(case.rows, HQ // HKV)
    for base in (("cc", "tc") if bandwidth else ("tc",)):
        if "eager" in forms:
            ours.append(base)
        if "graph" in forms:
            ours.append(base + "-graph")
    if case.kind == "tree":
        mine = ["fi-prefill"]
    elif case.rows == 1:
        mine = ["fi-cc", "fi-tc", "flash"]
    else:
        mine = ["fi-prefill", "flash"]
    return [k for k in OUR_KEYS if k in ours] + [k for k in PEER_KEYS if k in peers and k in mine]


def case_titles(case: Case) -> dict:
    t = dict(OURS + PEERS)
    how = f"q_len_per_req={case.rows}" if case.kind == "chain" else f"tree_parents, {case.rows} nodes"
    return {k: f"{v} [{how}]" for k, v in t.items()}


# ---------------------------------------------------------------- runners

def _plan_kwargs(case: Case) -> dict:
    if case.kind == "tree":
        return {"tree_parents": case.trees}
    return {"q_len_per_req": case.rows} if case.rows > 1 else {}


def _ours_note(w, case: Case, tensor_cores: bool) -> str:
    """The runner's flag and the route its plan took (the wrapper's own decision, not a rule restated here)."""
    decision = getattr(w, "_decision", None)
    kernel = getattr(decision, "kernel", None)
    route = {BANDWIDTH: "bandwidth kernel", TENSOR_CORE: "tensor-core route"}.get(kernel, f"route {kernel!r}")
    return f"use_tensor_cores={tensor_cores}, {route}, backend={getattr(w, 'backend', '?')}"


def _fake_capture(calls):
    """The CPU dry run's stand-in for ``common.capture_cuda_graphs``: the 'capture' runs each call once, a
    'replay' runs it again (into the same static output)."""
    results = [call() for call in calls]
    return [types.SimpleNamespace(replay=call) for call in calls], results


def _capture(calls):
    return common.capture_cuda_graphs(calls) if DEVICE == "cuda" else _fake_capture(calls)


def prepare_ours(tensor_cores: bool, graph: bool, case: Case, meta: Meta, sets, qs) -> common.Prepared:
    import torch
    import serveattn

    kwargs = {}
    if graph:  # what CUDAGraphBatchDecodeWithPagedKVCacheWrapper builds, with the backend choice kept
        i32 = dict(dtype=torch.int32, device=DEVICE)
        kwargs = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty(meta.batch + 1, **i32),
                      paged_kv_indices_buffer=torch.empty(meta.num_pages, **i32),
                      paged_kv_last_page_len_buffer=torch.empty(meta.batch, **i32))
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(common.workspace(WORKSPACE_BYTES, DEVICE), "NHD",
                                                     use_tensor_cores=tensor_cores, backend=BACKEND, **kwargs)
    w.plan(meta.indptr, meta.indices, meta.last_page_len, HQ, HKV, HEAD_DIM, PAGE_SIZE,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **_plan_kwargs(case))
    note = _ours_note(w, case, tensor_cores)
    if not graph:
        return common.Prepared(fns=[functools.partial(w.run, q, s.cache) for q, s in zip(qs, sets)], note=note,
                               keep=w, poisoned=common.poisoned_call(w.run, (qs[0], sets[0].cache), qs[0]))
    outs = [torch.empty_like(q) for q in qs]
    graphs, results = _capture([functools.partial(w.run, q, s.cache, out=o) for q, s, o in zip(qs, sets, outs)])
    results = [common.first(r) for r in results]
    poisoned = common.poisoned_replay(results[0], graphs[0])

    how = "planned before capture; run(q, cache, out=...) captured, one graph per input set, timed: graph.replay()"
    if DEVICE != "cuda":
        how += " (CPU dry run: no capture, a replay re-runs the call)"
    return common.Prepared(fns=[g.replay for g in graphs], poisoned=poisoned, poisoned_passes_out=False,
                           keep=(w, graphs, results, outs), note=f"{note}; {how}")


def prepare_fi_decode(tensor_cores: bool, case: Case, meta: Meta, sets, qs) -> common.Prepared:
    import torch

    fi = common.import_flashinfer()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(common.workspace(WORKSPACE_BYTES, DEVICE), "NHD",
                                              use_tensor_cores=tensor_cores)
    w.plan(meta.indptr, meta.indices, meta.last_page_len, HQ, HKV, HEAD_DIM, PAGE_SIZE,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return common.Prepared(fns=[functools.partial(w.run, q, s.cache) for q, s in zip(qs, sets)], keep=w,
                           note=f"flashinfer {getattr(fi, '__version__', '?')}, decode wrapper, "
                                f"use_tensor_cores={tensor_cores}, same shuffled page table")


def prepare_fi_prefill(case: Case, meta: Meta, sets, qs) -> common.Prepared:
    import torch
    import serveattn

    fi = common.import_flashinfer()
    qo_indptr = torch.arange(meta.batch + 1, dtype=torch.int32, device=DEVICE) * case.rows
    w = fi.BatchPrefillWithPagedKVCacheWrapper(common.workspace(WORKSPACE_BYTES, DEVICE), "NHD")
    if case.kind == "tree":
        mask, _, _ = serveattn.tree_parents_to_mask(case.trees, [meta.kv_len - case.rows] * meta.batch)
        kw = dict(custom_mask=mask.to(DEVICE), causal=False)
        how = "custom_mask (dense, from tree_parents_to_mask)"
    else:
        kw = dict(causal=True)
        how = "causal=True (bottom-right)"
    w.plan(qo_indptr, meta.indptr, meta.indices, meta.last_page_len, HQ, HKV, HEAD_DIM, PAGE_SIZE,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **kw)
    return common.Prepared(fns=[functools.partial(w.run, q, s.cache) for q, s in zip(qs, sets)], keep=(w, kw),
                           note=f"flashinfer {getattr(fi, '__version__', '?')}, paged prefill, {how}, "
                                f"same shuffled page table")


def _sdpa_lower_right(q, k, v, bias, gqa: bool):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa) if gqa else \
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _flash_would_run(q, k, v, gqa: bool) -> bool:
    """What ``CausalBias`` asks before it takes its flash path (on the CPU dry run: True, nothing to ask)."""
    if DEVICE != "cuda":
        return True
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    try:
        params = SDPAParams(q, k, v, None, 0.0, False, gqa)
    except TypeError:  # a torch whose SDPAParams has no enable_gqa
        if gqa:
            return False
        params = SDPAParams(q, k, v, None, 0.0, False)
    return bool(can_use_flash_attention(params))


def prepare_flash(case: Case, meta: Meta, sets, qs) -> common.Prepared:
    """torch SDPA, flash, on contiguous [B, Hkv, S, D] K/V; q [B, Hq, rows, D] (copied out of the rows outside the
    timing). k = 1: no mask. k > 1: ``causal_lower_right(k, kv_len)``; GQA through enable_gqa=True, else (refused,
    or flash would not take it) K/V repeated to Hq heads outside the timing."""
    import torch

    if case.kind != "chain":
        raise NotImplementedError("flash SDPA takes no arbitrary mask, so it has no tree form")
    if sets[0].kb is None:
        raise RuntimeError("contiguous K/V were not built")
    b, n = meta.batch, case.rows
    qbs = [q.view(b, n, HQ, HEAD_DIM).transpose(1, 2).contiguous() for q in qs]

    def normalize(out, _meta):
        return out.transpose(1, 2).reshape(b * n, HQ, HEAD_DIM)

    if n == 1:
        views = [types.SimpleNamespace(qb=qb, kb=s.kb, vb=s.vb) for qb, s in zip(qbs, sets)]
        fns, refused = common.sdpa_fns("FLASH_ATTENTION", views, HQ // HKV, causal=False)
        note = "no mask, GQA via enable_gqa=True" if refused is None else \
            f"no mask, K/V repeated to {HQ} heads (enable_gqa refused: {common.one_line(refused, 100)})"
        return common.Prepared(fns=fns, note=note, normalize=normalize, keep=views)

    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(n, meta.kv_len)
    s0 = sets[0]
    refused = "can_use_flash_attention is False with enable_gqa=True"
    if _flash_would_run(qbs[0], s0.kb, s0.vb, True):
        try:
            _sdpa_lower_right(qbs[0], s0.kb, s0.vb, bias, True)
            torch.cuda.synchronize()
            fns = [functools.partial(_sdpa_lower_right, qb, s.kb, s.vb, bias, True) for qb, s in zip(qbs, sets)]
            note = "causal_lower_right bias (flash, bottom-right), GQA via enable_gqa=True"
            if DEVICE != "cuda":
                note += " (CPU dry run: not the flash kernel)"
            return common.Prepared(fns=fns, note=note, normalize=normalize, keep=qbs)
        except Exception as exc:  # noqa: BLE001 - GQA refused: repeat K/V outside the timing
            refused = common.one_line(exc, 100)
    group = HQ // HKV
    rep = [(s.kb.repeat_interleave(group, dim=1).contiguous(), s.vb.repeat_interleave(group, dim=1).contiguous())
           for s in sets]
    if not _flash_would_run(qbs[0], rep[0][0], rep[0][1], False):
        raise NotImplementedError("torch.backends.cuda.can_use_flash_attention is False for this shape, so "
                                  "causal_lower_right would not run the flash kernel")
    fns = [functools.partial(_sdpa_lower_right, qb, kr, vr, bias, False) for qb, (kr, vr) in zip(qbs, rep)]
    note = (f"causal_lower_right bias (flash, bottom-right), K/V repeated to {HQ} heads, so it reads {group}x the "
            f"bytes counted (GQA: {refused})")
    return common.Prepared(fns=fns, note=note, normalize=normalize, keep=(qbs, rep))


def prepare(key: str, case: Case, meta: Meta, sets, qs) -> common.Prepared:
    if key in OUR_KEYS:
        return prepare_ours(key.startswith("tc"), key.endswith("-graph"), case, meta, sets, qs)
    if key in ("fi-cc", "fi-tc"):
        return prepare_fi_decode(key == "fi-tc", case, meta, sets, qs)
    if key == "fi-prefill":
        return prepare_fi_prefill(case, meta, sets, qs)
    if key == "flash":
        return prepare_flash(case, meta, sets, qs)
    raise KeyError(key)


def reference(case: Case, meta: Meta, s0: InputSet, q0):
    """The float64 oracle on input set 0, as [batch * rows, Hq, D]."""
    import torch
    import serveattn
    from serveattn import reference as oracle

    qo_indptr = torch.arange(meta.batch + 1, dtype=torch.int32) * case.rows
    if case.kind == "tree":
        mask, _, _ = serveattn.tree_parents_to_mask(case.trees, [meta.kv_len - case.rows] * meta.batch)
        out, _ = oracle.batch_paged(q0, s0.cache, qo_indptr, meta.indptr, meta.indices, meta.last_page_len,
                                    custom_mask=mask)
        how = "float64 serveattn.reference.batch_paged, custom_mask from tree_parents_to_mask"
    else:
        out, _ = oracle.batch_paged(q0, s0.cache, qo_indptr, meta.indptr, meta.indices, meta.last_page_len,
                                    causal=True)
        how = "float64 serveattn.reference.batch_paged, causal (bottom-right)"
    return out, f"{how} (all {meta.batch} requests, input set 0)"


# ---------------------------------------------------------------- the CPU dry run's timing

def _cpu_bench_ms(fn, warmup_ms, rep_ms) -> float:
    """The CPU dry run's timing: one call (the runner loop has warmed it up), time.perf_counter, in ms."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def _device_shims():
    """On the GPU: nothing. With DEVICE="cpu" (the dry run): ``torch.cuda.synchronize`` a no-op and
    ``common.bench_ms`` / ``common.back_to_back_ms`` on ``time.perf_counter``, restored afterwards, so that the
    shared runner loop runs unchanged."""
    if DEVICE == "cuda":
        yield
        return
    import torch

    saved = (torch.cuda.synchronize, common.bench_ms, common.back_to_back_ms)
    torch.cuda.synchronize = lambda *a, **k: None
    common.bench_ms = _cpu_bench_ms
    common.back_to_back_ms = _cpu_bench_ms
    try:
        yield
    finally:
        torch.cuda.synchronize, common.bench_ms, common.back_to_back_ms = saved


# ---------------------------------------------------------------- the run

def _int_list(text: str, what: str) -> List[int]:
    try:
        vals = [int(x) for x in common.split_list(text)]
    except ValueError:
        raise SystemExit(f"verify: {what} {text!r} is not a comma-separated list of integers.") from None
    if any(v < 1 for v in vals):
        raise SystemExit(f"verify: {what} {text!r} holds a value below 1.")
    return vals


def _parse_trees(text: str):
    if text.strip() == "none":
        return []
    out = []
    for item in common.split_list(text):
        n_s, _, d_s = item.partition(":")
        try:
            n = int(n_s)
            d = int(d_s) if d_s else max(1, min(n, int(round(math.log2(n))) if n > 1 else 1))
        except ValueError:
            raise SystemExit(f"verify: tree {item!r} is not <nodes> or <nodes>:<depth>.") from None
        if not 1 <= n <= MAX_TREE_NODES or not 1 <= d <= n:
            raise SystemExit(f"verify: tree {item!r}: nodes must be 1..{MAX_TREE_NODES} and depth 1..nodes.")
        out.append((n, d))
    return out


def _selected(args):
    quick = bool(getattr(args, "quick", False))
    chains = getattr(args, "chains", None)
    chains = _int_list(chains, "--chains") if chains else list(QUICK_CHAINS if quick else CHAINS)
    trees = getattr(args, "trees", None)
    trees = _parse_trees(trees) if trees else list(QUICK_TREES if quick else TREES)
    forms = common.split_list(getattr(args, "forms", None) or ",".join(FORMS))
    if not forms or any(f not in FORMS for f in forms):
        raise SystemExit(f"verify: --forms {forms} must be a list of {list(FORMS)}.")
    peers = common.select_peers(types.SimpleNamespace(peers=getattr(args, "verify_peers", None)), NAME, PEER_KEYS)
    batch = getattr(args, "batch", None)
    batch = BATCH if batch is None else batch
    kv_len = getattr(args, "kv_len", None)
    kv_len = KV_LEN if kv_len is None else kv_len
    if batch < 1 or kv_len < 1:
        raise SystemExit(f"verify: --batch {batch} and --kv-len {kv_len} must be positive.")
    return chains, trees, forms, peers, batch, kv_len


def run(args, ceilings: "common.Ceilings", checkpoint: Callable[[dict], None] = lambda r: None) -> dict:
    """Runs the chain and tree cases; returns the family's result (``ok``, ``cases``, ``targets``, ``report``)."""
    if DEVICE == "cuda":
        common.require_cuda()
    chains, trees, forms, peers, batch, kv_len = _selected(args)
    cases = plan_cases(chains, trees, batch, kv_len)
    timing = common.Timing.from_args(args)
    l2_multiple = getattr(args, "l2_multiple", None)
    l2_multiple = L2_MULTIPLE if l2_multiple is None else l2_multiple
    l2 = common.l2_cache_bytes() if DEVICE == "cuda" else common.DEFAULT_L2_BYTES
    nbytes = kv_bytes(batch, kv_len)
    n_sets = common.rotation_sets(nbytes, timing.sets, l2, l2_multiple, MAX_SETS)
    max_rows = max(c.rows for c in cases)

    result = common.new_result(NAME, {
        "num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE, "batch": batch,
        "kv_len": kv_len, "kv_len_note": "includes the draft tokens", "dtype": "bfloat16", "kv_layout": "NHD",
        "page_table": "shuffled (torch.randperm)", "device": DEVICE, "warmup_ms": timing.warmup_ms,
        "rep_ms": timing.rep_ms, "passes": timing.passes, "min_input_sets": timing.sets, "input_sets": n_sets,
        "l2_bytes": l2, "l2_multiple": l2_multiple, "tolerance": TOL, "chains": chains,
        "trees": [{"nodes": n, "depth": d} for n, d in trees], "tree_top_k": TREE_TOP_K, "tree_seed": TREE_SEED,
        "forms": forms, "peers": peers, "target": {"k": TARGET_K, "max_ratio": TARGET_RATIO}},
        FLOPS_FORMULA, BYTES_FORMULA)
    result["tree_shapes"] = {c.name: {"nodes": c.rows, "depth": c.depth, "level_widths_request0": level_widths(
        c.trees[0]), "parents": c.trees} for c in cases if c.kind == "tree"}

    runners = {c.name: case_runners(c, forms, peers) for c in cases}
    with _device_shims():
        bar = common.Progress(sum(len(r) for r in runners.values()) * (1 + timing.passes), NAME)
        try:
            meta = build_meta(batch, kv_len, seed=0)
            bar.log(f"[verify] batch {batch} x kv {kv_len}, {meta.num_pages} pages (shuffled), K/V "
                    f"{nbytes / 1e6:.1f} MB a set, {n_sets} input set(s) rotated; cases: "
                    f"{', '.join(c.name for c in cases)}")
            sets = [build_inputs(meta, max_rows, seed=100 + i, contiguous="flash" in peers) for i in range(n_sets)]
            for c in cases:
                case = _run_case(c, runners[c.name], meta, sets, bar, ceilings=ceilings, timing=timing,
                                 nbytes=nbytes, n_sets=n_sets)
                result["cases"].append(case)
                result["ok"] = result["ok"] and case["ours_ok"]
                checkpoint(result)
                if DEVICE == "cuda":
                    import torch

                    torch.cuda.empty_cache()
        finally:
            bar.close()
    result["targets"] = targets(result)
    result["comparisons"] = comparisons(result)
    result["report"] = report(result, ceilings)
    return result


def _run_case(c: Case, runners, meta: Meta, sets, bar, *, ceilings, timing, nbytes, n_sets) -> dict:
    flops, _ = work(meta.batch, c.rows, meta.kv_len)
    qs = [case_q(s, c.rows) for s in sets]
    case = {"name": c.name, "kind": c.kind, "rows_per_request": c.rows, "depth": c.depth, "why": c.why,
            "batch": meta.batch, "kv_len": meta.kv_len, "total_rows": meta.batch * c.rows,
            **common.floors(flops, nbytes, ceilings, "bf16"), "input_sets": n_sets, "runners": {}, "ours_ok": True}
    if c.kind == "tree":
        case["level_widths_request0"] = level_widths(c.trees[0])
    ref = common.case_reference(case, lambda m, s0: reference(c, m, s0, qs[0]), meta, sets[0])
    bar.log(f"[{c.name}] {c.rows} row(s) per request ({c.kind}"
            + (f", depth {c.depth}, level widths of request 0: {case['level_widths_request0']}" if c.kind == "tree"
               else "") + f"); reference: {case['reference']}")

    def measure(key, r, b2b_runs):
        r["tbps"] = nbytes / (r["ms"] * 1e-3) / 1e12
        r["over_floor"] = r["ms"] / case["floor_ms"]
        r["b2b_ms_runs"] = b2b_runs
        r["b2b_ms"] = sum(b2b_runs) / len(b2b_runs) if b2b_runs else None
        return (f"{r['ms']:.4f} ms, {r['tbps']:.2f} TB/s" + common.spread_note(r)
                + (f", back to back {r['b2b_ms']:.4f} ms/call" if r["b2b_ms"] is not None else ""))

    common.run_runners(case, runners, lambda key: prepare(key, c, meta, sets, qs), titles=case_titles(c),
                       our_keys=OUR_KEYS, meta=meta, ref=ref, tol=TOL, timing=timing, bar=bar,
                       first_call_label="prepare + first call", measure=measure, back_to_back=True)
    return case


# ---------------------------------------------------------------- ratios and targets

def _timed(r: Optional[dict]) -> Optional[float]:
    return r.get("ms") if r and r["status"] in ("ok", "unchecked") and r.get("ms") else None


def _case(result: dict, name: str) -> Optional[dict]:
    return next((c for c in result["cases"] if c["name"] == name), None)


def _best(case: Optional[dict], keys, metric: str = "ms"):
    """(key, value) of the smallest ``metric`` among ``keys`` timed in ``case``, or None."""
    if case is None:
        return None
    got = [(k, case["runners"][k][metric]) for k in keys
           if k in case["runners"] and _timed(case["runners"][k]) and case["runners"][k].get(metric)]
    return min(got, key=lambda kv: kv[1]) if got else None


def _form_keys(form: str):
    return ("cc", "tc") if form == "eager" else ("cc-graph", "tc-graph")


def baselines(result: dict) -> dict:
    """Per form and metric (ms, b2b_ms): the best k = 1 of ours, as (key, value), or None."""
    k1 = _case(result, "k=1")
    return {form: {m: _best(k1, _form_keys(form), m) for m in ("ms", "b2b_ms")} for form in FORMS}


def ours_time(case: Optional[dict], form: str, metric: str = "ms"):
    """Our time of ``case`` in ``form``: the best of cc/tc where both ran, tc otherwise."""
    return _best(case, _form_keys(form), metric)


def _verdict(ratio: float, goal: float, spreads) -> str:
    if ratio <= goal:
        return "met"
    noise = max([s for s in spreads if s is not None] or [0.0])
    return "missed (within the spread)" if ratio / goal - 1.0 <= noise else "missed"


def targets(result: dict) -> dict:
    """k = TARGET_K at most TARGET_RATIO x of the best k = 1, per form."""
    base = baselines(result)
    ck = _case(result, f"k={TARGET_K}")
    out = {}
    for form in FORMS:
        b, o = base[form]["ms"], ours_time(ck, form)
        if b is None or o is None:
            out[form] = {"verdict": "not measured", "ratio": None, "base": b and b[0], "base_ms": b and b[1],
                         "ours": o and o[0], "ours_ms": o and o[1]}
            continue
        k1 = _case(result, "k=1")
        spreads = [k1["runners"][b[0]].get("spread"), ck["runners"][o[0]].get("spread")]
        ratio = o[1] / b[1]
        out[form] = {"ratio": ratio, "base": b[0], "base_ms": b[1], "ours": o[0], "ours_ms": o[1],
                     "verdict": _verdict(ratio, TARGET_RATIO, spreads)}
    return out


def comparisons(result: dict) -> list:
    """Each tree against the chain of its depth and the chain of its node count, per form."""
    out = []
    for c in result["cases"]:
        if c["kind"] != "tree":
            continue
        row = {"tree": c["name"], "nodes": c["rows_per_request"], "depth": c["depth"], "forms": {}}
        for form in FORMS:
            t = ours_time(c, form)
            f = {"tree_ms": t and t[1]}
            for role, k in (("depth", c["depth"]), ("nodes", c["rows_per_request"])):
                ch = ours_time(_case(result, f"k={k}"), form)
                f[f"chain_{role}_k"] = k
                f[f"chain_{role}_ms"] = ch and ch[1]
                f[f"tree_over_chain_{role}"] = t[1] / ch[1] if t and ch else None
            b = baselines(result)[form]["ms"]
            f["tree_over_best_k1"] = t[1] / b[1] if t and b else None
            row["forms"][form] = f
        out.append(row)
    return out


# ---------------------------------------------------------------- report

def _x(v: Optional[float]) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _targets_line(result: dict) -> str:
    parts = []
    for form in FORMS:
        t = result["targets"][form]
        if t["ratio"] is None:
            parts.append(f"{form} not measured")
        else:
            parts.append(f"{form} {t['ratio']:.3f}x {t['verdict']} (k={TARGET_K} {t['ours']} {t['ours_ms']:.4f} ms "
                         f"vs k=1 {t['base']} {t['base_ms']:.4f} ms)")
    return f"targets: k={TARGET_K} <= {TARGET_RATIO:.2f}x of k=1: " + "; ".join(parts)


def report(result: dict, ceilings: "common.Ceilings") -> str:
    cfg = result["config"]
    cases = result["cases"]
    bw = ceilings.bandwidth / 1e12
    base = baselines(result)
    lines = [f"## verify: GQA {HQ}/{HKV} heads, head dim {HEAD_DIM}, bf16, batch {cfg['batch']}, KV {cfg['kv_len']} "
             f"per request (draft tokens included), page size {PAGE_SIZE}, shuffled page table", "",
             _targets_line(result), "",
             f"- {BYTES_FORMULA}; TB/s = K/V bytes / time; bandwidth floor = K/V bytes / {bw:.2f} TB/s.",
             f"- {FLOPS_FORMULA}; flop floor = flops / {ceilings.bf16_rate / 1e12:.0f} TFLOP/s. 'of floor' = time / "
             f"max(floors).",
             f"- ratio 'x k=1' = time / the best k=1 of ours in the same form (eager: the faster of cc and tc eager; "
             f"graph: of cc-graph and tc-graph); 'b2b' the same on back-to-back times. Passes interleave the "
             f"runners of one case only, so a ratio between cases (k=4 over k=1) also holds any drift between "
             f"them; the spread is the noise within a case.",
             f"- ms: median of {common.timing_phrase()}; warmup {cfg['warmup_ms']} ms, "
             f"rep {cfg['rep_ms']} ms), mean over {cfg['passes']} interleaved pass(es), {cfg['input_sets']} input "
             f"set(s) rotated. 'b2b': mean ms per call over a loop of calls with no flush (bounded below by the "
             f"host's launch cost: eager vs graph there is the launch overhead).",
             "- ours: cc = BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=False) (the bandwidth kernel, chains "
             "of k <= 8), tc = use_tensor_cores=True (k>1: q_len_per_req=k; trees: tree_parents); -graph = "
             "the wrapper with use_cuda_graph=True (CUDAGraphBatchDecodeWithPagedKVCacheWrapper), planned before "
             "capture, one graph per input set, graph.replay() timed.",
             f"- trees: one per request (seed {cfg['tree_seed']} + 1000 * nodes + request), breadth-first, exact "
             f"depth, extra nodes to levels weighted depth - level, at most {cfg['tree_top_k']} children per node, "
             f"parents weighted 1 / (rank + 1) in the level above (EAGLE-2-like).", ""]
    if cfg["device"] != "cuda":
        lines += [f"**CPU dry run (DEVICE={cfg['device']}): times are time.perf_counter of interpreted kernels, "
                  f"not measurements; graphs are not captured.**", ""]

    for form in FORMS:
        for m, label in (("ms", "ms"), ("b2b_ms", "b2b ms")):
            b = base[form][m]
            if b is not None:
                lines.append(f"best k=1, {form}, {label}: {b[0]} ({b[1]:.4f})")
    lines.append("")

    rows = []
    for c in cases:
        if c["kind"] != "chain":
            continue
        for key in OUR_KEYS:
            r = c["runners"].get(key)
            if r is None:
                continue
            form = "graph" if key.endswith("-graph") else "eager"
            ms, b2b = _timed(r), r.get("b2b_ms") if _timed(r) else None
            bm, bb = base[form]["ms"], base[form]["b2b_ms"]
            if ms is None:
                rows.append([c["name"], key, c["rows_per_request"], f"{r['status'].upper()}: {r['reason']}"]
                            + ["-"] * 6 + [common.fmt(r.get("err"), ".1e"), c["why"]])
                continue
            rows.append([c["name"], key, c["rows_per_request"], f"{ms:.4f}", _x(ms / bm[1] if bm else None),
                         common.fmt(b2b, ".4f"), _x(b2b / bb[1] if bb and b2b else None), f"{r['tbps']:.2f}",
                         f"{r['over_floor']:.2f}x", common.spread_cell(r), common.fmt(r.get("err"), ".1e"), c["why"]])
    lines += ["### chains: cost of k rows per request against k=1", "",
              common.markdown_table(["case", "ours", "rows/req", "ms", "x k=1", "b2b ms", "b2b x k=1", "K/V TB/s",
                                     "of floor", "spread", "err", "why this case"], rows), ""]

    frows = [[c["name"], c["total_rows"], f"{c['bytes'] / 1e6:.1f}", f"{c['bytes_floor_ms']:.4f}",
              f"{c['flops'] / 1e9:.2f}", f"{c['flops_floor_ms']:.4f}", c["bound"]] for c in cases]
    lines += ["### floors", "",
              common.markdown_table(["case", "rows", "K/V MB", f"bandwidth floor ms ({bw:.2f} TB/s)", "GFLOP",
                                     "flop floor ms", "bound"], frows), ""]

    trows = []
    for comp in result["comparisons"]:
        for form in FORMS:
            f = comp["forms"][form]
            trows.append([comp["tree"], comp["nodes"], comp["depth"], form, common.fmt(f["tree_ms"], ".4f"),
                          f"k={f['chain_depth_k']}: {common.fmt(f['chain_depth_ms'], '.4f')}",
                          _x(f["tree_over_chain_depth"]),
                          f"k={f['chain_nodes_k']}: {common.fmt(f['chain_nodes_ms'], '.4f')}",
                          _x(f["tree_over_chain_nodes"]), _x(f["tree_over_best_k1"])])
    if trows:
        shapes = "; ".join(f"{n}: level widths of request 0 {s['level_widths_request0']}"
                           for n, s in result["tree_shapes"].items())
        lines += ["### trees against chains of the same depth and of the same node count", "",
                  f"tree shapes ({shapes}; every parent array is in the JSON under tree_shapes).", "",
                  common.markdown_table(["tree", "nodes", "depth", "form", "tree ms", "chain same depth ms",
                                         "tree / chain(depth)", "chain same nodes ms", "tree / chain(nodes)",
                                         "tree x best k=1"], trows), ""]

    # every runner, ours and the peers, with its status
    arows = []
    peer_base = {"fi": _best(_case(result, "k=1"), ("fi-cc", "fi-tc")), "flash": _best(_case(result, "k=1"),
                                                                                         ("flash",))}
    for c in cases:
        ours_e = ours_time(c, "eager")
        for key, r in c["runners"].items():
            ms = _timed(r)
            pb = peer_base["flash" if key == "flash" else "fi"] if not r["ours"] else None
            arows.append([c["name"], key, r["status"], common.fmt(ms, ".4f"), common.fmt(r.get("b2b_ms"), ".4f"),
                          common.fmt(r.get("tbps"), ".2f"), common.fmt(r.get("err"), ".1e"),
                          _x(ms / pb[1] if ms and pb else None) if not r["ours"] else "-",
                          _x(ms / ours_e[1] if ms and ours_e and not r["ours"] else None),
                          common.fmt(r.get("first_call_s"), ".1f"), r["reason"] or r.get("note", "")])
    lines += ["### every runner (ours and the peers)", "",
              "'peer x its k=1': a peer's time over its own best k=1 (FlashInfer: the faster of its two decode "
              "wrappers; flash: its k=1). 'peer / ours eager': a peer's time over our eager time of the case "
              f"(above 1: ours is faster). Peers run eagerly only.", "",
              common.markdown_table(["case", "runner", "status", "ms", "b2b ms", "TB/s", "err", "peer x its k=1",
                                     "peer / ours eager", "prepare + first call s", "how / reason"], arows), ""]
    lines += common.report_footer(result, TOL)
    return "\n".join(lines)


# ---------------------------------------------------------------- CPU dry run (tests)

#: Tiny shapes of the CPU dry run: (HQ, HKV, HEAD_DIM, PAGE_SIZE).
DRY_SHAPES = (8, 2, 64, 16)
DRY_ARGV = ("--batch", "2", "--kv-len", "40", "--chains", "1,4", "--trees", "4:2", "--passes", "1", "--sets", "2",
            "--l2-multiple", "0")


def cpu_dry_run(extra_argv=()) -> dict:
    """The whole flow once on the CPU (Triton interpreter) with tiny shapes: the plumbing, not the speed. Sets
    DEVICE and the shape constants for the run, restores them after. Returns the family's result."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("cpu_dry_run needs TRITON_INTERPRET=1 set before triton is imported")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from .__main__ import build_parser

    g = globals()
    names = ("DEVICE", "BACKEND", "HQ", "HKV", "HEAD_DIM", "PAGE_SIZE", "WORKSPACE_BYTES")
    saved = {n: g[n] for n in names}
    g.update(DEVICE="cpu", BACKEND="triton", HQ=DRY_SHAPES[0], HKV=DRY_SHAPES[1], HEAD_DIM=DRY_SHAPES[2],
             PAGE_SIZE=DRY_SHAPES[3], WORKSPACE_BYTES=1 << 20)
    try:
        args = build_parser().parse_args(["verify", *DRY_ARGV, *extra_argv])
        return run(args, common.Ceilings())
    finally:
        g.update(saved)
