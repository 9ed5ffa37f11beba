"""Paged K/V gathered into contiguous (ragged) rows in the query's 16-bit dtype: how an fp8 cache reaches the
warp-specialized prefill kernel (attention_ws.py), whose consumers have no registers left to widen fp8 tiles.

One program per (page of the table, KV head): the page's valid slots (all of them, or last_page_len for a
request's last page) are widened exactly (common.widen: every fp8 value is a 16-bit value) and written to rows
tok_indptr[r] + (page - first page of r) * PAGE_SIZE + slot of the output, [tokens, kv heads, head dim]. The
gathered rows are the dequantized cache, so attention over them is, bitwise, the run on `cache.to(q.dtype)`
(API.md). The copy reads the fp8 bytes once and writes twice as many: at 8192 keys x 8 heads x 128 a few
microseconds against a millisecond of attention.
"""
import triton
import triton.language as tl

from .common import widen
from .launch import launch as launch_jit
from .sizes import next_pow2


@triton.jit
def gather_widen_kernel(K, V, KO, VO, page_req, kv_indptr, kv_indices, last_page_len, tok_indptr,
                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ot, stride_oh,
                        PAGE_SIZE: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)  # position in kv_indices
    kvh = tl.program_id(1).to(tl.int64)
    req = tl.load(page_req + i)
    first = tl.load(kv_indptr + req)
    last = tl.load(kv_indptr + req + 1) - 1
    valid = tl.where(i == last, tl.load(last_page_len + req), PAGE_SIZE)
    page = tl.load(kv_indices + i).to(tl.int64)
    slot = tl.arange(0, BLOCK_S)
    ok = slot < valid
    d = tl.arange(0, HEAD_DIM)
    row = tl.load(tok_indptr + req).to(tl.int64) + (i - first).to(tl.int64) * PAGE_SIZE + slot
    dtype = KO.dtype.element_ty
    k = tl.load(K + (page * stride_kp + kvh * stride_kh + slot.to(tl.int64) * stride_ks)[:, None] + d[None, :],
                mask=ok[:, None])
    v = tl.load(V + (page * stride_vp + kvh * stride_vh + slot.to(tl.int64) * stride_vs)[:, None] + d[None, :],
                mask=ok[:, None])
    out = (row * stride_ot + kvh * stride_oh)[:, None] + d[None, :]
    tl.store(KO + out, widen(k, dtype), mask=ok[:, None])
    tl.store(VO + out, widen(v, dtype), mask=ok[:, None])


def gather_widen(k, v, ko, vo, page_req, kv_indptr, kv_indices, last_page_len, tok_indptr, sk, sv,
                 page_size: int, head_dim: int, num_pages: int, num_kv_heads: int):
    """Launches gather_widen_kernel over num_pages table entries (sk/sv: (page, slot, head) strides)."""
    if num_pages == 0:
        return
    launch_jit(gather_widen_kernel, (num_pages, num_kv_heads),
        k, v, ko, vo, page_req, kv_indptr, kv_indices, last_page_len, tok_indptr,
        *sk, *sv, ko.stride(0), ko.stride(1),
        PAGE_SIZE=page_size, BLOCK_S=next_pow2(page_size), HEAD_DIM=head_dim)
