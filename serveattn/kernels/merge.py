"""Triton kernels that merge attention states (v, s) computed over disjoint KV segments; s is base-2 LSE.

Grid: (rows, head blocks). Each program loads a `[BLOCK_H, BLOCK_D]` tile of every state of one row and
reduces in fp32:  m = max_i s_i,  w_i = exp2(s_i - m),  v = sum_i w_i v_i / sum_i w_i,  s = m + log2(sum_i w_i).
A state with s = -inf has weight 0 and its v is never multiplied in (so garbage there cannot leak as
0 * inf = NaN); a row whose states are all -inf comes out v = 0, s = -inf. A NaN or +inf s is no empty state:
the row comes out NaN (the max propagates NaN, exp2(inf - inf) is NaN, and the total carries it), never a valid
state's values dropped as if every state were empty. The states of a row are
visited in index order, so results are bitwise reproducible. Strides are passed for every dimension:
Triton specialises a unit D stride, which keeps the usual contiguous case vectorised.
"""
import triton
import triton.language as tl

from .common import LAUNCH_OPTIONS, to_dtype
from .sizes import cdiv, next_pow2


@triton.jit
def _weighted(v, w):
    """w * v, and exactly 0 where w is 0 (an empty state's v may hold anything; a NaN w reaches the row through
    the total)."""
    return tl.where(w[:, None] > 0, v * w[:, None], 0.0)


@triton.jit
def _merge_two_kernel(
    va_ptr, sa_ptr, vb_ptr, sb_ptr, vo_ptr, so_ptr, keep_ptr,
    num_heads, head_dim,
    s_va_r, s_va_h, s_va_d, s_sa_r, s_sa_h,
    s_vb_r, s_vb_h, s_vb_d, s_sb_r, s_sb_h,
    s_vo_r, s_vo_h, s_vo_d, s_so_r, s_so_h,
    HAS_KEEP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * row stride passes 2**31 for long batches
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    tile_ok = head_ok[:, None] & (dims < head_dim)[None, :]
    h64, d64 = heads.to(tl.int64), dims.to(tl.int64)
    if HAS_KEEP:  # in-place merge under a row mask: a masked-out row is not written at all
        keep = tl.load(keep_ptr + row) != 0
        head_ok = head_ok & keep
        tile_ok = tile_ok & keep

    s_a = tl.load(sa_ptr + row * s_sa_r + h64 * s_sa_h, mask=head_ok, other=float("-inf"))
    s_b = tl.load(sb_ptr + row * s_sb_r + h64 * s_sb_h, mask=head_ok, other=float("-inf"))
    v_a = tl.load(va_ptr + row * s_va_r + h64[:, None] * s_va_h + d64[None, :] * s_va_d, mask=tile_ok,
                  other=0.0).to(tl.float32)
    v_b = tl.load(vb_ptr + row * s_vb_r + h64[:, None] * s_vb_h + d64[None, :] * s_vb_d, mask=tile_ok,
                  other=0.0).to(tl.float32)

    s_max = tl.maximum(s_a, s_b, propagate_nan=tl.PropagateNan.ALL)
    # Both -inf: shift by 0 instead, so that exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
    empty = s_max == float("-inf")
    shift = tl.where(empty, 0.0, s_max)
    w_a = tl.exp2(s_a - shift)
    w_b = tl.exp2(s_b - shift)
    total = w_a + w_b
    # both states empty: their weighted sum is 0, so v = 0 and s = -inf
    safe_total = tl.where(empty, 1.0, total)
    v = (_weighted(v_a, w_a) + _weighted(v_b, w_b)) / safe_total[:, None]
    s = tl.where(empty, float("-inf"), shift + tl.log2(safe_total))

    tl.store(vo_ptr + row * s_vo_r + h64[:, None] * s_vo_h + d64[None, :] * s_vo_d,
             to_dtype(v, vo_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(so_ptr + row * s_so_r + h64 * s_so_h, s, mask=head_ok)


@triton.jit
def _merge_many_kernel(
    v_ptr, s_ptr, vo_ptr, so_ptr,
    num_states, num_heads, head_dim,
    s_v_r, s_v_n, s_v_h, s_v_d, s_s_r, s_s_n, s_s_h,
    s_vo_r, s_vo_h, s_vo_d, s_so_r, s_so_h,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    tile_ok = head_ok[:, None] & (dims < head_dim)[None, :]
    h64, d64 = heads.to(tl.int64), dims.to(tl.int64)
    s_row = s_ptr + row * s_s_r + h64 * s_s_h
    v_row = v_ptr + row * s_v_r + h64[:, None] * s_v_h + d64[None, :] * s_v_d

    # Pass 1: the largest LSE of each head, so that every weight below is <= 1 (no overflow).
    s_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for i in range(num_states):
        s_max = tl.maximum(s_max, tl.load(s_row + i * s_s_n, mask=head_ok, other=float("-inf")),
                           propagate_nan=tl.PropagateNan.ALL)
    empty = s_max == float("-inf")
    shift = tl.where(empty, 0.0, s_max)

    # Pass 2: weighted sum in state order (fixed order: bitwise reproducible).
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(num_states):
        s_i = tl.load(s_row + i * s_s_n, mask=head_ok, other=float("-inf"))
        w = tl.exp2(s_i - shift)
        v = tl.load(v_row + i * s_v_n, mask=tile_ok, other=0.0).to(tl.float32)
        acc += _weighted(v, w)
        total += w
    safe_total = tl.where(empty, 1.0, total)  # all states empty: acc is 0, so v = 0 and s = -inf
    tl.store(vo_ptr + row * s_vo_r + h64[:, None] * s_vo_h + d64[None, :] * s_vo_d,
             to_dtype(acc / safe_total[:, None], vo_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(so_ptr + row * s_so_r + h64 * s_so_h,
             tl.where(empty, float("-inf"), shift + tl.log2(safe_total)), mask=head_ok)


def _blocks(num_heads: int, head_dim: int):
    """Whole head dim per program, and enough heads for ~2K elements: wide loads, still many programs."""
    block_d = next_pow2(head_dim)
    block_h = max(1, min(next_pow2(num_heads), 2048 // block_d))
    return block_h, block_d


def merge_two(v_a, s_a, v_b, s_b, v_out, s_out, keep=None):
    """v_* `[rows, H, D]`, s_* `[rows, H]` float32; v_out/s_out may be v_a/s_a (in place).
    keep: None or a uint8 `[rows]` view; rows where it is 0 are left untouched."""
    rows, num_heads, head_dim = v_a.shape
    if rows == 0:
        return
    block_h, block_d = _blocks(num_heads, head_dim)
    grid = (rows, cdiv(num_heads, block_h))
    _merge_two_kernel[grid](
        v_a, s_a, v_b, s_b, v_out, s_out, keep if keep is not None else s_out,
        num_heads, head_dim,
        *v_a.stride(), *s_a.stride(), *v_b.stride(), *s_b.stride(), *v_out.stride(), *s_out.stride(),
        HAS_KEEP=keep is not None, BLOCK_H=block_h, BLOCK_D=block_d, **LAUNCH_OPTIONS,
    )


def merge_many(v, s, v_out, s_out):
    """v `[rows, N, H, D]`, s `[rows, N, H]` float32 -> v_out `[rows, H, D]`, s_out `[rows, H]`."""
    rows, num_states, num_heads, head_dim = v.shape
    if rows == 0:
        return
    block_h, block_d = _blocks(num_heads, head_dim)
    grid = (rows, cdiv(num_heads, block_h))
    _merge_many_kernel[grid](
        v, s, v_out, s_out, num_states, num_heads, head_dim,
        *v.stride(), *s.stride(), *v_out.stride(), *s_out.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d, **LAUNCH_OPTIONS,
    )
