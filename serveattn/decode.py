"""Decode entry points with FlashInfer's names: batch decode over a paged cache, and single-request decode.

Two routes serve a plan (under backend="auto", serveattn/routing.py picks between them for
`use_tensor_cores=False` by the measured crossover). The bandwidth route runs `kernels/decode.py`
with split-KV: `plan()` cuts long KV into chunks when the batch alone would not fill the GPU, partial
states go to the caller's workspace, and a merge launch folds them in a fixed order. The tensor-core
route (`use_tensor_cores=True`), rotary embedding, and `backend="torch"` run through the prefill family
with one query row per request.
"""
from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Optional, Union

import numpy as np
import torch

from . import backend as backends
from . import routing
from . import knobs, policy, staging
from .kernels import decode as decode_kernel
from .kernels.decode import ITEM_INTS
from .prefill import BatchPrefillWithPagedKVCacheWrapper, TileConfig, WorkspaceAccessors, check_capacity, planned_rows
from .prefill import _single_prefill, even_splits, ragged_chunk, split_paged_cache, uneven_chunk
from .prefill import _Variants, _cache_views, _num_sms, _pair_views, _plain_run, _run_extras, positional_descales
from .spec_tree import MAX_TREE_NODES, tree_ancestor_bits

# Below this many programs (batch x KV heads) per SM pair the GPU is not full: split the KV.
PROGRAMS_PER_SM = 2
# A split request's chunks are folded by the decode kernel's last program of each (request, KV head) (no merge
# launch: 1 x 8192 in a CUDA graph 0.0337 -> 0.0309 ms, docs/performance.md) or, from 8 rows a KV head, by
# merge_kernel a query head a program: kernels/decode.merge_kind, a plan's `merge`.


def _programs_per_sm() -> int:
    """Split-KV aims at this many KV-head programs per SM; SERVEATTN_DECODE_PROGRAMS_PER_SM overrides it (for
    tuning runs only, like SERVEATTN_DECODE_MIN_CHUNK)."""
    return int(knobs.get("SERVEATTN_DECODE_PROGRAMS_PER_SM", str(PROGRAMS_PER_SM)))
MIN_CHUNK = 256  # tokens; shorter chunks cost more in merging than they gain in parallelism
# At most this many chunks a request: past it a fold of many slots costs more than the parallelism gains (H100,
# session 35: 1 x 16384 keys, 64 -> 32 chunks, bandwidth / tensor-core route 1.01 -> 0.88 at group 1, 1.08 -> 0.93
# at group 4; 8K and two requests unchanged). SERVEATTN_DECODE_MAX_SLOTS overrides it (measuring; 0: no cap).
MAX_SLOTS = 32
# A full GPU's batch is split where a request holds more keys than a program would carry with the batch spread
# evenly, into chunks of that share / RAGGED_SPLIT (prefill.ragged_chunk): with the items longest first, ragged
# batches of 64-256 requests took 0.12-0.70x the time, equal lengths unchanged (H100, session 36,
# scripts/probe_decode_ragged.py). SERVEATTN_DECODE_RAGGED_SPLIT overrides it (0: off).
RAGGED_SPLIT = 2


def prefer_tensor_cores(num_qo_heads: int, num_kv_heads: int, q_len_per_req: int = 1) -> bool:
    """Whether to ask for tensor cores: the bandwidth kernel already packs a KV group's query heads (times a
    chain's draft rows) into one tensor-core tile, so it serves decode and chains of up to 32 such rows; more go
    to the prefill family. With use_tensor_cores=False, backend="auto" still takes the tensor-core route where
    docs/routing.md measured it no slower (serveattn/routing.py)."""
    return not routing.fits_bandwidth_tile(q_len_per_req, max(1, num_qo_heads // max(1, num_kv_heads)))


def decode_tiles(head_dim: int, device: torch.device, kv_dtype: torch.dtype = torch.bfloat16,
                 rows: int = 16, batch_cap: Optional[int] = None) -> TileConfig:
    """BLOCK_N keys per step, warps, pipeline depth (block_m is unused: the tile's rows are the group's query
    heads times the chain's draft tokens, padded; `rows` is that padded count).
    SERVEATTN_DECODE_TILES="16,block_n,warps,stages" overrides the table (for tuning runs only).

    An fp8 cache keeps the 16-bit cache's BLOCK_N and warps (they fix the softmax's summation order, so the
    fp8 run stays bitwise the run on the dequantized cache; the pipeline depth does not touch the bits) and
    pipelines deeper: an fp8 tile is half the bytes in flight per stage. H200, 2026-12-02, groups 1/4/8
    (docs/runs/2026-12-02T2133-decode-tile-sweep.txt): 64-key blocks on 2 warps beat 128 on 4 for both
    dtypes; bf16 best at 4 stages (0.508 -> 0.495 ms at 64 x 8192, group 4), fp8 at 6 (0.486 -> 0.449)."""
    if device.type != "cuda":
        return _INTERPRETER_TILES
    override = knobs.get("SERVEATTN_DECODE_TILES", "")
    if override:
        return TileConfig(*map(int, override.split(",")))
    if head_dim == 256:
        return _TILES_256
    if rows > 16:  # a chain's 32 rows: 4 warps share the rows (not measured yet; 2 warps would hold 2x the state)
        return _TILES_FP8_32 if kv_dtype.itemsize == 1 else _TILES_16BIT_32
    if batch_cap is not None and batch_cap <= SMALL_BATCH:
        return _TILES_SMALL_BATCH
    return _TILES_FP8 if kv_dtype.itemsize == 1 else _TILES_16BIT


# the table's entries, built once (a frozen dataclass costs a microsecond per construction, in every plan)
_INTERPRETER_TILES, _TILES_256 = TileConfig(16, 32, 4, 1), TileConfig(16, 64, 4, 3)
_TILES_16BIT, _TILES_FP8 = TileConfig(16, 64, 2, 4), TileConfig(16, 64, 2, 6)
_TILES_16BIT_32, _TILES_FP8_32 = TileConfig(32, 64, 4, 4), TileConfig(32, 64, 4, 6)
# At most SMALL_BATCH requests (the batch capacity under CUDA graphs, which fixes the tiles at capture): split-KV
# gives every (request, KV head) at most PROGRAMS_PER_SM programs an SM, all resident at once, each a chain of
# single-buffered DRAM trips; a deeper pipeline keeps more of its blocks in flight. H200, CUDA graph, session 11:
# 1 x 8192 0.0288-0.0297 -> 0.0265-0.0268 ms with 7 or 8 stages, but 2 x 8192 0.0366 -> 0.0423 ms (and 8 x 4096
# 41.6 -> 51 us in session 7), hence one request only. 7 stages, not 8: where Triton buffers both K and V in every
# stage (group 1, contiguous K/V), 8 stages of 16-bit d128 tiles took 235520 bytes of shared memory, over sm_90's
# 232448; 7 take 6 x 32 KB + 6 KB. Same BLOCK_N and warps as both dtypes' tiles: the bits do not change (the depth
# never does). SERVEATTN_DECODE_SMALL_BATCH=0 turns it off (measuring only).
SMALL_BATCH = int(os.environ.get("SERVEATTN_DECODE_SMALL_BATCH", "1"))
_TILES_SMALL_BATCH = TileConfig(16, 64, 2, 7)


@dataclass
class DecodePlan:
    paged: bool
    device: torch.device
    num_qo_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    window_left: int
    soft_cap: float
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    batch: int
    tiles: TileConfig
    max_page: int
    num_work_host: int
    num_slots: int
    chunk: Optional[int]
    # the schedule: numpy arrays (the plan's own) from make_decode_plan, device tensors once installed
    work: Union[np.ndarray, torch.Tensor]
    num_work: Union[np.ndarray, torch.Tensor]
    req_first_slot: Union[np.ndarray, torch.Tensor]
    req_num_slots: Union[np.ndarray, torch.Tensor]
    kv_indptr: torch.Tensor
    kv_indices: Optional[torch.Tensor]
    last_page_len: Optional[torch.Tensor]
    part_o: Optional[torch.Tensor] = None
    part_lse: Optional[torch.Tensor] = None
    q_len: int = 1  # query rows per request: 1, or a chain's k draft tokens
    merge: str = "fused"  # how split requests are folded: kernels/decode.merge_kind
    # kernels/decode.launch's per-plan memo of what every run launches with (a fresh one for each plan, replace()
    # included: init=False)
    launch_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def static_signature(self):
        return (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, self.window_left,
                self.soft_cap, self.sm_scale, self.q_dtype, self.kv_dtype, self.o_dtype, self.tiles, self.q_len)


def choose_chunk(kv_lens: np.ndarray, num_kv_heads: int, num_sms: int, block_n: int,
                 fixed_split_size: Optional[int], disable_split_kv: bool) -> Optional[int]:
    """KV tokens per chunk (a multiple of block_n), or None when no request is split."""
    if disable_split_kv or kv_lens.size == 0:
        return None
    if fixed_split_size is not None:
        max_kv = int(kv_lens.max())
        chunk = -(-fixed_split_size // block_n) * block_n
    else:
        programs = kv_lens.size * num_kv_heads
        target = _programs_per_sm() * num_sms
        max_kv = int(kv_lens.max())
        divisor = int(knobs.get("SERVEATTN_DECODE_RAGGED_SPLIT", str(RAGGED_SPLIT)))
        if programs >= target:
            return ragged_chunk(kv_lens, max_kv, num_kv_heads, target, block_n, divisor, _split_limits)
        min_chunk, max_slots = _split_limits()
        chunk = max(min_chunk, -(-max_kv // even_splits(programs, target, max_slots)))
        chunk = -(-chunk // block_n) * block_n
        chunk = uneven_chunk(chunk, kv_lens, max_kv, num_kv_heads, target, block_n, divisor, _split_limits)
    return chunk if chunk < max_kv else None


def capacity_chunks(batch_cap: int, num_kv_heads: int, num_sms: int) -> np.ndarray:
    """Under CUDA graphs the fold is fixed at capture, so it follows the batch the graph was captured for (a
    FlashInfer graph wrapper's batch size is fixed; ours is at most the capacity): the chunks choose_chunk cuts a
    long request into when the batch fills the capacity, [0] where that batch fills the GPU (the ragged split then
    cuts only the requests far longer than the batch's share). H100, session 46 (docs/performance.md): group 8 under
    a graph, 32 requests of ragged e4m3 caches folded 3-15% faster fused than through merge_kernel a query head,
    which the rows alone chose; 64 with one 32768-key request 2% slower. Memoized (every graph re-plan asks): a
    read-only array."""
    key = (batch_cap, num_kv_heads, num_sms, knobs.snapshot(_SPLIT_KNOBS))
    chunks = _CAPACITY_CHUNKS.get(key)
    if chunks is None:
        programs = batch_cap * num_kv_heads
        target = _programs_per_sm() * num_sms
        # a batch that fills the GPU: 0 (the ragged split cuts only requests far over its share)
        splits = even_splits(programs, target, _split_limits()[1]) if programs < target else 0
        chunks = np.array([splits], dtype=np.int32)
        chunks.flags.writeable = False
        _CAPACITY_CHUNKS[key] = chunks
    return chunks


# the switches capacity_chunks reads (its memo's key), and the memo
_SPLIT_KNOBS = ("SERVEATTN_DECODE_PROGRAMS_PER_SM", "SERVEATTN_DECODE_MIN_CHUNK", "SERVEATTN_DECODE_MAX_SLOTS")
_CAPACITY_CHUNKS: dict = {}


def _split_limits():
    """(MIN_CHUNK, MAX_SLOTS), or SERVEATTN_DECODE_MIN_CHUNK / _MAX_SLOTS where set (measuring only)."""
    return (int(knobs.get("SERVEATTN_DECODE_MIN_CHUNK", str(MIN_CHUNK))),
            int(knobs.get("SERVEATTN_DECODE_MAX_SLOTS", str(MAX_SLOTS))))


def build_decode_work(kv: np.ndarray, kv_start: np.ndarray, chunk: Optional[int], costliest_first: bool = False):
    """Work items int32 [ITEM_INTS n]: (request, kv_lo, kv_hi, slot, the request's first page (or token), its KV
    length, its first slot, its slot count), and each request's first slot and slot count (for merge_kernel):
    numpy arrays, the plan's own until _install stages them. kv_start: each request's first page (or token).
    costliest_first (the default; SERVEATTN_DECODE_ORDER=request turns it off): items with the most keys first (ties in
    request order), so that a ragged batch's long requests do not start in the grid's last wave (each item
    carries its own slot: the order moves no bit)."""
    batch = kv.size
    if chunk is None:  # the common case: one item per request, no slots
        work = np.zeros((batch, ITEM_INTS), dtype=np.int32)
        if costliest_first and np.greater(kv[1:], kv[:-1]).any():  # equal lengths keep request order, unsorted
            work[:, 0] = order = np.argsort(-kv, kind="stable")
            kv, kv_start = kv[order], kv_start[order]
        else:
            work[:, 0] = np.arange(batch)
        work[:, 2] = work[:, 5] = kv
        work[:, 3] = -1
        work[:, 4] = kv_start
        return work.reshape(-1), batch, np.zeros(batch, dtype=np.int32), np.zeros(batch, dtype=np.int32), 0
    if batch and int(np.minimum.reduce(kv)) == int(np.maximum.reduce(kv)):
        return _equal_decode_work(int(kv[0]), kv_start, chunk, costliest_first)
    return _split_decode_work(kv, kv_start, chunk, costliest_first)


def _split_decode_work(kv: np.ndarray, kv_start: np.ndarray, chunk: int, costliest_first: bool):
    """build_decode_work's split path for any lengths."""
    batch = kv.size
    n_chunks = np.maximum((kv + chunk - 1) // chunk, 1)
    req = np.repeat(np.arange(batch), n_chunks)
    index = np.arange(req.size) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    lo = index * chunk
    hi = np.minimum(lo + chunk, kv[req])
    slots_per_req = np.where(n_chunks > 1, n_chunks, 0)
    first_slot = np.cumsum(slots_per_req) - slots_per_req
    slot = np.where(n_chunks[req] > 1, first_slot[req] + index, -1)
    work = np.stack([req, lo, hi, slot, kv_start[req], kv[req], first_slot[req], slots_per_req[req]], 1)
    if costliest_first:
        work = work[np.argsort(lo - hi, kind="stable")]
    return (work.reshape(-1).astype(np.int32), int(req.size), first_slot.astype(np.int32),
            slots_per_req.astype(np.int32), int(slots_per_req.sum()))


def _equal_decode_work(kv_len: int, kv_start: np.ndarray, chunk: int, costliest_first: bool):
    """build_decode_work's split path for requests of one length (one request, a uniform batch: the common split
    plans), the same arrays from a request's chunk list broadcast over the batch: ~12 numpy calls instead of ~30
    (27-37 -> 13-15 us a plan on a development CPU at 1x8192, 8x4096, 32x2048)."""
    batch = kv_start.size
    chunks = max(-(-kv_len // chunk), 1)
    lo = np.arange(0, chunks * chunk, chunk)
    hi = np.minimum(lo + chunk, kv_len)
    work = np.empty((batch, chunks, ITEM_INTS), dtype=np.int32)
    requests = np.arange(batch)[:, None]
    work[:, :, 0] = requests
    work[:, :, 1] = lo
    work[:, :, 2] = hi
    work[:, :, 4] = kv_start[:, None]
    work[:, :, 5] = kv_len
    if chunks > 1:  # in request order item i is slot i (the order below moves slots with their items)
        work[:, :, 3] = np.arange(batch * chunks).reshape(batch, chunks)
        work[:, :, 6] = requests * chunks
        work[:, :, 7] = chunks
    else:
        work[:, :, 3] = -1
        work[:, :, 6:] = 0
    items = work.reshape(-1, ITEM_INTS)
    if costliest_first and chunks > 1 and kv_len % chunk:  # each request's short last chunk after every full one
        items = np.concatenate((work[:, :-1].reshape(-1, ITEM_INTS), work[:, -1]))
    slots = chunks if chunks > 1 else 0
    return (items.reshape(-1), batch * chunks, np.arange(batch, dtype=np.int32) * slots,
            np.full(batch, slots, dtype=np.int32), batch * slots)


class BatchDecodeWithPagedKVCacheWrapper(WorkspaceAccessors):
    """Decode over a paged KV cache (FlashInfer's wrapper of the same name)."""
    _entry = "BatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None):
        policy.check_kv_layout(self._entry, kv_layout)
        policy.check_backend(self._entry, backend)
        if jit_args is not None:
            policy.unsupported(self._entry, "jit_args is not served; kernels are compiled by Triton.")
        if not isinstance(float_workspace_buffer, torch.Tensor):
            policy.refuse(self._entry, "float_workspace_buffer must be a torch.Tensor.")
        policy.check_graph_backend(self._entry, backend, use_cuda_graph, float_workspace_buffer.device)
        if use_cuda_graph and not all(isinstance(b, torch.Tensor) for b in (
                paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)):
            policy.refuse(self._entry, "use_cuda_graph=True needs paged_kv_indptr_buffer, paged_kv_indices_buffer "
                                       "and paged_kv_last_page_len_buffer: their sizes fix the batch and page "
                                       "capacity of the captured graph.")
        if use_cuda_graph:  # index buffers are int32 as every index tensor (API.md), checked here, not at plan()
            for name, buf in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                              ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                              ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                policy.check_index(self._entry, name, buf)
                policy.check_same_device(self._entry, float_workspace_buffer.device, **{name: buf})
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._use_tensor_cores = use_tensor_cores
        self._backend_request = backend
        self._bufs = dict(kv_indptr=paged_kv_indptr_buffer, kv_indices=paged_kv_indices_buffer,
                          last_page_len=paged_kv_last_page_len_buffer)
        # under CUDA graphs the batch capacity, which fixes the tiles from capture on (read once: a torch call)
        self._graph_cap = paged_kv_last_page_len_buffer.numel() if use_cuda_graph else None
        self._plan: Optional[DecodePlan] = None
        self._variants = _Variants()  # the plan under forward()'s settings
        self._partials_memo = None  # ((heads, head dim), the workspace views of _partials)
        self._kept = staging.Kept()  # the device buffer each plan's arrays are copied into (staging.to_device)
        self._caches = {}  # _cache_views' memo: id(cache) -> (weakref, what the views follow from, the views)
        self._done_count: Optional[torch.Tensor] = None  # fused folds: per (request, KV head), zero between runs
        self._prefill: Optional[BatchPrefillWithPagedKVCacheWrapper] = None  # the tensor-core / torch route
        self._chain_rows = None  # ((batch, q_len_per_req), its PlannedRows): the tensor-core route's last chain shape
        self._graph_bufs: Optional[staging.Captured] = None
        self._graph_q_rows: Optional[int] = None  # the bandwidth route's first run() under CUDA graphs: q's rows
        self._graph_signature = None
        self._graph_route: Optional["routing.Decision"] = None  # under use_cuda_graph: the first plan's route
        self._decision: Optional["routing.Decision"] = None
        self._graph_q_len: Optional[int] = None
        self._q_len_per_req = 1
        self.backend = None
        self.backend_fallback_reason = None

    @property
    def device(self) -> torch.device:
        return self._workspace.device

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def resolved_backend(self) -> str:
        """FlashInfer's name for what the last plan() resolved the backend to: here `backend` ("triton", "torch"),
        or the backend asked for before the first plan()."""
        return self.backend if self.backend is not None else self._backend_request

    def _drop_plans(self) -> None:
        """reset_workspace_buffer: the plans, partial-state views and counts made in the old workspace go."""
        self._plan = self._prefill = self._partials_memo = self._done_count = None
        self._variants = _Variants()

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, *positional_rest, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, o_data_type=None, fixed_split_size=None, disable_split_kv=False,
             q_len_per_req=1, tree_parents=None, seq_lens=None, is_causal=None, **unsupported_kwargs):
        """FlashInfer's decode plan, plus speculative verify: q_len_per_req=k (chain: k rows per request, the
        last k KV positions, bottom-right causal among themselves) or tree_parents (one parent array per
        request, -1 for a child of the prefix, at most 64 nodes; request i's rows are its tree's nodes in
        order, which are its last len(tree_parents[i]) KV positions; each sees the prefix, its ancestors and
        itself). Trees run on the tensor-core route; a chain runs on the bandwidth kernel (its split-KV included) when
        k x (query heads per KV head) <= 32 rows and the route is that kernel (use_tensor_cores=False, or auto's
        choice over the hint). seq_lens (FlashInfer's, for its trtllm-gen backend): the page table decides, and a
        seq_lens given must agree with it (policy.check_seq_lens). is_causal (FlashInfer's): the mask follows
        q_len_per_req, so a given one must say what it does (causal exactly when q_len_per_req > 1), as
        FlashInfer's plan requires."""
        entry = self._entry + ".plan"
        if positional_rest:  # FlashInfer 0.7's order past kv_data_type (vLLM passes 15 by position every step)
            given = locals()
            keywords = policy.bind_positions(entry, policy.DECODE_PLAN_POSITIONS, 5, positional_rest, {
                **{name: given[name] for name in _PLAN_KEYWORDS}, **unsupported_kwargs}, _PLAN_DEFAULTS)
            return self.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                             pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, **keywords)
        if unsupported_kwargs:
            policy.extra_kwargs(entry, unsupported_kwargs)
        if not policy.is_int(q_len_per_req) or q_len_per_req < 1:
            policy.refuse(entry, f"q_len_per_req={q_len_per_req!r} must be a positive int.")
        policy.check_seq_lens(entry, seq_lens, indptr, indices, last_page_len, page_size, policy.DECODE_TABLE_NAMES)
        if is_causal is not None and (tree_parents is not None or bool(is_causal) != (q_len_per_req > 1)):
            policy.unsupported(entry, f"is_causal={is_causal!r} is not served: the decode mask follows q_len_per_req "
                                      f"(causal among a request's rows exactly when q_len_per_req > 1) or "
                                      f"tree_parents; pass is_causal=None.")
        tree = None
        if tree_parents is not None:
            if q_len_per_req != 1:
                policy.refuse(entry, "give q_len_per_req (a chain) or tree_parents (a tree), not both.")
            if pos_encoding_mode != "NONE":
                policy.unsupported(entry, f"pos_encoding_mode={pos_encoding_mode!r} with tree_parents is not "
                                          f"served: a tree token's position is its depth, not its index; apply "
                                          f"RoPE before appending K and passing q.")
            tree = tree_ancestor_bits(entry, tree_parents, name="tree_parents")
        mode = "tree" if tree is not None else q_len_per_req
        if self._use_cuda_graph and self._graph_q_len is not None and mode != self._graph_q_len:
            policy.refuse(entry, f"under use_cuda_graph=True the verify mode is fixed by the first plan "
                                 f"(q_len_per_req or tree: {self._graph_q_len}); this plan asks for {mode}.")
        # fixed_split_size counts pages (FlashInfer's unit); tokens from here on
        fixed_split_size, batch_invariant = policy.split_args(entry, fixed_split_size, disable_split_kv, page_size)
        if data_type is not None:  # FlashInfer's older name, for whichever of the two was not given
            policy.canonical_dtype(entry, "data_type", data_type)  # a dtype even where unused (older positions)
            kv_data_type = data_type if kv_data_type is None else kv_data_type
            q_data_type = data_type if q_data_type is None else q_data_type
        # serveattn/routing.py: an explicit backend takes use_tensor_cores literally (several draft rows per
        # request and trees run on the tensor-core route whatever it says: the bandwidth kernel serves one row);
        # under auto the measured crossover chooses between the kernels, use_tensor_cores=True included (a hint
        # taken only where the table has no measurement); the first choice holds under graphs.
        decision = routing.choose_decode(entry, self._backend_request, routing.decode_request(
            self.device, batch=indptr.numel() - 1 if isinstance(indptr, torch.Tensor) else 0,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, q_data_type=q_data_type,
            kv_data_type=kv_data_type, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
            logits_soft_cap=logits_soft_cap, q_len_per_req=q_len_per_req, tree=tree is not None,
            use_tensor_cores=self._use_tensor_cores, use_cuda_graph=self._use_cuda_graph,
            batch_invariant=batch_invariant),
            self.device, self._graph_route)
        route = decision.backend
        if route == "torch" or decision.kernel == routing.TENSOR_CORE:
            self._plan_through_prefill(entry, route, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                                       head_dim, page_size, pos_encoding_mode, window_left, logits_soft_cap,
                                       q_data_type, kv_data_type, o_data_type, sm_scale, rope_scale, rope_theta,
                                       q_len_per_req, tree, (fixed_split_size, disable_split_kv), batch_invariant)
            self._decided(decision)
            self._record_settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
            return
        policy.check_pos_encoding(entry, pos_encoding_mode)
        if pos_encoding_mode == "ROPE_LLAMA":  # reached where the route is held (auto under CUDA graphs)
            policy.unsupported(entry, "pos_encoding_mode='ROPE_LLAMA' is served on the tensor-core route only, and "
                                      "this wrapper's route is the bandwidth kernel (under use_cuda_graph=True its "
                                      "first plan's); apply RoPE before the call, or build a wrapper for RoPE plans.")
        kv_lens, ip = policy.page_table(entry, indptr, indices, last_page_len, page_size, policy.DECODE_TABLE_NAMES)
        if q_len_per_req > 1:  # a chain: its k draft tokens are the last k KV positions
            policy.check_causal_lengths(entry, np.full(kv_lens.size, q_len_per_req), kv_lens)
        max_page = policy.max_page(entry, policy.host_view(indices)[: int(ip[-1])], "indices")
        plan = make_decode_plan(entry, self.device, kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size,
                                window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, sm_scale,
                                fixed_split_size, disable_split_kv, kv_indptr=indptr, kv_start=ip[:-1],
                                kv_indices=indices,
                                last_page_len=last_page_len, max_page=max_page, q_len=q_len_per_req,
                                batch_cap=self._graph_cap, workspace=None if self._sizing else self._workspace)
        self._install(entry, plan)
        self._prefill = None
        self._q_len_per_req = q_len_per_req
        if self._use_cuda_graph:
            self._graph_q_len = q_len_per_req
        self.backend = "triton"
        self._decided(decision)
        self._record_settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)

    def _decided(self, decision: "routing.Decision") -> None:
        """After a plan is installed: the route's reasons, and under CUDA graphs the route that holds."""
        self._decision = decision
        self.backend_fallback_reason = decision.reason
        if self._use_cuda_graph and self._graph_route is None:
            self._graph_route = decision

    def _plan_through_prefill(self, entry, route, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                              head_dim, page_size, pos_encoding_mode, window_left, logits_soft_cap, q_data_type,
                              kv_data_type, o_data_type, sm_scale, rope_scale, rope_theta, q_len_per_req=1,
                              tree=None, split=(None, False), batch_invariant=False):
        """One prefill plan with q_len_per_req rows per request; k > 1 rows are bottom-right causal among
        themselves and see the whole prefix (chain verify), kv_len >= k checked from the page metadata.
        tree: (sizes, ancestor words) of tree verify, the rows then also masked by the words. The query indptr
        goes to the prefill planner as prefill.PlannedRows: this wrapper's own, valid by construction."""
        policy.check_index(entry, "indptr", indptr, min_len=1)
        batch = indptr.numel() - 1
        if tree is not None:
            sizes, words = tree
            if sizes.size != batch:
                policy.refuse(entry, f"tree_parents has {sizes.size} parent arrays for a batch of {batch}.")
            qo_indptr = np.zeros(batch + 1, dtype=np.int32)
            qo_indptr[1:] = np.cumsum(sizes)
            rows = (int(sizes.min()), int(sizes.max())) if batch else (0, 0)
            tree_mask, max_rows, causal = torch.from_numpy(words), MAX_TREE_NODES, True
            qo_rows = planned_rows(qo_indptr, rows)
        else:
            # a chain's rows follow from (batch, q_len_per_req) alone: built once while they repeat (every decode
            # step's plan), ~3 us of numpy
            if self._chain_rows is None or self._chain_rows[0] != (batch, q_len_per_req):
                qo_indptr = np.arange(0, (batch + 1) * q_len_per_req, q_len_per_req, dtype=np.int32)
                self._chain_rows = (batch, q_len_per_req), planned_rows(
                    qo_indptr, (q_len_per_req, q_len_per_req) if batch else (0, 0))
            qo_rows = self._chain_rows[1]
            tree_mask, max_rows, causal = None, q_len_per_req, q_len_per_req > 1
        wrapper = self._prefill
        # one inner wrapper while the route holds (under CUDA graphs it always does): a new one a plan cost ~3-8 us
        if wrapper is None or wrapper._backend_request != route:
            kw = {}
            if self._use_cuda_graph:
                cap = self._graph_cap
                kw = dict(qo_indptr_buf=torch.arange(cap + 1, dtype=torch.int32, device=self.device),
                          paged_kv_indptr_buf=self._bufs["kv_indptr"], paged_kv_indices_buf=self._bufs["kv_indices"],
                          paged_kv_last_page_len_buf=self._bufs["last_page_len"])
            wrapper = BatchPrefillWithPagedKVCacheWrapper(self._workspace, self._kv_layout, self._use_cuda_graph,
                                                          backend=route, **kw)
            wrapper._entry = self._entry
            wrapper._table_names = policy.DECODE_TABLE_NAMES
            wrapper._graph_max_qo = max_rows
            wrapper._graph_split_kv = True  # under CUDA graphs: few long requests split as eager plans do
            wrapper._kept = self._kept  # the previous inner wrapper's plan is dropped with it: its buffer is free
            wrapper._sizing = self._sizing
        if not self._use_cuda_graph:  # the plan's bound on its rows (batch-invariant tiles); fixed under graphs
            wrapper._graph_max_qo = max_rows
        # make_plan trusts qo_rows (built here, valid by construction)
        wrapper._plan_paged(qo_rows, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                            page_size, causal=causal, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                            rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
                            o_data_type=o_data_type, tree_mask=tree_mask, split=split,
                            batch_invariant=batch_invariant,
                            # an explicit backend was resolved by choose_decode above (the same device and call)
                            resolved=self._backend_request != "auto")
        if self._sizing:  # workspace_size: the inner plan's bytes
            self._sized_bytes = wrapper._sized_bytes
        self._prefill = wrapper
        self._plan = None
        self._q_len_per_req = q_len_per_req
        if self._use_cuda_graph:
            self._graph_q_len = "tree" if tree is not None else q_len_per_req
        self.backend = route

    def _install(self, entry: str, plan: DecodePlan) -> None:
        """Checks the workspace, then copies the plan's arrays to the device; raises before any write."""
        if self._sizing:  # workspace_size: the bytes, nothing installed
            self._sized_bytes = policy.split_state_bytes(plan.num_slots * plan.q_len, plan.num_qo_heads,
                                                         plan.head_dim)
            return
        key = (plan.num_qo_heads, plan.head_dim)
        # a chain's slot holds q_len partial rows per query head; the views depend only on the key and cost host
        # time (a torch call each), so they are made once per key and the slot count is checked on its own
        if self._partials_memo is None or self._partials_memo[0] != key:
            self._partials_memo = (key, _partials(entry, self._workspace, plan.num_slots * plan.q_len, *key))
        else:
            _check_partials_room(entry, self._workspace, plan.num_slots * plan.q_len, *key)
        partials = self._partials_memo[1]
        names = _device_arrays(plan)
        if not self._use_cuda_graph:  # the plan is this call's own: set the partials and device arrays in place
            self._ensure_done_count(plan, plan.batch)
            for name, t in (*partials.items(), *staging.to_device({n: getattr(plan, n) for n in names},
                                                                  self.device, self._kept).items()):
                setattr(plan, name, t)
            self._plan = plan
            return
        # the plan is this call's own: set in place (a replace() of the dataclass costs ~10 us of host time)
        for name, t in partials.items():
            setattr(plan, name, t)
        bufs = self._graph_bufs or staging.Captured(self._allocate_graph_buffers(entry, plan))
        signature = plan.static_signature()
        if self._graph_signature is not None and signature != self._graph_signature:
            policy.refuse(entry, "under use_cuda_graph=True a re-plan may change only the batch's lengths and page "
                                 "table; heads, head dim, dtypes, page size, window, soft cap and sm_scale must stay "
                                 "as first planned.")
        if self._graph_q_rows is not None and plan.batch * plan.q_len > self._graph_q_rows:
            policy.refuse(entry, f"under use_cuda_graph=True the re-plan has {plan.batch * plan.q_len} query rows "
                                 f"but the first run() had q of {self._graph_q_rows} (the q a captured graph "
                                 f"reads: capture with q of the largest batch).")
        for name in _PLAN_ARRAYS:  # every buffer bounds the plan (kv_indptr's: the batch), copied or not
            check_capacity(entry, name, staging.size(getattr(plan, name)), bufs.caps[name], _GRAPH_BUFFER_SOURCE[name])
        # every check passed: only now are the captured buffers (and the counts a captured graph reads) replaced
        # or overwritten (one staged copy, staging.to_buffers)
        self._ensure_done_count(plan, self._graph_cap)
        arrays = {n: getattr(plan, n) for n in names}
        if "req_num_slots" in arrays:
            slots = np.zeros(bufs.caps["req_num_slots"], dtype=np.int32)  # requests past the batch: no merge
            slots[: plan.batch] = plan.req_num_slots
            arrays["req_num_slots"] = slots
        staging.to_buffers(arrays, bufs)
        self._graph_bufs, self._graph_signature = bufs, signature
        for name in _PLAN_ARRAYS:  # the buffers the graph captured, whether this plan wrote them or not
            setattr(plan, name, bufs[name])
        self._plan = plan

    def _ensure_done_count(self, plan: DecodePlan, batch: int) -> None:
        """A fused fold's completion counts, one per (request, KV head): allocated (zeroed) here, never inside run()
        (a captured graph must not re-zero them), and only once a plan has passed every check (a refused re-plan
        must leave the counts its predecessor's graph reads)."""
        need = batch * plan.num_kv_heads
        if plan.merge == "fused" and (self._done_count is None or self._done_count.numel() < need):
            self._done_count = torch.zeros(max(batch, 1) * plan.num_kv_heads, dtype=torch.int32, device=self.device)

    def _allocate_graph_buffers(self, entry: str, plan: DecodePlan) -> dict:
        cap = self._graph_cap
        for name, want in (("kv_indptr", cap + 1), ("kv_indices", 1), ("last_page_len", 1)):
            buf = self._bufs[name]  # int32 on the wrapper's device: the constructor checked them
            if buf.numel() < want:  # the batch capacity is last_page_len_buffer's size
                policy.refuse(entry, f"the {name} buffer holds {buf.numel()} entries; it needs at least {want}"
                                     + (f" (the batch capacity {cap} + 1)." if name == "kv_indptr" else "."))
        slot_cap = _slot_capacity(self._workspace, plan.num_qo_heads, plan.head_dim)
        i32 = dict(dtype=torch.int32, device=self.device)
        # an item for every program at least: each reads its first before it knows the work count
        items = max(cap + slot_cap, _grid_programs(plan.device))
        return dict(work=torch.empty(ITEM_INTS * items, **i32), num_work=torch.empty(1, **i32),
                    req_first_slot=torch.zeros(cap, **i32), req_num_slots=torch.zeros(cap, **i32),
                    kv_indptr=self._bufs["kv_indptr"], kv_indices=self._bufs["kv_indices"],
                    last_page_len=self._bufs["last_page_len"])

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, scale_q=None, scale_k=None,
            scale_v=None, out=None, lse=None, return_lse=False, q_len_per_req=None, enable_pdl=None, window_left=None,
            **unsupported_kwargs):
        """enable_pdl (FlashInfer's launch hint) is accepted and not needed; window_left, if given, must be the
        plan's (as FlashInfer's kernels assert)."""
        entry = self._entry + ".run"
        if args:  # FlashInfer 0.7 takes an fp8 query's descales by position here
            scale_q, scale_k, scale_v = positional_descales(entry, "q, paged_kv_cache", q, args, scale_q, scale_k,
                                                            scale_v)
        if unsupported_kwargs or window_left is not None:
            plan = self._prefill._plan if self._prefill is not None else self._plan
            _run_extras(entry, plan, window_left, unsupported_kwargs)
        if q_scale is not None:
            k_scale = policy.fold_q_scale(entry, q_scale, k_scale,
                                          scale_q is not None or scale_k is not None or scale_v is not None)
        if q_len_per_req is not None:
            warnings.warn("q_len_per_req belongs to plan(); passing it to run() is deprecated.", DeprecationWarning,
                          stacklevel=2)
            if q_len_per_req != self._q_len_per_req:
                policy.refuse(entry, f"q_len_per_req={q_len_per_req} given to run() differs from the plan's "
                                     f"{self._q_len_per_req}; re-plan instead.")
        if self._prefill is not None:
            return self._prefill.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, scale_q=scale_q,
                                     scale_k=scale_k, scale_v=scale_v, out=out, lse=lse, return_lse=return_lse)
        plan = self._plan
        if plan is None:
            policy.refuse(entry, "run() was called before plan().")
        if scale_q is not None or scale_k is not None or scale_v is not None:  # with none given it passes
            policy.check_descales(entry, scale_q, scale_k, scale_v, k_scale, v_scale, plan.q_dtype)
        kv = _cache_views(self._caches, paged_kv_cache, self._kv_layout) if paged_kv_cache.__class__ is torch.Tensor \
            else _pair_views(paged_kv_cache, self._kv_layout)
        if kv is not None and _plain_run(plan, q, kv, out, self._kv_layout, plan.batch * plan.q_len):
            k, v, kv_strides = kv[:3]
            if lse is not None:
                policy.check_tensor(entry, "lse", lse, q.shape[:2], torch.float32, plan.device)
            if k_scale is not None or v_scale is not None:
                policy.check_scales(entry, plan.device, plan.sm_scale, k_scale=k_scale, v_scale=v_scale)
        else:  # anything the fast checks do not pass: the full checks, which refuse or pass
            k, v = kv[:2] if kv is not None else split_paged_cache(entry, paged_kv_cache, self._kv_layout)
            _check_run(entry, plan, q, k, v, out, lse, k_scale, v_scale, self._kv_layout)
            kv_strides = None
        if out is None:
            out = torch.empty_like(q, dtype=plan.o_dtype, memory_format=torch.contiguous_format)
        if lse is None and return_lse:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        grid0, merge_rows = _grid(plan, self._use_cuda_graph)
        if self._use_cuda_graph and self._graph_q_rows is None:  # a graph captures this q: later plans fit it
            self._graph_q_rows = q.shape[0]
        if grid0:
            decode_kernel.launch(q, k, v, out, lse, plan, self._kv_layout, grid0, merge_rows, k_scale, v_scale,
                                 self._done_count, kv_strides, exact_grid=not self._use_cuda_graph)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)
    begin_forward = plan  # FlashInfer's deprecated name

    def forward(self, q, paged_kv_cache, pos_encoding_mode="NONE", q_scale=None, k_scale=None, v_scale=None,
                window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
                return_lse=False):
        """FlashInfer's deprecated run(): its arguments, defaults included, set this call's positional encoding,
        window, soft cap and scales, as FlashInfer's forward() does (there they also hold for later run() calls;
        here for this call). The bandwidth kernel serves no RoPE: plan with it (the tensor-core route)."""
        entry = self._entry + ".forward"
        settings = (pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        inner = self._prefill  # the tensor-core / torch route: its plan's causal mode (chains, trees) holds
        applied = inner._overridden(entry, inner._plan is not None and inner._plan.causal, *settings) \
            if inner is not None else self._overridden(entry, *settings)
        with applied:
            return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                            return_lse=return_lse)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)

    def end_forward(self) -> None:
        """FlashInfer's deprecated end_forward(): nothing to release."""

    def _overridden(self, entry, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta):
        """The bandwidth route's plan with forward()'s settings, for one call."""
        key = (pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self._variants.applied(self, entry, key, lambda plan: _plan_with(entry, plan, *key))


# plan()'s keyword defaults: a keyword that FlashInfer 0.7's positional order also binds counts as given off these
_PLAN_KEYWORDS, _PLAN_DEFAULTS = policy.keyword_signature(BatchDecodeWithPagedKVCacheWrapper.plan)
_PLAN_DEFAULTS["block_tables"] = None


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's CUDA-graph decode wrapper: the batch wrapper with use_cuda_graph=True."""
    _entry = "CUDAGraphBatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, workspace_buffer, indptr_buffer, indices_buffer, last_page_len_buffer, kv_layout="NHD",
                 use_tensor_cores=False):
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


def _plan_with(entry, plan: DecodePlan, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
               rope_theta) -> DecodePlan:
    """plan with forward()'s settings, checked as plan() checks them; plan itself where they are its own."""
    policy.check_pos_encoding(entry, pos_encoding_mode)
    policy.check_scalars(entry, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                         rope_scale=rope_scale, rope_theta=rope_theta)
    if pos_encoding_mode != "NONE":
        policy.unsupported(entry, f"pos_encoding_mode={pos_encoding_mode!r} at forward() on a plan of the bandwidth "
                                  f"kernel, which serves no RoPE; pass it to plan(), which takes the tensor-core "
                                  f"route for it.")
    fields = dict(window_left=policy.window(window_left), soft_cap=float(logits_soft_cap or 0.0),
                  sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(plan.head_dim))
    return plan if all(getattr(plan, k) == v for k, v in fields.items()) else replace(plan, **fields)


def make_decode_plan(entry, device, kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size, window_left,
                     logits_soft_cap, q_data_type, kv_data_type, o_data_type, sm_scale, fixed_split_size,
                     disable_split_kv, kv_indptr, kv_start, kv_indices=None, last_page_len=None, max_page=-1,
                     q_len=1, batch_cap=None, workspace=None) -> DecodePlan:
    """Host validation and the split-KV schedule (kv_lens, kv_start: numpy, each request's KV length and first
    page, or first token); kv_indices None means contiguous (unpaged) K/V. workspace: where a split the plan
    chose itself needs more partial-state slots than it holds, the plan stays unsplit (a fixed_split_size that
    needs more is refused when installed)."""
    policy.check_heads(entry, num_qo_heads, num_kv_heads)
    policy.check_head_dim(entry, head_dim)
    policy.check_scalars(entry, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap)
    q_dtype, kv_dtype, o_dtype = _dtypes(entry, q_data_type, kv_data_type, o_data_type)
    # batch_cap: the batch the tiles are chosen for (under CUDA graphs the capacity: the tiles hold from capture on)
    tiles = decode_tiles(head_dim, device, kv_dtype, decode_kernel.tile_rows(q_len, num_qo_heads // num_kv_heads),
                         batch_cap if batch_cap is not None else kv_lens.size)
    chunk = choose_chunk(kv_lens, num_kv_heads, _num_sms(device), tiles.block_n, fixed_split_size, disable_split_kv)
    # longest items first (SERVEATTN_DECODE_ORDER=request: the batch's order): a ragged batch's long requests then
    # start in the first wave (H100, session 36: 0.86-0.94x at 128-256 uniform requests of 1-8192 keys)
    order = knobs.get("SERVEATTN_DECODE_ORDER", "cost") == "cost"
    work, n, first_slot, num_slots, total_slots = build_decode_work(kv_lens, kv_start, chunk, order)
    if chunk is not None and fixed_split_size is None and workspace is not None and \
            total_slots * q_len > _slot_capacity(workspace, num_qo_heads, head_dim):
        chunk = None
        work, n, first_slot, num_slots, total_slots = build_decode_work(kv_lens, kv_start, chunk, order)
    return DecodePlan(
        paged=kv_indices is not None, device=device, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        group=num_qo_heads // num_kv_heads, head_dim=head_dim, page_size=page_size,
        window_left=policy.window(window_left),
        soft_cap=float(logits_soft_cap or 0.0),
        sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype, batch=kv_lens.size, tiles=tiles, max_page=max_page,
        num_work_host=n, num_slots=total_slots, chunk=chunk, work=work,
        num_work=np.array([n], dtype=np.int32),
        req_first_slot=first_slot, req_num_slots=num_slots, kv_indptr=kv_indptr, kv_indices=kv_indices,
        last_page_len=last_page_len, q_len=q_len, merge=decode_kernel.merge_kind(
            num_qo_heads // num_kv_heads, q_len,
            None if fixed_split_size is not None else num_slots if batch_cap is None else
            capacity_chunks(batch_cap, num_kv_heads, _num_sms(device))))


def _dtypes(entry, q_data_type, kv_data_type, o_data_type):
    return policy.decode_dtypes(entry, q_data_type, kv_data_type, o_data_type,
                                "an fp8 query is served on the tensor-core route only; " + (
                                    "pass use_tensor_cores=True." if entry.startswith("single_decode") else
                                    "construct the wrapper with use_tensor_cores=True."))


# what sizes each captured buffer, in the caller's terms (refusals name it)
_GRAPH_BUFFER_SOURCE = {
    "work": "sized at the first plan from the batch capacity and the workspace", "num_work": "one entry",
    "req_first_slot": "the batch capacity: paged_kv_last_page_len_buffer's size",
    "req_num_slots": "the batch capacity: paged_kv_last_page_len_buffer's size",
    "kv_indptr": "paged_kv_indptr_buffer, given at construction",
    "kv_indices": "paged_kv_indices_buffer, given at construction",
    "last_page_len": "paged_kv_last_page_len_buffer, given at construction"}
_PLAN_ARRAYS = ("work", "num_work", "req_first_slot", "req_num_slots", "kv_indptr", "kv_indices", "last_page_len")
# What the kernels read on the device: a work item carries its request's KV start and length and its slots, so
# kv_indptr and last_page_len stay on the host, and the request arrays are merge_kernel's alone (unfused merges).
_KERNEL_ARRAYS = ("work", "num_work", "kv_indices")
_MERGE_ARRAYS = ("req_first_slot", "req_num_slots")


def _device_arrays(plan: DecodePlan):
    """The plan arrays a plan copies to the device (fewer arrays, less host time a plan)."""
    return _KERNEL_ARRAYS if plan.merge == "fused" else _KERNEL_ARRAYS + _MERGE_ARRAYS


def _to_device(plan: DecodePlan, device) -> DecodePlan:
    """Copies (never aliases: the caller may reuse its index tensors) the plan's device arrays to the device."""
    return replace(plan, **staging.to_device({n: getattr(plan, n) for n in _device_arrays(plan)}, device))


def _grid(plan: DecodePlan, use_cuda_graph: bool):
    """(decode programs, merge rows): fixed under CUDA graphs, exact otherwise."""
    if use_cuda_graph:
        return _grid_programs(plan.device), plan.req_num_slots.numel()
    return plan.num_work_host, (plan.batch if plan.num_slots else 0)


def _grid_programs(device) -> int:
    """The work axis of a CUDA-graph decode grid (fixed at capture; programs stride over the work list)."""
    return _programs_per_sm() * _num_sms(device)


def _slot_capacity(workspace: torch.Tensor, num_qo_heads: int, head_dim: int) -> int:
    return policy.workspace_room(workspace) // (4 * num_qo_heads * (head_dim + 1))


def _check_partials_room(entry: str, workspace: torch.Tensor, num_slots: int, num_qo_heads: int,
                         head_dim: int) -> int:
    """Refuses a plan whose split-KV partial states do not fit the workspace; returns the workspace's usable bytes
    (policy.workspace_room)."""
    have = policy.workspace_room(workspace)
    need = policy.split_state_bytes(num_slots, num_qo_heads, head_dim)
    if need > have:
        if not have and workspace.numel():
            policy.refuse(entry, f"float_workspace_buffer cannot hold this plan's split-KV partial states ({need} "
                                 f"bytes): {policy.WORKSPACE_ROOM_HINT}; or pass disable_split_kv=True.")
        policy.refuse(entry, f"float_workspace_buffer holds {have} bytes but this plan's split-KV partial states "
                             f"need {need} bytes; pass a larger workspace (or disable_split_kv=True).")
    return have


def _partials(entry: str, workspace: torch.Tensor, num_slots: int, num_qo_heads: int, head_dim: int) -> dict:
    """fp32 partial outputs [cap, Hq, D] and LSEs [cap, Hq], carved from the caller's workspace.

    The layout depends only on the workspace size and the heads, never on this plan's slot count, so a
    captured CUDA graph keeps pointing at the right places after any re-plan."""
    have = _check_partials_room(entry, workspace, num_slots, num_qo_heads, head_dim)
    cap = _slot_capacity(workspace, num_qo_heads, head_dim)
    if cap == 0:  # nothing can be split (and nothing is): the kernels never touch these
        unused = torch.empty(1, dtype=torch.float32, device=workspace.device)
        return dict(part_o=unused, part_lse=unused)
    flat = workspace.view(-1) if workspace.dtype == torch.uint8 else workspace.view(-1).view(torch.uint8)
    floats = flat[: have // 4 * 4].view(torch.float32)
    width = cap * num_qo_heads
    return dict(part_o=floats[: width * head_dim].view(cap, num_qo_heads, head_dim),
                part_lse=floats[width * head_dim: width * (head_dim + 1)].view(cap, num_qo_heads))


def _check_run(entry, plan, q, k, v, out, lse, k_scale, v_scale, kv_layout):
    policy.check_tensor(entry, "q", q, (plan.batch * plan.q_len, plan.num_qo_heads, plan.head_dim), plan.q_dtype,
                        plan.device)
    want = (plan.page_size, plan.num_kv_heads, plan.head_dim) if kv_layout == "NHD" else \
        (plan.num_kv_heads, plan.page_size, plan.head_dim)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != plan.kv_dtype:
            policy.refuse(entry, f"{name} cache has dtype {t.dtype} but the plan declared {plan.kv_dtype}.")
        if t.device != plan.device:
            policy.refuse(entry, f"{name} cache is on {t.device}; expected {plan.device}.")
        if t.dim() != 4 or tuple(t.shape[1:]) != want:
            policy.refuse(entry, f"{name} cache has shape {tuple(t.shape)}; the plan ({kv_layout}) expects "
                                 f"[num_pages, {', '.join(map(str, want))}].")
        if t.stride(-1) != 1:
            policy.refuse(entry, f"{name} must have a contiguous last dimension.")
    policy.check_same_pages(entry, k, v)
    if plan.max_page >= k.shape[0]:
        policy.refuse(entry, f"indices (given to plan()) refers to page {plan.max_page}, beyond the cache's "
                             f"{k.shape[0]} pages.")
    if out is not None:
        policy.check_tensor(entry, "out", out, q.shape, plan.o_dtype, plan.device)
    if lse is not None:
        policy.check_tensor(entry, "lse", lse, q.shape[:2], torch.float32, plan.device)
    policy.check_scales(entry, plan.device, plan.sm_scale, k_scale=k_scale, v_scale=v_scale)


def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", use_tensor_cores=False,
                                q_scale=None, k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None,
                                sm_scale=None, rope_scale=None, rope_theta=None, return_lse=False, backend="auto",
                                **unsupported_kwargs):
    """One request's decode: q [Hq, D], k/v [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D] (HND) -> [Hq, D]."""
    entry = "single_decode_with_kv_cache"
    if unsupported_kwargs:  # FlashInfer's later keywords at their no-op values pass; others are named
        policy.extra_kwargs(entry, unsupported_kwargs)
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        policy.refuse(entry, f"q must be a 2-D [num_qo_heads, head_dim] tensor, got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}.")
    k_scale = policy.fold_q_scale(entry, q_scale, k_scale)
    policy.check_kv_layout(entry, kv_layout)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            policy.refuse(entry, f"{name} must be a 3-D tensor.")
    policy.check_kv_pair(entry, k, v)
    route = backends.resolve(entry, backend, q.device)
    if route == "triton" and use_tensor_cores and backend == "auto" and pos_encoding_mode == "NONE":
        # use_tensor_cores=True is a hint under auto, as for the batch wrapper: the table decides for one request
        num_kv_heads = k.shape[1] if kv_layout == "NHD" else k.shape[0]
        use_tensor_cores = routing.choose_decode(entry, backend, routing.decode_request(
            q.device, batch=1, num_qo_heads=q.shape[0], num_kv_heads=num_kv_heads, head_dim=q.shape[1],
            q_data_type=q.dtype, kv_data_type=k.dtype, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
            logits_soft_cap=logits_soft_cap, q_len_per_req=1, tree=False, use_tensor_cores=True,
            use_cuda_graph=False), q.device, None).kernel == routing.TENSOR_CORE
    if route == "triton" and not use_tensor_cores and pos_encoding_mode == "NONE" and not (
            backend == "auto" and q.dtype in policy.FP8_DTYPES):  # auto: an fp8 query takes the tensor-core route
        return _single_decode_bandwidth(entry, q, k, v, kv_layout, window_left, logits_soft_cap, sm_scale, k_scale,
                                        v_scale, return_lse)
    # one query row through single prefill, its refusals named after this entry
    res = _single_prefill(q[None], k, v, None, None, False, kv_layout, pos_encoding_mode, sm_scale, window_left,
                          logits_soft_cap, rope_scale, rope_theta, backend, return_lse, k_scale, v_scale, entry)
    return (res[0][0], res[1][0]) if return_lse else res[0]


def _single_decode_bandwidth(entry, q, k, v, kv_layout, window_left, logits_soft_cap, sm_scale, k_scale, v_scale,
                             return_lse):
    """The bandwidth kernel over contiguous K/V (its unpaged mode), split-KV included."""
    if k.shape != v.shape:
        policy.refuse(entry, f"k has shape {tuple(k.shape)} but v has shape {tuple(v.shape)}.")
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    if k.shape[2] != q.shape[1]:
        policy.refuse(entry, f"q has head dim {q.shape[1]} but k has {k.shape[2]}.")
    policy.check_same_device(entry, q.device, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):  # the kernel reads each row's head dim at unit stride
        if t.stride(-1) != 1:
            policy.refuse(entry, f"{name} must have a contiguous last dimension.")
    plan = make_decode_plan(entry, q.device, np.array([kv_len]), q.shape[0], num_kv_heads, q.shape[1], 1,
                            window_left, logits_soft_cap, q.dtype, k.dtype, None, sm_scale, None, False,
                            kv_indptr=torch.tensor([0, kv_len], dtype=torch.int32), kv_start=np.zeros(1))
    need = 4 * plan.num_slots * plan.num_qo_heads * (plan.head_dim + 1)
    workspace = torch.empty(max(need, 16), dtype=torch.uint8, device=q.device)
    plan = _to_device(replace(plan, **_partials(entry, workspace, plan.num_slots, plan.num_qo_heads,
                                                plan.head_dim)), q.device)
    out = torch.empty((1,) + tuple(q.shape), dtype=plan.o_dtype, device=q.device)
    lse = torch.empty((1, q.shape[0]), dtype=torch.float32, device=q.device) if return_lse else None
    grid0, merge_rows = _grid(plan, False)
    policy.check_scales(entry, q.device, plan.sm_scale, k_scale=k_scale, v_scale=v_scale)
    # completion counts only where a fold happens (an unsplit call launches no merge of either kind)
    fused = plan.merge == "fused" and plan.num_slots
    done = torch.zeros(num_kv_heads, dtype=torch.int32, device=q.device) if fused else None
    decode_kernel.launch(q[None], k, v, out, lse, plan, kv_layout, grid0, merge_rows, k_scale, v_scale, done,
                         exact_grid=True)
    return (out[0], lse[0]) if return_lse else out[0]
