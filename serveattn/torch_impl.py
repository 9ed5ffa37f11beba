"""backend="torch": plain PyTorch attention that runs on any device (float32 math, one loop step per request)."""
from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def _request_kv(k, v, plan, kv_layout, i):
    """Request i's K and V as [kv_len, Hkv, D] views/gathers of the cache."""
    start, end = int(plan.kv_indptr_host[i]), int(plan.kv_indptr_host[i + 1])
    kv_len = int(plan.kv_lens_host[i])
    if not plan.paged:
        if kv_layout == "HND":
            return k[:, start:end].transpose(0, 1), v[:, start:end].transpose(0, 1)
        return k[start:end], v[start:end]
    pages = plan.kv_indices_host[start:end].to(k.device)

    def gather(cache):
        g = cache[pages]  # [n_pages, page_size, Hkv, D] or [n_pages, Hkv, page_size, D]
        if kv_layout == "HND":
            g = g.transpose(1, 2)
        return g.reshape(-1, g.shape[-2], g.shape[-1])[:kv_len]

    return gather(k), gather(v)


def _rope(x, positions, plan):
    """LLaMA rotate-half RoPE in float32: x [n, H, D], positions [n]."""
    half = x.shape[-1] // 2
    i = torch.arange(half, device=x.device, dtype=torch.float32)
    freq = plan.rcp_scale * torch.exp2(-(i / half) * plan.log2_theta)
    angle = positions.to(torch.float32)[:, None] * freq[None, :]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def prefill(q, k, v, out, lse, plan, kv_layout, k_scale=None, v_scale=None, descales=None):
    """Fills out (and lse, base 2) for every request of the plan. descales (fp8 attention): per-tensor or
    per-head float32 scale_q / scale_k / scale_v, applied to the dequantized q, K and V."""
    k_scale = 1.0 if k_scale is None else float(k_scale)
    v_scale = 1.0 if v_scale is None else float(v_scale)
    if descales is not None:  # dequantize: per-tensor ([1]) or per-head scales broadcast over [.., H, D]
        sq, sk, sv = (d.to(q.device, torch.float32).reshape(-1, 1) for d in descales)
        q = q.float() * sq
    mask_offset = 0
    for i in range(plan.batch):
        q0, q1 = int(plan.qo_indptr_host[i]), int(plan.qo_indptr_host[i + 1])
        qo_len = q1 - q0
        kv_len = int(plan.kv_lens_host[i])
        if qo_len == 0:
            continue
        ki, vi = _request_kv(k, v, plan, kv_layout, i)
        qi = q[q0:q1].float()
        ki, vi = ki.float(), vi.float()
        if descales is not None:
            ki, vi = ki * sk, vi * sv
        q_pos = torch.arange(qo_len, device=q.device) + (kv_len - qo_len)
        k_pos = torch.arange(kv_len, device=q.device)
        if plan.rope:
            qi, ki = _rope(qi, q_pos, plan), _rope(ki, k_pos, plan)
        # [Hkv, group, qo, D] x [Hkv, kv, D] -> [Hkv, group, qo, kv]
        qg = qi.reshape(qo_len, plan.num_kv_heads, plan.group, -1).permute(1, 2, 0, 3)
        logits = torch.einsum("hgqd,khd->hgqk", qg, ki) * (plan.sm_scale * k_scale)
        if plan.soft_cap > 0:
            logits = plan.soft_cap * torch.tanh(logits / plan.soft_cap)
        visible = torch.ones(qo_len, kv_len, dtype=torch.bool, device=q.device)
        if plan.has_mask:
            n = qo_len * kv_len
            visible = plan.mask_host[mask_offset:mask_offset + n].reshape(qo_len, kv_len).to(q.device)
        elif plan.causal:
            visible = k_pos[None, :] <= q_pos[:, None]
            if plan.tree_mask_host is not None:  # draft tokens see the prefix, their ancestors and themselves
                words = plan.tree_mask_host[q0:q1].to(q.device)
                rel = k_pos - (kv_len - qo_len)
                bit = (words[:, None] >> rel.clamp(0, 63)[None, :]) & 1
                visible = visible & ((rel[None, :] < 0) | (bit != 0))
        if plan.window_left >= 0:
            visible = visible & (k_pos[None, :] >= q_pos[:, None] - plan.window_left)
        mask_offset += qo_len * kv_len
        logits = logits.masked_fill(~visible, float("-inf"))
        lse_nat = torch.logsumexp(logits, -1)  # [Hkv, group, qo]; -inf for rows that see nothing
        probs = torch.exp(logits - torch.where(torch.isinf(lse_nat), 0.0, lse_nat)[..., None])
        o = torch.einsum("hgqk,khd->qhgd", probs, vi).reshape(qo_len, plan.num_qo_heads, -1) * v_scale
        out[q0:q1] = o.to(out.dtype)
        if lse is not None:
            lse[q0:q1] = (lse_nat / LN2).permute(2, 0, 1).reshape(qo_len, plan.num_qo_heads)
