"""Paged K/V gathered into contiguous (ragged) rows in the query's 16-bit dtype: how an fp8 cache reaches the
warp-specialized prefill kernel (attention_ws.py), whose consumers have no registers left to widen fp8 tiles, and
how a 16-bit cache takes that kernel's ragged path where the copy pays (attention._gathered_plan).

One program per page of the table with all its KV heads (or a group of them, where a page holds more than
TILE_ELEMENTS values per tensor), so an NHD page is one contiguous run in and out (until session 15 a program
moved one head's 256-byte rows). The page's valid slots (all of them, or last_page_len for a request's last page)
are widened exactly (common.widen: every fp8 value is a 16-bit value) and written to rows tok_indptr[r] + (page -
first page of r) * PAGE_SIZE + slot of the output, [tokens, kv heads, head dim]. The gathered rows are the
dequantized cache, so attention over them is, bitwise, the run on `cache.to(q.dtype)` (API.md). At 8192 keys x 8
heads x 128, an fp8 cache's copy moves 50 MB (about 12 us at the copy rate) against a millisecond of attention.
"""
import triton
import triton.language as tl

from .common import widen
from .launch import Pack
from .sizes import cdiv, next_pow2

TILE_ELEMENTS = 16384  # values a program moves per tensor (8 warps: 64 a thread)


@triton.jit
def gather_widen_kernel(K, V, KO, VO, page_req, kv_indptr, kv_indices, last_page_len, tok_indptr,
                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ot, stride_oh,
                        num_kv_heads, PAGE_SIZE: tl.constexpr, BLOCK_S: tl.constexpr, HEADS: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)  # position in kv_indices
    h0 = tl.program_id(1) * HEADS
    req = tl.load(page_req + i)
    first = tl.load(kv_indptr + req)
    last = tl.load(kv_indptr + req + 1) - 1
    valid = tl.where(i == last, tl.load(last_page_len + req), PAGE_SIZE)
    page = tl.load(kv_indices + i).to(tl.int64)
    # rows of the tile: (slot, head) pairs, head fastest, so an NHD page and its output rows are one contiguous run
    r = tl.arange(0, BLOCK_S * HEADS)
    slot = (r // HEADS).to(tl.int64)
    head = (h0 + r % HEADS).to(tl.int64)
    ok = ((slot < valid) & (head < num_kv_heads))[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    row = tl.load(tok_indptr + req).to(tl.int64) + (i - first).to(tl.int64) * PAGE_SIZE + slot
    out = (row * stride_ot + head * stride_oh)[:, None] + d
    dtype = KO.dtype.element_ty
    k = tl.load(K + (page * stride_kp + slot * stride_ks + head * stride_kh)[:, None] + d, mask=ok)
    tl.store(KO + out, widen(k, dtype), mask=ok)
    v = tl.load(V + (page * stride_vp + slot * stride_vs + head * stride_vh)[:, None] + d, mask=ok)
    tl.store(VO + out, widen(v, dtype), mask=ok)


def gather_widen(k, v, ko, vo, page_req, kv_indptr, kv_indices, last_page_len, tok_indptr, sk, sv,
                 page_size: int, head_dim: int, num_pages: int, num_kv_heads: int, memo=None):
    """Launches gather_widen_kernel over num_pages table entries (sk/sv: (page, slot, head) strides). memo: the
    plan's launch memo, which keeps the launch's Pack (the plan's tensors, page_req to tok_indptr, keyed once).
    Returns (Pack, arguments, grid), for a replay (kernels/replay.Gathered)."""
    if num_pages == 0:
        return None
    block_s = next_pow2(page_size)
    # a program copies a page's keys for up to TILE_ELEMENTS // (slots x head dim) of its KV heads
    heads = min(next_pow2(num_kv_heads), max(1, TILE_ELEMENTS // (block_s * head_dim)))
    grid = (num_pages, cdiv(num_kv_heads, heads))
    args = (k, v, ko, vo, page_req, kv_indptr, kv_indices, last_page_len, tok_indptr,
            *sk, *sv, ko.stride(0), ko.stride(1), num_kv_heads)
    kwargs = dict(PAGE_SIZE=page_size, BLOCK_S=block_s, HEADS=heads, HEAD_DIM=head_dim, num_warps=8)
    memo = {} if memo is None else memo
    pack = memo.get("gather_widen")
    if pack is None:
        pack = memo["gather_widen"] = Pack(gather_widen_kernel, args, kwargs, (4, 5, 6, 7, 8))
    pack(grid, *args)
    return pack, args, grid
