"""The decode family: QLEN query rows per request (1 for decode, k for chain verify), read at memory
bandwidth, with split-KV.

A program owns one work item (request, KV chunk) for one KV head. Its GROUP_PAD rows are the (draft token,
query head) pairs of that KV group, token-major (padded to at least the 16 rows tensor cores need), so each
K/V tile gathered through the page table is read once for the whole group and every draft token. Draft
token t sits at KV position kv_len - QLEN + t and sees the keys up to it (bottom-right causal). A request
whose KV is cut into several chunks writes fp32 partial outputs and base-2 LSEs into the workspace; the
program that finishes a (request, KV head)'s last chunk folds them in chunk order (`_merge_request`; or
`merge_kernel`, a second launch, when no completion counts are given), so the result is the same bits on every
run.
"""
import os
from typing import Optional

import numpy as np
import triton
import triton.language as tl

from .attention import (LOG2E, _attend, _device_scales, _finish, _present, fits_int32, kv_scale_args,
                        kv_strides)
from .common import K_OPERAND, LAUNCH_OPTIONS, soft_cap_mode, to_dtype, with_8bit_origin
from .launch import Pack
from .sizes import next_pow2


def tile_rows(q_len: int, group: int) -> int:
    """The tile's rows: q_len draft tokens x the KV group's query heads, padded to a power of two >= 16."""
    return max(16, next_pow2(q_len * group))


# Measuring only (scripts/probe_decode_trace.py; results are wrong by design, no LSE is written):
# SERVEATTN_DECODE_TRACE=1 has each program stamp its first work item's timeline into the LSE buffer, read as int64,
# TRACE_SLOTS a program at row kvh + program_id(1) * KV heads: 0 %globaltimer at its start, 1 %clock64 at its start,
# 2 once its item and the work count are in, 3 after the KV loop, 4 after its output (or its partial state and the
# completion count), 5 after the fold (unwritten where it did not fold), 6 %globaltimer at its end, 7 %smid.
TRACE: tl.constexpr = tl.constexpr(os.environ.get("SERVEATTN_DECODE_TRACE", "0") == "1")
TRACE_SLOTS: tl.constexpr = tl.constexpr(8)
_CLOCK: tl.constexpr = tl.constexpr("mov.u64 $0, %clock64;")
_GLOBALTIMER: tl.constexpr = tl.constexpr("mov.u64 $0, %globaltimer;")
_SMID: tl.constexpr = tl.constexpr("{ .reg .u32 t; mov.u32 t, %smid; cvt.u64.u32 $0, t; }")


@triton.jit
def _stamp(LSE, program, slot: tl.constexpr, dep, ASM: tl.constexpr):
    """TRACE: stamp `slot` of `program`, read once the int32 scalar `dep` is there."""
    if TRACE:
        now = tl.inline_asm_elementwise(ASM, "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(LSE.to(tl.pointer_type(tl.int64)) + program * TRACE_SLOTS + slot, now)


@triton.jit
def _stamp_rows(LSE, program, slot: tl.constexpr, dep_rows, ASM: tl.constexpr):
    """TRACE: _stamp once the int32 values `dep_rows` (one a tile row) are there; row 0's clock is kept."""
    if TRACE:
        now = tl.inline_asm_elementwise(ASM, "=l,r", [dep_rows], dtype=tl.int64, is_pure=False, pack=1)
        where = LSE.to(tl.pointer_type(tl.int64)) + program * TRACE_SLOTS + slot + tl.zeros_like(now)
        tl.store(where, now, mask=tl.arange(0, dep_rows.shape[0]) == 0)


# How a split request's chunks are folded (merge_kind): "fused", the decode kernel's last program of a (request, KV
# head) folds its slots x group rows (no merge launch); "heads", merge_kernel a query head a program, the group's
# heads side by side; "kv_heads", merge_kernel a (request, KV head) a program. The fused fold is serial in its rows
# and slots: from 8 rows (group 8, or a chain's drafts x group) and 16 chunks a request its wait outweighs a second
# launch (H100, session 35, bandwidth / tensor-core route: group 8 1 x 16384 1.28 -> 0.90, 4 x 4096 1.00 -> 0.92;
# at 8 chunks (8 x 4096) within 1% either way, at 4 (16 requests) fused 1-3% faster; group 4 at 32 chunks fused
# 3% faster; docs/performance.md; measured with the fold inlined. Re-read with FOLD_CALL below (H100, session 45,
# 1-2 x 8192, 8 x 4096, 32 x 2048, groups 4 / 8, bf16 and fp8): the rule's choice fastest or level everywhere;
# ragged batches not re-read). Each kind's blocking is its own, so its bits are its own (each deterministic).
PER_HEAD_MERGE_MIN_ROWS = 8
PER_HEAD_MERGE_MIN_CHUNKS = 16
# SERVEATTN_DECODE_FUSED_MERGE (measuring only; read once here): "1" always fused, "0" always kv_heads, "heads"
# always heads; unset or "auto": the rule above
MERGE_MODE = os.environ.get("SERVEATTN_DECODE_FUSED_MERGE", "auto")


def merge_kind(group: int, q_len: int, chunks: Optional[np.ndarray]) -> str:
    """The fold of a plan's split requests. chunks: each request's chunk count (0: unsplit), read only where the
    rows allow a merge launch (plan() is paid every step; under CUDA graphs, where the captured launches hold for
    every re-plan, the chunks of a batch that fills the capacity: decode.capacity_chunks); None for
    fixed_split_size (a request's bits must not depend on its batch), so the rows alone decide."""
    forced = {"1": "fused", "0": "kv_heads", "heads": "heads"}.get(MERGE_MODE)
    if forced is not None:
        return forced
    if group * q_len < PER_HEAD_MERGE_MIN_ROWS:
        return "fused"
    if chunks is None:
        return "heads"
    return "heads" if chunks.size and int(np.maximum.reduce(chunks)) >= PER_HEAD_MERGE_MIN_CHUNKS else "fused"


# SERVEATTN_KV_OFFSETS_32 (on by default since session 37; =0 turns it off): K/V element offsets in int32 where the
# whole cache spans under 2^31 elements (attention.fits_int32; the cache, not the plan, so a captured graph holds for
# every re-plan). sm_90 SASS of the KV loop (16,64,2,6): fp8 1169 -> 1112 instructions a block and warp, bf16 962 ->
# 858: the page gather's 64-bit address arithmetic. H200, alternating processes (two rounds each):
# bf16 decode 64x8192 0.503 -> 0.492 ms (4.27 -> 4.36 TB/s), 128x4096 0.503 -> 0.494; fp8 0.317 -> 0.307 and 0.324 ->
# 0.312 ms (fp8/bf16 1.55-1.59 -> 1.58-1.61x); the same bits. Read once at import.
OFF32_ENABLED = os.environ.get("SERVEATTN_KV_OFFSETS_32", "1") == "1"

# SERVEATTN_DECODE_F16_SCORES=1 (measuring only, off by default): under an fp8 cache and a bf16 query, a work item
# whose query tile f16 holds exactly (every value 0 or of magnitude 2^-17 to 65504) takes q.K^T with f16 operands:
# the fp8 K tile widens to f16 in one conversion a pair (F2FP) instead of four (through fp32 to bf16), and the
# products and their fp32 sums are those of the bf16 product on the dequantized cache (exact products of the same
# values; the H100 summed both alike in every reading and GPU test, sessions 38-40). Other tiles take bf16's
# product, a branch a block in the one KV loop (two loops kept two sets of shared buffers: 3 or 2 CTAs an SM, slower
# on the H100). V and P.V are unchanged. sm_90 SASS of the KV loop (16,64,2,6, int32 offsets): 926 instructions a
# block on the f16 branch against 1112; 55.8 KB of shared memory a CTA as without (4 CTAs an SM). With the cache in
# the H100's L2 (session 40, where fp8 decode is compute-bound as on the H200) it reads 1-6% slower at 64x8192 and
# 128x4096, 3-6% faster at 8x4096 and on short caches: off. Read into each plan's launch memo (tests flip the
# attribute between plans).
F16_SCORES = os.environ.get("SERVEATTN_DECODE_F16_SCORES", "0") == "1"

# SERVEATTN_DECODE_Q_HELD=1 (for every cache; fp8 caches take it by default, Q_HELD_FP8 below): q's tensor-core
# operand held in registers over the KV loop. Under K_OPERAND q.K^T reads q at kWidth 4,
# which Triton stages through shared memory and reloads every block (ReorderInstructions sinks a shared -> register
# load with a single user into that user's loop), each 8-byte load then shuffled into the mma's register quads:
# 16 LDS.64 and ~90-120 IMAD.MOV a block. A second user outside the loop (a dot of q with a splat, used only where
# num_work < 0, never) keeps the load out, and q takes an 8-bit origin for both dtypes so that its layout conversion
# moves before that marker into registers. The same operand values in the same k-slots: the same bits. sm_90
# compile (session 41): e4m3 16,64,2,6 loop 1112 -> 1011 instructions, 200 -> 187 registers; bf16 16,64,2,4
# 780 -> 725, 216 -> 255 registers (a few spills outside the loop at groups 1 / 8, chains of 8, page size 1); head
# dim 256 spills, so it stays off there. H100 (session 42,
# docs/runs/2026-12-06T1352-h100-probe-v-halves/), the same bits (its GPU tests): fp8 decode with the cache in the L2
# (the H200's regime) 64x8192 0.2948 / 0.2905 -> 0.2782 / 0.2760 ms, 128x4096 0.2926 / 0.2873 -> 0.2732 / 0.2702;
# on HBM level (bandwidth-bound); bf16 in the L2 2.5% slower, on HBM level. Read into each plan's launch memo.
Q_HELD = os.environ.get("SERVEATTN_DECODE_Q_HELD", "0") == "1"
# Q_HELD for fp8 caches only, on by default since session 44 (SERVEATTN_DECODE_Q_HELD_FP8=0 turns it off): fp8 gains
# where it is compute-bound, bf16 reads slower (255 registers) and keeps the default kernel. The bits are the same
# either way, so an fp8 cache under it stays its dequantized bf16 run's (tests/test_decode.py).
Q_HELD_FP8 = os.environ.get("SERVEATTN_DECODE_Q_HELD_FP8", "1") == "1"

# The fused fold as a called function (noinline), not inlined into the decode kernel (on by default since session
# 44; SERVEATTN_DECODE_FOLD_CALL=0 inlines it, measuring only). Inlined, the fold's values take the kernel to 255
# registers and ptxas squeezes the KV loop that the same kernel runs (sm_90, group 4: bf16 780 -> 848 instructions a
# block and warp, +45 MOV +47 LOP3; e4m3 1011 -> 1050); called, bf16 829, e4m3 1027. The same fold: the same bits.
# H100 (session 44, scripts/probe_decode_ragged.py, docs/runs/2026-12-06T1724-h100-fold-call/): where a split
# request's programs run nearly alone the called fold is 6-23% faster (fp8 ragged 32 requests, one of 29623 keys,
# 0.3555 -> 0.3027 ms at group 4, 0.3579 -> 0.2761 at group 8; bf16 group 8 0.5011 -> 0.4354; fp8 under a CUDA graph
# with 64 requests 0.2806 -> 0.2619), level elsewhere (0.984-1.005; session 45: within 0.5% at 1 x 8192, 8 x 4096,
# 32 x 2048, 64 x 8192). Read at import, into each plan's launch memo.
FOLD_CALL = os.environ.get("SERVEATTN_DECODE_FOLD_CALL", "1") == "1"

# SERVEATTN_DECODE_ONE_ITEM (=0: off, measuring only): where the grid holds a program for every work item (eager
# launches; not a CUDA graph's fixed grid, nor a list past the grid's 65535 programs) the kernel reads its one item
# with no loop over the work list. A called fold inside that loop keeps the loop's state live across the call, and
# ptxas then moves registers around the KV loop too: sm_90, bf16 group 4 (16,64,2,4) 829 instructions a block and
# warp with the fold called in the loop, 769 without the loop (the plain kernel 780 -> 784); the one-request tile
# (16,64,2,7) 863 -> 796; bf16 group 8 760 -> 754; e4m3 under Q_HELD 1027 -> 1037 (234 registers instead of 252).
# The same arithmetic a work item: the same bits. On by default since session 49 (H200, eager, alternating processes:
# e4m3 1x8192 0.0201 -> 0.0186 ms, bf16 and the other split shapes within 1%; docs/performance.md). Read at import,
# into each plan's launch memo.
ONE_ITEM = os.environ.get("SERVEATTN_DECODE_ONE_ITEM", "1") == "1"

# SERVEATTN_DECODE_ITEM_CALL (=0: off, measuring only): where the loop over the work list stays (a CUDA graph's fixed
# grid) and the fused fold is called inside it, each item runs in a called function, whose KV loop then carries
# only its own state (the caller's is saved once an item, around the call). sm_90 SASS, bf16, a KV loop's
# instructions a block and warp: head dim 128 group 4 (16,64,2,4) 829 -> 781, the one-request tile (16,64,2,7)
# 863 -> 816, group 2 798 -> 778, group 8 760 -> 744, chain verify k=4 at group 8 (32,64,4,4) 840 with 5 spill
# reloads -> 821 with none, head dim 64 group 4 488 -> 469. Not taken where it lengthens the loop (item_call): the
# plain kernel (780 -> 805), fp8 caches (e4m3, (16,64,2,6): 1027 -> 1029), one row a KV head (group 1: 746 -> 773),
# head dim 256 (group 4, (16,64,4,3): 968 -> 1024). The same arithmetic an item: the same bits. On by default since
# session 49: H200, bf16 group 4 under CUDA graphs, inlined / called 1.003-1.028 at the split shapes, 1.01-1.14 on
# ragged batches of 32 and 64 requests; group 8 level (docs/runs/2026-12-07T0550-h200-probe-item-call.txt). Read at
# import, into each plan's launch memo.
ITEM_CALL = os.environ.get("SERVEATTN_DECODE_ITEM_CALL", "1") == "1"


def item_call(fused: bool, kv_itemsize: int, head_dim: int, rows: int) -> bool:
    """Whether a looping grid's items run as called functions (ITEM_CALL above): the fused fold, a 16-bit cache, head
    dim up to 128, more than one row (draft tokens x query heads) a KV head."""
    return ITEM_CALL and FOLD_CALL and fused and kv_itemsize == 2 and head_dim <= 128 and rows > 1

# int32 a work item: request, kv lo, kv hi, slot, the request's KV start, KV length, first slot, slot count
ITEM_INTS = 8
ITEM: tl.constexpr = tl.constexpr(ITEM_INTS)


@triton.jit
def _first_item(at):
    """The work item at `at`: (request, kv_lo, kv_hi, slot, KV start, KV length, first slot, slots)."""
    return (tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3), tl.load(at + 4), tl.load(at + 5),
            tl.load(at + 6), tl.load(at + 7))


@triton.jit
def _item(at, later, fallback):
    """The work item at `at` where `later`, else `fallback` (the program's first item, read before the loop)."""
    return (tl.load(at, mask=later, other=fallback[0]), tl.load(at + 1, mask=later, other=fallback[1]),
            tl.load(at + 2, mask=later, other=fallback[2]), tl.load(at + 3, mask=later, other=fallback[3]),
            tl.load(at + 4, mask=later, other=fallback[4]), tl.load(at + 5, mask=later, other=fallback[5]),
            tl.load(at + 6, mask=later, other=fallback[6]), tl.load(at + 7, mask=later, other=fallback[7]))


@triton.jit
def decode_kernel(
    Q, K, V, O, LSE, PART_O, PART_LSE,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ob, stride_oh, stride_lb, stride_lh,
    work, num_work_ptr, kv_indices, done_count,
    qk_scale, sm_scale, soft_cap, window_left, v_scale, k_scale_ptr, v_scale_ptr,
    NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr, RETURN_LSE: tl.constexpr, KV_SAME_STRIDES: tl.constexpr,
    K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr, QLEN: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_SLOTS: tl.constexpr, OFF32: tl.constexpr = False,
    F16_SCORES: tl.constexpr = False, Q_HELD: tl.constexpr = False,
    FOLD_CALL: tl.constexpr = False, ONE_ITEM: tl.constexpr = False, ITEM_CALL: tl.constexpr = False,
):
    # KV heads on the grid's first (fastest) axis: under CUDA graphs the work axis is a fixed size larger than
    # the work list, and CTAs go out in linear order, so the working programs go out first and spread over
    # every SM instead of sharing SMs with the ones that exit at once.
    kvh = tl.program_id(0)
    qk_scale, sm_scale, v_scale = _device_scales(qk_scale, sm_scale, v_scale, k_scale_ptr, v_scale_ptr,
                                                 K_SCALE_PTR, V_SCALE_PTR)
    # A program's first work item is read together with the work count, not after it (the buffer holds an item
    # for every program: eager grids are exact, the CUDA-graph buffer is sized to its grid), and an item carries
    # its request's KV start and length: two DRAM trips fewer before the first K/V tile is asked for.
    w0 = tl.program_id(1)
    item0 = _first_item(work + w0 * ITEM)
    num_work = tl.load(num_work_ptr)
    traced = kvh + w0 * (NUM_QO_HEADS // GROUP)  # TRACE: this program's row of stamps
    _stamp(LSE, traced, 0, kvh, _GLOBALTIMER)
    _stamp(LSE, traced, 1, kvh, _CLOCK)
    _stamp(LSE, traced, 2, item0[0] + num_work + item0[4], _CLOCK)
    if ONE_ITEM:  # an exact grid: a program an item, no loop over the work list (ONE_ITEM above says why)
        if w0 < num_work:
            _decode_item(
                item0, True, kvh, num_work, traced, Q, K, V, O, LSE, PART_O, PART_LSE,
                stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_ob, stride_oh, stride_lb, stride_lh, kv_indices, done_count,
                qk_scale, sm_scale, soft_cap, window_left, v_scale,
                NUM_QO_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_N, PAGE_SIZE, PAGED, HAS_WINDOW, SOFT_CAP, RETURN_LSE,
                KV_SAME_STRIDES, QLEN, FUSED_MERGE, MERGE_ROWS, MERGE_SLOTS, OFF32, F16_SCORES, Q_HELD, FOLD_CALL)
    else:
        for w in range(w0, num_work, tl.num_programs(1)):
            # a later item (a grid smaller than the work list) is read now; it runs in a function of its own where
            # ITEM_CALL takes it (ITEM_CALL above says why)
            (_decode_item_call if ITEM_CALL and not TRACE else _decode_item)(
                _item(work + w * ITEM, w != w0, item0), w == w0, kvh, num_work, traced,
                Q, K, V, O, LSE, PART_O, PART_LSE,
                stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_ob, stride_oh, stride_lb, stride_lh, kv_indices, done_count,
                qk_scale, sm_scale, soft_cap, window_left, v_scale,
                NUM_QO_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_N, PAGE_SIZE, PAGED, HAS_WINDOW, SOFT_CAP, RETURN_LSE,
                KV_SAME_STRIDES, QLEN, FUSED_MERGE, MERGE_ROWS, MERGE_SLOTS, OFF32, F16_SCORES, Q_HELD, FOLD_CALL)
    if TRACE:
        _stamp(LSE, traced, 6, kvh, _GLOBALTIMER)
        _stamp(LSE, traced, 7, kvh, _SMID)


@triton.jit
def _decode_item(
    item, first, kvh, num_work, traced, Q, K, V, O, LSE, PART_O, PART_LSE,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ob, stride_oh, stride_lb, stride_lh, kv_indices, done_count,
    qk_scale, sm_scale, soft_cap, window_left, v_scale,
    NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr, RETURN_LSE: tl.constexpr, KV_SAME_STRIDES: tl.constexpr, QLEN: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_SLOTS: tl.constexpr, OFF32: tl.constexpr,
    F16_SCORES: tl.constexpr, Q_HELD: tl.constexpr, FOLD_CALL: tl.constexpr,
):
    """decode_kernel's work item (request, kv_lo, kv_hi, slot, KV start, KV length, first slot, slots) for KV head
    kvh: slot -1, the request is not split (write the output); kv_base, its first page (or token). first: the
    program's first item (TRACE stamps only that one)."""
    req, lo, hi, slot, kv_base, kv_len, first_slot, num_slots = item
    r = tl.arange(0, GROUP_PAD)
    row_ok = r < QLEN * GROUP
    tok = r // GROUP  # the row's draft token (0 for decode)
    head = kvh * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    # F16_SCORES applies to an fp8 cache under a bf16 query
    FAST_QK: tl.constexpr = F16_SCORES and K.dtype.element_ty.is_fp8() and Q.dtype.element_ty == tl.bfloat16
    hi = tl.minimum(hi, kv_len)
    delta = kv_len - QLEN  # draft token t sits at position delta + t (decode: the last position)
    if HAS_WINDOW:
        lo = tl.maximum(lo, (delta - window_left) // BLOCK_N * BLOCK_N)

    q_tok = req.to(tl.int64) * QLEN + tok  # the row's index in q, out and lse
    q_row = q_tok * stride_qb + head.to(tl.int64) * stride_qh
    q = tl.load(Q + q_row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    HELD: tl.constexpr = Q_HELD and K_OPERAND and HEAD_DIM <= 128  # head dim 256's q spills held (bf16)
    if K_OPERAND and (HELD or not K.dtype.element_ty.is_fp8()):
        # q.K^T on the fp8 tile's k-slots (common.K_OPERAND); under Q_HELD for both dtypes
        q = with_8bit_origin(q, tl.load(Q.to(tl.pointer_type(tl.int8)) + q_row[:, None] + d[None, :],
                                        mask=row_ok[:, None], other=0))
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    if HELD:  # q's operand loaded into registers here, not in the loop (Q_HELD)
        marker = tl.dot(q, tl.full([HEAD_DIM, BLOCK_N], sm_scale, Q.dtype.element_ty))
        m_i = tl.where(num_work < 0, tl.max(marker, 1), m_i)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    use16 = False
    if FAST_QK:
        # F16_SCORES: a query tile that f16 holds exactly takes q.K^T in f16 (the same products and fp32 sums
        # as bf16's; the fp8 K tile widens to f16 in one conversion a pair, not four); any other tile (a
        # value past f16's range or below its precision, a NaN) takes bf16's
        use16 = tl.sum(tl.sum((q.to(tl.float16).to(tl.float32) != q.to(tl.float32)).to(tl.int32), 1), 0) == 0
    for n0 in range(lo, hi, BLOCK_N):  # every block masked: its bounds, a chain's draft keys, any window
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q, n0, K, V, kv_indices, kv_base, hi, kvh,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            tok, row_ok, delta, qk_scale, sm_scale, soft_cap, window_left, K, 0, 0, 0.0, 1.0, V, 0, 0, 0,
            HEAD_DIM, BLOCK_N, PAGE_SIZE, PAGED, True, QLEN > 1, False, HAS_WINDOW, SOFT_CAP, False,
            KV_SAME_STRIDES, False, False, K_IN_OPERAND=K_OPERAND, OFF32=OFF32, SCORES_F16=FAST_QK,
            use16=use16)

    out, lse = _finish(acc, l_i, m_i, v_scale)
    if TRACE:
        if first:
            _stamp_rows(LSE, traced, 3, l_i.to(tl.int32, bitcast=True), _CLOCK)
    if slot >= 0:  # a slot holds QLEN partial rows per query head
        s_row = (slot.to(tl.int64) * QLEN + tok) * NUM_QO_HEADS + head
        tl.store(PART_O + s_row[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])
        tl.store(PART_LSE + s_row, lse, mask=row_ok)
        if FUSED_MERGE:
            # The program that writes a (request, KV head)'s last chunk folds them all, in chunk order (the
            # same bits whichever program finishes last), and resets the count for the next launch. The
            # barrier orders every thread's partial stores before the count's release (CUTLASS's semaphore).
            tl.debug_barrier()
            count = done_count + req * (NUM_QO_HEADS // GROUP) + kvh
            done = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if TRACE:
                if first:
                    _stamp(LSE, traced, 4, done, _CLOCK)
            if done == num_slots - 1:
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
                if FOLD_CALL and not TRACE:  # a called function returns no tensor: traces inline it
                    _merge_request_call(PART_O, PART_LSE, O, LSE, first_slot, num_slots, req, kvh,
                                        stride_ob, stride_oh, stride_lb, stride_lh,
                                        NUM_QO_HEADS, GROUP, MERGE_ROWS, HEAD_DIM, RETURN_LSE, QLEN, MERGE_SLOTS)
                else:
                    folded = _merge_request(PART_O, PART_LSE, O, LSE, first_slot, num_slots, req, kvh,
                                            stride_ob, stride_oh, stride_lb, stride_lh,
                                            NUM_QO_HEADS, GROUP, MERGE_ROWS, HEAD_DIM, RETURN_LSE and not TRACE,
                                            QLEN, MERGE_SLOTS)
                if TRACE:
                    if first:
                        _stamp_rows(LSE, traced, 5, folded.to(tl.int32, bitcast=True), _CLOCK)
    else:
        o_row = q_tok * stride_ob + head.to(tl.int64) * stride_oh
        tl.store(O + o_row[:, None] + d[None, :], to_dtype(out, O.dtype.element_ty), mask=row_ok[:, None])
        if RETURN_LSE and not TRACE:
            tl.store(LSE + q_tok * stride_lb + head.to(tl.int64) * stride_lh, lse, mask=row_ok)
        if TRACE:
            if first:
                _stamp_rows(LSE, traced, 4, lse.to(tl.int32, bitcast=True), _CLOCK)


# _decode_item as a called function (ITEM_CALL): its KV loop's registers are its own
_decode_item_call = triton.jit(noinline=True)(_decode_item.fn)


def merge_slots(rows: int, head_dim: int) -> int:
    """Partial states a merge folds per load: its loop's loads are not pipelined (Triton 3.6 pipelines the
    loads that feed a dot), so each trip is one round trip to L2, and a block of slots per trip cuts the trips;
    the block holds about 8K fp32 values (64 registers a thread at merge_kernel's 4 warps)."""
    return max(1, min(16, 8192 // (rows * head_dim)))


@triton.jit
def _merge_request(PART_O, PART_LSE, O, LSE, first, n, req, kvh, stride_ob, stride_oh, stride_lb, stride_lh,
                   NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   RETURN_LSE: tl.constexpr, QLEN: tl.constexpr, SLOTS: tl.constexpr):
    """Folds the n partial states from slot `first` of request req, KV head kvh (fixed order and blocking, so
    bitwise repeatable), SLOTS chunks per load, each block's outputs weighted by exp2(lse - the running max) and the
    sum so far rescaled when the max grows (one trip to L2 a block; a max over all chunks first was one more).
    ROWS: the (draft token, query head) rows padded to a power of two (no tensor cores here: no 16-row floor). The
    loads bypass L1 (.cg): another program may have written these slots."""
    r = tl.arange(0, ROWS)
    row_ok = r < QLEN * GROUP
    tok = r // GROUP
    head = kvh * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, SLOTS)
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, n, SLOTS):
        ok = ((s0 + j) < n)[:, None] & row_ok[None, :]
        s_row = (((first + s0 + j)[:, None] * QLEN + tok[None, :]) * NUM_QO_HEADS + head[None, :]).to(tl.int64)
        lse = tl.load(PART_LSE + s_row, mask=ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(PART_O + s_row[:, :, None] * HEAD_DIM + d[None, None, :], mask=ok[:, :, None], other=0.0,
                       cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row no chunk saw: every weight 0
        alpha = tl.exp2(m - m_safe)  # 0 while m is -inf
        w = tl.exp2(lse - m_safe[None, :])  # an empty chunk weighs 0
        acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    out, lse = _finish(acc, total, m, 1.0)
    q_tok = req.to(tl.int64) * QLEN + tok
    o_row = q_tok * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(O + o_row[:, None] + d[None, :], to_dtype(out, O.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        tl.store(LSE + q_tok * stride_lb + head.to(tl.int64) * stride_lh, lse, mask=row_ok)
    return lse  # the fold's last value (a trace stamps after it)


@triton.jit(noinline=True)
def _merge_request_call(PART_O, PART_LSE, O, LSE, first, n, req, kvh, stride_ob, stride_oh, stride_lb, stride_lh,
                        NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                        HEAD_DIM: tl.constexpr, RETURN_LSE: tl.constexpr, QLEN: tl.constexpr, SLOTS: tl.constexpr):
    """_merge_request as a called function (FOLD_CALL): its registers are its own, not the KV loop's."""
    _merge_request(PART_O, PART_LSE, O, LSE, first, n, req, kvh, stride_ob, stride_oh, stride_lb, stride_lh,
                   NUM_QO_HEADS, GROUP, ROWS, HEAD_DIM, RETURN_LSE, QLEN, SLOTS)


@triton.jit
def merge_kernel(
    PART_O, PART_LSE, O, LSE, req_first_slot, req_num_slots,
    stride_ob, stride_oh, stride_lb, stride_lh,
    NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    RETURN_LSE: tl.constexpr, QLEN: tl.constexpr, SLOTS: tl.constexpr,
):
    """One program per (request, KV head): folds a split request's partial states (_merge_request). Under
    a plan's merge "heads" the second axis is the query head, launched with GROUP 1 and one row per draft token."""
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    n = tl.load(req_num_slots + req)
    if n > 0:
        _merge_request(PART_O, PART_LSE, O, LSE, tl.load(req_first_slot + req), n, req, kvh,
                       stride_ob, stride_oh, stride_lb, stride_lh,
                       NUM_QO_HEADS, GROUP, ROWS, HEAD_DIM, RETURN_LSE and not TRACE, QLEN, SLOTS)


def launch(q, k, v, out, lse, plan, kv_layout: str, grid0: int, merge_rows: int, k_scale=None, v_scale=None,
           done_count=None, kv_stride_args=None, exact_grid: bool = False):
    """Decode launch, and the merge launch when the plan splits any request, unless done_count (int32 zeros, one
    per request and KV head, left zero by every launch) lets the decode kernel fold each split request itself.
    kv_stride_args: kv_strides of k, the same for v (a caller that keeps them per cache), else read here.
    exact_grid: grid0 is the plan's work count (an eager launch), not a fixed grid that later plans reuse."""
    ks, ks_ptr, ks_dev, vs, vs_ptr, vs_dev = kv_scale_args(k_scale, v_scale, plan.work)
    if kv_stride_args is None:
        sk = kv_strides(k, kv_layout, plan.paged)
        sv = kv_strides(v, kv_layout, plan.paged)
        off32 = OFF32_ENABLED and fits_int32(k) and fits_int32(v)
    else:  # views of one shape and strides (the wrappers' _cache_views / _pair_views): one span for both
        sk = sv = kv_stride_args
        off32 = OFF32_ENABLED and fits_int32(k)
    lse_arg = lse if lse is not None else out
    slb, slh = lse.stride()[:2] if lse is not None else (0, 0)
    fused = plan.merge == "fused" and bool(merge_rows)
    assert done_count is not None or not fused, "a fused fold needs the wrapper's completion counts"
    # what follows from the plan and this call's kind alone is made once per plan (run() is paid every step)
    kind = (fused, lse is not None, ks_dev, vs_dev, sk == sv, off32, exact_grid and grid0 <= 65535)
    memo = plan.launch_memo.get(kind)
    if memo is None:
        memo = plan.launch_memo[kind] = _launch_memo(plan, *kind)
    plan_args, kwargs, merge_kwargs, packs = memo
    sq, so = q.stride(), out.stride()
    args = (q, k, v, out, lse_arg, plan.part_o, plan.part_lse,
            sq[0], sq[1], *sk, *sv, so[0], so[1], slb, slh,
            *plan_args, done_count if fused else plan.work,
            plan.sm_scale * ks * LOG2E, plan.sm_scale * ks, plan.soft_cap, plan.window_left, vs, ks_ptr, vs_ptr)
    if not packs:  # the plan's own arguments keyed once (launch.Pack): made at the first call of this kind
        packs.append(Pack(decode_kernel, args, kwargs, _fixed_positions(len(plan_args), ks_dev, vs_dev)))
    # the grid's second axis holds at most 65535 programs; they stride over any longer work list
    packs[0]((plan.num_kv_heads, min(grid0, 65535)), *args)
    if merge_rows and not fused:
        merge_args = _merge_args(plan, out, lse_arg, slb, slh)
        if len(packs) == 1:  # made only where a merge launches (a plan is made every step: a Pack is ~10 us)
            packs.append(Pack(merge_kernel, merge_args, merge_kwargs, (0, 1, 4, 5)))
        packs[1]((merge_rows, plan.num_qo_heads if plan.merge == "heads" else plan.num_kv_heads), *merge_args)


def _merge_args(plan, out, lse_arg, slb, slh):
    return (plan.part_o, plan.part_lse, out, lse_arg, plan.req_first_slot, plan.req_num_slots,
            out.stride(0), out.stride(1), slb, slh)


def _fixed_positions(num_plan_args: int, ks_dev: bool, vs_dev: bool):
    """Positions of decode_kernel's arguments that are the plan's own objects at every call of one kind (launch's
    argument order): part_o, part_lse, the schedule arrays and work / done_count, soft_cap and window_left, and the
    scale pointers when they are the placeholder."""
    first_plan_arg = 19  # q, k, v, out, lse, part_o, part_lse, 2 + 3 + 3 + 2 + 2 strides
    work = first_plan_arg + num_plan_args
    fixed = [5, 6, *range(first_plan_arg, work + 1), work + 3, work + 4]
    if not ks_dev:
        fixed.append(work + 6)
    if not vs_dev:
        fixed.append(work + 7)
    return tuple(fixed)


def _launch_memo(plan, fused: bool, return_lse: bool, ks_dev: bool, vs_dev: bool, kv_same_strides: bool,
                 off32: bool, item_per_program: bool):
    """(the plan's schedule arguments, decode_kernel's keywords, merge_kernel's keywords) for one kind of call."""
    group_pad = tile_rows(plan.q_len, plan.group)
    merge_rows_pad = next_pow2(plan.q_len * plan.group)
    (kv_indices,) = _present(plan.work, plan.kv_indices)
    plan_args = (plan.work, plan.num_work, kv_indices)
    kwargs = dict(
        NUM_QO_HEADS=plan.num_qo_heads, GROUP=plan.group, GROUP_PAD=group_pad, HEAD_DIM=plan.head_dim,
        BLOCK_N=plan.tiles.block_n, PAGE_SIZE=plan.page_size, PAGED=plan.paged,
        HAS_WINDOW=plan.window_left >= 0, SOFT_CAP=soft_cap_mode(plan.soft_cap), RETURN_LSE=return_lse,
        KV_SAME_STRIDES=kv_same_strides, K_SCALE_PTR=ks_dev, V_SCALE_PTR=vs_dev, QLEN=plan.q_len,
        FUSED_MERGE=fused, MERGE_ROWS=merge_rows_pad, OFF32=off32, F16_SCORES=F16_SCORES,
        Q_HELD=Q_HELD or (Q_HELD_FP8 and plan.kv_dtype.itemsize == 1),
        FOLD_CALL=FOLD_CALL and fused, ONE_ITEM=ONE_ITEM and item_per_program,
        # where the loop over the work list runs
        ITEM_CALL=not (ONE_ITEM and item_per_program) and item_call(fused, plan.kv_dtype.itemsize, plan.head_dim,
                                                                   plan.q_len * plan.group),
        # the merge kernel's blocking, so the fold is the same arithmetic in both (its 4-warp register budget fits
        # 2 warps too once the KV loop's registers are free: sm_90 SASS spills only a few loop-invariant values,
        # outside the loop)
        MERGE_SLOTS=merge_slots(merge_rows_pad, plan.head_dim) if fused else 1,
        num_warps=plan.tiles.num_warps,
        num_stages=plan.tiles.num_stages, **LAUNCH_OPTIONS,
    )
    merge_group, merge_rows = (1, next_pow2(plan.q_len)) if plan.merge == "heads" else (plan.group, merge_rows_pad)
    merge_kwargs = dict(
        NUM_QO_HEADS=plan.num_qo_heads, GROUP=merge_group, ROWS=merge_rows, HEAD_DIM=plan.head_dim,
        RETURN_LSE=return_lse, QLEN=plan.q_len, SLOTS=merge_slots(merge_rows, plan.head_dim),
        num_warps=4, **LAUNCH_OPTIONS,
    )
    return plan_args, kwargs, merge_kwargs, []  # launch.Packs, made at the first call
