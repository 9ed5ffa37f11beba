"""Prefill entry points with FlashInfer's names: single, ragged-batch and paged-batch prefill.

`plan()` validates on the host and builds the tile schedule; `run()` checks the tensors it is given
against the plan and launches. A `plan()` that raises changes nothing: all checks run before any
state or caller buffer is touched.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import weakref
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from . import routing, vendor
from . import knobs, policy, staging, torch_impl
from .kernels import attention as attention_kernel
from .kernels.attention import VT_BLOCK_N
from .quantization import segment_packbits


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def choose_tiles(head_dim: int, group: int, max_qo_len: Optional[int], device: torch.device,
                 paged: bool, fp8: bool = False, fp8_ws: bool = False) -> TileConfig:
    """Tile shapes per head dim; small query blocks when a request has few (token, head) rows.
    fp8_ws: an fp8 q+KV plan the warp-specialized kernel will take (its 128 x 128 tiles).

    max_qo_len=None asks for the configuration that serves any length (CUDA graphs freeze it).
    SERVEATTN_PREFILL_TILES="block_m,block_n,warps,stages" overrides the table (for tuning runs only)."""
    if device.type != "cuda":  # the interpreter: fewer, larger numpy steps are faster
        block_m = 64 if max_qo_len is None else min(64, max(16, triton_next_pow2(max_qo_len * group)))
        return _tile_config(block_m, 32, 4, 1)
    override = knobs.get("SERVEATTN_PREFILL_TILES", "")
    if override:
        return TileConfig(*map(int, override.split(",")))
    # H200 sweep of 2026-12-02 (docs/performance.md, head dim 128): 128x128 tiles, 8 warps; a paged gather
    # pipelines best 2 deep, contiguous K/V 3 deep. Head dim 256 halves the tiles to fit shared memory.
    if head_dim == 256:
        block_m, block_n, warps, stages = 64, 64, 4, 2
    elif fp8 and paged and not fp8_ws:
        # fp8 q and KV (both products on fp8 wgmma), H200 sweep of 2026-12-02 (docs/runs/2026-12-02T1840-fp8-
        # prefill-tile-sweep.txt): 64 x 128 tiles on one warpgroup, 5 deep (its tiles take half the shared memory
        # of bf16's), 520 / 586 / 617 TFLOP/s at 4096 / 8192 / 16384 tokens against 396 / 439 / 468 for the bf16
        # tiles; 7 stages no longer fit twice per SM (433 at 8192). Contiguous K/V was not swept: bf16's tiles.
        block_m, block_n, warps, stages = 64, 128, 4, 5
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 2 if paged else 3
    if max_qo_len is not None:
        block_m = min(block_m, max(16, triton_next_pow2(max_qo_len * group)))
        if block_m <= 32:
            warps = 4
    return _tile_config(block_m, block_n, warps, stages)


# one instance per configuration (a frozen dataclass costs a microsecond per construction, in every plan)
_tile_config = functools.lru_cache(maxsize=None)(TileConfig)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass
class Plan:
    """Everything run() needs; host values are Python/CPU, device tensors live on the compute device."""
    paged: bool
    backend: str
    device: torch.device
    num_qo_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    causal: bool
    has_mask: bool
    window_left: int
    soft_cap: float
    rope: bool
    sm_scale: float
    log2_theta: float
    rcp_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    batch: int
    total_q: int
    total_kv: int  # kv_indptr's last entry: a ragged plan's K/V rows, checked at run()
    tiles: TileConfig
    num_work_host: int
    max_page: int  # the largest page index the table uses (-1 if none), checked against the cache at run()
    # host copies (torch path and checks)
    qo_indptr_host: torch.Tensor
    kv_indptr_host: torch.Tensor
    kv_indices_host: Optional[torch.Tensor]  # the torch route only (it reads the page table at run())
    kv_lens_host: torch.Tensor
    mask_host: Optional[torch.Tensor]
    # device tensors (kernel path); make_plan's own arrays are numpy until _commit stages them
    work: Optional[torch.Tensor] = None
    num_work: Optional[torch.Tensor] = None
    qo_indptr: Optional[torch.Tensor] = None
    kv_indptr: Optional[torch.Tensor] = None
    kv_indices: Optional[torch.Tensor] = None
    last_page_len: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    # native tree verify (the decode wrapper's tree_parents): one int64 ancestor word per query row
    tree_mask_host: Optional[torch.Tensor] = None
    tree_mask: Optional[torch.Tensor] = None
    # how backend="auto" resolved (serveattn/routing.py): the route and the declined candidates' reasons
    decision: Optional[routing.Decision] = None
    # fp8 attention: V transposed per run (transposed_v); work items (request, first key) and column offsets
    vt_work: Optional[torch.Tensor] = None
    kv_tok_indptr: Optional[torch.Tensor] = None
    vt_tokens: int = 0
    # the paged cache copied into ragged rows for the warp-specialized kernel (kernels/attention.Gathered: page ->
    # request, token indptr, the ragged view of this plan, whether it pays), made at the first run that asks
    gathered: Optional[tuple] = None
    # split-KV (build_split_work): the (output row, first partial row, chunks) of each split request's tokens, their
    # count, the partial rows; split = (partial outputs, partial LSEs, merge_rows) set by _commit; the chunk's keys
    merge_rows: Optional[torch.Tensor] = None
    split_chunk: Optional[int] = None
    num_merge: int = 0
    split_rows: int = 0
    split: Optional[tuple] = None
    # the warp-specialized kernel's persistent grid where a smaller one deals this plan's tasks more evenly
    # (attention_ws.persistent_programs; eager plans, SERVEATTN_PREFILL_WS_BALANCE=0 turns it off); None: one an SM
    ws_programs: Optional[int] = None
    # launch arguments made once per plan and kind of call (kernels: launch.Pack); not carried over by replace()
    launch_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def static_signature(self):
        """What a captured CUDA graph bakes in: a re-plan under use_cuda_graph must keep all of it."""
        return (self.paged, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, self.causal,
                self.has_mask, self.window_left, self.soft_cap, self.rope, self.sm_scale, self.log2_theta,
                self.rcp_scale, self.q_dtype, self.kv_dtype, self.o_dtype, self.tiles, self.tree_mask_host is not None)


def build_work(qo_lens, kv_lens, group: int, block_m: int, causal: bool, costliest_first: bool = False,
               qo_range: Optional[Tuple[int, int]] = None):
    """(request, query tile) pairs, int32 numpy [2 * n]: requests with the costliest tile first so the last wave is
    short, each request's tiles together (costliest first) so the programs running at once share its K/V in L2.
    Costliest-first over the whole batch instead ran each request's last tiles at once, every one on other K/V:
    16 x 2048 keys read all 268 MB of K/V from DRAM once per wave (16% slower, docs/performance.md session 10).

    costliest_first (SERVEATTN_PREFILL_ORDER: by default where the batch is small, see ORDER_COST_MAX_BYTES; =cost
    every batch, measuring only): every tile of the batch costliest first (the
    keys its last row sees; ties in request order), for prefill_kernel's eager grid, whose KV head is the slow
    axis (unlike the warp-specialized kernel's tasks, KV head fastest): the programs running at once share one KV
    head's K/V of every request, and the grid ends on the cheapest tiles instead of the last request's dearest
    (docs/performance.md, session 35).

    numpy, not torch: a handful of small-array operations per plan(), each a few microseconds cheaper. The lengths
    are host tensors or numpy arrays (the plan's own). qo_range: (shortest, longest) of qo_lens where the caller
    has them (make_plan), else read here."""
    qo, kv = np.asarray(qo_lens), np.asarray(kv_lens)
    # A request's costliest tile is its last, which sees all kv_len keys (causal or not); a later tile never
    # sees fewer keys than an earlier one, so each request's tiles go last to first.
    # equal lengths (a decode batch, the common case): request order is already the stable order; no sort
    same = kv.size == 0 or int(np.minimum.reduce(kv)) == int(np.maximum.reduce(kv))
    by_cost = np.arange(kv.size) if same else np.argsort(-kv, kind="stable")
    if qo_range is not None:
        shortest, longest = qo_range
    else:
        shortest, longest = (int(np.minimum.reduce(qo)), int(np.maximum.reduce(qo))) if qo.size else (0, 0)
    if _tiles(shortest, group, block_m) == 1 == _tiles(longest, group, block_m):
        work = np.zeros((qo.size, 2), dtype=np.int32)  # one tile a request (decode through this family)
        work[:, 0] = by_cost
        return work.reshape(-1), qo.size
    tiles = _tiles(qo, group, block_m)
    n = int(tiles.sum())
    work = np.empty((n, 2), dtype=np.int32)
    counts = tiles[by_cost]
    work[:, 0] = np.repeat(by_cost, counts)
    ends = np.cumsum(counts)  # one past each request's last position in the list
    work[:, 1] = np.repeat(ends, counts) - 1 - np.arange(n)
    if costliest_first:
        return costliest_first_order(work, qo, kv, group, block_m, causal), n
    return work.reshape(-1), n


def costliest_first_order(work, qo_lens, kv_lens, group: int, block_m: int, causal: bool) -> np.ndarray:
    """build_work's pairs (numpy, [n, 2] or flat) reordered every tile of the batch costliest first: by the keys
    each tile's last row sees (item_costs in single keys), ties in their given order; flat int32."""
    pairs = np.asarray(work).reshape(-1, 2)
    pairs = pairs[np.argsort(-item_costs(pairs, qo_lens, kv_lens, group, block_m, 1, causal), kind="stable")]
    return np.ascontiguousarray(pairs).reshape(-1)


def item_costs(work, qo_lens, kv_lens, group: int, block_m: int, block_n: int, causal: bool) -> np.ndarray:
    """build_work's items' costs in key blocks, plus one for the tile's own q load and output store: the
    persistent kernel's balance model (kernels/attention_ws.persistent_programs). Causal (bottom-right): a tile's
    last row, token i of qo_len, sees kv_len - qo_len + i + 1 keys."""
    pairs = np.asarray(work).reshape(-1, 2)
    req, tile = pairs[:, 0], pairs[:, 1]
    qo, kv = np.asarray(qo_lens)[req], np.asarray(kv_lens)[req]
    if causal:
        last_token = (np.minimum((tile + 1) * block_m, qo * group) - 1) // group
        kv = kv - qo + last_token + 1
    return -(-kv // block_n) + 1


# split while (work items x KV heads) is at most half this many programs per SM: a plan filling half the GPU or
# more gains no wave by splitting (session 28, H200: 64 programs split 1.5x faster, 256 programs 0.87x as fast as
# unsplit; session 31, H100, page size 1: 64 programs -> 256 1.54x faster, 128 -> 256 0.72x as fast)
SPLIT_PROGRAMS_PER_SM = 1
SPLIT_MIN_CHUNK = 256  # KV tokens: shorter chunks cost more in partial states and merging than they gain
# the ragged split of a decode-shaped plan that fills the GPU (ragged_chunk)
RAGGED_PROGRAMS_PER_SM = 2
RAGGED_MAX_CHUNKS = 32


def split_chunk(qo_lens, kv_lens, group: int, tiles: TileConfig, num_kv_heads: int, num_sms: int, num_items: int,
                fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
                warp_specialized=None) -> Optional[int]:
    """KV tokens per chunk (a multiple of block_n) when the plan's programs would not fill the GPU and some request
    is long enough to cut, else None. fixed_split_size: chunks of that many tokens whatever the batch;
    disable_split_kv: none (plan()'s arguments). warp_specialized: a function saying whether the plan's calls
    run on that kernel, faster unsplit than split on prefill_kernel (attention_ws.takes_16bit), asked only of a
    plan that would split: only fixed chunks split such a plan.
    SERVEATTN_PREFILL_SPLIT=0 turns splitting off; SERVEATTN_PREFILL_SPLIT_CHUNK=N forces chunks of N tokens
    (tests, measuring)."""
    if disable_split_kv:
        return None
    programs = num_items * num_kv_heads
    target = SPLIT_PROGRAMS_PER_SM * num_sms
    forced = fixed_split_size or knobs.get("SERVEATTN_PREFILL_SPLIT_CHUNK", "")
    # a plan that fills the GPU (most prefill, large decode batches) leaves here, before any array is read, unless
    # it is decode-shaped (a tile a request: the tensor-core decode route) and SERVEATTN_PREFILL_RAGGED_SPLIT is on
    # (2 by default since session 37: H200, ragged batches of 64-256 requests 0.19-0.74x the time, uniform 1.00x;
    # docs/performance.md; 0 turns it off)
    ragged = int(knobs.get("SERVEATTN_PREFILL_RAGGED_SPLIT", "2"))
    full = 2 * programs > target and not forced
    if num_items == 0 or (full and (ragged <= 0 or num_items > len(kv_lens))) or \
            knobs.get("SERVEATTN_PREFILL_SPLIT", "1") == "0":
        return None
    if full:  # the warp-specialized kernel asked only where a ragged cut falls (equal lengths never cut)
        # in flight: 2 programs an SM, or the plan's own programs where fewer (0.5-2 an SM): there a cut falls only
        # where the longest request stands out (then every request past the chunk is cut), so equal and near-equal
        # lengths stay whole (H100, session 50: 16-32 requests of 1024-4096 keys cut into chunks of 256-512 ran
        # 1.02-1.33x slower than whole; session 51: near-equal lengths (+-10%) cut by the mean alone took 0.95-1.23x
        # the time whole, 1.03-1.23x in eager).
        in_flight = RAGGED_PROGRAMS_PER_SM * num_sms
        max_kv = int(np.maximum.reduce(kv_lens))
        total_keys = int(np.add.reduce(kv_lens, dtype=np.int64))
        if programs < in_flight:
            in_flight = programs
            if not stands_out(kv_lens, max_kv, total_keys):
                return None
        chunk = ragged_chunk(kv_lens, max_kv, num_kv_heads, in_flight, tiles.block_n, ragged, _ragged_limits,
                             total_keys)
        return None if chunk is None or (warp_specialized is not None and warp_specialized()) else chunk
    if not forced and warp_specialized is not None and warp_specialized():
        return None
    max_kv = int(np.maximum.reduce(kv_lens))
    if forced:
        chunk = int(forced)
    else:
        chunk = max(SPLIT_MIN_CHUNK, -(-max_kv // even_splits(programs, target)))
    chunk = -(-chunk // tiles.block_n) * tiles.block_n
    if not forced and ragged > 0 and num_items <= len(kv_lens):  # decode-shaped: a long request among short ones
        chunk = uneven_chunk(chunk, kv_lens, max_kv, num_kv_heads, target, tiles.block_n, ragged, _ragged_limits)
    return chunk if chunk < max_kv else None


def even_splits(programs: int, target: int, max_slots: int = 0) -> int:
    """The chunks a request is cut into where `programs` (under `target`) leave the GPU part idle (both routes):
    a power of two, so chunks of a power-of-two KV length come out even (8 x 4096 on 132 SMs: 8 chunks of 512,
    0.057 ms, instead of 5 of 896 with a short last one, 0.062 ms; docs/runs/2026-12-02T2133-*), at most max_slots
    (0: no cap)."""
    splits = 1 << (-(-target // programs) - 1).bit_length()
    return min(splits, max_slots) if max_slots > 0 else splits


def ragged_chunk(kv_lens, max_kv: int, num_kv_heads: int, in_flight: int, block_n: int, divisor: int,
                 limits, total_keys: Optional[int] = None) -> Optional[int]:
    """The ragged split of a batch that fills the GPU (decode's bandwidth kernel; this kernel's decode-shaped plans
    under SERVEATTN_PREFILL_RAGGED_SPLIT): one program streams ~13 GB/s (H100: 16 MB of one 32768-key request in
    1.3 ms), so `in_flight` of them make the copy bandwidth and the batch's bandwidth-bound time is about one
    program's time for per_program = its keys x KV heads / in_flight. Only a request longer than per_program is cut
    (never one of equal lengths: in_flight is at most the batch's programs), into power-of-two chunks of
    per_program / divisor keys (0: off), at least min_chunk and at most max_chunks of them: limits() -> (min_chunk,
    max_chunks), asked only where a cut falls. total_keys: kv_lens' sum where the caller has it."""
    if total_keys is None:
        total_keys = int(np.add.reduce(kv_lens, dtype=np.int64))
    per_program = total_keys * num_kv_heads // in_flight
    if divisor <= 0 or max_kv <= per_program:
        return None
    min_chunk, max_chunks = limits()
    chunk = max(1 << max(per_program // divisor, 1).bit_length() - 1, min_chunk,  # the power of two at or below
                -(-max_kv // max_chunks) if max_chunks > 0 else 0)
    chunk = -(-chunk // block_n) * block_n
    return chunk if chunk < max_kv else None


def uneven_chunk(even_chunk: int, kv_lens, max_kv: int, num_kv_heads: int, in_flight: int, block_n: int,
                 divisor: int, limits) -> int:
    """The chunk of a batch too small to fill the GPU: even_chunk (the longest request cut into as many chunks as
    make in_flight programs, fit for equal lengths), or the ragged cut (ragged_chunk) where even_chunk carries more
    than a program's share of the batch's keys plus a tile: one long request among short ones. The batch then waits
    on the program streaming that chunk (1 x 32768 beside 31 x 1024 kept 2 chunks of 16384, one program each
    streaming 8 MB, 7x the batch's copy floor, H200, session 49; 16 lognormal requests kept 2816-key chunks for a
    share of 1481, 2.2x the floor, H100, session 50). Equal lengths keep even_chunk: it is at most a share plus a
    tile's rounding (the longest request is cut into at least in_flight / programs chunks), or MIN_CHUNK or a
    request's max_chunks-th part, which bound the ragged cut too. (Session 49's line of two shares was 1.11-1.27x
    slower at 16 lognormal requests, H100, session 50.)"""
    total_keys = int(np.add.reduce(kv_lens, dtype=np.int64))
    per_program = total_keys * num_kv_heads // in_flight
    if even_chunk <= per_program + block_n:
        return even_chunk
    # near-equal lengths (no request standing out) keep the even cut too: a power-of-two count of chunks can leave
    # an even chunk a few percent over a share (17 requests of 8192 +-10% keys, 4 KV heads: 2304 against 2110),
    # where the ragged cut would halve every request's chunks (1.05-1.10x slower at 17 requests, H100, session 51)
    if not stands_out(kv_lens, max_kv, total_keys):
        return even_chunk
    cut = ragged_chunk(kv_lens, max_kv, num_kv_heads, in_flight, block_n, divisor, limits, total_keys)
    return even_chunk if cut is None else min(even_chunk, cut)


def stands_out(kv_lens, max_kv: int, total_keys: int) -> bool:
    """Whether the longest request is over twice the mean of the others: a long request among short ones, which a
    ragged cut serves; near-equal lengths (+-10%) never, and a batch of two only where one is over twice the other
    (twice the whole batch's mean would never hold for two)."""
    return max_kv * (len(kv_lens) - 1) > 2 * (total_keys - max_kv)


def _ragged_limits():
    return SPLIT_MIN_CHUNK, RAGGED_MAX_CHUNKS


def split_rows(qo_lens, kv_lens, chunk: int) -> int:
    """The partial rows build_split_work's plan keeps: each split request's tokens times its chunks."""
    qo, kv = np.asarray(qo_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
    return int(np.dot(qo, np.where(kv > chunk, -(-kv // chunk), 0)))


def unsplit_items(pairs: np.ndarray, kv_lens) -> np.ndarray:
    """build_work's (request, tile) pairs as build_split_work's items of a plan that cuts no request: every
    request's whole KV, the output written directly (a few numpy calls: CUDA-graph re-plans take this path)."""
    n = pairs.size // 2
    work = np.empty((n, 6), dtype=np.int32)
    work[:, :2] = pairs.reshape(n, 2)
    work[:, 2] = 0
    work[:, 3] = np.asarray(kv_lens)[work[:, 0]]
    work[:, 4] = -1
    work[:, 5] = 0
    return work.reshape(-1)


def build_split_work(qo_lens, kv_lens, group: int, block_m: int, chunk: int):
    """Work items int32 [6 n] (request, query tile, first key, end key, first partial row, partial row stride) for
    requests longer than chunk cut into chunks of chunk keys, each request's chunks together and each chunk's
    tiles together (costliest first, as build_work) so the programs running at once share K/V in L2; an unsplit
    request's items have first partial row -1 and write the output. Token t of a split request of n chunks keeps
    chunk c's state in partial row base + t n + c; merge rows int32 [1 + 3 m]: m, then (output row, base + t n, n)
    per such token. Returns (work, items, merge_rows, merge count, partial rows)."""
    qo, kv = np.asarray(qo_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
    if qo.size and int(np.minimum.reduce(qo)) == int(np.maximum.reduce(qo)) and \
            int(np.minimum.reduce(kv)) == int(np.maximum.reduce(kv)):
        return _equal_split_work(qo.size, int(qo[0]), int(kv[0]), group, block_m, chunk)
    return _general_split_work(qo, kv, group, block_m, chunk)


def _general_split_work(qo: np.ndarray, kv: np.ndarray, group: int, block_m: int, chunk: int):
    """build_split_work for any lengths (int64 arrays)."""
    tiles = _tiles(qo, group, block_m)
    chunks = np.where(kv > chunk, -(-kv // chunk), 1)
    split = chunks > 1
    rows = np.where(split, qo * chunks, 0)
    base = np.cumsum(rows) - rows
    by_cost = np.argsort(-kv, kind="stable")
    counts = (tiles * chunks)[by_cost]
    req = np.repeat(by_cost, counts)
    index = np.arange(req.size) - np.repeat(np.cumsum(counts) - counts, counts)
    c = index // tiles[req]
    work = np.empty((req.size, 6), dtype=np.int64)
    work[:, 0] = req
    work[:, 1] = tiles[req] - 1 - index % tiles[req]
    work[:, 2] = c * chunk
    work[:, 3] = np.where(split[req], (c + 1) * chunk, kv[req])
    work[:, 4] = np.where(split[req], base[req] + c, -1)
    work[:, 5] = np.where(split[req], chunks[req], 0)
    q_start = np.cumsum(qo) - qo
    tok_req = np.repeat(np.flatnonzero(split), qo[split])
    t = np.arange(tok_req.size) - np.repeat(np.cumsum(qo[split]) - qo[split], qo[split])
    merge = np.empty(1 + 3 * tok_req.size, dtype=np.int32)
    merge[0] = tok_req.size
    merge[1:] = np.stack([q_start[tok_req] + t, base[tok_req] + t * chunks[tok_req], chunks[tok_req]], 1).reshape(-1)
    return work.reshape(-1).astype(np.int32), int(req.size), merge, int(tok_req.size), int(rows.sum())


def _equal_split_work(batch: int, qo_len: int, kv_len: int, group: int, block_m: int, chunk: int):
    """build_split_work for `batch` requests of qo_len rows and kv_len keys each (one request, a uniform batch),
    broadcast from one request's items: ~12 numpy calls instead of ~35 (50 -> ~15 us on a development CPU)."""
    tiles = _tiles(qo_len, group, block_m)
    chunks = -(-kv_len // chunk) if kv_len > chunk else 1
    split = chunks > 1
    first = np.arange(chunks) * chunk
    requests = np.arange(batch)[:, None, None]
    work = np.empty((batch, chunks, tiles, 6), dtype=np.int32)  # a request's chunks, each chunk's tiles last first
    work[..., 0] = requests
    work[..., 1] = np.arange(tiles - 1, -1, -1)
    work[..., 2] = first[:, None]
    work[..., 3] = (first + chunk)[:, None] if split else kv_len
    if split:  # request r's token t keeps chunk c's state in partial row r qo_len chunks + t chunks + c
        work[..., 4] = requests * (qo_len * chunks) + np.arange(chunks)[:, None]
        work[..., 5] = chunks
        tokens = np.arange(batch * qo_len)
        merge = np.empty((1 + 3 * tokens.size,), dtype=np.int32)
        merge[0] = tokens.size
        rows = merge[1:].reshape(-1, 3)
        rows[:, 0] = tokens
        rows[:, 1] = tokens * chunks
        rows[:, 2] = chunks
        return work.reshape(-1), batch * chunks * tiles, merge, int(tokens.size), int(tokens.size * chunks)
    work[..., 4] = -1
    work[..., 5] = 0
    return work.reshape(-1), batch * tiles, np.zeros(1, dtype=np.int32), 0, 0


def _tiles(qo_len, group: int, block_m: int):
    """Query tiles of block_m rows for qo_len rows per head (a number or an array of them)."""
    return (qo_len * group + block_m - 1) // block_m


class PlannedRows(NamedTuple):
    """The decode wrapper's query rows, which it built itself (valid by construction: make_plan skips its checks):
    the int32 indptr, the same as int64, each request's rows, and (fewest, most) rows a request ((0, 0) for no
    requests). Read-only by convention: a wrapper keeps one and passes it to each plan of the same shape."""
    indptr: np.ndarray
    indptr64: np.ndarray
    lens: np.ndarray
    rows: Tuple[int, int]


def planned_rows(indptr: np.ndarray, rows: Tuple[int, int]) -> PlannedRows:
    """PlannedRows of an int32 indptr whose requests have rows[0] to rows[1] rows each."""
    indptr64 = indptr.astype(np.int64)
    return PlannedRows(indptr, indptr64, indptr64[1:] - indptr64[:-1], rows)


def make_plan(entry: str, *, paged: bool, qo_indptr, kv_indptr, kv_indices, last_page_len, page_size,
              num_qo_heads, num_kv_heads, head_dim, head_dim_vo, custom_mask, packed_custom_mask, causal,
              pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
              q_data_type, kv_data_type, o_data_type, device, backend, graph_tiles: bool,
              graph_max_qo: Optional[int] = None, graph_split_kv: bool = False,
              tree_mask: Optional[torch.Tensor] = None, held: Optional[routing.Decision] = None,
              workspace_bytes: int = 0, split: tuple = (None, False), batch_invariant: bool = False,
              table_names: Tuple[str, str, str] = policy.PREFILL_TABLE_NAMES, resolved: bool = False) -> Plan:
    """All host-side validation and schedule building; touches no state and no caller buffer.

    qo_indptr: the caller's int32 tensor, checked here, or the decode wrapper's PlannedRows (valid by construction;
    a numpy array is the caller's, and refused as a tensor would be).
    tree_mask (native tree verify, built and checked by the decode wrapper): int64 [total_q] ancestor words;
    the rows are then causal and, among the last qo_len keys, see only the keys whose bit is set.
    graph_split_kv: under use_cuda_graph=True, every plan takes split-KV's items (decode's tensor-core route).
    held: under use_cuda_graph=True, the route of the first plan (routing: it holds).
    workspace_bytes: the float workspace's size; split-KV (split_chunk) only where its partial states fit.
    split: (fixed_split_size in KV tokens (plan() took pages of a paged cache: policy.split_args), disable_split_kv).
    batch_invariant: the prefill wrappers' plan() was given either (FlashInfer's batch-invariance arguments): the
    tiles and the route do not follow the batch's lengths, so a request's rows have the same bits alone or beside
    any others (tile rows and warps change the tensor-core instructions). The decode wrapper's chains all have
    q_len_per_req rows; its trees, up to 64, take tiles for 64 (graph_max_qo) when batch-invariant.
    resolved: backend is the route the caller resolved from its explicit backend in this same call, on this device
    (the decode wrapper's inner plan): taken as choose_prefill would return it, without resolving it again."""
    policy.check_heads(entry, num_qo_heads, num_kv_heads)
    policy.check_head_dim(entry, head_dim, head_dim_vo)
    policy.check_pos_encoding(entry, pos_encoding_mode)
    policy.check_scalars(entry, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                         rope_scale=rope_scale, rope_theta=rope_theta)
    q_dtype = policy.canonical_dtype(entry, "q_data_type", q_data_type)
    kv_dtype = policy.canonical_dtype(entry, "kv_data_type", kv_data_type if kv_data_type is not None else q_dtype)
    default_o = torch.bfloat16 if q_dtype in policy.FP8_DTYPES else q_dtype  # API.md: bf16 for an fp8 query
    o_dtype = policy.canonical_dtype(entry, "o_data_type", o_data_type if o_data_type is not None else default_o)
    policy.check_q_dtype(entry, q_dtype, "q_data_type", kv_dtype)
    if q_dtype in policy.FP8_DTYPES and pos_encoding_mode != "NONE":
        policy.unsupported(entry, f"pos_encoding_mode={pos_encoding_mode!r} with an fp8 query is not served; "
                                  f"apply RoPE before quantizing q and k.")
    policy.check_kv_dtype(entry, kv_dtype, q_dtype, "kv_data_type")
    policy.check_o_dtype(entry, o_dtype)
    if custom_mask is not None and packed_custom_mask is not None:
        policy.refuse(entry, "custom_mask and packed_custom_mask were both given; pass one of them.")

    # Host arithmetic in numpy (a torch op on a small host tensor costs several times a numpy one, a numpy call
    # about a microsecond); the plan keeps torch views of the same int64 arrays.
    rows = None  # (fewest, most) rows per request, where known by construction
    if qo_indptr.__class__ is PlannedRows:  # the decode planner's own: valid by construction
        qo_indptr, qo_np, qo_lens, rows = qo_indptr
    else:
        policy.check_index(entry, "qo_indptr", qo_indptr, min_len=1)
        qo_np = policy.host_array(qo_indptr)
        qo_lens = qo_np[1:] - qo_np[:-1]  # int64 from int32: no overflow, so a decrease is a negative length
        if int(qo_np[0]) != 0 or (qo_lens.size and int(np.minimum.reduce(qo_lens)) < 0):
            policy.check_indptr(entry, "qo_indptr", qo_np)  # raises the failing check's sentence
    batch = qo_np.size - 1
    if paged:
        kv_lens, kv_np = policy.page_table(entry, kv_indptr, kv_indices, last_page_len, page_size, table_names)
        idx_np = policy.host_view(kv_indices)  # int32 as given: no int64 copy
        idx_host = None  # the torch route's copy, made below once the route is known
        max_page = policy.max_page(entry, idx_np[: int(kv_np[-1])], table_names[1])
    else:
        policy.check_index(entry, "kv_indptr", kv_indptr, min_len=1)
        kv_np = policy.host_array(kv_indptr)
        policy.check_indptr(entry, "kv_indptr", kv_np)
        kv_lens = kv_np[1:] - kv_np[:-1]
        idx_host = None
        page_size = 1
        max_page = -1
    if kv_np.size - 1 != batch:
        policy.refuse(entry, f"qo_indptr describes {batch} requests but the KV indptr describes "
                             f"{kv_np.size - 1}.")
    mask_host = mask_lens = None
    if custom_mask is not None or packed_custom_mask is not None:
        mask_lens = torch.from_numpy(qo_lens), torch.from_numpy(kv_lens)  # the mask helpers take torch tensors
        mask_host = _check_mask(entry, custom_mask, packed_custom_mask, *mask_lens)
    elif causal:
        policy.check_causal_lengths(entry, qo_lens, kv_lens)

    device = torch.device(device)
    # the request's lengths and flags are read only where auto chooses (an explicit or held route reads none)
    request = routing.prefill_request(
        device, paged=paged, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype, head_dim=head_dim,
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, causal=causal, custom_mask=mask_host is not None,
        tree=tree_mask is not None, window_left=window_left, soft_cap=logits_soft_cap,
        rope=pos_encoding_mode == "ROPE_LLAMA", use_cuda_graph=graph_tiles, qo_lens=qo_lens,
        kv_lens=kv_lens, batch_invariant=batch_invariant) if backend == "auto" and held is None else None
    decision = routing.resolved_route(backend) if resolved else routing.choose_prefill(entry, backend, request,
                                                                                           device, held)
    chosen = decision.backend
    # the torch route's own copy of the page table (it reads it at run()): a caller may rewrite its table after
    # plan(); the kernels' routes copy it to the device in _commit instead
    if paged and chosen == "torch":
        idx_host = kv_indices.clone() if kv_indices.is_cpu else torch.from_numpy(idx_np)
    group = num_qo_heads // num_kv_heads
    # the fewest and most rows a request: the decode wrapper's by construction, else read once here
    min_qo_len, max_qo_len = rows if rows is not None else \
        (int(np.minimum.reduce(qo_lens)), int(np.maximum.reduce(qo_lens))) if batch else (0, 0)
    # Under CUDA graphs the tiles must serve any later plan: sized for graph_max_qo rows (None: any length).
    # batch-invariant: the decode wrapper's bound on its rows (a tree's 64 nodes) where it gives one, else any length
    max_qo = graph_max_qo if graph_tiles or (batch_invariant and graph_max_qo is not None) else \
        None if batch_invariant else max_qo_len if batch else 1
    if graph_tiles and graph_max_qo is not None and batch and max_qo_len > graph_max_qo:
        policy.refuse(entry, f"under use_cuda_graph=True this wrapper serves at most {graph_max_qo} query rows "
                             f"per request; the plan has {max_qo_len}.")
    fp8 = q_dtype.itemsize == 1
    # fp8 q+KV: the warp-specialized kernel's tiles where it will serve (V^T made: not under CUDA graphs)
    fp8_ws = (fp8 and not graph_tiles and attention_kernel.attention_ws is not None
              and attention_kernel.attention_ws.takes_fp8(device, head_dim, page_size if paged else None,
                                                          max_qo_len * group))
    tiles = choose_tiles(head_dim, group, max_qo, device, paged, fp8=fp8, fp8_ws=fp8_ws)
    rope = pos_encoding_mode == "ROPE_LLAMA"
    plan = Plan(
        paged=paged, backend=chosen, device=device, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        group=group, head_dim=head_dim, page_size=page_size, causal=bool(causal) and mask_host is None,
        has_mask=mask_host is not None, window_left=policy.window(window_left),
        soft_cap=float(logits_soft_cap or 0.0), rope=rope,
        sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        log2_theta=math.log2(rope_theta if rope_theta is not None else 1e4),
        rcp_scale=1.0 / (rope_scale if rope_scale is not None else 1.0),
        q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype, batch=batch, total_q=int(qo_np[-1]),
        total_kv=int(kv_np[-1]), tiles=tiles, num_work_host=0, max_page=max_page,
        qo_indptr_host=torch.from_numpy(qo_np), kv_indptr_host=torch.from_numpy(kv_np), kv_indices_host=idx_host,
        kv_lens_host=torch.from_numpy(kv_lens),
        mask_host=mask_host, tree_mask_host=tree_mask, decision=decision)
    if chosen != "torch":  # the cuDNN route keeps our kernel's schedule too: its fallback if cuDNN raises
        work, n = build_work(qo_lens, kv_lens, group, tiles.block_m, plan.causal,
                             qo_range=(min_qo_len, max_qo_len))
        answers = {}  # _warp_specialized's, asked here for the tile order and again for split-KV: once each form

        def warp_specialized(graphed: bool) -> bool:
            if graphed not in answers:
                answers[graphed] = _warp_specialized(plan, kv_lens, graphed)
            return answers[graphed]
        # a tile a request (n == batch: decode-shaped plans) has one order, and one request's tiles are costliest
        # first already (build_work: last to first, a stable sort of them is the identity): the switch is read only
        # past those
        order = knobs.get("SERVEATTN_PREFILL_ORDER", "cost-small") if n > batch > 1 else ""
        if order and chosen == "triton" and not graph_tiles and \
                (order == "cost" or order == "cost-small" and _order_fits(plan, kv_lens)) and \
                not warp_specialized(False):
            # prefill_kernel's eager grid, costliest tile of the batch first (=cost-small, the default: small batches
            # only, ORDER_COST_MAX_BYTES; =cost every batch, measuring only; ="" request by request)
            work = costliest_first_order(work, qo_lens, kv_lens, group, tiles.block_m, plan.causal)
        # split-KV on our kernel for 16-bit queries (fp8 attention's V^T is per request), where the partial states
        # fit workspace_bytes. Under CUDA graphs only where the wrapper asks (graph_split_kv) and the
        # warp-specialized kernel would not take the plan (chain verify k=64 ran 1.7x slower on split items than on
        # it, session 31), or where fixed_split_size asks for chunks (batch invariance: the eager plan's bits): its
        # every plan keeps split items (split or not: the captured kernel is the split one). That kernel's answer
        # rests on what a graph wrapper holds fixed (dtypes, tiles sized for its rows, page size, flags), so all
        # its plans answer alike.
        items = chosen == "triton" and not fp8 and workspace_bytes > 0 and (not graph_tiles or (
            graph_split_kv and (split[0] is not None or not warp_specialized(True))))
        chunk = split_chunk(qo_lens, kv_lens, group, tiles, num_kv_heads, _num_sms(device), n, *split,
                            warp_specialized=lambda: warp_specialized(graph_tiles)) \
            if items else None
        need = policy.split_state_bytes(split_rows(qo_lens, kv_lens, chunk), num_qo_heads, head_dim) \
            if chunk is not None else 0
        if need > workspace_bytes and split[0] is not None:  # unsplit, the long requests' bits would follow the batch
            policy.refuse(entry, f"float_workspace_buffer holds {workspace_bytes} bytes for split-KV but "
                                 f"fixed_split_size's chunks of {split[0]} KV tokens need {need} bytes of partial "
                                 f"states for this batch; pass a larger workspace (or disable_split_kv=True).")
        if need > workspace_bytes:
            chunk = None  # the partial states would not fit: unsplit
        if chunk is not None:
            work, n, plan.merge_rows, plan.num_merge, plan.split_rows = build_split_work(
                qo_lens, kv_lens, group, tiles.block_m, chunk)
            plan.split_chunk = chunk
        elif items and graph_tiles:  # the split kernel's items for an unsplit plan
            work, plan.merge_rows = unsplit_items(work, kv_lens), np.zeros(1, dtype=np.int32)
        # numpy, the plan's own: on the host to_device wraps it instead of copying it as it would a caller's tensor
        plan.work, plan.num_work_host = work, n
        # one request's tiles deal evenly on the SM count already (the model, 256-32768 rows, groups 1-8): batches only
        if chosen == "triton" and chunk is None and not graph_tiles and n > batch > 1 and device.type == "cuda" and \
                attention_kernel.attention_ws is not None and knobs.get("SERVEATTN_PREFILL_WS_BALANCE", "1") == "1":
            # a balanced persistent grid (on since session 36: causal batches of 8-16 up to 1.5x, docs/performance.md)
            same_tiles = min_qo_len == max_qo_len  # every request as many items
            ws, sms, per_request = attention_kernel.attention_ws, _num_sms(device), n // batch if same_tiles else None
            candidates = ws.grid_candidates(n * num_kv_heads, num_kv_heads, sms, per_request)
            if candidates and same_tiles and int(np.minimum.reduce(kv_lens)) == int(np.maximum.reduce(kv_lens)):
                # equal requests: the grid follows from one request's shape (37-47 us of numpy a plan, once)
                plan.ws_programs = _equal_batch_programs(batch, max_qo_len, int(kv_lens[0]), group, tiles.block_m,
                                                         tiles.block_n, plan.causal, num_kv_heads, sms,
                                                         tuple(candidates))
            elif candidates:  # else the SM count stands: no item costs to compute
                plan.ws_programs = ws.persistent_programs(
                    item_costs(plan.work, qo_lens, kv_lens, group, tiles.block_m, tiles.block_n, plan.causal),
                    num_kv_heads, sms, per_request, candidates)
        plan.num_work = np.array([n], dtype=np.int32)  # numpy: the plan's own (staging.to_device)
        plan.qo_indptr, plan.kv_indptr = qo_indptr, kv_indptr
        plan.kv_indices, plan.last_page_len = kv_indices, last_page_len
        if mask_host is not None:
            plan.mask, plan.mask_indptr = segment_packbits(mask_host, _mask_indptr(*mask_lens), bitorder="little")
        plan.tree_mask = tree_mask
    return plan


@functools.lru_cache(maxsize=256)
def _equal_batch_programs(batch: int, qo_len: int, kv_len: int, group: int, block_m: int, block_n: int, causal: bool,
                          num_kv_heads: int, num_sms: int, candidates: tuple) -> int:
    """persistent_programs for `batch` requests of qo_len rows and kv_len keys each (build_work's list: request
    order, each request's tiles last to first), kept per shape."""
    qo, kv = np.full(batch, qo_len, dtype=np.int64), np.full(batch, kv_len, dtype=np.int64)
    work, n = build_work(qo, kv, group, block_m, causal)
    costs = item_costs(work, qo, kv, group, block_m, block_n, causal)
    return attention_kernel.attention_ws.persistent_programs(costs, num_kv_heads, num_sms, n // batch,
                                                             list(candidates))


def _warp_specialized(plan: Plan, kv_lens, graphed: bool) -> bool:
    """Whether the plan's calls will run on the warp-specialized kernel (split_chunk leaves those unsplit); an fp8
    cache reaches it through a widened copy of K and V (2 bytes a value each), made where that fits
    GATHER_MAX_BYTES."""
    ws = attention_kernel.attention_ws
    fits = plan.kv_dtype.itemsize == 1 and (4 * int(np.add.reduce(kv_lens)) * plan.num_kv_heads * plan.head_dim
                                            <= attention_kernel.GATHER_MAX_BYTES)
    return ws is not None and ws.takes_16bit(plan, graphed, fits)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return policy.cuda_properties(device)[1]
    return 2  # the interpreter: a small target still exercises splitting


# SERVEATTN_PREFILL_ORDER=cost-small (the default since session 40): costliest first only where the batch's K/V
# bytes x group stay under this. The H100's head-dim-256 causal points (session 36,
# docs/runs/2026-12-05T2133-h100-probe-prefill-order-compare.md), by that product: 5-7% faster up to 128 MiB (group
# 1 to 8x2048, group 4 at 8x512), 0.97-1.01x at 256 MiB, 1.00-1.03x at 512 MiB, 1.10x at 1 GiB: costliest first
# interleaves every request's K/V, so the L2 holds less of what runs at once (a guess at why the group counts: more
# rows a KV head keep each request's tiles in flight longer). Session 40 on an H100, out of sample (group 2 added):
# 0.914-0.972x where it applies, 0.999-1.002x where it does not (docs/runs/2026-12-06T0730-h100-prefill-order-small*).
ORDER_COST_MAX_BYTES = 1 << 28


def _order_fits(plan: "Plan", kv_lens) -> bool:
    """Whether SERVEATTN_PREFILL_ORDER=cost-small lists the plan's tiles costliest first (ORDER_COST_MAX_BYTES)."""
    kv_bytes = 2 * int(kv_lens.sum()) * plan.num_kv_heads * plan.head_dim * plan.kv_dtype.itemsize
    return kv_bytes * plan.group < ORDER_COST_MAX_BYTES


# workspace_size's room for split-KV: more than any plan's partial states
SIZING_ROOM = 1 << 62

# Under CUDA graphs a wrapper's work list lives in a buffer of its own (FlashInfer's int workspace is 8 MB a wrapper
# too), never in the float workspace, which serving engines share between wrappers as scratch (SGLang's multi-step
# draft plans several graph wrappers on one buffer before replaying them all). Its entries: a quarter of the
# workspace's bytes where the wrapper splits (the partial states' share of old), all of them where not, at most this.
GRAPH_WORK_MAX_INTS = 1 << 21


def _graph_work_ints(workspace: torch.Tensor, split_kv: bool) -> int:
    nbytes = workspace.numel() * workspace.element_size()
    return max(16, min(GRAPH_WORK_MAX_INTS, (nbytes // 4 if split_kv else nbytes) // 4))


def _split_states(workspace: torch.Tensor, plan: Plan, room: int) -> tuple:
    """(partial outputs fp32 [cap, Hq, D], partial LSEs [cap, Hq]), carved from the first `room` bytes of the
    caller's workspace (make_plan checked this plan's rows fit). The layout depends only on the room
    and the heads, never on the plan's rows, so a captured CUDA graph's pointers stay right after any re-plan."""
    flat = workspace.reshape(-1).view(torch.uint8)
    cap = room // (4 * plan.num_qo_heads * (plan.head_dim + 1))
    width = cap * plan.num_qo_heads
    floats = flat[: 4 * width * (plan.head_dim + 1)].view(torch.float32)
    return (floats[: width * plan.head_dim].view(cap, plan.num_qo_heads, plan.head_dim),
            floats[width * plan.head_dim:].view(cap, plan.num_qo_heads))


def _mask_indptr(qo_lens, kv_lens):
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(qo_lens * kv_lens, 0)]).to(torch.int32)


def packed_segment_bytes(qo_lens, kv_lens):
    """A packed mask's bytes per request: its qo_len * kv_len bits padded to a whole byte (segment_packbits)."""
    return (qo_lens * kv_lens + 7) // 8


def _check_mask(entry, custom_mask, packed_custom_mask, qo_lens, kv_lens) -> torch.Tensor:
    """Returns the flat bool mask on the host (a packed mask is unpacked once, here)."""
    bits = int((qo_lens * kv_lens).sum())
    for name, mask in (("custom_mask", custom_mask), ("packed_custom_mask", packed_custom_mask)):
        if mask is not None and not isinstance(mask, torch.Tensor):
            policy.refuse(entry, f"{name} is a {type(mask).__name__}; it must be a torch.Tensor.")
    if custom_mask is not None:
        # any shape is read flattened, as FlashInfer's; the one mistake that shows is one request's mask given
        # transposed, [kv_len, qo_len] (the same numel, read as another mask)
        if qo_lens.numel() == 1 and custom_mask.dim() == 2 and int(qo_lens[0]) != int(kv_lens[0]) and \
                tuple(custom_mask.shape) == (int(kv_lens[0]), int(qo_lens[0])):
            policy.refuse(entry, f"custom_mask has shape {tuple(custom_mask.shape)}, [kv_len, qo_len]; a request's "
                                 f"mask is [qo_len, kv_len] = [{int(qo_lens[0])}, {int(kv_lens[0])}], row-major "
                                 f"(flattened, one block per request).")
        if custom_mask.dtype != torch.bool:
            policy.refuse(entry, f"custom_mask has dtype {custom_mask.dtype}; it must be bool.")
        if custom_mask.numel() != bits:
            policy.refuse(entry, f"custom_mask has {custom_mask.numel()} elements; the batch's "
                                 f"sum(qo_len * kv_len) is {bits}.")
        return custom_mask.reshape(-1).to("cpu", copy=True)  # the plan's own: the caller may reuse its mask
    if packed_custom_mask.dtype != torch.uint8:
        policy.refuse(entry, f"packed_custom_mask has dtype {packed_custom_mask.dtype}; it must be uint8.")
    seg_bytes = packed_segment_bytes(qo_lens, kv_lens)
    need = int(seg_bytes.sum())
    if packed_custom_mask.numel() != need:
        policy.refuse(entry, f"packed_custom_mask has {packed_custom_mask.numel()} bytes; per-request "
                             f"segments padded to whole bytes need {need}.")
    packed = packed_custom_mask.reshape(-1).to("cpu")
    # Unpack each request's byte-padded segment and drop its pad bits.
    unpacked = ((packed[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(-1)
    starts = torch.repeat_interleave((torch.cumsum(seg_bytes, 0) - seg_bytes) * 8, qo_lens * kv_lens)
    offs = torch.arange(bits) - torch.repeat_interleave(torch.cumsum(qo_lens * kv_lens, 0) - qo_lens * kv_lens,
                                                        qo_lens * kv_lens)
    return unpacked[starts + offs]


def split_paged_cache(entry: str, cache, kv_layout: str):
    """(k, v) 4-D views of a 5-D cache or a (k_cache, v_cache) tuple (of page size 1: 4-D, or 3-D tensors,
    policy.slot_axis)."""
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            policy.refuse(entry, f"paged_kv_cache tuple has {len(cache)} tensors; expected (k_cache, v_cache).")
        k, v = policy.with_slot_axis(cache, kv_layout)
    else:
        cache = policy.with_slot_axis(cache, kv_layout)
        if not isinstance(cache, torch.Tensor) or cache.dim() != 5 or cache.shape[1] != 2:
            shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            policy.refuse(entry, f"paged_kv_cache has shape {shape}; expected a 5-D [num_pages, 2, ...] tensor "
                                 f"or a (k_cache, v_cache) tuple.")
        k, v = cache.unbind(1)  # both views in one call (every run pays this)
    policy.check_kv_pair(entry, k, v)
    return k, v


_CACHES_KEPT = 1024  # _cache_views' entries per wrapper (live caches only: a dead cache's entry goes with it)


def _cache_views(memo: dict, cache, kv_layout: str):
    """(k, v, their (page, slot, head) strides, dtype, device, shape, last stride) of a 5-D cache tensor, kept per
    tensor: a server passes the same layer caches at every step, and unbind plus reading the views cost ~3 us a
    run. An entry holds while the tensor's address, shape, strides, dtype and device are the ones its views were
    made from; the views are of a detached alias, so they do not keep `cache` alive, and its entry is dropped when
    it dies. None for what split_paged_cache refuses."""
    key = id(cache)
    held = memo.get(key)
    if held is not None and held[0]() is cache and held[1] == (cache.data_ptr(), cache.shape, cache.stride(),
                                                               cache.dtype, cache.device):
        return held[2]
    if cache.layout != torch.strided or cache.dim() != 5 or cache.shape[1] != 2:
        return None
    k, v = cache.detach().unbind(1)
    s = k.stride()  # unbind's views share shape and strides
    views = (k, v, (s[0], s[1], s[2]) if kv_layout == "NHD" else (s[0], s[2], s[1]), k.dtype, k.device, k.shape,
             s[3])
    if len(memo) >= _CACHES_KEPT:
        memo.clear()
    memo[key] = (weakref.ref(cache, lambda _, memo=memo, key=key: memo.pop(key, None)),
                 (cache.data_ptr(), cache.shape, cache.stride(), cache.dtype, cache.device), views)
    return views


def _pair_views(cache, kv_layout: str):
    """_cache_views' tuple for a (k, v) pair of plain tensors alike in dtype, device, shape and strides (read at
    every call: there is nothing to split); None for any other pair, or anything else."""
    if cache.__class__ not in (tuple, list) or len(cache) != 2:
        return None
    k, v = cache
    if k.__class__ is not torch.Tensor or v.__class__ is not torch.Tensor or k.layout != torch.strided or \
            v.layout != torch.strided:
        return None
    if k.dim() == 3:  # page size 1 without the slot axis (SGLang's token pools): the axis of 1 put back
        k, v = policy.slot_axis(k, kv_layout, 4), policy.slot_axis(v, kv_layout, 4)
    s, shape, dtype, device = k.stride(), k.shape, k.dtype, k.device
    if len(s) != 4 or v.stride() != s or v.shape != shape or v.dtype != dtype or v.device != device:
        return None
    return k, v, (s[0], s[1], s[2]) if kv_layout == "NHD" else (s[0], s[2], s[1]), dtype, device, shape, s[3]


def _plain_run(plan, q, kv, out, kv_layout, rows: int) -> bool:
    """Whether the paged run()'s checks (the cache's shape and pages, then _check_run; decode's run() the same)
    pass q of `rows` rows, the K/V of _cache_views or _pair_views, and out (lse and the scales aside), in the
    common case: True only where they would; False leaves it to them."""
    _, _, _, kv_dtype, kv_device, kv_shape, kv_last_stride = kv
    device = plan.device
    want = (plan.page_size, plan.num_kv_heads, plan.head_dim) if kv_layout == "NHD" else \
        (plan.num_kv_heads, plan.page_size, plan.head_dim)
    shape = (rows, plan.num_qo_heads, plan.head_dim)
    return (q.__class__ is torch.Tensor and q.shape == shape and q.dtype == plan.q_dtype and q.device == device
            and q.stride()[2] == 1
            and kv_dtype == plan.kv_dtype and kv_device == device and kv_shape[1:] == want
            and kv_last_stride == 1 and plan.max_page < kv_shape[0]
            and (out is None or out.__class__ is torch.Tensor and out.shape == shape and out.dtype == plan.o_dtype
                 and out.device == device and out.stride()[2] == 1))


def _plain_ragged_run(plan, q, k, v, out, kv_layout) -> bool:
    """The same for the ragged run()'s checks (K/V's dtypes and shapes, then _check_run)."""
    device = plan.device
    want = (plan.total_kv, plan.num_kv_heads, plan.head_dim) if kv_layout == "NHD" else \
        (plan.num_kv_heads, plan.total_kv, plan.head_dim)
    shape = (plan.total_q, plan.num_qo_heads, plan.head_dim)
    return (q.__class__ is torch.Tensor and q.shape == shape and q.dtype == plan.q_dtype and q.device == device
            and q.stride()[2] == 1
            and k.__class__ is torch.Tensor and k.shape == want and k.dtype == plan.kv_dtype and k.device == device
            and k.stride()[2] == 1
            and v.__class__ is torch.Tensor and v.shape == want and v.dtype == plan.kv_dtype and v.device == device
            and v.stride()[2] == 1
            and (out is None or out.__class__ is torch.Tensor and out.shape == shape and out.dtype == plan.o_dtype
                 and out.device == device and out.stride()[2] == 1))


_ARRAYS = ("num_work", "work", "qo_indptr", "kv_indptr", "kv_indices", "last_page_len", "mask", "mask_indptr",
           "tree_mask", "vt_work", "kv_tok_indptr", "merge_rows")


def transposed_v(plan: Plan, use_cuda_graph: bool) -> Plan:
    """fp8 attention (fp8 query and cache) on our kernel: schedules a transposed copy of V for each run.

    fp8 tensor cores read both operands K-major, so the second product wants V with keys contiguous, which
    the cache layout is not; transposed inside the attention kernel, every query tile of a request would
    transpose the same V tiles again, through byte-wide shared-memory stores that cannot be pipelined.
    Transposed once per run (transpose_v_kernel, one read and one write of V: about 1% of a 4096-token
    prefill's time), V streams into the kernel like K. Only where a request has more than one query tile (V
    is then read more than once) and not under CUDA graphs (the copy's size follows the batch).
    SERVEATTN_FP8_VT=0 turns it off (for measuring it)."""
    if (plan.backend != "triton" or use_cuda_graph or plan.q_dtype not in policy.FP8_DTYPES or plan.batch == 0
            or knobs.get("SERVEATTN_FP8_VT", "1") != "1"):
        return plan
    qo_lens = plan.qo_indptr_host[1:] - plan.qo_indptr_host[:-1]
    if int(qo_lens.max()) * plan.group <= plan.tiles.block_m:
        return plan
    # Each request's columns padded to whole blocks of both kernels (powers of two: the larger is a multiple of
    # the smaller), zero-filled: whole-block V loads, 16-byte aligned starts.
    pad = max(plan.tiles.block_n, VT_BLOCK_N, 16)
    padded = (plan.kv_lens_host.to(torch.int64) + pad - 1) // pad * pad
    blocks = padded // VT_BLOCK_N
    if int(blocks.sum()) == 0:
        return plan
    cols = torch.zeros(plan.batch + 1, dtype=torch.int64)
    cols[1:] = torch.cumsum(padded, 0)
    req = torch.repeat_interleave(torch.arange(plan.batch), blocks)
    first = torch.repeat_interleave(torch.cumsum(blocks, 0) - blocks, blocks)
    work = torch.stack([req, (torch.arange(req.numel()) - first) * VT_BLOCK_N], 1).reshape(-1)
    return replace(plan, vt_work=work.to(torch.int32), kv_tok_indptr=cols.to(torch.int32), vt_tokens=int(cols[-1]))


class _Variants:
    """A wrapper's plan under the settings FlashInfer's deprecated forward() takes (it sets them before its run()):
    made once per distinct set while the plan holds, and the wrapper's plan for one call."""
    __slots__ = ("plan", "made")

    def __init__(self):
        self.plan, self.made = None, {}

    @contextlib.contextmanager
    def applied(self, wrapper, entry: str, key: tuple, make):
        plan = wrapper._plan
        if plan is None:
            policy.refuse(entry, "forward() was called before plan().")
        if self.plan is not plan:
            self.plan, self.made = plan, {}
        variant = self.made.get(key)
        if variant is None:
            variant = self.made[key] = make(plan)
        wrapper._plan = variant
        try:
            yield
        finally:
            if wrapper._plan is variant:  # (a cuDNN failure inside the call replaces the plan: that one stays)
                wrapper._plan = plan


def _check_signature(entry: str, plan: Plan, signature, first) -> None:
    if (plan.static_signature() if signature is None else signature) != first:
        policy.refuse(entry, "under use_cuda_graph=True a re-plan may change only the batch's lengths and "
                             "page table; heads, head dim, dtypes, page size, causal/mask mode, window, "
                             "soft cap, sm_scale and positional encoding must stay as first planned.")


def _check_capacities(entry: str, plan: Plan, caps: dict) -> None:
    for name in _ARRAYS:
        t = getattr(plan, name)
        if t is not None:
            check_capacity(entry, name, staging.size(t), caps[name])


def check_capacity(entry: str, name: str, size: int, cap: int, source: Optional[str] = None) -> None:
    """A captured buffer must hold the re-plan's array (source: what sized the buffer, where the wrapper knows)."""
    if size > cap:
        how = f" ({source})." if source else "; give larger buffers (or workspace) at construction."
        policy.refuse(entry, f"under use_cuda_graph=True the plan needs {size} entries in its {name} buffer, "
                             f"which holds {cap}{how}")


def _torch_sizes(plan: Plan) -> dict:
    """The entries each index array of a torch-route plan would take in the captured routes' buffers."""
    sizes = {"qo_indptr": plan.batch + 1, "kv_indptr": plan.batch + 1}
    if plan.paged:
        sizes.update(kv_indices=plan.kv_indices_host.numel(), last_page_len=plan.batch)
    if plan.has_mask:
        qo_lens = plan.qo_indptr_host[1:] - plan.qo_indptr_host[:-1]
        sizes.update(mask=int(packed_segment_bytes(qo_lens, plan.kv_lens_host).sum()), mask_indptr=plan.batch + 1)
    return sizes


def check_workspace_reset(entry: str, float_workspace_buffer, use_cuda_graph: bool) -> None:
    if not isinstance(float_workspace_buffer, torch.Tensor):
        policy.refuse(entry, f"float_workspace_buffer is a {type(float_workspace_buffer).__name__}; it must be a "
                             f"torch.Tensor.")
    if use_cuda_graph:
        policy.unsupported(entry, "under use_cuda_graph=True the workspace holds what a captured graph reads; "
                                  "build a new wrapper (and capture again) instead.")


class WorkspaceAccessors:
    """What every batch wrapper shares with FlashInfer's beyond plan() and run(): is_cuda_graph_enabled,
    reset_workspace_buffer, workspace_size, the settings a plan leaves readable, and a sentence for FlashInfer's
    private state; for a wrapper with _entry, _workspace, _use_cuda_graph and _drop_plans()."""

    def __getattr__(self, name: str):
        """Only for attributes not found: FlashInfer's private state gets a sentence instead of Python's line."""
        if name in policy.FLASHINFER_PRIVATE:
            raise AttributeError(f"{type(self).__name__}: {name} is FlashInfer's private wrapper state, which "
                                 f"serveattn's wrappers do not have; code that writes FlashInfer's internals (vLLM's "
                                 f"fast_plan_decode, SGLang's fast_decode_plan under CUDA graphs) must call plan() "
                                 f"instead.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """FlashInfer's: the buffer the next plan() works in (int_workspace_buffer is taken and not used: a plan's
        index arrays live in a buffer the wrapper allocates). The plan is dropped: plan() again before run()."""
        check_workspace_reset(self._entry + ".reset_workspace_buffer", float_workspace_buffer,
                              self._use_cuda_graph)
        self._workspace = float_workspace_buffer
        self._drop_plans()

    def _record_settings(self, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                         causal=None) -> None:
        """FlashInfer's per-plan attributes as its plan() leaves them (the values given; a soft cap of None as 0.0):
        engines read them back, vLLM asserting _sm_scale, _window_left, _logits_soft_cap and a prefill's _causal
        before every run()."""
        self._pos_encoding_mode, self._window_left, self._sm_scale = pos_encoding_mode, window_left, sm_scale
        self._logits_soft_cap = 0.0 if logits_soft_cap is None else logits_soft_cap
        self._rope_scale, self._rope_theta = rope_scale, rope_theta
        if causal is not None:
            self._causal = causal

    # workspace_size's copy of a wrapper: its plan() records the float bytes the plan needs and installs nothing
    _sizing = False
    _sized_bytes = 0

    def workspace_size(self, *args, **kwargs) -> Tuple[int, int]:
        """FlashInfer 0.7's: (float, int) workspace bytes that plan(*args, **kwargs) needs, for
        reset_workspace_buffer before that plan(). The float workspace holds split-KV's partial states (fp32 outputs
        and LSEs) for as many chunks as the plan cuts its requests into with room unbounded; a workspace of that size
        gives plan() the same split, so the same bits. The int workspace is not used: 0. A copy of this wrapper
        plans, so nothing is allocated and this wrapper's plan stays; refusals are plan()'s."""
        entry = self._entry + ".workspace_size"
        if self._use_cuda_graph:
            policy.unsupported(entry, "workspace_size is served without use_cuda_graph only: a CUDA-graph wrapper "
                                      "keeps the workspace it was built with (reset_workspace_buffer is refused), "
                                      "and its size fixes the captured buffers.")
        shadow = copy.copy(self)
        shadow._entry = _CallName(entry)
        shadow._sizing = True
        shadow._drop_plans()
        shadow.plan(*args, **kwargs)
        return shadow._sized_bytes, 0


class _PrefillWrapper(WorkspaceAccessors):
    _entry = "BatchPrefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", jit_args=None, extra_kwargs=None):
        policy.check_kv_layout(self._entry, kv_layout)
        policy.check_backend(self._entry, backend)
        if jit_args is not None:
            policy.unsupported(self._entry, "jit_args is not served; kernels are compiled by Triton.")
        policy.extra_kwargs(self._entry, extra_kwargs or {})
        if not isinstance(float_workspace_buffer, torch.Tensor):
            policy.refuse(self._entry, "float_workspace_buffer must be a torch.Tensor.")
        policy.check_graph_backend(self._entry, backend, use_cuda_graph, float_workspace_buffer.device)
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._backend_request = backend
        self._plan: Optional[Plan] = None
        self._kept = staging.Kept()  # the device buffer each plan's arrays are copied into (staging.to_device)
        self._graph_bufs: Optional[staging.Captured] = None  # under use_cuda_graph: what the captured graph reads
        self._graph_signature = None
        self._torch_caps: Optional[dict] = None  # backend='torch' under use_cuda_graph (CPU): _checked_torch
        self._caller_bufs: dict = {}
        self._graph_max_qo: Optional[int] = None  # decode's tensor-core route pins it to its rows per request
        # under use_cuda_graph=True: split-KV items in every plan, the partial states in the workspace (decode's
        # tensor-core route, whose batches may be few long requests)
        self._graph_split_kv = False
        self._split_views = None  # ((heads, head dim), split-KV's partial-state views of the workspace)
        self._workspace_bytes = policy.workspace_room(float_workspace_buffer)  # 0: plans stay unsplit
        self._graph_q_rows: Optional[int] = None
        self._held: Optional[routing.Decision] = None  # under use_cuda_graph: the first plan's route
        self._variants = _Variants()  # the plan under forward()'s settings
        self.backend = None
        self.backend_fallback_reason = None

    @property
    def device(self) -> torch.device:
        return self._workspace.device

    def _drop_plans(self) -> None:
        """reset_workspace_buffer: the plan (and its forward() variants) and split-KV's views of the old workspace
        go."""
        self._workspace_bytes = policy.workspace_room(self._workspace)
        self._plan = self._split_views = None
        self._variants = _Variants()

    def _split_bytes(self) -> int:
        """What split-KV's partial states may take of the workspace (policy.workspace_room): all of it, under CUDA
        graphs only where the wrapper splits (_graph_split_kv)."""
        if self._sizing:  # workspace_size: the split that unbounded room gives
            return SIZING_ROOM
        return self._workspace_bytes if not self._use_cuda_graph or self._graph_split_kv else 0

    def _commit(self, plan: Plan, graph_bufs: Optional[staging.Captured] = None) -> None:
        """Installs a validated plan: copies its arrays to the device (into fixed buffers under CUDA graphs).
        graph_bufs: what check_graph_plan returned for this plan (a caller that checked it already), else checked
        here."""
        if self._sizing:
            self._sized_bytes = policy.split_state_bytes(plan.split_rows, plan.num_qo_heads, plan.head_dim)
            return
        if plan.backend != "torch":
            plan = transposed_v(plan, self._use_cuda_graph)
            if self._use_cuda_graph:
                plan = self._install_graph_plan(plan, graph_bufs)
            else:  # copies, never aliases: the caller may reuse its index tensors after plan()
                # the plan is this call's own (make_plan built it): set the device arrays in place; a replace()
                # of this 45-field dataclass cost about 10 us of host time per plan. Absent arrays stay None.
                arrays = {n: t for n in _ARRAYS if (t := getattr(plan, n)) is not None}
                for name, t in staging.to_device(arrays, self.device, self._kept).items():
                    setattr(plan, name, t)
        elif self._use_cuda_graph:
            self._torch_caps = graph_bufs if graph_bufs is not None else self._checked_torch(self._entry + ".plan",
                                                                                             plan)
            self._graph_signature = plan.static_signature()
        if plan.merge_rows is not None:
            key = (plan.num_qo_heads, plan.head_dim)
            if self._split_views is None or self._split_views[0] != key:  # made once: a few us of torch calls
                self._split_views = key, _split_states(self._workspace, plan, self._split_bytes())
            plan.split = self._split_views[1] + (plan.merge_rows,)
        self._plan = plan
        self.backend = plan.backend
        self.backend_fallback_reason = plan.decision.reason if plan.decision is not None else None
        if self._use_cuda_graph and self._held is None:
            self._held = plan.decision  # the first resolution holds: the captured graph reads its buffers

    def _install_graph_plan(self, plan: Plan, bufs: Optional[staging.Captured] = None) -> Plan:
        """Writes the plan's arrays into the buffers a captured graph reads; checks everything first (unless the
        caller passes the buffers check_graph_plan returned for this plan: the cascade wrapper checks every level
        before any commits, and a first plan's check allocates them)."""
        signature = plan.static_signature()
        if bufs is None:
            bufs = self.check_graph_plan(self._entry + ".plan", plan, signature)
        # Every check passed: only now are the captured buffers overwritten (one staged copy: staging.to_buffers).
        arrays = {n: t for n in _ARRAYS if (t := getattr(plan, n)) is not None}
        staging.to_buffers(arrays, bufs)
        self._graph_bufs, self._graph_signature = bufs, signature
        for name in arrays:  # the plan is this call's own (see _commit): set in place, not replace()d
            setattr(plan, name, bufs[name])
        return plan

    def check_graph_plan(self, entry: str, plan: Plan, signature=None) -> staging.Captured:
        """Every refusal installing `plan` under use_cuda_graph=True could raise, raised before any write;
        returns the fixed buffers the plan would be written into (the cascade wrapper checks all its levels
        with this before the first level commits). signature: plan.static_signature(), where the caller has it."""
        if plan.backend == "torch":
            return self._checked_torch(entry, plan, signature)
        if self._graph_bufs is None:
            return self._checked_sizes(entry, plan, staging.Captured(self._allocate_graph_buffers(entry, plan)))
        _check_signature(entry, plan, signature, self._graph_signature)
        if self._graph_q_rows is not None and plan.total_q > self._graph_q_rows:
            policy.refuse(entry, f"under use_cuda_graph=True the re-plan has {plan.total_q} query rows but "
                                 f"the captured q holds {self._graph_q_rows}.")
        return self._checked_sizes(entry, plan, self._graph_bufs)

    @staticmethod
    def _checked_sizes(entry: str, plan: Plan, bufs: staging.Captured) -> staging.Captured:
        _check_capacities(entry, plan, bufs.caps)
        return bufs

    def _checked_torch(self, entry: str, plan: Plan, signature=None) -> dict:
        """backend='torch' under use_cuda_graph=True (the CPU: on CUDA it is refused at construction): nothing is
        captured, but a re-plan keeps the other routes' rules (the first plan's signature; each index array
        within the buffer given at construction, else the first plan's size), so what passes here passes on the
        GPU. Returns the capacities."""
        if self._graph_signature is not None:
            _check_signature(entry, plan, signature, self._graph_signature)
        sizes = _torch_sizes(plan)
        caps = self._torch_caps
        if caps is None:
            caps = {n: self._caller_bufs[n].numel() if self._caller_bufs.get(n) is not None else size
                    for n, size in sizes.items()}
        for name, size in sizes.items():
            check_capacity(entry, name, size, caps.get(name, size))
        return caps

    def _allocate_graph_buffers(self, entry: str, plan: Plan) -> dict:
        """The fixed buffers: the caller's where given, the work list in one of the wrapper's own (sized from the
        workspace: _graph_work_ints), else sized by this plan."""
        ws = self._workspace
        if ws.dtype != torch.uint8 or not ws.is_contiguous() or ws.numel() < 64:
            policy.refuse(entry, f"under use_cuda_graph=True float_workspace_buffer must be a contiguous uint8 "
                                 f"tensor of at least 64 bytes (got {ws.dtype}, {ws.numel()} elements).")
        ints = torch.empty(_graph_work_ints(ws, self._graph_split_kv), dtype=torch.int32, device=self.device)
        bufs = {"num_work": ints[:1], "work": ints[1:]}
        for name in _ARRAYS[2:]:
            given, t = self._caller_bufs.get(name), getattr(plan, name)
            if name in ("merge_rows", "tree_mask") and t is not None:
                # room for every row the wrapper serves (its requests x rows each): a merge row's count and 3 ints
                # each; a tree's ancestor word each (a later plan's trees may be larger than the first's)
                given_qo = self._caller_bufs.get("qo_indptr")
                rows = (given_qo.numel() - 1 if given_qo is not None else 0) * (self._graph_max_qo or 0)
                need, dtype = (1 + 3 * rows, torch.int32) if name == "merge_rows" else (rows, t.dtype)
                bufs[name] = torch.empty(max(staging.size(t), need), dtype=dtype, device=self.device)
            elif given is not None:
                want = torch.uint8 if name == "mask" else torch.int32
                if given.dtype != want or given.device != self.device or given.dim() != 1:
                    policy.refuse(entry, f"the {name} buffer must be a 1-D {want} tensor on {self.device}.")
                bufs[name] = given
            elif t is not None:
                bufs[name] = torch.empty(t.numel(), dtype=t.dtype, device=self.device)
        return bufs

    def _check_run(self, q, k, v, out, lse, return_lse, k_scale, v_scale):
        entry = self._entry + ".run"
        plan = self._plan
        if plan is None:
            policy.refuse(entry, "run() was called before plan().")
        policy.check_tensor(entry, "q", q, (plan.total_q, plan.num_qo_heads, plan.head_dim), plan.q_dtype, plan.device)
        for name, t in (("k", k), ("v", v)):
            if t.dtype != plan.kv_dtype:
                policy.refuse(entry, f"{name} cache has dtype {t.dtype} but the plan declared {plan.kv_dtype}.")
            if t.device != plan.device:
                policy.refuse(entry, f"{name} cache is on {t.device}; expected {plan.device}.")
            if t.stride(-1) != 1:
                policy.refuse(entry, f"{name} must have a contiguous last dimension.")
        if out is not None:
            policy.check_tensor(entry, "out", out, (plan.total_q, plan.num_qo_heads, plan.head_dim), plan.o_dtype,
                                plan.device)
        if lse is not None:
            policy.check_tensor(entry, "lse", lse, (plan.total_q, plan.num_qo_heads), torch.float32, plan.device)
        policy.check_scales(entry, plan.device, plan.sm_scale, k_scale=k_scale, v_scale=v_scale)

    def _descales(self, entry, scale_q, scale_k, scale_v, k_scale, v_scale):
        plan = self._plan
        if scale_q is None and scale_k is None and scale_v is None and plan is not None and \
                plan.q_dtype not in policy.FP8_DTYPES:
            return None  # what check_descales returns for a 16-bit query with no descales
        if plan is None:
            return policy.check_descales(entry, scale_q, scale_k, scale_v, k_scale, v_scale)
        return policy.check_descales(entry, scale_q, scale_k, scale_v, k_scale, v_scale, plan.q_dtype, plan.device,
                                     plan.num_qo_heads, plan.num_kv_heads)

    def _run(self, q, k, v, out, lse, return_lse, k_scale, v_scale, descales=None, checked=False,
             kv_stride_args=None):
        """checked: the plain checks passed q, K/V and out (_plain_run); lse and the scales are checked here."""
        if not checked:
            self._check_run(q, k, v, out, lse, return_lse, k_scale, v_scale)
        else:
            if lse is not None:
                policy.check_tensor(self._entry + ".run", "lse", lse, (self._plan.total_q, self._plan.num_qo_heads),
                                    torch.float32, self._plan.device)
            if k_scale is not None or v_scale is not None:
                policy.check_scales(self._entry + ".run", self._plan.device, self._plan.sm_scale, k_scale=k_scale,
                                    v_scale=v_scale)
        plan = self._plan
        if plan.backend == "cudnn":
            if isinstance(k_scale, torch.Tensor) and k_scale.device.type != "cpu":
                # cuDNN takes the logits' scale as a host float, and reading a device k_scale would wait for the
                # GPU (run() only launches): this call runs our kernel, which reads it on the device (the plan
                # keeps the schedule for it)
                twin = plan.launch_memo.get("triton")
                if twin is None:
                    twin = plan.launch_memo["triton"] = replace(plan, backend="triton")
                plan = twin
            else:
                try:
                    return vendor.prefill(q, k, v, out, lse, return_lse, plan, self._kv_layout, k_scale, v_scale)
                except RuntimeError as exc:  # cuDNN could not build or run this shape: our kernel, from now on
                    plan = self._cudnn_failed(plan, exc)
        if out is None:
            out = torch.empty(q.shape, dtype=plan.o_dtype, device=q.device)
        if lse is None and return_lse:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if plan.backend == "torch":
            torch_impl.prefill(q, k, v, out, lse, plan, self._kv_layout, k_scale, v_scale, descales)
        else:
            if self._use_cuda_graph and self._graph_q_rows is None:
                self._graph_q_rows = plan.total_q
            grid0 = self._grid0(plan)
            if grid0:
                attention_kernel.launch(q, k, v, out, lse, plan, self._kv_layout, grid0, k_scale, v_scale, descales,
                                        gather_ok=not self._use_cuda_graph, kv_stride_args=kv_stride_args,
                                        merge_programs=self._merge_grid0(plan) if self._use_cuda_graph else 0)
        return (out, lse) if return_lse else out

    def _cudnn_failed(self, plan: Plan, exc: BaseException) -> Plan:
        reason = routing.cudnn_failed_at_run()
        if routing.remember_cudnn_failure(plan.device, plan.decision):  # one warning per shape
            routing.log.warning("serveattn on %s: %s (%s: %s)", plan.device, reason, type(exc).__name__,
                                str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        decision = routing.Decision("triton", reasons=plan.decision.reasons + (reason,))
        self._plan = plan = replace(plan, backend="triton", decision=decision)
        self.backend, self.backend_fallback_reason = plan.backend, decision.reason
        return plan

    def _grid0(self, plan: Plan) -> int:
        if not self._use_cuda_graph:
            return plan.num_work_host
        if plan.device.type != "cuda":
            return 4
        return 2 * policy.cuda_properties(plan.device)[1]

    @staticmethod
    def _merge_grid0(plan: Plan) -> int:
        """Under CUDA graphs, split_merge_kernel's programs per query head (fixed at capture, striding over the
        tokens): about four programs an SM in all."""
        if plan.device.type != "cuda":
            return 2
        return -(-4 * policy.cuda_properties(plan.device)[1] // plan.num_qo_heads)

    def _overridden(self, entry, causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
                    rope_theta):
        """The current plan with forward()'s causal mode, positional encoding, window, soft cap and scales, for one
        call (checked as plan() checks them; a custom mask still overrides causal)."""
        key = (bool(causal), pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self._variants.applied(self, entry, key, lambda plan: _plan_with(entry, plan, *key))

    def end_forward(self) -> None:
        """FlashInfer's deprecated end_forward(): nothing to release."""

    def _lse_as(self, entry, lse_base, lse_layout, return_lse, lse, call):
        """FlashInfer's lse_base / lse_layout: the base-2 [rows, heads] LSE the kernels write, returned as natural
        log ("ln") and / or [heads, rows] ("HN", a contiguous copy, into the caller's lse of that layout where
        given). call(lse, return_lse) runs the call with our own layout's buffer. A caller's lse is written in the
        asked base and layout with or without return_lse (as a base-2 NH lse is)."""
        if lse_base not in ("log2", "ln"):
            policy.refuse(entry, f"lse_base={lse_base!r} must be 'log2' (the default) or 'ln'.")
        if lse_layout not in ("NH", "HN"):
            policy.refuse(entry, f"lse_layout={lse_layout!r} must be 'NH' (the default) or 'HN'.")
        plan = self._plan
        if plan is None or (not return_lse and lse is None):
            return call(None, return_lse)
        if lse_layout == "NH":
            out, nh = call(lse, True)
            nh.mul_(LN2)
            return (out, nh) if return_lse else out
        if lse is not None:
            policy.check_tensor(entry, "lse", lse, (plan.num_qo_heads, plan.total_q), torch.float32, plan.device)
            if not lse.is_contiguous():
                policy.refuse(entry, "lse for lse_layout='HN' must be contiguous.")
        out, nh = call(None, True)
        hn = lse if lse is not None else torch.empty(nh.t().shape, dtype=torch.float32, device=nh.device)
        if lse_base == "ln":
            torch.mul(nh.t(), LN2, out=hn)
        else:
            hn.copy_(nh.t())
        return (out, hn) if return_lse else out

    # FlashInfer's deprecated forward() / forward_return_lse() are defined per wrapper: their arguments differ


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapper):
    """Prefill over a paged KV cache (FlashInfer's wrapper of the same name)."""
    _entry = "BatchPrefillWithPagedKVCacheWrapper"
    _table_names = policy.PREFILL_TABLE_NAMES  # the decode wrapper's inner one says indptr, indices, last_page_len

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, **unsupported_kwargs):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, unsupported_kwargs)
        self._caller_bufs = dict(qo_indptr=qo_indptr_buf, kv_indptr=paged_kv_indptr_buf,
                                 kv_indices=paged_kv_indices_buf, last_page_len=paged_kv_last_page_len_buf,
                                 mask=custom_mask_buf, mask_indptr=mask_indptr_buf)
        self._caches = {}  # _cache_views' memo: id(cache) -> (weakref, what the views follow from, the views)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, *positional_rest, seq_lens=None, fixed_split_size=None,
             disable_split_kv=False, **unsupported_kwargs):
        """fixed_split_size / disable_split_kv (FlashInfer's, which vLLM passes for batch-invariant results): chunks
        of that many pages (FlashInfer's unit: page_size tokens each) for every longer request, or no split-KV
        (split_chunk); with either given neither the tiles nor backend='auto''s route follow the batch (make_plan),
        so a request's bits never depend on it.
        seq_lens (FlashInfer's per-request KV lengths for its trtllm-gen and cuDNN backends): the page table decides,
        and a seq_lens given must agree with it (policy.check_seq_lens)."""
        _refuse_extra(self._entry + ".plan", unsupported_kwargs, positional_rest)
        policy.check_seq_lens(self._entry + ".plan", seq_lens, paged_kv_indptr, paged_kv_indices,
                              paged_kv_last_page_len, page_size)
        fixed_split_size, batch_invariant = policy.split_args(self._entry + ".plan", fixed_split_size,
                                                              disable_split_kv, page_size)  # pages -> tokens
        self._plan_paged(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                         num_kv_heads, head_dim_qk, page_size, head_dim_vo, custom_mask, packed_custom_mask, causal,
                         pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
                         q_data_type, kv_data_type, o_data_type, split=(fixed_split_size, disable_split_kv),
                         batch_invariant=batch_invariant)
        self._record_settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                              causal)

    def _plan_paged(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                    num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
                    packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", sm_scale=None, window_left=-1,
                    logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16",
                    kv_data_type=None, o_data_type=None, tree_mask=None, split=(None, False),
                    batch_invariant=False, resolved=False):
        plan = make_plan(
            self._entry + ".plan", paged=True, qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr,
            kv_indices=paged_kv_indices, last_page_len=paged_kv_last_page_len, page_size=page_size,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim_qk, head_dim_vo=head_dim_vo,
            custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, device=self.device,
            backend=self._backend_request, graph_tiles=self._use_cuda_graph,
            graph_max_qo=self._graph_max_qo, graph_split_kv=self._graph_split_kv, tree_mask=tree_mask, held=self._held,
            workspace_bytes=self._split_bytes(), split=split, batch_invariant=batch_invariant,
            table_names=self._table_names, resolved=resolved)
        self._commit(plan)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, scale_q=None, scale_k=None,
            scale_v=None, out=None, lse=None, return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None,
            window_left=None, **unsupported_kwargs):
        """enable_pdl (FlashInfer's launch hint) is accepted and not needed; window_left, if given, must be the
        plan's (as FlashInfer's kernels assert); lse_base / lse_layout: _lse_as; q_scale: policy.fold_q_scale."""
        entry = self._entry + ".run"
        if args:  # FlashInfer 0.7 takes fp8 descales by position here
            scale_q, scale_k, scale_v = positional_descales(entry, "q, paged_kv_cache", q, args, scale_q, scale_k,
                                                            scale_v)
        if q_scale is not None:
            k_scale = policy.fold_q_scale(entry, q_scale, k_scale,
                                          scale_q is not None or scale_k is not None or scale_v is not None)
        if lse_base != "log2" or lse_layout != "NH":
            return self._lse_as(entry, lse_base, lse_layout, return_lse, lse, lambda nh, ret: self.run(
                q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, scale_q=scale_q, scale_k=scale_k,
                scale_v=scale_v, out=out, lse=nh, return_lse=ret, window_left=window_left,
                **unsupported_kwargs))
        if unsupported_kwargs or window_left is not None:
            _run_extras(entry, self._plan, window_left, unsupported_kwargs)
        descales = self._descales(entry, scale_q, scale_k, scale_v, k_scale, v_scale)
        plan = self._plan
        kv = _cache_views(self._caches, paged_kv_cache, self._kv_layout) if paged_kv_cache.__class__ is torch.Tensor \
            else _pair_views(paged_kv_cache, self._kv_layout)
        if plan is not None and kv is not None and _plain_run(plan, q, kv, out, self._kv_layout, plan.total_q):
            return self._run(q, kv[0], kv[1], out, lse, return_lse, k_scale, v_scale, descales, checked=True,
                             kv_stride_args=kv[2])
        # anything the plain checks do not pass: the full checks, which refuse or pass
        k, v = kv[:2] if kv is not None else split_paged_cache(entry, paged_kv_cache, self._kv_layout)
        if plan is not None:
            want = (plan.page_size, plan.num_kv_heads, plan.head_dim) if self._kv_layout == "NHD" else \
                (plan.num_kv_heads, plan.page_size, plan.head_dim)
            for name, t in (("k", k), ("v", v)):
                if t.dim() != 4 or tuple(t.shape[1:]) != want:
                    policy.refuse(entry, f"{name} cache has shape {tuple(t.shape)}; the plan ({self._kv_layout}) "
                                         f"expects [num_pages, {', '.join(map(str, want))}].")
            policy.check_same_pages(entry, k, v)
            if plan.max_page >= k.shape[0]:
                policy.refuse(entry, f"{self._table_names[1]} (given to plan()) refers to page {plan.max_page}, "
                                     f"beyond the cache's {k.shape[0]} pages.")
        return self._run(q, k, v, out, lse, return_lse, k_scale, v_scale, descales)

    run_return_lse = functools.partialmethod(run, return_lse=True)
    begin_forward = plan  # FlashInfer's deprecated name

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """FlashInfer 0.7's: its FA2 backend loads a kernel for K and V of different strides before a graph capture.
        The kernels here take K's and V's strides as separate arguments in every variant, so nothing is loaded; the
        call is checked as FlashInfer checks it (after a plan, variant 'independent'). A K/V pair of new strides may
        still compile on its first run(), which a graph's warm-up run takes outside the capture."""
        entry = self._entry + ".prewarm_paged_kv_stride_variant"
        if variant != "independent":
            policy.refuse(entry, f"variant={variant!r}: the only variant is 'independent' (K and V of different "
                                 f"strides).")
        if self._plan is None:
            policy.refuse(entry, "prewarm_paged_kv_stride_variant() was called before plan().")

    def forward(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                rope_theta=None, return_lse=False):
        """FlashInfer's deprecated run(): its arguments, defaults included, set this call's causal mode, positional
        encoding, window, soft cap and scales, as FlashInfer's forward() does (there they also hold for later
        run() calls; here for this call). use_fp16_qk_reduction permits a less exact sum: it is not needed."""
        with self._overridden(self._entry + ".forward", causal, pos_encoding_mode, window_left, logits_soft_cap,
                              sm_scale, rope_scale, rope_theta):
            return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapper):
    """Prefill over ragged (contiguous, per-request concatenated) K/V (FlashInfer's wrapper of the same name)."""
    _entry = "BatchPrefillWithRaggedKVCacheWrapper"

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None,
                 **unsupported_kwargs):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, unsupported_kwargs)
        self._caller_bufs = dict(qo_indptr=qo_indptr_buf, kv_indptr=kv_indptr_buf, mask=custom_mask_buf,
                                 mask_indptr=mask_indptr_buf)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True,
             *positional_rest, fixed_split_size=None, disable_split_kv=False, **unsupported_kwargs):
        """fixed_split_size / disable_split_kv: as for the paged wrapper's plan(), fixed_split_size in tokens here
        (FlashInfer's ragged planner counts K/V rows as pages of one)."""
        _refuse_extra(self._entry + ".plan", unsupported_kwargs, positional_rest)
        fixed_split_size, batch_invariant = policy.split_args(self._entry + ".plan", fixed_split_size,
                                                              disable_split_kv)
        plan = make_plan(
            self._entry + ".plan", paged=False, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=None,
            last_page_len=None, page_size=1, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim_qk, head_dim_vo=head_dim_vo, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
            rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            device=self.device, backend=self._backend_request, graph_tiles=self._use_cuda_graph,
            graph_max_qo=self._graph_max_qo, graph_split_kv=self._graph_split_kv, held=self._held,
            workspace_bytes=self._split_bytes(), split=(fixed_split_size, disable_split_kv),
            batch_invariant=batch_invariant)
        self._commit(plan)
        self._record_settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                              causal)

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, scale_q=None, scale_k=None, scale_v=None,
            out=None, lse=None, return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None,
            **unsupported_kwargs):
        """enable_pdl (FlashInfer's launch hint) is accepted and not needed; lse_base / lse_layout: _lse_as;
        q_scale: policy.fold_q_scale."""
        entry = self._entry + ".run"
        if args:
            scale_q, scale_k, scale_v = positional_descales(entry, "q, k, v", q, args, scale_q, scale_k, scale_v)
        if q_scale is not None:
            k_scale = policy.fold_q_scale(entry, q_scale, k_scale,
                                          scale_q is not None or scale_k is not None or scale_v is not None)
        if lse_base != "log2" or lse_layout != "NH":
            return self._lse_as(entry, lse_base, lse_layout, return_lse, lse, lambda nh, ret: self.run(
                q, k, v, k_scale=k_scale, v_scale=v_scale, scale_q=scale_q, scale_k=scale_k, scale_v=scale_v,
                out=out, lse=nh, return_lse=ret, **unsupported_kwargs))
        if unsupported_kwargs:
            _run_extras(entry, self._plan, None, unsupported_kwargs)
        descales = self._descales(entry, scale_q, scale_k, scale_v, k_scale, v_scale)
        plan = self._plan
        if plan is not None and _plain_ragged_run(plan, q, k, v, out, self._kv_layout):
            return self._run(q, k, v, out, lse, return_lse, k_scale, v_scale, descales, checked=True)
        policy.check_kv_pair(entry, k, v)
        if plan is not None:
            total_kv = plan.total_kv
            want = (total_kv, plan.num_kv_heads, plan.head_dim) if self._kv_layout == "NHD" else \
                (plan.num_kv_heads, total_kv, plan.head_dim)
            for name, t in (("k", k), ("v", v)):
                if tuple(t.shape) != want:
                    policy.refuse(entry, f"{name} has shape {tuple(t.shape)}; the plan ({self._kv_layout}) "
                                         f"expects {list(want)}.")
        return self._run(q, k, v, out, lse, return_lse, k_scale, v_scale, descales)

    run_return_lse = functools.partialmethod(run, return_lse=True)
    begin_forward = plan  # FlashInfer's deprecated name

    def forward(self, q, k, v, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=-1,
                logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, return_lse=False):
        """FlashInfer's deprecated run(), as BatchPrefillWithPagedKVCacheWrapper.forward (no scales: FlashInfer's
        ragged forward() takes none)."""
        with self._overridden(self._entry + ".forward", causal, pos_encoding_mode, window_left, logits_soft_cap,
                              sm_scale, rope_scale, rope_theta):
            return self.run(q, k, v, return_lse=return_lse)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)


LN2 = math.log(2.0)


def _plan_with(entry: str, plan: Plan, causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
               rope_theta) -> Plan:
    """plan with forward()'s settings (_PrefillWrapper._overridden), checked as make_plan checks them; plan itself
    where they are its own. The cuDNN route's variants take our kernel (its table measured the planned kind)."""
    policy.check_pos_encoding(entry, pos_encoding_mode)
    policy.check_scalars(entry, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                         rope_scale=rope_scale, rope_theta=rope_theta)
    rope = pos_encoding_mode == "ROPE_LLAMA"
    if rope and not plan.rope and (plan.q_dtype in policy.FP8_DTYPES or plan.tree_mask_host is not None):
        policy.unsupported(entry, f"pos_encoding_mode={pos_encoding_mode!r} is not served with an fp8 query or a "
                                  f"tree; apply RoPE before quantizing q and k (or appending K).")
    causal = causal and not plan.has_mask  # a custom mask overrides causal, as at plan()
    if causal and not plan.causal:
        policy.check_causal_lengths(entry, np.diff(plan.qo_indptr_host.numpy()), plan.kv_lens_host.numpy())
    fields = dict(causal=causal, window_left=policy.window(window_left), soft_cap=float(logits_soft_cap or 0.0),
                  rope=rope,
                  sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(plan.head_dim),
                  log2_theta=math.log2(rope_theta if rope_theta is not None else 1e4),
                  rcp_scale=1.0 / (rope_scale if rope_scale is not None else 1.0))
    if all(getattr(plan, name) == value for name, value in fields.items()):
        return plan
    # gathered (the paged cache as ragged rows) holds a ragged copy of the plan's settings: made again if asked
    return replace(plan, **fields, gathered=None, backend="triton" if plan.backend == "cudnn" else plan.backend)


def _run_extras(entry: str, plan, window_left, kwargs: dict) -> None:
    """run()'s keywords beyond ours (FlashInfer's later ones): refused with a sentence, before anything runs, but
    at their no-op values (policy.extra_kwargs)."""
    policy.extra_kwargs(entry, kwargs, "run() argument(s)")
    if window_left is not None and plan is not None and policy.window(window_left) != plan.window_left:
        policy.refuse(entry, f"window_left={window_left!r} given to run() differs from the plan's "
                             f"{plan.window_left}; pass it to plan().")


def positional_descales(entry: str, tensors: str, q, args: tuple, scale_q, scale_k, scale_v):
    """FlashInfer 0.7's run(..., scale_q, scale_k, scale_v) by position, which it reads for an fp8 query only:
    (scale_q, scale_k, scale_v). Anything else after the tensors by position (its JIT variants' extras) is
    refused with a sentence, as are descales given both ways."""
    if q.dtype in policy.FP8_DTYPES and len(args) == 3:
        if scale_q is None and scale_k is None and scale_v is None:
            return args
        policy.refuse(entry, "the fp8 descales were given by position and by keyword; pass them one way.")
    policy.unsupported(entry, f"run() takes {tensors} by position, then FlashInfer 0.7's three fp8 descales (scale_q, "
                              f"scale_k, scale_v) for an fp8 query, and the rest by keyword; got {len(args)} more "
                              f"by position.")


def _refuse_extra(entry: str, kwargs: dict, positional_rest: tuple = ()) -> None:
    if positional_rest:  # FlashInfer's later arguments (prefix_len_ptr, ...) in this place are not ours
        policy.unsupported(entry, f"plan() got {len(positional_rest)} arguments after non_blocking by position; "
                                  f"pass them by keyword.")
    policy.extra_kwargs(entry, kwargs)


# single_prefill_with_kv_cache's workspace (FlashInfer's size for it): a short query over a long KV splits like a
# batch; a plan whose partial states would not fit stays unsplit. Allocated per call, as single decode's is: the
# caching allocator makes that cheap, and calls on different streams never share partial states.
SINGLE_WORKSPACE_BYTES = 32 << 20


class _CallName(str):
    """A single call's name as its inner wrapper's entry: the wrapper's refusals add ".plan" / ".run" to its entry,
    and a caller of single_prefill_with_kv_cache called neither, so the name stays as it is."""

    def __add__(self, suffix):
        return self


def _single_prefill(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode, sm_scale,
                    window_left, logits_soft_cap, rope_scale, rope_theta, backend, return_lse, k_scale, v_scale,
                    entry, o_dtype=None, descales=None):
    policy.check_kv_layout(entry, kv_layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            policy.refuse(entry, f"{name} must be a 3-D tensor, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
    policy.check_kv_pair(entry, k, v)
    if k.shape != v.shape:
        policy.refuse(entry, f"k has shape {tuple(k.shape)} but v has shape {tuple(v.shape)}.")
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    if k.shape[2] != q.shape[2]:
        policy.refuse(entry, f"q has head dim {q.shape[2]} but k has {k.shape[2]}.")
    policy.check_same_device(entry, q.device, k=k, v=v)
    policy.check_backend(entry, backend)  # here, so the refusal names this entry, not the wrapper inside
    workspace = torch.empty(SINGLE_WORKSPACE_BYTES if backend != "torch" else 0, dtype=torch.uint8, device=q.device)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout, backend=backend)
    wrapper._entry = _CallName(entry)
    # a [qo_len, kv_len] mask goes as it is: the plan checks its shape (a transposed one has the same numel)
    wrapper.plan(torch.tensor([0, q.shape[0]], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
                 q.shape[1], num_kv_heads, q.shape[2], custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                 causal=causal, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                 q_data_type=q.dtype, kv_data_type=k.dtype, o_data_type=o_dtype)
    scale_q, scale_k, scale_v = descales or (None, None, None)
    return wrapper.run(q, k, v, k_scale=k_scale, v_scale=v_scale, scale_q=scale_q, scale_k=scale_k, scale_v=scale_v,
                       return_lse=return_lse)


def single_prefill_with_kv_cache(q, k, v, *positional_rest, custom_mask=None, packed_custom_mask=None, causal=False,
                                 kv_layout="NHD", pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                 backend="auto", return_lse=False, k_scale=None, v_scale=None, scale_q=None,
                                 scale_k=None, scale_v=None, o_dtype=None, **unsupported_kwargs):
    """Attention of one request: q [qo_len, Hq, D], k/v [kv_len, Hkv, D] (NHD) or [Hkv, kv_len, D] (HND). The
    arguments after v come by keyword: FlashInfer 0.7 put scale_q, scale_k, scale_v, o_dtype where 0.2 had
    custom_mask, packed_custom_mask, causal."""
    if positional_rest:
        policy.unsupported("single_prefill_with_kv_cache", f"got {len(positional_rest)} arguments after v by "
                                                           f"position; pass them by keyword (their order differs "
                                                           f"between FlashInfer releases).")
    policy.extra_kwargs("single_prefill_with_kv_cache", unsupported_kwargs)
    return _single_prefill(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode, sm_scale,
                           window_left, logits_soft_cap, rope_scale, rope_theta, backend, return_lse, k_scale,
                           v_scale, "single_prefill_with_kv_cache", o_dtype, (scale_q, scale_k, scale_v))


def single_prefill_with_kv_cache_return_lse(q, k, v, *positional_rest, **kwargs):
    """single_prefill_with_kv_cache with return_lse=True (FlashInfer's partial: a return_lse given wins): returns
    (out, lse), lse in base 2."""
    kwargs.setdefault("return_lse", True)
    return single_prefill_with_kv_cache(q, k, v, *positional_rest, **kwargs)
