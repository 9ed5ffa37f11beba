"""The prefill kernel family: one Triton kernel for single, ragged and paged prefill.

A program owns one work item (request, query tile) for one KV head. The tile's BLOCK_M rows are
(query token, query head) pairs of that KV head's group, token-major, so each K/V tile loaded from
memory serves every query head of the group. Keys are walked in BLOCK_N blocks with an online
softmax in base 2; blocks that no mask can touch take an unmasked path.

The grid's first axis may be smaller than the work list (CUDA graphs fix the grid): programs then
stride over the work items.
"""
import functools
import os
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

try:  # Gluon's Hopper API as Triton 3.6 has it; older Tritons get prefill_kernel for everything
    from . import attention_ws
except (ImportError, AttributeError):
    attention_ws = None
from . import gather, replay
from .. import knobs
from .common import (EARLY_V, FP8_KEY_ORDER, LAUNCH_OPTIONS, ROWSUM_MMA, ROWSUM_N, SOFTMAX_FMA, mma, narrow,
                     soft_cap_mode, to_dtype, vt_column, widen, widen_in_operand)
from .launch import Pack, launch as launch_jit

LOG2E = 1.4426950408889634
VT_BLOCK_N = 64  # keys per transpose_v_kernel program
P_SCALE: tl.constexpr = tl.constexpr(256.0)  # fp8 attention: P * 256 <= 256 fits e4m3 (448)
LOG2_P_SCALE: tl.constexpr = tl.constexpr(8.0)
# A paged cache is copied into ragged rows for the warp-specialized kernel only while the temporary (K and V)
# stays this small. A 16-bit cache only when the copy (COPY_BYTES_PER_S) costs less than GATHER_GAIN of the
# attention (MATRIX_FLOPS), i.e. when (query rows a key meets on average) x group > 300 / GATHER_GAIN. On the H200
# (session 14, docs/runs/2026-12-03T2040-probe-gather-ab*.txt, GQA 4) pages read in place beat the copy at
# 16 x 2048 causal (481 vs 470 TFLOP/s; 1024 rows a key x 4 = 4096), tie at 1 x 4096 (8192), lose at 1 x 8192 and
# 1 x 16384 (-3 to -6%; 16384, 32768): 0.06 puts the line at 5000.
GATHER_MAX_BYTES = 256 << 20
GATHER_GAIN = 0.06
MATRIX_FLOPS = 450e12
COPY_BYTES_PER_S = 3.0e12  # the copy's read + write rate (the H200 copies at up to 4.27 TB/s)


@triton.jit
def _kv_offsets(kv_indices, kv_base, n, n_ok, kvh, stride_p, stride_s, stride_h,
                PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, OFF32: tl.constexpr = False):
    """int64 element offsets of the rows of keys n for KV head kvh; int32 under OFF32 (the launch checked that every
    element of the cache lies within 2^31 - 1 of its start: fits_int32), fewer address instructions."""
    WIDE: tl.constexpr = tl.int32 if OFF32 else tl.int64
    if PAGED:
        page = tl.load(kv_indices + kv_base + n // PAGE_SIZE, mask=n_ok, other=0)
        off = page.to(WIDE) * stride_p + (n % PAGE_SIZE).to(WIDE) * stride_s
    else:
        off = (kv_base + n).to(WIDE) * stride_p
    return off + kvh.to(WIDE) * stride_h


def fits_int32(t) -> bool:
    """Whether every element of the K or V view t lies within 2^31 - 1 elements of its first: int32 offsets then
    never overflow (_kv_offsets' OFF32). Read from the whole cache, not a plan's pages, so a CUDA graph captured
    with it stays right for any later plan over the same cache. Asked every run(): kept per shape and strides."""
    return _spans_int32(t.shape, t.stride())


# SERVEATTN_PREFILL_KV_OFFSETS_32 (on by default since session 39; =0 turns it off): prefill_kernel (head dim 256,
# trees, RoPE, fp8 attention's fallback) addresses K/V with int32 offsets where the cache fits (fits_int32), as the
# decode kernel does, for tiles of at least SERVEATTN_PREFILL_KV_OFFSETS_32_MIN_ROWS (64) query rows. sm_90 SASS of
# the KV loops, bf16, 64,64,4,2: unmasked / masked 522 / 699 -> 423 / 592 instructions a block. H100, session 39:
# prefill 6-9% faster (head dim 128 and 256, bf16 and fp8 caches); the tensor-core decode route's 16-row tiles
# (16,128,4,2) 3% (bf16) and 13% (fp8) slower in int32 at 64x8192, even at 8x4096, though their loop is shorter (fp8
# 951 / 1189 -> 911 / 1064 instructions) and takes fewer registers, so they keep int64. Read into each launch's
# keywords (tests flip the attributes).
PREFILL_OFF32 = os.environ.get("SERVEATTN_PREFILL_KV_OFFSETS_32", "1") == "1"
PREFILL_OFF32_MIN_ROWS = int(os.environ.get("SERVEATTN_PREFILL_KV_OFFSETS_32_MIN_ROWS", "64"))


@functools.lru_cache(maxsize=256)
def _spans_int32(shape, strides) -> bool:
    return sum((size - 1) * abs(stride) for size, stride in zip(shape, strides)) < 2 ** 31  # the last: 2^31 - 1


@triton.jit
def _request_kv(kv_indptr, last_page_len, req, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """(first page or token, kv_len) of request req, from the page table (or ragged indptr)."""
    kv_base = tl.load(kv_indptr + req)
    if PAGED:
        num_pages = tl.load(kv_indptr + req + 1) - kv_base
        kv_len = tl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + tl.load(last_page_len + req), 0)
    else:
        kv_len = tl.load(kv_indptr + req + 1) - kv_base
    return kv_base, kv_len


@triton.jit
def _finish(acc, l_i, m_i, v_scale):
    """Normalised output and base-2 LSE; rows that saw no key give 0 and -inf."""
    empty = l_i == 0.0
    out = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    return out, lse


@triton.jit
def _device_scales(qk_scale, sm_scale, v_scale, k_scale_ptr, v_scale_ptr, K_SCALE_PTR: tl.constexpr,
                   V_SCALE_PTR: tl.constexpr):
    """Folds k_scale / v_scale given as one-element device tensors (read here, so a captured CUDA graph
    follows their current values) into the logit and output scales."""
    if K_SCALE_PTR:
        k_scale = tl.load(k_scale_ptr)
        qk_scale = qk_scale * k_scale
        sm_scale = sm_scale * k_scale
    if V_SCALE_PTR:
        v_scale = v_scale * tl.load(v_scale_ptr)
    return qk_scale, sm_scale, v_scale


@triton.jit
def _rope_cos_sin(pos, log2_theta, rcp_scale, HALF: tl.constexpr):
    """cos/sin [len(pos), HALF] of LLaMA RoPE angles pos * rcp_scale * theta^(-2i/D)."""
    i = tl.arange(0, HALF).to(tl.float32)
    freq = rcp_scale * tl.exp2(-(i / HALF) * log2_theta)
    angle = pos.to(tl.float32)[:, None] * freq[None, :]
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _widen_k(k, dtype: tl.constexpr, K_IN_OPERAND: tl.constexpr):
    """A loaded K tile in dtype for q.K^T: an fp8 tile dequantized exactly (inside the dot operand under
    K_IN_OPERAND), a 16-bit tile untouched."""
    if K_IN_OPERAND and k.dtype.is_fp8():
        return widen_in_operand(k, dtype)
    else:
        return widen(k, dtype)


@triton.jit
def _attend(acc, l_i, m_i, q, q2, n0, K, V, kv_indices, kv_base, kv_len, kvh,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            tok, row_ok, delta, qk_scale, sm_scale, soft_cap, window_left,
            mask_ptr, mask_bit0, tree_bits, log2_theta, rcp_scale, VT, vt_base, vt_stride_h, vt_stride_d,
            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            PAGED: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
            HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
            ROPE: tl.constexpr, KV_SAME_STRIDES: tl.constexpr, TREE: tl.constexpr, V_T: tl.constexpr,
            K_IN_OPERAND: tl.constexpr = False, OFF32: tl.constexpr = False, SCORES_F16: tl.constexpr = False,
            use16=False):
    """One BLOCK_N block of keys starting at n0 folded into the running (acc, l_i, m_i).

    K_IN_OPERAND (the decode kernel under common.K_OPERAND): an fp8 K tile is widened inside the dot operand
    (widen_in_operand), q coming with the matching layout. OFF32: int32 K/V offsets (_kv_offsets).
    SCORES_F16 (the decode kernel's F16_SCORES, an fp8 cache under a bf16 query): where use16 (f16 holds the query
    tile exactly) q.K^T takes the tile and the fp8 K tile in f16; else as without. One loop for both (a branch a
    block, uniform over the program): two loops kept two sets of shared buffers.

    V_T: V is read from VT, the request's values transposed ([kv head, dim, token], keys contiguous, written by
    transpose_v_kernel), so an fp8 V tile reaches the second product's K-major operand by async copies."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < kv_len
    k_off = _kv_offsets(kv_indices, kv_base, n, n_ok, kvh, stride_kp, stride_ks, stride_kh, PAGE_SIZE, PAGED, OFF32)
    if KV_SAME_STRIDES:  # one page-table gather serves K and V
        v_off = k_off
    else:
        v_off = _kv_offsets(kv_indices, kv_base, n, n_ok, kvh, stride_vp, stride_vs, stride_vh, PAGE_SIZE, PAGED,
                            OFF32)
    dtype = q.dtype
    # An fp8 V tile feeds the second product transposed (fp8 wgmma reads B K-major only), so Triton cannot
    # stream it into shared memory with async copies; issuing its load before the first product hides the
    # global latency behind QK^T and the softmax.
    EARLY: tl.constexpr = EARLY_V and V.dtype.element_ty.is_fp8() and dtype.is_fp8() and not V_T
    dv = tl.arange(0, HEAD_DIM)
    if EARLY:
        if MASKED:
            v_raw = tl.load(V + v_off[:, None] + dv[None, :], mask=n_ok[:, None], other=0.0)
        else:
            v_raw = tl.load(V + v_off[:, None] + dv[None, :])
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        dh = tl.arange(0, HALF)
        if MASKED:
            k1 = widen(tl.load(K + k_off[:, None] + dh[None, :], mask=n_ok[:, None], other=0.0), dtype).to(tl.float32)
            k2 = widen(tl.load(K + k_off[:, None] + HALF + dh[None, :], mask=n_ok[:, None], other=0.0),
                       dtype).to(tl.float32)
        else:
            k1 = widen(tl.load(K + k_off[:, None] + dh[None, :]), dtype).to(tl.float32)
            k2 = widen(tl.load(K + k_off[:, None] + HALF + dh[None, :]), dtype).to(tl.float32)
        cos, sin = _rope_cos_sin(n, log2_theta, rcp_scale, HALF)
        k1r = to_dtype(k1 * cos - k2 * sin, dtype)
        k2r = to_dtype(k2 * cos + k1 * sin, dtype)
        s = mma(q, tl.trans(k1r), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32))
        s = mma(q2, tl.trans(k2r), s)
    else:
        d = tl.arange(0, HEAD_DIM)
        if MASKED:
            k = tl.load(K + k_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(K + k_off[:, None] + d[None, :])
        s0 = tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32)
        if SCORES_F16:
            if use16:
                # the f16 copy made in the loop (a select on n0 keeps it there): its shared buffer then lives
                # within a block, beside V's round trip; hoisted out of the loop it took 4 KB a CTA more (59.9 KB:
                # 3 CTAs an SM instead of 4) for ~11 instructions a block less
                s = mma(tl.where(n0 >= 0, q, 0.0).to(tl.float16), tl.trans(_widen_k(k, tl.float16, K_IN_OPERAND)), s0)
            else:
                s = mma(q, tl.trans(_widen_k(k, dtype, K_IN_OPERAND)), s0)
        else:
            s = mma(q, tl.trans(_widen_k(k, dtype, K_IN_OPERAND)), s0)
    if SOFT_CAP:
        # c * tanh(y / c) with tanh(t) = 1 - 2 / (exp(2t) + 1): exact limits at +-inf. Near 0 that form cancels
        # (~1e-7 absolute, so ~1e-7 * c on the logit: harmless for real caps, but a cap of 1e8 flattened every
        # logit); above SERIES_CAP (common.soft_cap_mode: 2) |t| < 1/8 takes tanh's series to t^7 (the next
        # term, 62/2835 t^9, is under 2^-28 of t there), at ~7 instructions a score.
        t = s * (sm_scale / soft_cap)
        tanh = 1.0 - 2.0 / (tl.exp2(t * (2.0 * 1.4426950408889634)) + 1.0)
        if SOFT_CAP == 2:
            t2 = t * t
            series = t * (1.0 + t2 * (-0.3333333333333333 + t2 * (0.13333333333333333 + t2 * -0.05396825396825397)))
            tanh = tl.where(tl.abs(t) < 0.125, series, tanh)
        x = soft_cap * tanh * 1.4426950408889634
    elif SOFTMAX_FMA:
        x = s  # scaled inside the fma below
    else:
        x = s * qk_scale
    if MASKED:
        visible = n_ok[None, :] & row_ok[:, None]
        if HAS_MASK:
            bit = mask_bit0 + tok[:, None].to(tl.int64) * kv_len + n[None, :]
            byte = tl.load(mask_ptr + bit // 8, mask=visible, other=0)
            visible = visible & (((byte.to(tl.int32) >> (bit % 8).to(tl.int32)) & 1) != 0)
        elif CAUSAL:
            visible = visible & (n[None, :] <= (delta + tok)[:, None])
            if TREE:  # a draft token sees the prefix, its ancestors and itself (bit j: draft token j)
                rel = n[None, :] - delta
                shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)  # causal keeps the visible ones < 64
                visible = visible & ((rel < 0) | (((tree_bits[:, None] >> shift) & 1) != 0))
        if HAS_WINDOW:
            visible = visible & (n[None, :] >= (delta + tok - window_left)[:, None])
        x = tl.where(visible, x, float("-inf"))
    FMA: tl.constexpr = SOFTMAX_FMA and not SOFT_CAP
    if FMA:  # qk_scale is a scalar or, for fp8 attention's per-head descales, a [rows, 1] column
        m_new = tl.maximum(m_i, tl.max(tl.max(x, 1, keep_dims=True) * qk_scale, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(x, 1))
    # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # fp8 attention under FMA: P_SCALE folded into the exponent (exp2(y + 8) = 256 exp2(y)), so P comes out
    # scaled for the fp8 product and only the row sum is scaled back, once a row, exactly (a power of two)
    FOLD: tl.constexpr = FMA and dtype.is_fp8()
    if FOLD:
        p = tl.exp2(tl.fma(x, qk_scale, (-m_safe + LOG2_P_SCALE)[:, None]))
    elif FMA:
        p = tl.exp2(tl.fma(x, qk_scale, -m_safe[:, None]))
    else:
        p = tl.exp2(x - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    ROWSUM: tl.constexpr = ROWSUM_MMA and dtype.is_fp8()  # l is P x ones, below (common.ROWSUM_MMA)
    if ROWSUM:
        pass
    elif FOLD:
        l_i = l_i * alpha + tl.sum(p, 1) * (1.0 / P_SCALE)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    if V_T:
        vt = VT + kvh.to(tl.int64) * vt_stride_h + dv[:, None].to(tl.int64) * vt_stride_d + \
            (vt_base + vt_column(n))[None, :]
        v = tl.trans(tl.load(vt))  # unmasked (so it streams): keys past kv_len are zeros up to the block's end
    elif EARLY:
        v = v_raw
    elif MASKED:
        v = tl.load(V + v_off[:, None] + dv[None, :], mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(V + v_off[:, None] + dv[None, :])
    v = widen(v, dtype)
    if v.dtype.is_fp8():
        # fp8 attention: P (in [0, 1]) is scaled by P_SCALE into e4m3's normal range and rounded to e4m3 (3
        # mantissa bits, also over an e5m2 V: the tensor cores take mixed fp8 operands) for the second
        # product; the row sums l_i stay in fp32, and _finish divides P_SCALE out.
        p_op = narrow(p if FOLD else p * P_SCALE, tl.float8e4nv)
    else:
        p_op = to_dtype(p, v.dtype)
    acc = mma(p_op, v, acc * alpha[:, None])
    if ROWSUM:  # [rows, ROWSUM_N], every column the row's sum of P * P_SCALE in f16
        ones = tl.full([BLOCK_N, ROWSUM_N], 1.0, tl.float16)
        l_i = mma(to_dtype(p if FOLD else p * P_SCALE, tl.float16), ones, l_i * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def prefill_kernel(
    Q, K, V, O, LSE,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    work, num_work_ptr, qo_indptr, kv_indptr, kv_indices, last_page_len,
    mask_ptr, mask_indptr, tree_mask,
    qk_scale, sm_scale, soft_cap, window_left, log2_theta, rcp_scale, v_scale, k_scale_ptr, v_scale_ptr,
    q_descale, k_descale, v_descale, q_descale_stride, kv_descale_stride,
    VT, kv_tok_indptr, vt_stride_h, vt_stride_d, PART_O, PART_LSE,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, ROPE: tl.constexpr, RETURN_LSE: tl.constexpr,
    KV_SAME_STRIDES: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr, FP8_QKV: tl.constexpr,
    TREE: tl.constexpr, V_T: tl.constexpr, SPLIT_KV: tl.constexpr, OFF32: tl.constexpr = False,
):
    kvh = tl.program_id(1)
    num_work = tl.load(num_work_ptr)
    qk_scale, sm_scale, v_scale = _device_scales(qk_scale, sm_scale, v_scale, k_scale_ptr, v_scale_ptr,
                                                 K_SCALE_PTR, V_SCALE_PTR)
    # split-KV: an item is (request, tile, first key, end key, first partial row, partial row stride), see
    # prefill.build_split_work; a request cut into chunks writes fp32 partial states that split_merge_kernel folds
    ITEM: tl.constexpr = 6 if SPLIT_KV else 2
    for w in range(tl.program_id(0), num_work, tl.num_programs(0)):
        req = tl.load(work + ITEM * w)
        tile = tl.load(work + ITEM * w + 1)
        q_start = tl.load(qo_indptr + req)
        qo_len = tl.load(qo_indptr + req + 1) - q_start
        kv_base, kv_len = _request_kv(kv_indptr, last_page_len, req, PAGE_SIZE, PAGED)
        delta = kv_len - qo_len  # bottom-right alignment: row r sits at key position delta + r
        vt_base = 0
        if V_T:  # the request's first column in VT (a multiple of 16: prefill.transposed_v pads each request)
            vt_base = tl.multiple_of(tl.load(kv_tok_indptr + req), 16)

        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = tok < qo_len
        q_row = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        if FP8_QKV:  # descales, per tensor (stride 0) or per head: scale_q per row, scale_k/v per program
            dq_dk = tl.load(q_descale + head * q_descale_stride) * tl.load(k_descale + kvh * kv_descale_stride)
            row_qk_scale = (qk_scale * dq_dk)[:, None]
            row_sm_scale = (sm_scale * dq_dk)[:, None]
            out_scale = v_scale * tl.load(v_descale + kvh * kv_descale_stride) / P_SCALE
        else:
            row_qk_scale = qk_scale
            row_sm_scale = sm_scale
            out_scale = v_scale
        if ROPE:
            HALF: tl.constexpr = HEAD_DIM // 2
            dh = tl.arange(0, HALF)
            q1 = tl.load(Q + q_row[:, None] + dh[None, :], mask=row_ok[:, None], other=0.0)
            q2 = tl.load(Q + q_row[:, None] + HALF + dh[None, :], mask=row_ok[:, None], other=0.0)
            cos, sin = _rope_cos_sin(delta + tok, log2_theta, rcp_scale, HALF)
            q1f = q1.to(tl.float32)
            q2f = q2.to(tl.float32)
            q = to_dtype(q1f * cos - q2f * sin, q1.dtype)
            q2 = to_dtype(q2f * cos + q1f * sin, q1.dtype)
        else:
            d = tl.arange(0, HEAD_DIM)
            q = tl.load(Q + q_row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
            q2 = q
        mask_bit0 = 0
        if HAS_MASK:
            mask_bit0 = tl.load(mask_indptr + req).to(tl.int64) * 8
        tree_bits = tl.zeros([BLOCK_M], dtype=tl.int64)
        if TREE:  # native tree verify: one ancestor word per draft token (rows are causal + these bits)
            tree_bits = tl.load(tree_mask + q_start + tok, mask=row_ok, other=0)

        # Key range any row of the tile sees, and the part that every valid row sees unmasked.
        tok_min = tile * BLOCK_M // GROUP
        tok_max = tl.minimum(((tile + 1) * BLOCK_M - 1) // GROUP, qo_len - 1)
        hi = kv_len
        full_hi = kv_len
        if CAUSAL:
            hi = tl.minimum(kv_len, delta + tok_max + 1)
            full_hi = tl.minimum(kv_len, delta + tok_min + 1)
        if TREE:  # only the prefix is seen by every row
            full_hi = tl.minimum(full_hi, delta)
        lo = 0
        part_row0 = -1
        part_stride = 0
        if SPLIT_KV:  # this item's chunk of keys [kv_lo, kv_hi), both multiples of BLOCK_N (or kv_hi past kv_len)
            kv_lo = tl.load(work + ITEM * w + 2)
            kv_hi = tl.load(work + ITEM * w + 3)
            part_row0 = tl.load(work + ITEM * w + 4)
            part_stride = tl.load(work + ITEM * w + 5)
            hi = tl.minimum(hi, kv_hi)
            full_hi = tl.minimum(full_hi, kv_hi)
            lo = kv_lo
        full_lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(lo, delta + tok_min - window_left)
            full_lo = tl.maximum(delta + tok_max - window_left, 0)
        lo = lo // BLOCK_N * BLOCK_N
        hi_pad = tl.cdiv(hi, BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(tl.maximum(lo, tl.cdiv(full_lo, BLOCK_N) * BLOCK_N), hi_pad)
        mid_hi = tl.maximum(mid_lo, full_hi // BLOCK_N * BLOCK_N)
        if HAS_MASK:
            mid_lo = hi_pad
            mid_hi = hi_pad

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if ROWSUM_MMA and FP8_QKV:
            l_i = tl.zeros([BLOCK_M, ROWSUM_N], dtype=tl.float32)
        else:
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # three runs of key blocks: masked (the window's edge), full (no mask: the bulk), masked (the causal diagonal,
        # the last partial block, a custom mask's every block)
        for run in tl.static_range(3):
            run_lo = lo if run == 0 else (mid_lo if run == 1 else mid_hi)
            run_hi = mid_lo if run == 0 else (mid_hi if run == 1 else hi)
            for n0 in range(run_lo, run_hi, BLOCK_N):
                acc, l_i, m_i = _attend(
                    acc, l_i, m_i, q, q2, n0, K, V, kv_indices, kv_base, kv_len, kvh,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                    tok, row_ok, delta, row_qk_scale, row_sm_scale, soft_cap, window_left, mask_ptr, mask_bit0,
                    tree_bits, log2_theta, rcp_scale, VT, vt_base, vt_stride_h, vt_stride_d, HEAD_DIM, BLOCK_N,
                    PAGE_SIZE, PAGED, run != 1, CAUSAL, HAS_MASK,
                    HAS_WINDOW, SOFT_CAP, ROPE, KV_SAME_STRIDES, TREE, V_T, OFF32=OFF32)

        if ROWSUM_MMA and FP8_QKV:  # in P's units, as the warp-specialized kernel's
            l_i = tl.max(l_i, 1) * (1.0 / P_SCALE)
        out, lse = _finish(acc, l_i, m_i, out_scale)
        dv = tl.arange(0, HEAD_DIM)
        if part_row0 >= 0:  # a chunk of a split request: its state, in fp32, for split_merge_kernel
            p_row = (part_row0 + tok * part_stride).to(tl.int64) * (tl.num_programs(1) * GROUP) + head
            tl.store(PART_O + p_row[:, None] * HEAD_DIM + dv[None, :], out, mask=row_ok[:, None])
            tl.store(PART_LSE + p_row, lse, mask=row_ok)
        else:
            o_row = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
            tl.store(O + o_row[:, None] + dv[None, :], to_dtype(out, O.dtype.element_ty), mask=row_ok[:, None])
            if RETURN_LSE:
                l_row = (q_start + tok).to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
                tl.store(LSE + l_row, lse, mask=row_ok)


@triton.jit
def split_merge_kernel(PART_O, PART_LSE, O, LSE, merge_rows, stride_ot, stride_oh, stride_lt, stride_lh,
                       NUM_QO_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SLOTS: tl.constexpr,
                       RETURN_LSE: tl.constexpr):
    """One query head (program_id(1)) of query tokens of split requests: folds a token's n chunk states (partial
    rows first, first + 1, ..., written by prefill_kernel under SPLIT_KV), SLOTS chunks a load, in chunk order (so
    bitwise repeatable), each block weighted by exp2(lse - the running max) and the sum so far rescaled when the max
    grows. merge_rows: the token count m, then (output row, first, n) per token; programs stride over the tokens (a
    CUDA graph's grid is fixed at capture). One head a program: a lone token still spreads over NUM_QO_HEADS
    programs, and its chunks come in SLOTS at a time instead of one dependent load each."""
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, SLOTS)
    for t in range(tl.program_id(0), tl.load(merge_rows), tl.num_programs(0)):
        row = tl.load(merge_rows + 1 + 3 * t)
        first = tl.load(merge_rows + 2 + 3 * t)
        n = tl.load(merge_rows + 3 + 3 * t)
        m = float("-inf")
        total = 0.0
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for s0 in range(0, n, SLOTS):
            ok = (s0 + j) < n
            p_row = (first + s0 + j).to(tl.int64) * NUM_QO_HEADS + head
            lse = tl.load(PART_LSE + p_row, mask=ok, other=float("-inf"))
            part = tl.load(PART_O + p_row[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no chunk with a visible key yet: weights 0
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)  # an empty chunk (lse -inf) weighs 0, and its state is never multiplied in
            acc = acc * alpha + tl.sum(tl.where(w[:, None] > 0, part * w[:, None], 0.0), 0)
            total = total * alpha + tl.sum(w, 0)
            m = m_new
        empty = total == 0.0
        out = acc / tl.where(empty, 1.0, total)
        o_row = row.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(O + o_row + d, to_dtype(out, O.dtype.element_ty))
        if RETURN_LSE:
            tl.store(LSE + row.to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh,
                     tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, total))))


@triton.jit
def transpose_v_kernel(V, VT, vt_work, kv_indptr, kv_indices, last_page_len, kv_tok_indptr,
                       stride_vp, stride_vs, stride_vh, vt_stride_h, vt_stride_d,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """VT[kv head, dim, kv_tok_indptr[req] + n] = V[request req's key n, kv head, dim] for one BLOCK_N block of
    keys (work item (req, n0)) of one KV head: the layout fp8 tensor cores read V from (keys contiguous). Keys
    past kv_len (the request's columns are padded to whole attention blocks) are written as zeros, so the
    attention kernel reads whole blocks unmasked and never meets uninitialized bytes."""
    kvh = tl.program_id(1)
    req = tl.load(vt_work + 2 * tl.program_id(0))
    n0 = tl.load(vt_work + 2 * tl.program_id(0) + 1)
    kv_base, kv_len = _request_kv(kv_indptr, last_page_len, req, PAGE_SIZE, PAGED)
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < kv_len
    off = _kv_offsets(kv_indices, kv_base, n, n_ok, kvh, stride_vp, stride_vs, stride_vh, PAGE_SIZE, PAGED)
    d = tl.arange(0, HEAD_DIM)
    v = tl.load(V + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    if FP8_KEY_ORDER:  # row c of the tile takes key vt_column^-1(c): permuted in registers so the stores stay
        # contiguous (a computed vt_column(n) destination made them byte stores: H200, session 13)
        v = tl.reshape(tl.permute(tl.reshape(v, [BLOCK_N // 32, 2, 2, 2, 2, 2, HEAD_DIM]), [0, 1, 3, 4, 2, 5, 6]),
                       [BLOCK_N, HEAD_DIM])
    col = tl.multiple_of(tl.load(kv_tok_indptr + req), 16) + n  # BLOCK_N: a multiple of 32
    dst = VT + kvh.to(tl.int64) * vt_stride_h + d[:, None].to(tl.int64) * vt_stride_d + col[None, :]
    tl.store(dst, tl.trans(v))


def kv_strides(t: torch.Tensor, kv_layout: str, paged: bool):
    """(page, slot, head) element strides of a 4-D paged K or V cache, or (token, 0, head) of ragged K/V."""
    s = t.stride()
    if paged:
        return (s[0], s[1], s[2]) if kv_layout == "NHD" else (s[0], s[2], s[1])
    return (s[0], 0, s[1]) if kv_layout == "NHD" else (s[1], 0, s[0])


def _present(placeholder, *tensors):
    """Pointers the kernel never reads (their feature is compiled out) still need a tensor."""
    return [placeholder if t is None else t for t in tensors]


def scale_args(scale, placeholder):
    """(host factor, device pointer, read-the-pointer flag) of a k_scale / v_scale: None, float or tensor."""
    if isinstance(scale, torch.Tensor):
        return 1.0, scale, True
    return (1.0 if scale is None else float(scale)), placeholder, False


def kv_scale_args(k_scale, v_scale, placeholder):
    """scale_args of k_scale, then of v_scale, as one tuple of six (neither given, a serving step's usual call:
    no further call)."""
    if k_scale is None and v_scale is None:
        return 1.0, placeholder, False, 1.0, placeholder, False
    return scale_args(k_scale, placeholder) + scale_args(v_scale, placeholder)


class Gathered(NamedTuple):
    """What copying a plan's pages into ragged rows takes (gather.gather_widen), made once per plan."""
    page_req: torch.Tensor  # the request of each kv_indices entry
    tok_indptr: torch.Tensor  # each request's first gathered row
    ragged: object  # the plan as a ragged one over the gathered rows
    tokens: int
    pays: bool  # whether gathering a 16-bit cache is worth it (see _launch_gathered)


def _gathered_plan(plan) -> Gathered:
    """The plan's Gathered, made at its first call that asks."""
    if plan.gathered is None:
        pages = np.diff(plan.kv_indptr_host.numpy())
        page_req = torch.from_numpy(np.repeat(np.arange(pages.size, dtype=np.int32), pages))
        kv = plan.kv_lens_host.numpy()
        tok = np.zeros(pages.size + 1, dtype=np.int32)
        np.cumsum(kv, out=tok[1:])
        dev = plan.device
        tok_indptr = torch.from_numpy(tok).to(dev)
        ragged = replace(plan, paged=False, kv_indptr=tok_indptr, kv_indices=None, last_page_len=None, page_size=1,
                         total_kv=int(tok[-1]))
        # attention reads each key once per query tile: (query rows x keys) per gathered key, the copy's cost
        # (a read and a write of each key) against GATHER_GAIN of the attention's
        qo = np.diff(plan.qo_indptr_host.numpy())
        pairs = float(np.dot(qo.astype(np.float64), kv)) * (0.5 if plan.causal else 1.0)
        flops = 4.0 * pairs * plan.num_qo_heads * plan.head_dim
        copy_bytes = 2.0 * 2 * int(tok[-1]) * plan.num_kv_heads * plan.head_dim * 2
        pays = GATHER_GAIN * flops / MATRIX_FLOPS > copy_bytes / COPY_BYTES_PER_S
        plan.gathered = Gathered(page_req.to(dev), tok_indptr, ragged, int(tok[-1]), pays)
    return plan.gathered


def _launch_gathered(q, k, v, out, lse, plan, sk, sv, grid0, qk_scale, vs, ks_ptr, vs_ptr, ks_dev, vs_dev) -> bool:
    """A paged cache on the warp-specialized kernel's ragged path: the batch's pages are copied (an fp8 cache
    widened, exactly) into temporary ragged rows in q's dtype first, at most GATHER_MAX_BYTES, never under CUDA
    graphs (their memory is fixed at capture). An fp8 cache under a 16-bit query has no other way onto that
    kernel; a 16-bit cache goes this way when the copy costs less than what ragged gains over paged
    (SERVEATTN_PREFILL_GATHER=0 turns that off). False (nothing launched) where this does not apply; every path
    gives the same bits. SERVEATTN_PREFILL_GATHER=force copies a 16-bit cache whether it pays or not (measuring)."""
    if not (plan.paged and q.is_cuda and v.dtype == k.dtype and q.dtype.itemsize == 2):
        return False
    if k.dtype.itemsize == 2:
        knob = knobs.get("SERVEATTN_PREFILL_GATHER", "1")
        if k.dtype != q.dtype or knob not in ("1", "force"):
            return False
        # a 16-bit cache is copied only where that pays (decided once per plan), or when forced
        must_pay = knob != "force"
        if must_pay and plan.gathered is not None and not plan.gathered.pays:
            return False  # known from an earlier call: no need to ask serves()
    elif k.dtype.itemsize == 1:
        must_pay = False  # an fp8 cache has no other way onto the kernel
    else:
        return False
    if not attention_ws.serves(q, k, v, plan, None, as_ragged=True):  # before any host work for the copy
        return False
    page_req, tok_indptr, ragged, tokens, pays = _gathered_plan(plan)
    if must_pay and not pays:
        return False
    shape = (tokens, plan.num_kv_heads, plan.head_dim)
    if tokens == 0 or 2 * tokens * plan.num_kv_heads * plan.head_dim * q.element_size() > GATHER_MAX_BYTES:
        return False
    ko = torch.empty(shape, dtype=q.dtype, device=q.device)
    vo = torch.empty(shape, dtype=q.dtype, device=q.device)
    copy = gather.gather_widen(k, v, ko, vo, page_req, plan.kv_indptr, plan.kv_indices, plan.last_page_len,
                               tok_indptr, sk, sv, plan.page_size, plan.head_dim, int(page_req.numel()),
                               plan.num_kv_heads, memo=plan.launch_memo)
    so = kv_strides(ko, "NHD", False)
    # the ragged plan's launch kept as its Replay (scales passed per call), and with the copy as this plan's
    launched = attention_ws.launch(q, ko, vo, out, lse, ragged, so, so, grid0, qk_scale, vs, ks_ptr, vs_ptr, ks_dev,
                                   vs_dev, replay_gather_ok=False, replay_scales=True)
    inner = ragged.launch_memo.get(replay.KEY)
    if launched and copy is not None and inner is not None and replay.GATHERED not in plan.launch_memo:
        plan.launch_memo[replay.GATHERED] = replay.Gathered(copy, inner, k, v, shape, q.dtype)
    return launched


def _kernel_call(q, k, v, out, lse, plan, sk, sv, qk_scale, ks, vs, ks_ptr, vs_ptr, ks_dev, vs_dev, descales, vt,
                 vt_tokens, split):
    """prefill_kernel's positional arguments and keywords for one launch. vt: fp8 attention's V^T (None: no V^T);
    split: the plan's split-KV states (None: the kernel without split items)."""
    fp8 = descales is not None
    dq, dk, dv = descales if fp8 else (plan.work, plan.work, plan.work)
    slt, slh = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    part_o, part_lse = split[:2] if split is not None else (plan.work, plan.work)
    args = (
        q, k, v, out, lse if lse is not None else out,  # lse: never written when RETURN_LSE is False
        q.stride(0), q.stride(1), *sk, *sv, out.stride(0), out.stride(1), slt, slh,
        plan.work, plan.num_work, plan.qo_indptr, plan.kv_indptr, *_present(plan.work, plan.kv_indices,
                                                                              plan.last_page_len, plan.mask,
                                                                              plan.mask_indptr, plan.tree_mask),
        qk_scale, plan.sm_scale * ks, plan.soft_cap, plan.window_left,
        plan.log2_theta, plan.rcp_scale, vs, ks_ptr, vs_ptr,
        dq, dk, dv, int(fp8 and dq.numel() > 1), int(fp8 and dk.numel() > 1),
        plan.work if vt is None else vt, plan.work if vt is None else plan.kv_tok_indptr, plan.head_dim * vt_tokens,
        vt_tokens, part_o, part_lse)
    cfg = plan.tiles
    kwargs = dict(
        GROUP=plan.group, HEAD_DIM=plan.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        PAGE_SIZE=plan.page_size, PAGED=plan.paged, CAUSAL=plan.causal, HAS_MASK=plan.has_mask,
        HAS_WINDOW=plan.window_left >= 0, SOFT_CAP=soft_cap_mode(plan.soft_cap), ROPE=plan.rope,
        RETURN_LSE=lse is not None, KV_SAME_STRIDES=sk == sv, K_SCALE_PTR=ks_dev, V_SCALE_PTR=vs_dev,
        FP8_QKV=fp8, TREE=plan.tree_mask is not None, V_T=vt is not None, SPLIT_KV=split is not None,
        # a replay re-checks K/V's shapes and strides
        OFF32=PREFILL_OFF32 and cfg.block_m >= PREFILL_OFF32_MIN_ROWS and fits_int32(k) and fits_int32(v),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **LAUNCH_OPTIONS,
    )
    return args, kwargs


def _launch_split(q, k, v, out, lse, plan, kv_layout, grid0, k_scale, v_scale, descales, kv_stride_args,
                  merge_programs):
    """prefill_kernel over the plan's split work list (prefill.build_split_work), then split_merge_kernel over the
    split requests' tokens (merge_programs of them under CUDA graphs, else one a token; none for no token). Plain
    launches each call: two kernels, and the plans that split are the small ones."""
    ks, ks_ptr, ks_dev, vs, vs_ptr, vs_dev = kv_scale_args(k_scale, v_scale, plan.work)
    sk, sv = (kv_strides(k, kv_layout, plan.paged), kv_strides(v, kv_layout, plan.paged)) \
        if kv_stride_args is None else (kv_stride_args, kv_stride_args)
    args, kwargs = _kernel_call(q, k, v, out, lse, plan, sk, sv, plan.sm_scale * ks * LOG2E, ks, vs, ks_ptr, vs_ptr,
                                ks_dev, vs_dev, descales, None, 0, plan.split)
    launch_jit(prefill_kernel, (grid0, plan.num_kv_heads), *args, **kwargs)
    merge_programs = merge_programs or plan.num_merge
    if not merge_programs:
        return
    part_o, part_lse, merge_rows = plan.split
    slt, slh = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    launch_jit(split_merge_kernel, (merge_programs, plan.num_qo_heads),
               part_o, part_lse, out, lse if lse is not None else out, merge_rows, out.stride(0), out.stride(1), slt,
               slh,
               NUM_QO_HEADS=plan.num_qo_heads, HEAD_DIM=plan.head_dim, SLOTS=max(1, 2048 // plan.head_dim),
               RETURN_LSE=lse is not None, **LAUNCH_OPTIONS)


def launch(q, k, v, out, lse, plan, kv_layout: str, grid0: int, k_scale=None, v_scale=None, descales=None,
           gather_ok: bool = False, kv_stride_args=None, merge_programs: int = 0):
    """Launches the kernel for a plan built by serveattn.prefill (all validation happened there).

    k_scale folds into the logit scale and v_scale into the output, inside the kernel; each is a float or
    a one-element float32 device tensor (read by the kernel). descales: (scale_q, scale_k, scale_v) float32
    device tensors of one element or one per head, for an fp8 query over an fp8 cache. gather_ok: an fp8 cache
    may be widened into a temporary for the warp-specialized kernel (not under CUDA graphs).
    kv_stride_args: kv_strides of k, the same for v (a caller that keeps them per cache), else read here.
    merge_programs: a split plan's merge grid under CUDA graphs (fixed at capture; 0: one program a token)."""
    if plan.split is not None:  # a few long requests cut into KV chunks: no replay, no warp-specialized kernel
        _launch_split(q, k, v, out, lse, plan, kv_layout, grid0, k_scale, v_scale, descales, kv_stride_args,
                      merge_programs)
        return
    plain = k_scale is None and v_scale is None and descales is None and plan.vt_work is None
    # fp8 attention over V^T (k_scale/v_scale are refused beside descales): its transpose and attention launches
    fp8_vt = descales is not None and plan.vt_work is not None
    if plain or fp8_vt:  # a plan's later calls repeat its first such launch where nothing it follows from moved
        repeat = plan.launch_memo.get(replay.KEY)
        if repeat is not None and repeat(q, k, v, out, lse, grid0, gather_ok, descales):
            return
    ks, ks_ptr, ks_dev, vs, vs_ptr, vs_dev = kv_scale_args(k_scale, v_scale, plan.work)
    qk_scale = plan.sm_scale * ks * LOG2E
    if gather_ok and descales is None:  # and the same for a plan whose calls copy their pages (_launch_gathered)
        repeat = plan.launch_memo.get(replay.GATHERED)
        if repeat is not None and repeat(q, k, v, out, lse, grid0, (qk_scale, vs, ks_ptr, vs_ptr, ks_dev, vs_dev)):
            return
    if kv_stride_args is None:
        sk = kv_strides(k, kv_layout, plan.paged)
        sv = kv_strides(v, kv_layout, plan.paged)
    else:
        sk = sv = kv_stride_args
    if attention_ws is not None and gather_ok and descales is None and _launch_gathered(
            q, k, v, out, lse, plan, sk, sv, grid0, qk_scale, vs, ks_ptr, vs_ptr, ks_dev, vs_dev):
        return
    ws = attention_ws is not None and attention_ws.serves(q, k, v, plan, descales)
    vt, vt_tokens, transpose = plan.work, 0, None
    if plan.vt_work is not None:  # fp8 attention: V transposed once, read by every query tile of its request
        vt_tokens = plan.vt_tokens
        vt = torch.empty((plan.num_kv_heads, plan.head_dim, vt_tokens), dtype=v.dtype, device=v.device)
        t_args = (v, vt, plan.vt_work, plan.kv_indptr, *_present(plan.work, plan.kv_indices, plan.last_page_len),
                  plan.kv_tok_indptr, *sv, plan.head_dim * vt_tokens, vt_tokens)
        t_pack = plan.launch_memo.get("transpose_v")
        if t_pack is None:  # the plan's tensors keyed once (launch.Pack)
            t_pack = plan.launch_memo["transpose_v"] = Pack(
                transpose_v_kernel, t_args, dict(HEAD_DIM=plan.head_dim, BLOCK_N=VT_BLOCK_N,
                                                 PAGE_SIZE=plan.page_size, PAGED=plan.paged), (2, 3, 4, 5, 6))
        transpose = (t_pack, t_args, (plan.vt_work.numel() // 2, plan.num_kv_heads))
        t_pack(transpose[2], *t_args)
    if ws and attention_ws.launch(q, k, v, out, lse, plan, sk, sv, grid0, qk_scale, vs, ks_ptr, vs_ptr, ks_dev,
                                  vs_dev, descales, vt if plan.vt_work is not None else None,
                                  replay_gather_ok=gather_ok if plain or fp8_vt else None, transpose=transpose):
        return
    args, kwargs = _kernel_call(q, k, v, out, lse, plan, sk, sv, qk_scale, ks, vs, ks_ptr, vs_ptr, ks_dev, vs_dev,
                                descales, vt if plan.vt_work is not None else None, vt_tokens, None)
    grid = (grid0, plan.num_kv_heads)
    if not (plain and replay.KEY not in plan.launch_memo and replay.aligned(q, out, lse)
            and (plan.paged or replay.aligned(k, v))):
        launch_jit(prefill_kernel, grid, *args, **kwargs)
        return
    pack = Pack(prefill_kernel, args, kwargs, ())  # the plan's first plain launch, kept as its replay
    pack(grid, *args)
    arg_key = pack.arguments_key(args)
    if arg_key is not None:
        plan.launch_memo[replay.KEY] = replay.Replay(pack, arg_key, args, grid, q, k, v, out, lse, grid0, gather_ok,
                                                     not plan.paged)
