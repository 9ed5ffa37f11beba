"""The cuDNN route: single and ragged prefill through torch's cuDNN SDPA, where serveattn/routing.py finds it
capable and measured faster.

What it serves (routing.cudnn_declines): requests of one length, contiguous K/V (NHD or HND), float16 or
bfloat16 throughout, head dims 64/128, no custom mask, window, soft cap or RoPE, causal only when
kv_len == qo_len (API.md's causal is bottom-right aligned, SDPA's ``is_causal`` top-left; they agree only
there), not under CUDA graphs. The ragged batch is viewed as dense ``[B, H, S, D]`` without a copy (the NHD
rows ``[B*S, H, D]`` are cuDNN's BSHD layout); GQA is native (K/V keep their own head count).

It calls ``torch.ops.aten._scaled_dot_product_cudnn_attention``, the op behind
``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``, because that op also
returns the log-sum-exp (natural log; divided by ln 2 here for API.md's base-2 LSE). Before the route is chosen,
``torch_declines`` asks torch's own gate (``torch.backends.cuda.can_use_cudnn_attention``) for the plan's shape
and dtype, so the cuDNN version limits, ``torch.use_deterministic_algorithms`` and
``torch.backends.cuda.enable_cudnn_sdp(False)`` are respected as torch respects them. k_scale folds into the
logit scale (a tensor k_scale is read on the host: one synchronisation), v_scale multiplies the output.

Determinism: cuDNN's forward pass has no split-KV reduction across thread blocks; for a fixed shape, the same
inputs give the same bits (tested on the GPU). cuDNN builds an execution plan the first time it sees a shape
(batch, lengths, heads, strides), which costs milliseconds to a tenth of a second; ``SERVEATTN_CUDNN=0`` keeps
``auto`` off this route.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import routing

LOG2E = 1.0 / math.log(2.0)

_probes: dict = {}


def available() -> bool:
    """torch has cuDNN, the cuDNN SDPA op and torch's check for it."""
    try:
        from torch.backends.cuda import SDPAParams, can_use_cudnn_attention  # noqa: F401
    except ImportError:
        return False
    return bool(torch.backends.cudnn.is_available()) and hasattr(torch.ops.aten,
                                                                  "_scaled_dot_product_cudnn_attention")


def torch_declines(req: "routing.Request", device) -> Optional[str]:
    """torch's own verdict on running cuDNN SDPA for this request (None: it would), asked with stand-in tensors
    of the plan's shapes (head_dim elements on the device, expanded; no copy of the data)."""
    if not available():
        return routing.cudnn_unavailable()
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    device = torch.device(device)
    key = (device, req.q_dtype, req.head_dim)
    base = _probes.get(key)
    if base is None:
        base = _probes[key] = torch.zeros(req.head_dim, dtype=req.q_dtype, device=device)
    q = base.expand(req.batch, req.num_qo_heads, req.min_qo_len, req.head_dim)
    k = base.expand(req.batch, req.num_kv_heads, req.min_kv_len, req.head_dim)
    try:
        with torch.cuda.device(device):
            params = SDPAParams(q, k, k, None, 0.0, bool(req.causal), req.num_qo_heads != req.num_kv_heads)
            ok = bool(can_use_cudnn_attention(params, False))
    except Exception:  # noqa: BLE001 - an older torch with another SDPAParams: not confirmed, so not chosen
        ok = False
    return None if ok else routing.cudnn_torch_declines()


def _dense(x: torch.Tensor, batch: int, seq: int, kv_layout: str, is_q: bool) -> torch.Tensor:
    """[B, H, S, D] view of ragged rows: NHD [B*S, H, D] (q always), HND [H, B*S, D]."""
    if is_q or kv_layout == "NHD":
        return x.unflatten(0, (batch, seq)).transpose(1, 2)
    return x.unflatten(1, (batch, seq)).permute(1, 0, 2, 3)


def _sdpa_cudnn(qb, kb, vb, want_lse: bool, causal: bool, scale: float):
    """torch's cuDNN SDPA op: (output [B, Hq, S, D] in q's memory layout, natural-log LSE [B, Hq, S(, 1)], ...)."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(qb, kb, vb, None, want_lse, 0.0, causal, False,
                                                              scale=scale)


def prefill(q, k, v, out, lse, return_lse: bool, plan, kv_layout: str, k_scale=None, v_scale=None):
    """Runs a plan that routing gave to cuDNN; returns what the wrapper's run() returns. ``out``/``lse`` are the
    caller's buffers or None (then the output is cuDNN's own tensor, viewed as rows: no copy)."""
    batch = plan.batch
    seq_q = plan.total_q // batch
    seq_kv = int(plan.kv_lens_host[0])
    qb = _dense(q, batch, seq_q, kv_layout, True)
    kb = _dense(k, batch, seq_kv, kv_layout, False)
    vb = _dense(v, batch, seq_kv, kv_layout, False)
    scale = plan.sm_scale * (float(k_scale) if k_scale is not None else 1.0)
    want_lse = bool(return_lse or lse is not None)
    res = _sdpa_cudnn(qb, kb, vb, want_lse, plan.causal, scale)
    rows = res[0].transpose(1, 2)  # [B, S, Hq, D]: a view of cuDNN's output, contiguous when it matched q
    if out is None and v_scale is None:
        out = rows.reshape(plan.total_q, plan.num_qo_heads, plan.head_dim)
    elif v_scale is not None:  # in float32 when v_scale is a tensor, rounded once into the output dtype
        if out is None:
            out = torch.empty(plan.total_q, plan.num_qo_heads, plan.head_dim, dtype=plan.o_dtype, device=q.device)
        torch.mul(rows, v_scale if isinstance(v_scale, torch.Tensor) else float(v_scale),
                  out=out.unflatten(0, (batch, seq_q)))
    else:
        out.unflatten(0, (batch, seq_q)).copy_(rows)
    if want_lse:
        nat = res[1].reshape(batch, plan.num_qo_heads, seq_q).transpose(1, 2)  # [B, S, Hq], natural log
        if lse is None:
            lse = torch.empty(plan.total_q, plan.num_qo_heads, dtype=torch.float32, device=q.device)
        torch.mul(nat, LOG2E, out=lse.unflatten(0, (batch, seq_q)))
    return (out, lse) if return_lse else out
