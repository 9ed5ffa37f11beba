"""The float64 oracle: plain, obviously correct implementations that the kernels are tested against.

Nothing here is fast. Every function upcasts to float64 and loops over requests (or tokens) in Python,
so that a reader can check it line by line against docs/dev/design.md and /work/shared/API.md.
"""
from __future__ import annotations

import math
from typing import Tuple, Union

import torch

PagedCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _as_float(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def rope_llama(x: torch.Tensor, positions: torch.Tensor, rope_scale: float = 1.0,
               rope_theta: float = 1e4) -> torch.Tensor:
    """Rotate-half (non-interleaved) RoPE in float64. x `[n, H, D]`, positions `[n]` -> `[n, H, D]`."""
    x = x.to(torch.float64)
    half = x.shape[-1] // 2
    i = torch.arange(half, dtype=torch.float64, device=x.device)
    freq = (1.0 / rope_scale) * rope_theta ** (-2.0 * i / x.shape[-1])
    angle = positions.to(device=x.device, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(q, k, v, *, causal=False, custom_mask=None, window_left=-1, logits_soft_cap=None,
              sm_scale=None, pos_encoding_mode="NONE", rope_scale=None, rope_theta=None,
              k_scale=1.0, v_scale=1.0):
    """One request. q `[qo_len, Hq, D]`, k/v `[kv_len, Hkv, D]` -> (out `[qo_len, Hq, D]`, lse `[qo_len, Hq]`).

    Both results are float64; lse is base 2. Rows that see no key get out 0 and lse -inf.
    """
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_qo_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    device = q.device

    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64) * _as_float(k_scale)
    v64 = v.to(torch.float64) * _as_float(v_scale)
    # Bottom-right alignment: query row r sits at absolute position kv_len - qo_len + r.
    q_pos = torch.arange(qo_len, device=device) + (kv_len - qo_len)
    k_pos = torch.arange(kv_len, device=device)
    if pos_encoding_mode == "ROPE_LLAMA":
        scale = 1.0 if rope_scale is None else rope_scale
        theta = 1e4 if rope_theta is None else rope_theta
        q64 = rope_llama(q64, q_pos, scale, theta)
        k64 = rope_llama(k64, k_pos, scale, theta)
    elif pos_encoding_mode != "NONE":
        raise ValueError(f"reference.attention: pos_encoding_mode={pos_encoding_mode!r} is not modelled.")

    k64 = k64.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v64 = v64.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q64, k64) * sm_scale
    if logits_soft_cap is not None and logits_soft_cap > 0:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)

    if custom_mask is not None:
        visible = custom_mask.to(device=device, dtype=torch.bool).reshape(qo_len, kv_len).clone()
    else:
        visible = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
        if causal:
            visible &= k_pos[None, :] <= q_pos[:, None]
    if window_left is not None and window_left >= 0:
        visible &= k_pos[None, :] >= q_pos[:, None] - window_left

    logits = logits.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1) if kv_len else logits.new_full((num_qo_heads, qo_len), float("-inf"))
    seen = visible.any(dim=-1)[None, :].expand_as(lse)
    # exp(-inf - -inf) is NaN: rows without a visible key get probability 0 everywhere instead.
    probs = torch.where(seen[..., None], torch.exp(logits - lse.masked_fill(~seen, 0.0)[..., None]),
                        torch.zeros_like(logits))
    out = torch.einsum("hqk,khd->qhd", probs, v64)
    return out, (lse / math.log(2.0)).transpose(0, 1).contiguous()


def batch_ragged(q, k, v, qo_indptr, kv_indptr, *, custom_mask=None, **kw):
    """Ragged batch: request i has rows q[qo_indptr[i]:qo_indptr[i+1]] and keys k[kv_indptr[i]:kv_indptr[i+1]]."""
    qo = [int(x) for x in qo_indptr.tolist()]
    kv = [int(x) for x in kv_indptr.tolist()]
    outs, lses, mask_offset = [], [], 0
    for i in range(len(qo) - 1):
        qo_len, kv_len = qo[i + 1] - qo[i], kv[i + 1] - kv[i]
        mask = None
        if custom_mask is not None:
            mask = custom_mask.reshape(-1)[mask_offset:mask_offset + qo_len * kv_len].reshape(qo_len, kv_len)
            mask_offset += qo_len * kv_len
        out, lse = attention(q[qo[i]:qo[i + 1]], k[kv[i]:kv[i + 1]], v[kv[i]:kv[i + 1]], custom_mask=mask, **kw)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return (torch.zeros(0, *q.shape[1:], dtype=torch.float64, device=q.device),
                torch.zeros(0, q.shape[1], dtype=torch.float64, device=q.device))
    return torch.cat(outs), torch.cat(lses)


def _nhd_views(paged_kv_cache: PagedCache, kv_layout: str):
    """(k, v) views of the cache, each `[pages, page_size, Hkv, D]` whatever the layout or form."""
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    elif kv_layout != "NHD":
        raise ValueError(f"reference: kv_layout={kv_layout!r} is not a layout.")
    return k_cache, v_cache


def gather_paged(paged_kv_cache: PagedCache, indptr, indices, last_page_len, kv_layout="NHD"):
    """Each request's keys and values, concatenated: (k `[total_kv, Hkv, D]`, v, kv_indptr int64 CPU)."""
    k_cache, v_cache = _nhd_views(paged_kv_cache, kv_layout)
    page_size = k_cache.shape[1]
    ip = [int(x) for x in indptr.tolist()]
    pages_all = indices.to("cpu", torch.int64)
    last = [int(x) for x in last_page_len.tolist()]
    ks, vs, kv_indptr = [], [], [0]
    for i in range(len(ip) - 1):
        pages = pages_all[ip[i]:ip[i + 1]].to(k_cache.device)
        kv_len = (len(pages) - 1) * page_size + last[i] if len(pages) else 0
        ks.append(k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len])
        vs.append(v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len])
        kv_indptr.append(kv_indptr[-1] + kv_len)
    empty = k_cache.new_zeros(0, *k_cache.shape[2:])
    return (torch.cat(ks) if ks else empty, torch.cat(vs) if vs else empty,
            torch.tensor(kv_indptr, dtype=torch.int64))


def batch_paged(q, paged_kv_cache, qo_indptr, indptr, indices, last_page_len, *, kv_layout="NHD",
                custom_mask=None, **kw):
    k, v, kv_indptr = gather_paged(paged_kv_cache, indptr, indices, last_page_len, kv_layout)
    return batch_ragged(q, k, v, qo_indptr, kv_indptr, custom_mask=custom_mask, **kw)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                          kv_indptr, kv_last_page_len, kv_layout="NHD"):
    """A clone of the cache (same form) with token t written at (batch_indices[t], positions[t])."""
    if isinstance(paged_kv_cache, (tuple, list)):
        result = tuple(c.clone() for c in paged_kv_cache)
    else:
        result = paged_kv_cache.clone()
    k_cache, v_cache = _nhd_views(result, kv_layout)
    page_size = k_cache.shape[1]
    pages, ip = kv_indices.tolist(), kv_indptr.tolist()
    for t, (b, pos) in enumerate(zip(batch_indices.tolist(), positions.tolist())):
        page = pages[ip[b] + pos // page_size]
        k_cache[page, pos % page_size] = append_key[t]
        v_cache[page, pos % page_size] = append_value[t]
    return result


def packbits(x: torch.Tensor) -> torch.Tensor:
    """Little-endian: bit j of byte i is x[8*i + j]; the last byte is zero-padded."""
    bits = [bool(b) for b in x.reshape(-1).tolist()]
    out = [sum(1 << j for j in range(8) if 8 * i + j < len(bits) and bits[8 * i + j])
           for i in range((len(bits) + 7) // 8)]
    return torch.tensor(out, dtype=torch.uint8, device=x.device)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor):
    """Each segment x[indptr[i]:indptr[i+1]] packed on its own -> (packed uint8, byte indptr int32)."""
    ip = [int(a) for a in indptr.tolist()]
    parts, new_indptr = [], [0]
    for i in range(len(ip) - 1):
        parts.append(packbits(x[ip[i]:ip[i + 1]]))
        new_indptr.append(new_indptr[-1] + parts[-1].numel())
    packed = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=x.device)
    return packed, torch.tensor(new_indptr, dtype=torch.int32, device=indptr.device)


def merge_states(v: torch.Tensor, s: torch.Tensor):
    """Attention states over disjoint KV segments, combined into the state over their union.

    v `[rows, num_states, H, D]`, s `[rows, num_states, H]` (base-2 LSE) -> (v `[rows, H, D]`, s `[rows, H]`),
    float64. A state with s = -inf is empty: its v is ignored. A row whose states are all empty gets v 0, s -inf.
    """
    v64, s64 = v.to(torch.float64), s.to(torch.float64)
    ln2 = math.log(2.0)
    merged = torch.logsumexp(s64 * ln2, dim=1) / ln2  # -inf when every state is empty
    shift = merged.masked_fill(merged == float("-inf"), 0.0)  # exp2(-inf - 0) = 0 for the empty states
    weight = torch.exp2(s64 - shift[:, None])
    contrib = torch.where(weight[..., None] > 0, weight[..., None] * v64, torch.zeros_like(v64))
    return contrib.sum(dim=1), merged


# (mantissa bits, exponent bias, largest finite value) of the OCP fp8 encodings
FP8_FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}


def quantize_fp8(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """What `append_paged_kv_cache` stores for 16-bit x in an fp8 cache of `dtype` with `scale`.

    q = x / scale as an IEEE float32 division (scale rounded to float32 first; computing the quotient in
    float64 and rounding it to float32 gives exactly that, because 53 >= 2 * 24 + 2 bits), saturated to
    the format's largest finite value, then rounded to the nearest fp8 value, ties to an even mantissa,
    worked out bit by bit in float64. NaN becomes the canonical NaN 0x7F. Returns a CPU tensor of `dtype`.
    """
    mbits, bias, fmax = FP8_FORMATS[dtype]
    s = float(torch.tensor(_as_float(scale), dtype=torch.float32))
    q = (x.detach().cpu().to(torch.float64) / s).to(torch.float32).to(torch.float64)
    nan = torch.isnan(q)
    q = torch.where(nan, 0.0, q.clamp(-fmax, fmax))
    negative = torch.signbit(q)
    a = q.abs()
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): a lies in the binade [2**(e-1), 2**e)
    e = (e - 1).clamp(min=1 - bias)  # fp8 subnormals share the smallest normal binade's spacing
    quantum = torch.ldexp(torch.ones_like(a), e - mbits)  # spacing of fp8 values in that binade
    r = torch.round(a / quantum)  # exact division by a power of two; torch.round: half to even
    carry = r == 2 ** (mbits + 1)  # rounded up into the next binade
    e, r = torch.where(carry, e + 1, e), torch.where(carry, 2 ** mbits, r)
    normal = r >= 2 ** mbits
    field = torch.where(normal, e + bias, 0).to(torch.int64)
    mant = torch.where(normal, r - 2 ** mbits, r).to(torch.int64)
    bits = (negative.to(torch.int64) << 7) | (field << mbits) | mant
    bits = torch.where(nan, 0x7F, bits)
    return bits.to(torch.uint8).view(dtype)
