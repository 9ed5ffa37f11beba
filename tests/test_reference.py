"""The float64 oracle checked against a scalar loop that reads like the definitions in API.md."""
import math

import pytest
import torch

from serveattn import reference


def naive(q, k, v, *, causal=False, mask=None, window_left=-1, soft_cap=None, sm_scale=None, rope=False,
          rope_scale=1.0, rope_theta=1e4, k_scale=1.0, v_scale=1.0):
    """Python floats and math.exp only; returns nested lists out[r][h][d], lse[r][h] (base 2)."""
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    Q, K, V = q.double().tolist(), k.double().tolist(), v.double().tolist()

    def rotate(x, pos):
        half = head_dim // 2
        out = list(x)
        for i in range(half):
            a = pos * (1.0 / rope_scale) * rope_theta ** (-2.0 * i / head_dim)
            out[i] = x[i] * math.cos(a) - x[i + half] * math.sin(a)
            out[i + half] = x[i + half] * math.cos(a) + x[i] * math.sin(a)
        return out

    out = [[[0.0] * head_dim for _ in range(num_qo_heads)] for _ in range(qo_len)]
    lse = [[-math.inf] * num_qo_heads for _ in range(qo_len)]
    for r in range(qo_len):
        q_pos = kv_len - qo_len + r
        for h in range(num_qo_heads):
            kh = h // (num_qo_heads // num_kv_heads)
            qv = rotate(Q[r][h], q_pos) if rope else Q[r][h]
            logits = {}
            for j in range(kv_len):
                if mask is not None:
                    if not mask[r][j]:
                        continue
                elif causal and j > q_pos:
                    continue
                if window_left >= 0 and j < q_pos - window_left:
                    continue
                kv = [x * k_scale for x in K[j][kh]]
                kv = rotate(kv, j) if rope else kv
                s = scale * sum(a * b for a, b in zip(qv, kv))
                if soft_cap:
                    s = soft_cap * math.tanh(s / soft_cap)
                logits[j] = s
            if not logits:
                continue
            m = max(logits.values())
            total = sum(math.exp(s - m) for s in logits.values())
            lse[r][h] = (m + math.log(total)) / math.log(2.0)
            for j, s in logits.items():
                p = math.exp(s - m) / total
                for d in range(head_dim):
                    out[r][h][d] += p * V[j][kh][d] * v_scale
    return out, lse


def check(q, k, v, naive_kw, **ref_kw):
    out, lse = reference.attention(q, k, v, **ref_kw)
    want_out, want_lse = naive(q, k, v, **naive_kw)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, torch.tensor(want_out, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, torch.tensor(want_lse, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    return out, lse


def make(qo_len, kv_len, hq, hkv, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(qo_len, hq, d, generator=g).to(dtype)
    k = torch.randn(kv_len, hkv, d, generator=g).to(dtype)
    v = torch.randn(kv_len, hkv, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("qo_len,kv_len", [(1, 7), (5, 5), (3, 9)])
def test_plain_and_causal(qo_len, kv_len):
    q, k, v = make(qo_len, kv_len, 2, 2, 8)
    check(q, k, v, {})
    check(q, k, v, {"causal": True}, causal=True)


def test_gqa_and_bf16():
    q, k, v = make(4, 6, 6, 2, 8, dtype=torch.bfloat16, seed=1)
    check(q, k, v, {"causal": True}, causal=True)


def test_window_soft_cap_sm_scale():
    q, k, v = make(4, 10, 4, 2, 8, seed=2)
    check(q, k, v, {"causal": True, "window_left": 2}, causal=True, window_left=2)
    check(q, k, v, {"window_left": 0}, window_left=0)
    check(q, k, v, {"soft_cap": 0.5, "sm_scale": 0.7}, logits_soft_cap=0.5, sm_scale=0.7)


def test_custom_mask_overrides_causal_and_empty_rows():
    q, k, v = make(3, 5, 2, 1, 8, seed=3)
    mask = torch.tensor([[1, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)
    out, lse = check(q, k, v, {"mask": mask.tolist()}, custom_mask=mask, causal=True)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


def test_empty_rows_from_window_and_empty_kv():
    q, k, v = make(4, 2, 2, 2, 8, seed=4)
    # causal with kv_len < qo_len: rows 0 and 1 sit at positions -2, -1 and see nothing.
    out, lse = check(q, k, v, {"causal": True}, causal=True)
    assert (out[:2] == 0).all() and torch.isneginf(lse[:2]).all()
    out, lse = reference.attention(q, k[:0], v[:0])
    assert out.shape == (4, 2, 8) and (out == 0).all() and torch.isneginf(lse).all()


def test_scales_dequantize_fp8():
    q, k, v = make(2, 4, 2, 2, 8, seed=5)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    check(q, k8, v8, {"k_scale": 0.5, "v_scale": 2.0}, k_scale=0.5, v_scale=torch.tensor([2.0]))


def test_rope_matches_naive():
    q, k, v = make(3, 6, 2, 2, 8, seed=6)
    kw = {"rope": True, "rope_scale": 2.0, "rope_theta": 500.0, "causal": True}
    check(q, k, v, kw, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=500.0, causal=True)
    check(q, k, v, {"rope": True}, pos_encoding_mode="ROPE_LLAMA")


def test_rope_preserves_norm_and_is_relative():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(1, 1, 16, generator=g, dtype=torch.float64), torch.randn(1, 1, 16, generator=g,
                                                                                 dtype=torch.float64)
    rot = lambda t, p: reference.rope_llama(t, torch.tensor([p]))
    for p in (0, 3, 1000):
        torch.testing.assert_close(rot(x, p).norm(), x.norm(), rtol=1e-12, atol=0)
    dots = [(rot(x, m) * rot(y, n)).sum() for m, n in ((5, 2), (13, 10), (103, 100))]
    for d in dots[1:]:
        torch.testing.assert_close(d, dots[0], rtol=1e-9, atol=1e-12)


def test_lse_is_base_2():
    q, k, v = make(3, 7, 2, 2, 8, seed=8)
    _, lse = reference.attention(q, k, v)
    logits = torch.einsum("qhd,khd->qhk", q.double(), k.double()) / math.sqrt(8)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1) / math.log(2), rtol=1e-12, atol=0)


def test_batch_ragged_and_paged_match_single():
    g = torch.Generator().manual_seed(9)
    qo_lens, kv_lens, page_size = [2, 0, 3], [5, 3, 3], 2
    q = torch.randn(sum(qo_lens), 4, 8, generator=g).half()
    k = torch.randn(sum(kv_lens), 2, 8, generator=g).half()
    v = torch.randn(sum(kv_lens), 2, 8, generator=g).half()
    qo_indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 5, 8, 11], dtype=torch.int32)
    mask = torch.rand(sum(a * b for a, b in zip(qo_lens, kv_lens)), generator=g) > 0.3
    out, lse = reference.batch_ragged(q, k, v, qo_indptr, kv_indptr, custom_mask=mask, sm_scale=0.3)
    o0, l0 = reference.attention(q[:2], k[:5], v[:5], custom_mask=mask[:10].reshape(2, 5), sm_scale=0.3)
    o2, l2 = reference.attention(q[2:], k[8:], v[8:], custom_mask=mask[10:].reshape(3, 3), sm_scale=0.3)
    assert torch.equal(out, torch.cat([o0, o2])) and torch.equal(lse, torch.cat([l0, l2]))

    # The same keys scattered over shuffled pages of an HND cache (request 1's pages hold 3 = 2 + 1 keys).
    num_pages = 8
    pages = torch.tensor([6, 0, 3, 5, 1, 7, 2], dtype=torch.int32)  # 3 + 2 + 2 pages
    indptr = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    last = torch.tensor([1, 1, 1], dtype=torch.int32)
    cache = torch.randn(num_pages, 2, 2, page_size, 8, generator=g).half()
    for i, (lo, n) in enumerate(zip([0, 5, 8], kv_lens)):
        for t in range(n):
            page = int(pages[int(indptr[i]) + t // page_size])
            cache[page, 0, :, t % page_size] = k[lo + t]
            cache[page, 1, :, t % page_size] = v[lo + t]
    k2, v2, kv_indptr2 = reference.gather_paged(cache, indptr, pages, last, "HND")
    assert torch.equal(k2, k) and torch.equal(v2, v) and kv_indptr2.tolist() == kv_indptr.tolist()
    out2, lse2 = reference.batch_paged(q, cache, qo_indptr, indptr, pages, last, kv_layout="HND",
                                       custom_mask=mask, sm_scale=0.3)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_reference_packbits():
    x = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert reference.packbits(x).tolist() == [0b1101, 0b11]
    packed, ip = reference.segment_packbits(x, torch.tensor([0, 3, 3, 10], dtype=torch.int32))
    assert packed.tolist() == [0b101, 0b1100001] and ip.tolist() == [0, 1, 1, 2]
