"""Triton kernel for `append_paged_kv_cache`: scatter appended K/V tokens into their cache pages.

Grid: (token blocks, kv heads). Each program copies a `[BLOCK_T, BLOCK_D]` tile of K and of V for one
head; the destination page and slot of each token come from batch_indices/positions through the CSR
page table; a token of request -1 (padding) is skipped. The caller passes NHD-ordered views (page, slot, head, dim) of both caches, so HND caches,
the two halves of a 5-D cache and caches that are slices of larger buffers all arrive as strides.
Every tensor's last (D) stride is 1.

With QUANT, 16-bit K/V are quantized into an fp8 cache on the way: x / scale as an IEEE float32 division
(`div_rn`, as torch's), saturated to +-FP8_MAX in float32 (NaN passes both comparisons untouched), then
converted with round-to-nearest-even; a NaN is stored as the canonical 0x7F. The scales are float
arguments, or (SCALE_PTR) one-element float32 tensors read in the kernel, so that nothing syncs.
"""
import triton
import triton.language as tl

from .common import to_float32, to_fp8
from .sizes import cdiv, next_pow2


@triton.jit
def _quantize(x, scale, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    q = tl.div_rn(to_float32(x), scale)
    q = tl.where(q > FP8_MAX, FP8_MAX, q)
    q = tl.where(q < -FP8_MAX, -FP8_MAX, q)
    bits = to_fp8(q, dtype).to(tl.uint8, bitcast=True)
    bits = tl.where(q == q, bits, 0x7F)
    return bits.to(dtype, bitcast=True)


@triton.jit
def _append_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr,
    batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
    k_scale, v_scale,
    nnz, page_size, head_dim,
    s_key_t, s_key_h, s_value_t, s_value_h,
    s_kc_page, s_kc_slot, s_kc_head, s_vc_page, s_vc_slot, s_vc_head,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, SCALE_PTR: tl.constexpr, FP8_MAX: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    batch = tl.load(batch_indices_ptr + tokens, mask=tokens < nnz, other=-1)
    token_ok = batch >= 0  # request -1: padding (get_batch_indices_positions past the appended tokens), not written
    tile_ok = token_ok[:, None] & (dims < head_dim)[None, :]
    pos = tl.load(positions_ptr + tokens, mask=token_ok, other=0)
    page_entry = tl.load(kv_indptr_ptr + batch, mask=token_ok, other=0) + pos // page_size
    # int64 from here on: page * page stride exceeds 2**31 elements for large caches.
    page = tl.load(kv_indices_ptr + page_entry, mask=token_ok, other=0).to(tl.int64)
    slot = (pos % page_size).to(tl.int64)
    t64 = tokens.to(tl.int64)
    d64 = dims.to(tl.int64)

    key = tl.load(key_ptr + (t64 * s_key_t + head * s_key_h)[:, None] + d64[None, :], mask=tile_ok)
    value = tl.load(value_ptr + (t64 * s_value_t + head * s_value_h)[:, None] + d64[None, :], mask=tile_ok)
    if QUANT:
        if SCALE_PTR:
            ks = tl.load(k_scale)
            vs = tl.load(v_scale)
        else:
            ks = k_scale
            vs = v_scale
        key = _quantize(key, ks, FP8_MAX, k_cache_ptr.dtype.element_ty)
        value = _quantize(value, vs, FP8_MAX, v_cache_ptr.dtype.element_ty)
    k_dst = page * s_kc_page + slot * s_kc_slot + head * s_kc_head
    v_dst = page * s_vc_page + slot * s_vc_slot + head * s_vc_head
    tl.store(k_cache_ptr + k_dst[:, None] + d64[None, :], key, mask=tile_ok)
    tl.store(v_cache_ptr + v_dst[:, None] + d64[None, :], value, mask=tile_ok)


def append(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
           k_scale=None, v_scale=None):
    """k_cache/v_cache: NHD-ordered views `[pages, page_size, Hkv, D]`. Every tensor's last stride is 1
    (the caller copies append_key/append_value otherwise): a unit D stride is what makes the loads wide.
    k_scale/v_scale (both or neither): quantize 16-bit K/V into the fp8 cache; float32-exact Python floats
    or 0-d float32 tensors on the cache's device (validated by the caller)."""
    nnz, num_kv_heads, head_dim = append_key.shape
    if nnz == 0:
        return
    quant = k_scale is not None
    scale_ptr = quant and hasattr(k_scale, "data_ptr")
    fp8_max = {"torch.float8_e4m3fn": 448.0, "torch.float8_e5m2": 57344.0}.get(str(k_cache.dtype), 0.0)
    block_d = next_pow2(head_dim)
    # About 2K elements per tile: wide enough to vectorise D, small enough for decode batches.
    block_t = max(1, min(64, 2048 // block_d, next_pow2(nnz)))
    grid = (cdiv(nnz, block_t), num_kv_heads)
    # the index arrays are read at unit stride: a strided view (a column of a table, x[::2]) is copied first
    batch_indices, positions, kv_indptr, kv_indices = (
        t.contiguous() for t in (batch_indices, positions, kv_indptr, kv_indices))
    _append_kernel[grid](
        append_key, append_value, k_cache, v_cache,
        batch_indices, positions, kv_indptr, kv_indices,
        k_scale if quant else 1.0, v_scale if quant else 1.0,
        nnz, k_cache.shape[1], head_dim,
        *append_key.stride()[:2], *append_value.stride()[:2],
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        BLOCK_T=block_t, BLOCK_D=block_d,
        QUANT=quant, SCALE_PTR=scale_ptr, FP8_MAX=fp8_max if quant else 0.0,
    )
