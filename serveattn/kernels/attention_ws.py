"""Hopper (sm_90) prefill kernel in Gluon, warp-specialized: the fast path of the prefill family.

Triton 3.6's `tl.dot` waits for each wgmma right after issuing it and cannot warp-specialize an attention loop
on Hopper, so the Triton kernel (attention.py) leaves the tensor cores idle during each block's softmax. This
kernel writes the FA3 schedule out by hand:
- the grid is persistent (one program per SM, each walking its share of the (work item, KV head) tasks), so a
  producer warp runs from one task into the next: it copies each task's q by TMA into one of two buffers and
  gathers K and V blocks page by page with TMA (one copy per page into a 2-stage ring, completion counted in
  bytes on an mbarrier), waiting for the consumers to free a buffer or stage;
- two consumer warp groups take 64 of the work item's 128 (token, query head) rows each and take turns at the
  tensor cores (FA3's ping-pong): the group holding the turn issues S(j+1) = q.K(j+1)^T and P(j).V(j) back to
  back and passes the turn on, then runs block j+1's softmax while the other group's products run. On the H200
  this took paged causal prefill from 402-488 to 519-613 TFLOP/s over an issue order without turns (session 9).

It serves what most prefill calls are (anything else takes attention.prefill_kernel, see `serves`): 16-bit q
and K/V of one dtype, head dim 64 or 128, no custom mask, window, soft cap, RoPE or tree; pages of 8+ keys (a power
of two) or ragged K/V. Per block its arithmetic is prefill_kernel's, op for op (same 128 x 128 blocks, the same
wgmma accumulator layouts and row reductions, fp contraction off), so the two kernels agree bitwise and an fp8
cache served by prefill_kernel stays bitwise equal to its dequantized run served here (API.md); a GPU test
holds them to it.

K/V reach the TMA unit as a 2-D view [rows, slot stride] of the cache: a key (page p, slot s, head h) is row
p * page_rows + head_row(h) + s, column head_col(h), which covers NHD and HND pages and FlashInfer's
interleaved [pages, 2, ...] cache alike. The last block of a request may hold keys past kv_len (the rest of a
partial page, pages never fetched): their logits are masked, and before P.V the consumers zero those V rows
(0 * NaN would poison the output).

An fp8 cache under a 16-bit query reaches this kernel through attention._launch_gathered: its pages are
widened into temporary ragged rows (kernels/gather.py), exactly, and the ragged kernel runs on them.
"""
import functools
import os
import weakref
from typing import Optional

import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .. import knobs
from ..policy import FP8_DTYPES, cuda_properties
from .common import FP8_KEY_ORDER, LAUNCH_OPTIONS, ROWSUM_MMA, SOFTMAX_FMA
from . import replay
from .launch import Pack
from .sizes import cdiv

BLOCK_M = gl.constexpr(128)  # rows of a work item (the plan's tiles must match)
BLOCK_N = gl.constexpr(128)  # keys per block: prefill_kernel's, so the online softmax takes the same steps
P_SCALE = gl.constexpr(256.0)  # fp8 attention: attention.P_SCALE (P * 256 rounded to e4m3 for P.V)
LOG2_P_SCALE = gl.constexpr(8.0)
HEAD_DIMS = (64, 128)  # served head dims (the kernels read theirs from the tiles' shapes)
# K and V ring depth; SERVEATTN_PREFILL_WS_STAGES=3 (229 KB of shared memory) is for measuring only
STAGES = gl.constexpr(int(os.environ.get("SERVEATTN_PREFILL_WS_STAGES", "2")))
# Measuring only (results wrong; scripts/probe_knockouts.sh): SERVEATTN_PREFILL_WS_KNOCKOUT names parts
# of the work to drop, comma-separated: softmax (P = the scaled logits, no max / exp2 / sum / rescale), exp (exp2
# replaced by its argument), rowstats (no row max or row sum), pv (no P.V product), kv (the producer arrives on the
# K/V barriers without copying), mask (the causal diagonal's blocks take the full blocks' path: no mask)
_KNOCKOUT = os.environ.get("SERVEATTN_PREFILL_WS_KNOCKOUT", "").split(",")
KNOCK_SOFTMAX = gl.constexpr("softmax" in _KNOCKOUT)
KNOCK_ROWSTATS = gl.constexpr("rowstats" in _KNOCKOUT)
KNOCK_EXP = gl.constexpr("exp" in _KNOCKOUT)
KNOCK_PV = gl.constexpr("pv" in _KNOCKOUT)
KNOCK_KV = gl.constexpr("kv" in _KNOCKOUT)
KNOCK_MASK = gl.constexpr("mask" in _KNOCKOUT)
# Measuring only (the LSE is not written; scripts/probe_ws_trace.py): SERVEATTN_PREFILL_WS_TRACE=1 has each consumer
# group write TRACE_SLOTS %clock64 stamps a task into the LSE buffer (read as int64, row (task * 2 + group)): the
# task's start, S(0) issued, S(0) done, softmax(0) done, the block loop done, the last P.V done, the output stored,
# n_blocks + (SM id << 32), then q's buffer ready (8) and the item's loads used (9). Where a task's fixed cost goes,
# beside the per-block time.
TRACE = gl.constexpr(os.environ.get("SERVEATTN_PREFILL_WS_TRACE", "0") == "1")
TRACE_SLOTS = gl.constexpr(10)
# The output tile goes from the accumulator's layout through shared memory into a layout of 16-byte pieces of whole
# rows before its stores: 8 coalesced stores a thread instead of 32 4-byte ones that each touch 8 rows (session 22,
# H200: kernel time -4% bf16, -8..-11% fp8 at 1x4096 and 16x2048). SERVEATTN_PREFILL_WS_EPILOGUE_SMEM=0 (measuring
# only) stores straight from the accumulator's layout.
EPILOGUE_SMEM = gl.constexpr(os.environ.get("SERVEATTN_PREFILL_WS_EPILOGUE_SMEM", "1") == "1")
# common.ROWSUM_MMA (SERVEATTN_FP8_ROWSUM_MMA, default on): fp8's row sum off the issue slots, P (f16) times a
# [keys, 8] tile of ones, accumulated and rescaled like the output (64 FADD and two shuffle rounds a thread a block
# become one small wgmma)
ROWSUM_N = gl.constexpr(8)
# fp8: a thread skips the accumulator's rescale when the row max of both its rows stayed (bits unchanged: _rescale)
SKIP_RESCALE = gl.constexpr(os.environ.get("SERVEATTN_PREFILL_WS_SKIP_RESCALE", "1") == "1")
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
MAX_REGS = 168  # 12 warps (two consumer groups + the producer's group) x 168 fills the register file


@gluon.jit
def _stamp(LSE, t, CID: gl.constexpr, slot: gl.constexpr):
    """TRACE: this group's %clock64 as stamp `slot` of task t (see TRACE)."""
    _stamp_after(LSE, t, CID, slot, 0)


@gluon.jit
def _stamp_after(LSE, t, CID: gl.constexpr, slot: gl.constexpr, dep):
    """_stamp, read once the int32 scalar `dep` is there (the clock read takes it as an input)."""
    if TRACE:
        now = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=gl.int64, is_pure=False,
                                        pack=1)
        gl.store(LSE.to(gl.pointer_type(gl.int64)) + (t * 2 + CID) * TRACE_SLOTS + slot, now)


@gluon.jit
def _num_rounds(num_tasks):
    """Tasks this program takes in _task's order: one a round, plus one of the last, partial round's."""
    P = gl.num_programs(0)
    p = gl.program_id(0)
    full = num_tasks // P
    rem = num_tasks - full * P
    last = gl.where(full % 2 == 0, p < rem, p >= P - rem)
    return full + gl.where(last, 1, 0)


@gluon.jit
def _task(r):
    """Round r's task of this program: the task list (prefill.build_work's order, costliest requests first) dealt
    out in a snake, programs 0..P-1 then P-1..0, so every program's total comes out even (a plain stride gave
    program 0 the costliest task of every round)."""
    P = gl.num_programs(0)
    p = gl.program_id(0)
    return r * P + gl.where(r % 2 == 0, p, P - 1 - p)


@gluon.jit
def _item(work, w, qo_indptr, kv_indptr, last_page_len, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr,
          PAGED: gl.constexpr, CAUSAL: gl.constexpr):
    """A work item's request geometry and its key blocks: blocks [0, n_full) every valid row sees whole,
    [n_full, n_blocks) masked (prefill_kernel's loop bounds without window or mask)."""
    req = gl.load(work + 2 * w)
    tile = gl.load(work + 2 * w + 1)
    q_start = gl.load(qo_indptr + req)
    qo_len = gl.load(qo_indptr + req + 1) - q_start
    kv_base = gl.load(kv_indptr + req)
    if PAGED:
        num_pages = gl.load(kv_indptr + req + 1) - kv_base
        kv_len = gl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + gl.load(last_page_len + req), 0)
    else:
        kv_len = gl.load(kv_indptr + req + 1) - kv_base
    delta = kv_len - qo_len
    hi = kv_len
    full_hi = kv_len
    if CAUSAL:
        tok_min = tile * BLOCK_M // GROUP
        tok_max = gl.minimum(((tile + 1) * BLOCK_M - 1) // GROUP, qo_len - 1)
        hi = gl.minimum(kv_len, delta + tok_max + 1)
        full_hi = gl.minimum(kv_len, delta + tok_min + 1)
    n_blocks = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
    n_full = gl.maximum(full_hi, 0) // BLOCK_N
    return tile, q_start, qo_len, kv_base, kv_len, delta, n_blocks, n_full


@gluon.jit
def _block_rows(kv_indices, kv_base, kv_len, block, page_rows, head_row, PAGE_SIZE: gl.constexpr,
                BOX: gl.constexpr, PAGED: gl.constexpr):
    """Row coordinates of key block `block`'s BLOCK_N / BOX copies. Paged: every page index is loaded here,
    before the producer waits for a free stage, so the table's latency overlaps that wait."""
    rows = ()
    if PAGED:
        last_page = kv_base + gl.cdiv(kv_len, PAGE_SIZE) - 1
        for i in gl.static_range(BLOCK_N // BOX):
            key0 = block * BLOCK_N + i * BOX
            # past the request's last page (tail block only) fetch that page again: masked, V rows zeroed
            page = gl.load(kv_indices + gl.minimum(kv_base + key0 // PAGE_SIZE, last_page))
            rows = rows + (page * page_rows + head_row + key0 % PAGE_SIZE,)
    else:  # ragged: rows past the tensor's end come back as zeros, past kv_len as other requests' keys
        rows = (kv_base + block * BLOCK_N + head_row,)
    return rows


@gluon.jit
def _fetch(desc, smem, bar, rows, head_col, BOX: gl.constexpr):
    """TMA of one key block (its copies' rows from _block_rows) into smem, completing on bar."""
    HEAD_DIM: gl.constexpr = smem.shape[1]
    if KNOCK_KV:
        mbarrier.arrive(bar, count=1)
    else:
        mbarrier.expect(bar, BLOCK_N * HEAD_DIM * smem.dtype.primitive_bitwidth // 8)  # one per phase: every copy issued
        for i in gl.static_range(BLOCK_N // BOX):
            tma.async_copy_global_to_shared(desc, [rows[i], head_col], bar, smem.slice(i * BOX, BOX))


@gluon.jit
def _fetch_q(q_desc, q_smem, q_ready, q_empty, items, tok0, kvh, GROUP: gl.constexpr):
    """TMA of a work item's 128 (token, head) rows of q, 64 per consumer group: a [tokens, GROUP heads, dim] box
    of q viewed as [tokens, heads, dim] lands row for row where the group's [64, dim] operand expects it (the
    swizzle follows the address, whatever the box's rank). Tokens past q's end arrive as zeros, tokens of the
    next request as their values: rows that are never stored."""
    ROWS: gl.constexpr = BLOCK_M // 2
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    buf = items % 2  # two items' buffers: the one freed by item - 2 is long free, so this never holds up K/V
    mbarrier.wait(q_empty.index(buf), ((items // 2) & 1) ^ 1)
    mbarrier.expect(q_ready.index(buf), BLOCK_M * HEAD_DIM * q_smem.dtype.primitive_bitwidth // 8)
    for c in gl.static_range(2):
        box = q_smem.index(buf * 2 + c)._reinterpret(q_smem.dtype, [ROWS // GROUP, GROUP, HEAD_DIM],
                                                     q_desc.layout)
        tma.async_copy_global_to_shared(q_desc, [tok0 + c * (ROWS // GROUP), kvh * GROUP, 0], q_ready.index(buf),
                                        box)


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
             work, num_work_ptr, qo_indptr, kv_indptr, kv_indices, last_page_len,
             k_page_rows, k_head_rows, k_head_cols, v_page_rows, v_head_rows, v_head_cols, kv_tok_indptr,
             GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, BOX: gl.constexpr, PAGED: gl.constexpr,
             CAUSAL: gl.constexpr, V_T: gl.constexpr, Q_TMA: gl.constexpr, KV_HEADS: gl.constexpr):
    num_tasks = gl.load(num_work_ptr) * KV_HEADS
    done = 0  # blocks of earlier work items: the ring's stage and phase run on across items
    items = 0
    rounds = _num_rounds(num_tasks)
    for r in range(rounds):
        t = _task(r)
        w = t // KV_HEADS
        kvh = t % KV_HEADS
        k_row = kvh * k_head_rows
        k_col = kvh * k_head_cols
        v_row = kvh * v_head_rows
        v_col = kvh * v_head_cols
        tile, q_start, qo_len, kv_base, kv_len, delta, n_blocks, n_full = _item(
            work, w, qo_indptr, kv_indptr, last_page_len, GROUP, PAGE_SIZE, PAGED, CAUSAL)
        vt_base = 0
        if V_T:  # the request's first column in V^T (padded to whole blocks, zero-filled past kv_len)
            vt_base = gl.load(kv_tok_indptr + gl.load(work + 2 * w))
        if Q_TMA:  # the item's query rows, into the buffer every q.K^T of the item two back is done with
            _fetch_q(q_desc, q_smem, q_ready, q_empty, items, q_start + tile * (BLOCK_M // GROUP), kvh, GROUP)
            items += 1
        # consumers take K(0), K(1), V(0), K(2), V(1), ...: issue in that order
        if n_blocks > 0:
            rows = _block_rows(kv_indices, kv_base, kv_len, 0, k_page_rows, k_row, PAGE_SIZE, BOX, PAGED)
            st = done % STAGES
            mbarrier.wait(k_empty.index(st), ((done // STAGES) & 1) ^ 1)
            _fetch(k_desc, k_smem.index(st), k_ready.index(st), rows, k_col, BOX)
        for j in range(n_blocks):
            g = done + j + 1
            if j + 1 < n_blocks:
                rows = _block_rows(kv_indices, kv_base, kv_len, j + 1, k_page_rows, k_row, PAGE_SIZE, BOX, PAGED)
                st = g % STAGES
                mbarrier.wait(k_empty.index(st), ((g // STAGES) & 1) ^ 1)
                _fetch(k_desc, k_smem.index(st), k_ready.index(st), rows, k_col, BOX)
            g = done + j
            st = g % STAGES
            if V_T:  # fp8 attention: V^T [kv head * dim, token] (attention.transpose_v_kernel), one copy a block
                mbarrier.wait(v_empty.index(st), ((g // STAGES) & 1) ^ 1)
                if KNOCK_KV:
                    mbarrier.arrive(v_ready.index(st), count=1)
                else:
                    mbarrier.expect(v_ready.index(st), BLOCK_N * v_smem.shape[1])
                    tma.async_copy_global_to_shared(v_desc, [v_row, vt_base + j * BLOCK_N], v_ready.index(st),
                                                    v_smem.index(st))
            else:
                rows = _block_rows(kv_indices, kv_base, kv_len, j, v_page_rows, v_row, PAGE_SIZE, BOX, PAGED)
                mbarrier.wait(v_empty.index(st), ((g // STAGES) & 1) ^ 1)
                _fetch(v_desc, v_smem.index(st), v_ready.index(st), rows, v_col, BOX)
        done += n_blocks


@gluon.jit
def _softmax_block(s, m_i, l_i, j, n_full, kv_len, row_ok, delta, tok, qk_scale, p_layout: gl.constexpr,
                   dtype: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr, ps_layout: gl.constexpr):
    """Block j's logits folded into the running (m_i, l_i): returns P as P.V's A operand, the accumulator's
    rescale factor, m_i, l_i. prefill_kernel's _attend, op for op. FP8: qk_scale is a per-row column (descales
    per head) and P goes to the tensor cores as P * P_SCALE in e4m3."""
    BN: gl.constexpr = s.shape[1]
    if SOFTMAX_FMA:  # common.SOFTMAX_FMA: scaled inside the fma below, the row max taken on the raw logits
        x = s
    elif FP8:
        x = s * qk_scale[:, None]
    else:
        x = s * qk_scale
    # key n = key0 + column. fp8 compares the column against bounds less key0, so the column vector is the same
    # every block (no per-block adds): fp8 +4-5% on the H200, bf16 -1% at 1x4096 (session 17), hence fp8 only
    key0 = j * BN if FP8 else 0
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout)) + (j * BN - key0)
    if j >= n_full and not KNOCK_MASK:  # prefill_kernel's MASKED blocks
        # its three conditions (n < kv_len - key0, row_ok, n <= delta + tok - key0) as one bound a row, so a score
        # takes one compare and one select (three selects and 1.5 compares as written there: ~290 instructions a
        # thread a masked block, against ~475 for a whole full block)
        limit = gl.where(row_ok, kv_len - key0, 0)
        if CAUSAL:
            limit = gl.minimum(limit, delta + tok - key0 + 1)
        x = gl.where(n[None, :] < limit[:, None], x, float("-inf"))
    if KNOCK_SOFTMAX or KNOCK_ROWSTATS:
        m_new = m_i
    elif SOFTMAX_FMA:
        m_new = gl.maximum(m_i, gl.max(x, 1) * qk_scale)
    else:
        m_new = gl.maximum(m_i, gl.max(x, 1))
    # a row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    if KNOCK_SOFTMAX:
        p = x
        alpha = gl.exp2(m_i - m_safe)
    else:
        if SOFTMAX_FMA and FP8:  # P_SCALE folded into the exponent, as prefill_kernel's FOLD
            p = gl.fma(x, qk_scale[:, None], (-m_safe + LOG2_P_SCALE)[:, None])
        elif SOFTMAX_FMA:
            p = gl.fma(x, qk_scale, -m_safe[:, None])
        else:
            p = x - m_safe[:, None]
        if not KNOCK_EXP:
            p = gl.exp2(p)
        alpha = gl.exp2(m_i - m_safe)
        if ROWSUM_MMA and FP8:
            pass  # l is a product of _consume's (P x ones)
        elif KNOCK_ROWSTATS:
            l_i = l_i * alpha
        elif SOFTMAX_FMA and FP8:
            l_i = l_i * alpha + gl.sum(p, 1) * (1.0 / P_SCALE)
        else:
            l_i = l_i * alpha + gl.sum(p, 1)
    if FP8 and FP8_KEY_ORDER:  # V^T holds the keys in this order (common.vt_column); packed words (_p_operand)
        p_op = _p_operand_permuted(p if SOFTMAX_FMA else p * P_SCALE, p_layout)
    else:
        if SOFTMAX_FMA and FP8:
            p_op = p.to(gl.float8e4nv)
        elif FP8:
            p_op = (p * P_SCALE).to(gl.float8e4nv)
        else:
            p_op = p.to(dtype)
        p_op = gl.convert_layout(p_op, p_layout)
    if ROWSUM_MMA and FP8:  # the row sum's A operand: P * P_SCALE in f16 (11 bits: l as exact as an fp32 sum's
        # bound needs), in the 16-bit operand layout of the accumulator (a relabelling)
        p_sum = gl.convert_layout((p if SOFTMAX_FMA else p * P_SCALE).to(gl.float16), ps_layout)
    else:
        p_sum = alpha  # not read
    return p_op, alpha, m_new, l_i, p_sum


def _rescale_asm(n: int) -> str:
    """PTX that multiplies a thread's n accumulator registers ($0..$n-1, tied to inputs $n..$2n-1) by their row's
    alpha, behind one branch taken when both of the thread's rows have alpha == 1 (x * 1.0 == x, so skipping is
    bitwise the same). wgmma accumulator registers go four to a column group of 8: two of row r, two of row r + 8;
    the alphas come broadcast the same way ($2n.. ), so $2n is row r's and $2n+2 row r + 8's."""
    a0, a1 = 2 * n, 2 * n + 2
    muls = "\n".join(f"mul.f32 ${k}, ${n + k}, ${2 * n + k};" for k in range(n))
    return (f"{{\n.reg .pred %keep;\n.reg .pred %keep1;\n"
            f"setp.eq.f32 %keep, ${a0}, 0f3F800000;\nsetp.eq.f32 %keep1, ${a1}, 0f3F800000;\n"
            f"and.pred %keep, %keep, %keep1;\n@%keep bra SKIP_RESCALE_${{:uid}};\n{muls}\n"
            f"SKIP_RESCALE_${{:uid}}:\n}}")


# head dim 128: a thread holds 64 accumulator registers ([64 rows, 128 dims] over 128 threads)
_RESCALE_ASM = gl.constexpr(_rescale_asm(64))
_RESCALE_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 64 + [str(k) for k in range(64)] + ["r"] * 64))


@gluon.jit
def _rescale(acc, alpha, FP8: gl.constexpr):
    """acc * alpha[:, None]; fp8 at head dim 128 skips it in a thread whose rows both have alpha == 1 (the row max
    did not move): fp8 +2-4% on the H200, bf16 -3% at 1x4096 and -2% at 1x8192 (session 18), hence fp8 only."""
    if SKIP_RESCALE and FP8 and acc.shape[1] == 128:
        return gl.inline_asm_elementwise(_RESCALE_ASM, _RESCALE_CONSTRAINTS,
                                         [acc, gl.broadcast(alpha[:, None], acc)[0]], dtype=gl.float32,
                                         is_pure=True, pack=64)
    else:
        return acc * alpha[:, None]


@gluon.jit
def _p_operand_permuted(p, p_layout: gl.constexpr):
    """fp8 P as the A operand of P.V without moving a value between lanes: within each 32 keys, A position
    a = 16 h + 4 c + e (lane c of a quad, byte e of its register) takes key 16 h + 8 (e // 2) + 2 c + e % 2,
    the key that lane already holds in the accumulator layout of S (two adjacent keys every 8). V^T is
    written in the same order (common.vt_column). Four values to one int32 word in two cvt (the same rounding as
    Triton's fp32 -> e4m3 conversion): P as [rows, cols / 4] words, the operand made from them by _p_operand."""
    rows: gl.constexpr = p.shape[0]
    cols: gl.constexpr = p.shape[1]
    # key bits (k4 k3 k2 k1 k0) -> A position bits (k4 k2 k1 k3 k0)
    p = gl.reshape(gl.permute(gl.reshape(p, [rows, cols // 32, 2, 2, 2, 2, 2]), [0, 1, 2, 4, 5, 3, 6]), [rows, cols])
    p = gl.convert_layout(p, p_layout)  # the same registers: a relabelling
    # each register's four values as four tensors [rows, cols / 4] (e = 2 * e1 + e0), packed into one int32 each:
    # P crosses _consume's loop edge as 16 words a thread (as fp8 values it crossed as 64 bytes, each unpacked
    # from its word and packed again: ~180 instructions a block)
    e0, e1 = gl.split(gl.reshape(p, [rows, cols // 4, 2, 2]))
    e00, e10 = gl.split(e0)
    e01, e11 = gl.split(e1)
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        }""",
        "=r,r,r,r,r", [e00, e01, e10, e11], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _p_operand(p_op, p_layout: gl.constexpr, PACKED: gl.constexpr):
    """P.V's A operand from what _softmax_block returned: as it is, or (PACKED) fp8 from _p_operand_permuted's
    words: each word repeated over its four positions, then its bytes taken as they stand."""
    if PACKED:
        rows: gl.constexpr = p_op.shape[0]
        cols: gl.constexpr = p_op.shape[1] * 4
        w2 = gl.join(p_op, p_op)
        w4 = gl.reshape(gl.join(w2, w2), [rows, cols])
        w4 = gl.convert_layout(w4, p_layout)  # the same registers: a relabelling
        # not pure, so it stays where it is called: before the loop's first wgmma (ptxas serializes every wgmma
        # when an operand is defined by another instruction while a wgmma is in flight)
        p_op = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [w4], dtype=gl.float8e4nv,
                                         is_pure=False, pack=4)
    return p_op


@gluon.jit
def _v_ready(v_smem, v_ready, st, phase, j, kv_len, io_layout: gl.constexpr, V_T: gl.constexpr):
    """Waits for V block j in stage st and returns it as P.V's B operand; zeroes its rows past kv_len (P is 0
    there; 0 * NaN is not) unless it is a V^T tile (zero-filled there already)."""
    mbarrier.wait(v_ready.index(st), phase)
    if V_T:
        v_op = v_smem.index(st).permute((1, 0))
    else:
        if (j + 1) * BLOCK_N > kv_len:
            v_tile = v_smem.index(st).load(io_layout)
            n_io = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
            v_smem.index(st).store(gl.where((n_io < kv_len)[:, None], v_tile, gl.zeros_like(v_tile)))
            fence_async_shared()
            gl.thread_barrier()
        v_op = v_smem.index(st)
    return v_op


@gluon.jit
def _consume(q_smem, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty,
             Q, O, LSE, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
             work, num_work_ptr, qo_indptr, kv_indptr, last_page_len,
             qk_scale, v_scale, k_scale_ptr, v_scale_ptr, q_descale, k_descale, v_descale, q_descale_stride,
             kv_descale_stride, row0,
             GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, CAUSAL: gl.constexpr,
             RETURN_LSE: gl.constexpr, K_SCALE_PTR: gl.constexpr, V_SCALE_PTR: gl.constexpr, FP8: gl.constexpr,
             turn, CID: gl.constexpr, q_ready, q_empty, Q_TMA: gl.constexpr, KV_HEADS: gl.constexpr):
    ROWS: gl.constexpr = BLOCK_M // 2
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    nw: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_smem.dtype
    K_STEP: gl.constexpr = 256 // dtype.primitive_bitwidth  # a wgmma's k: 32 bytes of each operand row
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, HEAD_DIM, K_STEP])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // dtype.primitive_bitwidth)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [nw, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    RS: gl.constexpr = ROWSUM_MMA and FP8  # the row sum as P (f16) x ones on the tensor cores
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, ROWSUM_N, 16])
    pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)

    num_tasks = gl.load(num_work_ptr) * KV_HEADS
    if K_SCALE_PTR:  # a one-element device tensor, read here so a captured graph follows its value
        qk_scale = qk_scale * gl.load(k_scale_ptr)
    if V_SCALE_PTR:
        v_scale = v_scale * gl.load(v_scale_ptr)
    if CID == 1:  # the first consumer group issues first
        mbarrier.arrive(turn.index(0), count=1)
    turns = 0
    done = 0
    items = 0
    for r in range(_num_rounds(num_tasks)):
        t = _task(r)
        _stamp(LSE, t, CID, 0)
        w = t // KV_HEADS
        kvh = t % KV_HEADS
        tile, q_start, qo_len, kv_base, kv_len, delta, n_blocks, n_full = _item(
            work, w, qo_indptr, kv_indptr, last_page_len, GROUP, PAGE_SIZE, PAGED, CAUSAL)
        item_v_scale = v_scale
        if FP8:  # descales per tensor (stride 0) or per head: scale_q per row, scale_k / scale_v per KV head
            item_v_scale = v_scale * gl.load(v_descale + kvh * kv_descale_stride) / P_SCALE
        if Q_TMA:  # the producer's copy (_fetch_q), into this item's buffer of the two
            q_buf = q_smem.index((items % 2) * 2 + CID)
            mbarrier.wait(q_ready.index(items % 2), (items // 2) & 1)
            _stamp(LSE, t, CID, 8)
        else:
            q_buf = q_smem.index(CID)
            r_io = tile * BLOCK_M + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
            d_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
            tok_io = r_io // GROUP
            q_off = (q_start + tok_io).to(gl.int64) * stride_qt + (kvh * GROUP + r_io % GROUP).to(gl.int64) * \
                stride_qh
            q = gl.load(Q + q_off[:, None] + d_io[None, :], mask=(tok_io < qo_len)[:, None], other=0.0)
            q_buf.store(q)
            fence_async_shared()
            gl.thread_barrier()

        rows = tile * BLOCK_M + row0 + gl.arange(0, ROWS, layout=row_layout)
        tok = rows // GROUP
        row_ok = tok < qo_len
        row_qk_scale = qk_scale
        if FP8:
            dq_dk = gl.load(q_descale + (kvh * GROUP + rows % GROUP) * q_descale_stride) * gl.load(
                k_descale + kvh * kv_descale_stride)
            row_qk_scale = qk_scale * dq_dk
        if TRACE:  # once the item's loads (and fp8's V descale) have landed
            _stamp_after(LSE, t, CID, 9, n_blocks + q_start + qo_len + item_v_scale.to(gl.int32, bitcast=True))
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([ROWS], gl.float32, row_layout)
        out_acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        lsum = gl.zeros([ROWS, ROWSUM_N], gl.float32, l_layout)
        if n_blocks > 0:
            # FA3's order: S(j+1) and P.V(j) issued back to back while this group holds the turn (the other group
            # is in its softmax), then this group's softmax of block j+1 while both run.
            st = done % STAGES
            mbarrier.wait(k_ready.index(st), (done // STAGES) & 1)
            _stamp(LSE, t, CID, 1)
            s = warpgroup_mma(q_buf, k_smem.index(st).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32,
                              s_layout), use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            _stamp(LSE, t, CID, 2)
            mbarrier.arrive(k_empty.index(st), count=1)
            p_op, alpha, m_i, l_i, p_sum = _softmax_block(s, m_i, l_i, 0, n_full, kv_len, row_ok, delta, tok,
                                                          row_qk_scale, p_layout, dtype, CAUSAL, FP8, pl_layout)
            _stamp(LSE, t, CID, 3)
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
            for j in range(n_blocks - 1):
                g = done + j
                st = g % STAGES
                nst = (g + 1) % STAGES
                p_in = _p_operand(p_op, p_layout, FP8 and FP8_KEY_ORDER)
                mbarrier.wait(turn.index(CID), turns & 1)
                mbarrier.wait(k_ready.index(nst), ((g + 1) // STAGES) & 1)
                s = warpgroup_mma(q_buf, k_smem.index(nst).permute((1, 0)),
                                  gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
                if not KNOCK_PV:
                    acc = _rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), FP8)
                v_op = _v_ready(v_smem, v_ready, st, (g // STAGES) & 1, j, kv_len, io_layout, FP8)
                if not KNOCK_PV:
                    acc = warpgroup_mma(p_in, v_op, acc, is_async=True)
                if RS:
                    lsum = lsum * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
                    lsum = warpgroup_mma(p_sum, ones_smem.permute((1, 0)), lsum, is_async=True)
                mbarrier.arrive(turn.index(1 - CID), count=1)
                turns += 1
                # S(j+1); P.V(j) (and the row sum's product) may still run
                s = warpgroup_mma_wait(num_outstanding=(0 if KNOCK_PV else 1) + (1 if RS else 0), deps=(s,))
                mbarrier.arrive(k_empty.index(nst), count=1)
                p_op, alpha, m_i, l_i, p_sum = _softmax_block(s, m_i, l_i, j + 1, n_full, kv_len, row_ok, delta,
                                                              tok, row_qk_scale, p_layout, dtype, CAUSAL, FP8,
                                                              pl_layout)
                if RS:
                    acc, lsum = warpgroup_mma_wait(num_outstanding=0, deps=(acc, lsum))  # P.V(j), its row sum
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # P.V(j)
                mbarrier.arrive(v_empty.index(st), count=1)
                if FP8 and FP8_KEY_ORDER:
                    # P(j+1)'s words were made while P.V(j) read P(j)'s; carried as they are, ptxas gives both one
                    # set of registers and serializes every wgmma (C7513). A copy once P.V(j) is done keeps them apart.
                    p_op = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [p_op], dtype=gl.int32,
                                                     is_pure=False, pack=1)
                if RS:  # the same for the sum's f16 operand
                    p_sum = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [p_sum], dtype=gl.float16,
                                                      is_pure=False, pack=2)
            _stamp(LSE, t, CID, 4)
            if Q_TMA:  # every q.K^T of the item has completed: the producer may refill the buffer
                mbarrier.arrive(q_empty.index(items % 2), count=1)
            g = done + n_blocks - 1
            st = g % STAGES
            acc = _rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), FP8)
            v_op = _v_ready(v_smem, v_ready, st, (g // STAGES) & 1, n_blocks - 1, kv_len, io_layout, FP8)
            p_in = _p_operand(p_op, p_layout, FP8 and FP8_KEY_ORDER)
            if not KNOCK_PV:
                acc = warpgroup_mma(p_in, v_op, acc, is_async=True)
            if RS:
                lsum = lsum * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
                lsum = warpgroup_mma(p_sum, ones_smem.permute((1, 0)), lsum, is_async=True)
                out_acc, lsum = warpgroup_mma_wait(num_outstanding=0, deps=(acc, lsum))
                # every column holds the row's sum of P * P_SCALE (as e4m3 or f16): l in P's units
                l_i = gl.convert_layout(gl.max(lsum, 1), row_layout) * (1.0 / P_SCALE)
            else:
                out_acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _stamp(LSE, t, CID, 5)
            mbarrier.arrive(v_empty.index(st), count=1)
        elif Q_TMA:
            mbarrier.arrive(q_empty.index(items % 2), count=1)
        done += n_blocks
        items += 1

        # attention._finish, op for op
        empty = l_i == 0.0
        out_scale = gl.convert_layout(item_v_scale / gl.where(empty, 1.0, l_i), gl.SliceLayout(1, o_layout))
        out = out_acc * out_scale[:, None]
        if EPILOGUE_SMEM:  # through shared memory into rows of 16-byte pieces (see EPILOGUE_SMEM)
            out = gl.convert_layout(out.to(O.dtype.element_ty), io_layout)
            st_layout: gl.constexpr = io_layout
        else:
            out = out.to(O.dtype.element_ty)
            st_layout: gl.constexpr = o_layout
        o_rows = tile * BLOCK_M + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
        o_tok = o_rows // GROUP
        o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st_layout))
        o_off = (q_start + o_tok).to(gl.int64) * stride_ot + (kvh * GROUP + o_rows % GROUP).to(gl.int64) * stride_oh
        gl.store(O + o_off[:, None] + o_d[None, :], out, mask=(o_tok < qo_len)[:, None])
        if TRACE:  # the LSE buffer holds the stamps instead
            _stamp(LSE, t, CID, 6)
            gl.store(LSE.to(gl.pointer_type(gl.int64)) + (t * 2 + CID) * TRACE_SLOTS + 7,
                     n_blocks.to(gl.int64) + (gl.program_id(0).to(gl.int64) << 32))
        elif RETURN_LSE:
            lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
            l_off = (q_start + tok).to(gl.int64) * stride_lt + (kvh * GROUP + rows % GROUP).to(gl.int64) * stride_lh
            gl.store(LSE + l_off, lse, mask=row_ok)
        if not Q_TMA:
            gl.thread_barrier()  # every row's q read from q_smem before the next item overwrites it


@gluon.jit
def _consume_second(q_smem, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty,
                    Q, O, LSE, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                    work, num_work_ptr, qo_indptr, kv_indptr, last_page_len,
                    qk_scale, v_scale, k_scale_ptr, v_scale_ptr, q_descale, k_descale, v_descale,
                    q_descale_stride, kv_descale_stride,
                    GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, CAUSAL: gl.constexpr,
                    RETURN_LSE: gl.constexpr, K_SCALE_PTR: gl.constexpr, V_SCALE_PTR: gl.constexpr,
                    FP8: gl.constexpr, turn, q_ready, q_empty, Q_TMA: gl.constexpr, KV_HEADS: gl.constexpr):
    _consume(q_smem, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty,
             Q, O, LSE, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
             work, num_work_ptr, qo_indptr, kv_indptr, last_page_len,
             qk_scale, v_scale, k_scale_ptr, v_scale_ptr, q_descale, k_descale, v_descale, q_descale_stride,
             kv_descale_stride, BLOCK_M // 2,
             GROUP, PAGE_SIZE, PAGED, CAUSAL, RETURN_LSE, K_SCALE_PTR, V_SCALE_PTR, FP8, turn, 1, q_ready, q_empty,
             Q_TMA, KV_HEADS)


@gluon.jit
def prefill_ws_kernel(Q, q_desc, k_desc, v_desc, O, LSE,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                      work, num_work_ptr, qo_indptr, kv_indptr, kv_indices, last_page_len,
                      k_page_rows, k_head_rows, k_head_cols, v_page_rows, v_head_rows, v_head_cols,
                      qk_scale, v_scale, k_scale_ptr, v_scale_ptr,
                      kv_tok_indptr, q_descale, k_descale, v_descale, q_descale_stride, kv_descale_stride,
                      GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, BOX: gl.constexpr, PAGED: gl.constexpr,
                      CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, K_SCALE_PTR: gl.constexpr,
                      V_SCALE_PTR: gl.constexpr, FP8: gl.constexpr, Q_TMA: gl.constexpr, KV_HEADS: gl.constexpr):
    """Persistent: each program walks its share of the (work item, KV head) tasks (_task), so a program's producer
    fetches its next task's q and K/V while the current one ends.
    FP8: fp8 q and K/V, both products on fp8 tensor cores; v_desc then addresses V^T (keys contiguous, the
    operand order fp8 wgmma reads), q/k/v descales as prefill_kernel's FP8_QKV."""
    dtype: gl.constexpr = Q.dtype.element_ty
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, HEAD_DIM], dtype)
    # [item buffer, consumer group]: two items' q with the producer's copies, one the consumers load themselves
    q_smem = gl.allocate_shared_memory(dtype, [4 if Q_TMA else 2, BLOCK_M // 2, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    if FP8:  # V^T tiles
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
    else:
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    if ROWSUM_MMA and FP8:  # the row sum's B operand: [8, keys] of f16 ones (keys contiguous)
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWSUM_N, BLOCK_N], gl.float16)
        ones = gl.full([ROWSUM_N, BLOCK_N], 1.0, gl.float32,
                       gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])).to(gl.float16)
        ones_smem = gl.allocate_shared_memory(gl.float16, [ROWSUM_N, BLOCK_N], ones_layout, value=ones)
        fence_async_shared()
    else:
        ones_smem = k_smem  # not read
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer group
        mbarrier.init(v_empty.index(i), count=2)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # ping-pong: whose turn to issue
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer group
    gl.warp_specialize([
        (_consume, (q_smem, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty,
                    Q, O, LSE, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                    work, num_work_ptr, qo_indptr, kv_indptr, last_page_len,
                    qk_scale, v_scale, k_scale_ptr, v_scale_ptr, q_descale, k_descale, v_descale, q_descale_stride,
                    kv_descale_stride, 0,
                    GROUP, PAGE_SIZE, PAGED, CAUSAL, RETURN_LSE, K_SCALE_PTR, V_SCALE_PTR, FP8, turn, 0, q_ready,
                    q_empty, Q_TMA, KV_HEADS)),
        (_consume_second, (q_smem, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty,
                           Q, O, LSE, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                           work, num_work_ptr, qo_indptr, kv_indptr, last_page_len,
                           qk_scale, v_scale, k_scale_ptr, v_scale_ptr, q_descale, k_descale, v_descale,
                           q_descale_stride, kv_descale_stride,
                           GROUP, PAGE_SIZE, PAGED, CAUSAL, RETURN_LSE, K_SCALE_PTR, V_SCALE_PTR, FP8, turn, q_ready,
                           q_empty, Q_TMA, KV_HEADS)),
        (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                    v_empty,
                    work, num_work_ptr, qo_indptr, kv_indptr, kv_indices, last_page_len,
                    k_page_rows, k_head_rows, k_head_cols, v_page_rows, v_head_rows, v_head_cols, kv_tok_indptr,
                    GROUP, PAGE_SIZE, BOX, PAGED, CAUSAL, FP8, Q_TMA, KV_HEADS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _capability(device: torch.device):
    return cuda_properties(device)[0]


def _num_sms(device: torch.device) -> int:
    return cuda_properties(device)[1]


# The persistent grid is dealt statically (_task's snake), so its time is its most loaded program's. Where a
# batch's tasks repeat with a period near the SM count (equal causal requests: each request's tiles, costliest
# first, one a KV head), the rounds drift against that period and the snake stops pairing dear tasks with cheap
# ones: 8 x 2048 keys, group 1, on 132 SMs loads the busiest program 1.68x the mean (128 programs: 1.03x).
# persistent_programs tries a few smaller grids and keeps the one whose busiest program carries least.
# grids tried: the SM count and up to this many fewer programs (over 276 random and equal-length batches the model
# gained 1.055x on average with 4 or 8; 4 tries half as many grids)
BALANCE_SPAN = 4
BALANCED = 1.02  # a busiest program within this factor of the mean: the SM count's grid stands
# Past this many rounds a plan tries only grids whose rounds align with its requests (all requests the same
# number of tiles): each try reads every task (~25 us at 16K tasks on a fast host).
SEARCH_ROUNDS = 32


def program_loads(task_costs: np.ndarray, programs: int) -> np.ndarray:
    """Each program's summed task cost under _task's deal (round r: tasks r*P .. r*P + P-1, to programs 0..P-1 on
    even rounds, P-1..0 on odd ones; _num_rounds gives the last, partial round's tasks to the same programs)."""
    rounds = -(-task_costs.size // programs)
    dealt = np.zeros(rounds * programs, dtype=task_costs.dtype)
    dealt[: task_costs.size] = task_costs
    dealt = dealt.reshape(rounds, programs)
    dealt[1::2] = dealt[1::2, ::-1]
    return np.add.reduce(dealt, axis=0)


def grid_candidates(num_tasks: int, num_kv_heads: int, num_sms: int, items_per_request: Optional[int] = None):
    """The smaller grids persistent_programs tries, in order (none: the SM count stands, and the plan need not
    compute its items' costs): up to BALANCE_SPAN fewer programs, those whose rounds hold whole requests (or
    whole halves, quarters.. of one) first, and past SEARCH_ROUNDS rounds only those."""
    if num_tasks <= num_sms:
        return []
    tried = range(num_sms - 1, num_sms - BALANCE_SPAN - 1, -1)
    aligned = []
    if items_per_request:
        period = items_per_request * num_kv_heads
        aligned = [p for p in tried if p % period == 0 or (period % p == 0 and (period // p) % 2 == 0)]
    if num_tasks > SEARCH_ROUNDS * num_sms:
        return aligned
    return [*aligned, *(p for p in tried if p not in aligned)]


def persistent_programs(item_costs: np.ndarray, num_kv_heads: int, num_sms: int,
                        items_per_request: Optional[int] = None, candidates: Optional[list] = None) -> int:
    """The persistent grid for a plan whose work items cost item_costs each (one task an item and KV head, the
    KV head fastest): the SM count unless a grid of up to BALANCE_SPAN fewer programs leaves its busiest program
    less to do. items_per_request: where every request has that many items, grids whose rounds hold whole
    requests, or whole halves, quarters.. of one, are tried first (the snake then pairs each tile with its
    mirror), and past SEARCH_ROUNDS only those. A task is computed whole by one program, so the grid changes no
    bit of the result. candidates: grid_candidates' answer where the caller has it already."""
    num_tasks = item_costs.size * num_kv_heads
    if num_tasks <= num_sms:
        return int(num_tasks)
    if candidates is None:
        candidates = grid_candidates(num_tasks, num_kv_heads, num_sms, items_per_request)
    if not candidates:
        return num_sms
    task_costs = np.repeat(item_costs.astype(np.int64), num_kv_heads)
    total = int(np.add.reduce(task_costs))
    best_programs, best_load = num_sms, int(np.maximum.reduce(program_loads(task_costs, num_sms)))
    if best_load <= BALANCED * total / num_sms:
        return num_sms
    for programs in candidates:
        if total / programs >= best_load:  # even a perfect deal on fewer programs carries more
            continue
        load = int(np.maximum.reduce(program_loads(task_costs, programs)))
        if load < best_load:
            best_programs, best_load = programs, load
            if load <= BALANCED * total / programs:
                break
    return best_programs


SCALES_AT = 24  # launch(): where (qk_scale, v_scale, k_scale_ptr, v_scale_ptr) stand among the kernel's arguments
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
              torch.float8_e5m2: gl.float8e5}


@functools.lru_cache(maxsize=None)
def _smem_layout(shape: tuple, dtype: torch.dtype):
    """A TMA box's shared-memory layout (made once per shape: the descriptors are built on every launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), _GL_DTYPES[dtype])


def _fp8_enabled() -> bool:
    """fp8 attention (fp8 q and K/V) on this kernel: on since session 12, where with the softmax fma (common.py)
    it ran 1.02-1.09x prefill_kernel's fp8 tiles (H200, alternating processes); SERVEATTN_PREFILL_WS_FP8=0 keeps
    fp8 attention on prefill_kernel (the same bits)."""
    return knobs.get("SERVEATTN_PREFILL_WS_FP8", "1") == "1"


def _enabled() -> bool:
    return knobs.get("SERVEATTN_PREFILL_WS", "1") == "1" and knobs.get("TRITON_INTERPRET", "0") != "1"


def _row_map(t: torch.Tensor, strides, num_kv_heads: int, head_dim: int):
    """(slot stride, page rows, head rows, head cols) of K or V as rows of a [rows, slot stride] view, or None
    when the cache's strides do not allow that view (see the module docstring)."""
    page_stride, slot_stride, head_stride = strides
    align = 16 // t.element_size()  # TMA: 16-byte row strides and column offsets
    if t.stride(-1) != 1 or slot_stride <= 0 or slot_stride % align or t.data_ptr() % 16:
        return None
    if page_stride % slot_stride:
        return None
    if head_stride % slot_stride == 0:
        head_rows, head_cols = head_stride // slot_stride, 0
    elif head_stride * (num_kv_heads - 1) + head_dim <= slot_stride and head_stride % align == 0:
        head_rows, head_cols = 0, head_stride
    else:
        return None
    return slot_stride, page_stride // slot_stride, head_rows, head_cols


_VALIDATED = {}  # (dtype, strides, block shape) a TensorDescriptor has validated -> its shared-memory layout


def _tma_descriptor(base: torch.Tensor, shape: list, strides: list, block_shape: list) -> TensorDescriptor:
    """A TensorDescriptor, its dataclass checks (a third of our launch's host time) made once per (dtype,
    strides, block shape): what they check depends on nothing else but the base's alignment and the shape's
    positivity, checked here on every call (the callers have checked both already)."""
    key = (base.dtype, tuple(strides), tuple(block_shape))
    layout = _VALIDATED.get(key)
    if layout is None or base.data_ptr() % 16 or min(shape) <= 0:
        desc = TensorDescriptor(base, shape, strides, block_shape, _smem_layout(key[2], base.dtype))
        _VALIDATED[key] = desc.layout
        return desc
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block_shape, layout=layout,
                         padding="zero")
    return desc


def _descriptor(t: torch.Tensor, slot_stride: int, box: int, head_dim: int):
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    rows = cdiv(extent, slot_stride)  # host integers: triton.cdiv is a jit function, microseconds a call
    return _tma_descriptor(t, [rows, slot_stride], [slot_stride, 1], [box, head_dim]), rows


_KEPT = {}  # _kept_descriptor's memo: id(cache) -> (weakref, what its entries follow from, {layout: made})
_KEPT_MAX = 1024  # live caches only: a dead cache's entry goes with it


def _kept_descriptor(t: torch.Tensor, strides, num_kv_heads: int, box: int, head_dim: int):
    """(_row_map, then its _descriptor and rows; (None, None, None) where the map is None) of a paged K or V cache,
    kept per cache tensor (the same view object at every step of a server, through prefill._cache_views): ~3 us a
    run. An entry holds while the tensor's address, shape, strides, dtype and device are the ones it was made from; its
    descriptors are of a detached alias, so they do not keep `t` alive, and the entry goes when `t` dies."""
    key, what = id(t), (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    held = _KEPT.get(key)
    if held is None or held[0]() is not t or held[1] != what:
        if len(_KEPT) >= _KEPT_MAX:
            _KEPT.clear()
        held = _KEPT[key] = (weakref.ref(t, lambda _, key=key: _KEPT.pop(key, None)), what, {})
    layout = (strides, num_kv_heads, box, head_dim)
    made = held[2].get(layout)
    if made is None:
        row_map = _row_map(t, strides, num_kv_heads, head_dim)
        made = (None, None, None) if row_map is None else \
            (row_map, *_descriptor(t.detach(), row_map[0], box, head_dim))
        held[2][layout] = made
    return made


def takes_fp8(device: torch.device, head_dim: int, page_size, rows: Optional[int]) -> bool:
    """Whether an fp8 q+KV plan should get this kernel's tiles (prefill.choose_tiles): served here when V^T is
    made (prefill.transposed_v: a request with more than one query tile, `rows` = its (token, head) rows; not
    under CUDA graphs, rows=None) and the pages suit TMA (page_size None: ragged)."""
    if not (_enabled() and _fp8_enabled() and device.type == "cuda" and rows is not None and rows > BLOCK_M.value):
        return False
    ok_pages = page_size is None or (page_size >= 8 and page_size & (page_size - 1) == 0)
    return ok_pages and head_dim in HEAD_DIMS and _capability(device) == (9, 0)


def _q_descriptor(q: torch.Tensor, group: int, head_dim: int):
    """q as [tokens, heads, dim] for _fetch_q, or None (the consumers load q themselves) where a consumer
    group's 64 rows are not whole tokens or q's strides do not suit TMA. SERVEATTN_PREFILL_WS_QTMA=0: never."""
    if knobs.get("SERVEATTN_PREFILL_WS_QTMA", "1") != "1" or (BLOCK_M.value // 2) % group:
        return None
    es, strides = q.element_size(), q.stride()
    if strides[2] != 1 or (strides[0] * es) % 16 or (strides[1] * es) % 16 or q.data_ptr() % 16:
        return None
    return _tma_descriptor(q, list(q.shape), list(strides), [BLOCK_M.value // 2 // group, group, head_dim])


def serves(q, k, v, plan, descales, as_ragged: bool = False) -> bool:
    """Whether this call's kind is the warp-specialized kernel's (launch() still checks the cache's strides);
    otherwise the call takes prefill_kernel, which gives the same bits. as_ragged: for the plan's keys copied
    into ragged rows of q's dtype (attention._launch_gathered), whatever the cache's dtype and page size.
    descales: fp8 q and K/V (FP8_QKV), served with V^T (plan.vt_work) only."""
    if as_ragged:
        k = v = q
    fp8 = descales is not None
    if not (_enabled() and q.is_cuda and (plan.vt_work is not None) == fp8):
        return False
    if _capability(q.device) != (9, 0):
        return False
    if fp8:
        if not _fp8_enabled() or q.dtype not in FP8_DTYPES or k.dtype not in FP8_DTYPES or v.dtype != k.dtype:
            return False
    elif q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if not _serves_kind(plan):
        return False
    return not plan.paged or as_ragged or _tma_pages(plan.page_size)


def _serves_kind(plan) -> bool:
    """The plan's settings this kernel serves: its head dims and tiles, no mask, window, soft cap, RoPE or tree."""
    if plan.head_dim not in HEAD_DIMS or plan.tiles.block_m != BLOCK_M.value or plan.tiles.block_n != BLOCK_N.value:
        return False
    return not (plan.has_mask or plan.window_left >= 0 or plan.soft_cap > 0 or plan.rope
                or plan.tree_mask is not None or plan.tree_mask_host is not None)


def _tma_pages(page_size: int) -> bool:
    return page_size >= 8 and page_size & (page_size - 1) == 0


def takes_16bit(plan, graphed: bool, gather_fits: bool) -> bool:
    """Whether a 16-bit-query plan's calls will run on this kernel (serves() at plan time, no tensors yet):
    prefill.split_chunk leaves such plans unsplit (session 28, H200: this kernel unsplit ran 1.25-2.4x the split
    prefill_kernel on 1-4 requests of 128-512 rows over 8-32K keys). K/V of q's dtype: ragged, or pages that
    suit TMA (other page sizes are copied only where that pays, decided at run()); an fp8 cache: copied into
    ragged rows, never under CUDA graphs (graphed), and only where the widened copy fits attention's
    GATHER_MAX_BYTES (gather_fits)."""
    if not (_enabled() and plan.device.type == "cuda" and plan.q_dtype in (torch.bfloat16, torch.float16)):
        return False
    if not _serves_kind(plan) or _capability(plan.device) != (9, 0):
        return False
    if plan.kv_dtype == plan.q_dtype:
        return not plan.paged or _tma_pages(plan.page_size)
    return plan.kv_dtype in FP8_DTYPES and plan.paged and not graphed and gather_fits


def launch(q, k, v, out, lse, plan, sk, sv, grid0: int, qk_scale: float, v_scale: float, ks_ptr, vs_ptr,
           ks_dev: bool, vs_dev: bool, descales=None, vt=None, replay_gather_ok=None, transpose=None,
           replay_scales: bool = False) -> bool:
    """Launches the kernel if the cache's layout allows its TMA view; False (nothing launched) if not.
    descales, vt: fp8 attention's (scale_q, scale_k, scale_v) and V^T ([kv heads, head dim, columns],
    attention.transpose_v_kernel; transpose: that launch's (Pack, arguments, grid)). replay_gather_ok:
    attention.launch's gather_ok, given where its call had no scales (fp8: descales only) and came here directly:
    the plan's first such launch (fp8: with its transpose) is kept as its replay.Replay. replay_scales: that
    Replay takes each call's scales (attention._launch_gathered's ragged plan: k_scale/v_scale floats or tensors)."""
    lse_arg = lse if lse is not None else out
    slt, slh = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    fp8 = descales is not None
    if not plan.paged:  # ragged: a token is a row (kv_strides gives (token, 0, head))
        sk, sv = (sk[0], sk[0], sk[2]), (sv[0], sv[0], sv[2])
    box = min(plan.page_size, BLOCK_N.value) if plan.paged else BLOCK_N.value
    if plan.paged:  # a paged cache's views are the same objects at every step (prefill._cache_views)
        k_map, k_desc, k_rows = _kept_descriptor(k, sk, plan.num_kv_heads, box, plan.head_dim)
    else:
        k_map = _row_map(k, sk, plan.num_kv_heads, plan.head_dim)
    if fp8:  # V^T as a [kv heads * head dim, columns] matrix: head h's rows start at h * head dim
        v_map = (vt.shape[-1], 0, plan.head_dim, 0)
    elif plan.paged:
        v_map, v_desc, v_rows = _kept_descriptor(v, sv, plan.num_kv_heads, box, plan.head_dim)
    else:
        v_map = _row_map(v, sv, plan.num_kv_heads, plan.head_dim)
    if k_map is None or v_map is None:
        return False
    if not plan.paged:
        k_desc, k_rows = _descriptor(k, k_map[0], box, plan.head_dim)
    if fp8:
        v_rows = plan.num_kv_heads * plan.head_dim
        v_desc = _tma_descriptor(vt, [v_rows, vt.shape[-1]], [vt.shape[-1], 1], [plan.head_dim, BLOCK_N.value])
        dq, dk, dv = descales
        descale_args = (plan.kv_tok_indptr, dq, dk, dv, int(dq.numel() > 1), int(dk.numel() > 1))
    else:
        if not plan.paged:
            v_desc, v_rows = _descriptor(v, v_map[0], box, plan.head_dim)
        descale_args = (plan.work,) * 4 + (0, 0)
    if max(k_rows, v_rows) >= 2 ** 31:
        return False
    q_desc = _q_descriptor(q, plan.group, plan.head_dim)
    # one program per SM (its registers allow no second): grid0 x KV heads tasks at most, or the plan's balanced
    # grid (prefill.make_plan: persistent_programs); SERVEATTN_PREFILL_WS_PERSISTENT=0 gives every task its own
    # program (measuring only)
    programs = grid0 * plan.num_kv_heads
    if knobs.get("SERVEATTN_PREFILL_WS_PERSISTENT", "1") == "1":
        programs = min(programs, plan.ws_programs or _num_sms(q.device))
    kind = (lse is not None, ks_dev, vs_dev, fp8, q_desc is not None)
    pack = plan.launch_memo.get(kind)
    args = (q, k_desc if q_desc is None else q_desc, k_desc, v_desc, out, lse_arg,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), slt, slh,
            plan.work, plan.num_work, plan.qo_indptr, plan.kv_indptr,
            plan.kv_indices if plan.paged else plan.work, plan.last_page_len if plan.paged else plan.work,
            k_map[1], k_map[2], k_map[3], v_map[1], v_map[2], v_map[3],
            qk_scale, v_scale, ks_ptr, vs_ptr, *descale_args)
    assert args[SCALES_AT] is qk_scale and args[SCALES_AT + 3] is vs_ptr
    if pack is None:  # the plan's own arguments keyed once per plan and kind (launch.Pack)
        kwargs = dict(GROUP=plan.group, PAGE_SIZE=plan.page_size, BOX=box, PAGED=plan.paged, CAUSAL=plan.causal,
                      RETURN_LSE=lse is not None, K_SCALE_PTR=ks_dev, V_SCALE_PTR=vs_dev, FP8=fp8,
                      Q_TMA=q_desc is not None, KV_HEADS=plan.num_kv_heads, num_warps=4, maxnreg=MAX_REGS,
                      **LAUNCH_OPTIONS)
        # the schedule arrays, the scale placeholders and (fp8) the column indptr, or the descale placeholders
        fixed = (12, 13, 14, 15, 16, 17) + ((26,) if not ks_dev else ()) + ((27,) if not vs_dev else ()) + \
            ((28,) if fp8 else (28, 29, 30, 31))
        pack = plan.launch_memo[kind] = Pack(prefill_ws_kernel, args, kwargs, fixed)
    pack((programs, 1), *args)
    if (replay_gather_ok is not None and fp8 == (transpose is not None) and (replay_scales or not (ks_dev or vs_dev))
            and replay.KEY not in plan.launch_memo and replay.aligned(q, out, lse, *(descales or ()))
            and (plan.paged or replay.aligned(k, v))
            and replay.aligned(*(t for t, dev in ((ks_ptr, ks_dev), (vs_ptr, vs_dev)) if dev))):
        arg_key = pack.arguments_key(args)
        t_key = transpose[0].arguments_key(transpose[1]) if fp8 else None
        if arg_key is not None and (t_key is not None or not fp8):
            plan.launch_memo[replay.KEY] = replay.Replay(
                pack, arg_key, args, (programs, 1), q, k, v, out, lse, grid0, replay_gather_ok, not plan.paged,
                TensorDescriptor, descales, transpose and (transpose[0], t_key, transpose[1], transpose[2]),
                SCALES_AT if replay_scales else None, (ks_dev, vs_dev) if replay_scales else None)
    return True
