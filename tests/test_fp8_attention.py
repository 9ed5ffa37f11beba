"""fp8 query + fp8 KV on tensor cores: accuracy calibrated against the bf16 kernel, and A/B checks of the
descales. P is rounded (after scaling by 256) to e4m3 for the second product, whatever V's encoding. The float64 model
below rounds P against the row's final max; the kernel rounds it against the running max of the online
softmax (a different, equally large rounding), so the kernel is held to the model's P-rounding error (with
50% slack for that difference) plus a few times the bf16 kernel's error on the same inputs."""
import zlib

import pytest
import torch

import serveattn
from serveattn import reference
from helpers import make_paged_batch, rel_err

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _draw(gen, shape, dist):
    x = torch.randn(shape, generator=gen)
    if dist == "outliers":  # a few channels 30x larger, as in real activations
        x[..., torch.randint(0, shape[-1], (3,), generator=gen)] *= 30
    return x


def _quantize(x, enc, per_head):
    """x [n, H, D] -> (fp8 values, float32 descale [1] or [H]), amax scaling."""
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax().reshape(1)
    scale = (amax / FP8_MAX[enc]).float()
    return (x / scale.reshape(1, -1, 1)).to(enc), scale


def _dequant(x8, scale):
    return x8.double() * scale.double().reshape(1, -1, 1)


def _model(dq, dk, dv, enc_v, causal):
    """Float64 attention with P rounded as the kernel does: (P * 256) to V's encoding, / 256."""
    group = dq.shape[1] // dk.shape[1]
    kk, vv = dk.repeat_interleave(group, 1), dv.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", dq, kk) / dq.shape[-1] ** 0.5
    qo, kv = dq.shape[0], dk.shape[0]
    if causal:
        visible = torch.arange(kv)[None, :] <= torch.arange(qo)[:, None] + (kv - qo)
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p8 = (p * 256).float().to(torch.float8_e4m3fn).double() / 256  # e4m3 whatever V's encoding
    return torch.einsum("hqk,khd->qhd", p8, vv) / p.sum(-1).permute(1, 0)[..., None]


def _single(q8, k8, v8, sq, sk, sv, causal=True, backend="triton"):
    return serveattn.single_prefill_with_kv_cache(q8, k8, v8, causal=causal, backend=backend, scale_q=sq,
                                                  scale_k=sk, scale_v=sv, return_lse=True)


@pytest.mark.parametrize("dist", ["random", "outliers"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_accuracy_calibrated_against_bf16(enc, per_head, dist, device):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{enc}{per_head}{dist}".encode()))  # same inputs every run
    q, k, v = _draw(gen, (24, 8, 64), dist), _draw(gen, (70, 2, 64), dist), _draw(gen, (70, 2, 64), dist)
    (q8, sq), (k8, sk), (v8, sv) = (_quantize(x, enc, per_head) for x in (q, k, v))
    dq, dk, dv = _dequant(q8, sq), _dequant(k8, sk), _dequant(v8, sv)
    ref, ref_lse = reference.attention(dq, dk, dv, causal=True)
    model = _model(dq, dk, dv, enc, True)
    out, lse = _single(q8.to(device), k8.to(device), v8.to(device), sq.to(device), sk.to(device), sv.to(device))
    assert out.dtype == torch.bfloat16
    bf16 = serveattn.single_prefill_with_kv_cache(dq.bfloat16().to(device), dk.bfloat16().to(device),
                                                  dv.bfloat16().to(device), causal=True, backend="triton")
    bf16_err = rel_err(bf16, ref)
    assert rel_err(out, ref) < 1.5 * rel_err(model.float(), ref) + 4 * bf16_err
    # Products of fp8 values are exact, but Hopper's fp8 tensor cores sum them in a narrower accumulator
    # than fp32 (about 14 significant bits, as reported for H800 by DeepSeek-V3): each of the few k-steps of
    # a head-dim-64 product may drop low bits of the largest partial sum a logit passes through,
    # sum_d |q_d k_d| * sm_scale * log2(e). Seen on the H200: up to 2^-10.98 of it (e4m3, per-head descales,
    # outliers; 2026-12-02 17:01, docs/runs/2026-12-02T1701-gpu-tests.log), hence a bound of 2^-10.
    # The interpreter and float32 accumulation stay within the 1e-3 floor.
    group = dq.shape[1] // dk.shape[1]
    partial = torch.einsum("qhd,khd->qhk", dq.abs(), dk.abs().repeat_interleave(group, 1)).amax() \
        * dq.shape[-1] ** -0.5 * 1.4427
    assert (lse.double().cpu() - ref_lse).abs().max().item() < 1e-3 + 2 ** -10 * partial.item()


def test_descale_ab(device):
    gen = torch.Generator().manual_seed(3)
    enc = torch.float8_e4m3fn
    q, k, v = torch.randn(16, 8, 64, generator=gen), torch.randn(40, 2, 64, generator=gen) * 0.01, \
        torch.randn(40, 2, 64, generator=gen) * 100
    (q8, sq), (k8, sk), (v8, sv) = (_quantize(x, enc, False) for x in (q, k, v))
    args = [t.to(device) for t in (q8, k8, v8)]
    ref, _ = reference.attention(_dequant(q8, sq), _dequant(k8, sk), _dequant(v8, sv), causal=True)
    out, _ = _single(*args, sq.to(device), sk.to(device), sv.to(device))
    # a 4x scale_q must move the result
    out4, _ = _single(*args, 4 * sq.to(device), sk.to(device), sv.to(device))
    assert rel_err(out4, out.double()) > 1e-2
    # K and V quantized at very different scales: swapping their descales is much worse than the right order
    swapped, _ = _single(*args, sq.to(device), sv.to(device), sk.to(device))
    assert rel_err(swapped, ref) > 10 * rel_err(out, ref)
    # a per-head descale differs from its per-tensor mean
    sk_heads = torch.tensor([0.5, 2.0], dtype=torch.float32) * sk
    per_head, _ = _single(*args, sq.to(device), sk_heads.to(device), sv.to(device))
    mean, _ = _single(*args, sq.to(device), sk_heads.mean().reshape(1).to(device), sv.to(device))
    assert rel_err(per_head, mean.double()) > 1e-2


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("per_head", ["k", "v", "both"])
def test_per_head_descales_read_per_kv_head(per_head, backend, device):
    """A KV head's rows under per-head descales are bitwise its rows under that head's value given per tensor, and
    a per-head scale_k beside a per-tensor (or absent) scale_v is read head by head, and the other way round (the
    kernels once read both with one stride: scale_v past its end, or scale_v[0] for every head)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"descale-heads{per_head}".encode()))
    enc = torch.float8_e4m3fn
    q8, k8, v8 = (torch.randn(n, h, 64, generator=gen).to(enc).to(device) for n, h in ((12, 8), (30, 2), (30, 2)))
    heads = torch.tensor([0.5, 2.0], dtype=torch.float32)
    sq = torch.tensor([0.75], dtype=torch.float32, device=device)
    sk = heads.to(device) if per_head in ("k", "both") else None
    sv = (heads * 3).to(device) if per_head in ("v", "both") else None
    out, lse = _single(q8, k8, v8, sq, sk, sv, backend=backend)
    for h in range(2):
        one = lambda s: None if s is None else s[h:h + 1].clone()  # noqa: E731
        out_h, lse_h = _single(q8, k8, v8, sq, one(sk), one(sv), backend=backend)
        rows = slice(4 * h, 4 * h + 4)  # GQA 8/2: query heads 4h..4h+3 read KV head h
        assert torch.equal(out[:, rows], out_h[:, rows]) and torch.equal(lse[:, rows], lse_h[:, rows])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_paged_fp8_attention_and_o_data_type(backend, device):
    gen = torch.Generator().manual_seed(5)
    b = make_paged_batch(gen, qo_lens=[5, 9], kv_lens=[40, 70], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.float32, device=device)
    enc = torch.float8_e4m3fn
    q8, sq = _quantize(b.q.cpu(), enc, True)
    cache8 = (b.cache / 8).to(enc)
    sk = sv = torch.tensor([8.0])
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                      backend=backend)
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
           q_data_type=enc, kv_data_type=enc, o_data_type=torch.float16)
    out = w.run(q8.to(device), cache8, scale_q=sq.to(device), scale_k=sk.to(device), scale_v=sv.to(device))
    assert out.dtype == torch.float16
    # FlashInfer 0.7's run(q, cache, scale_q, scale_k, scale_v) by position: the same call
    assert torch.equal(w.run(q8.to(device), cache8, sq.to(device), sk.to(device), sv.to(device)), out)
    with pytest.raises(NotImplementedError, match="got 2 more by position"):
        w.run(q8.to(device), cache8, sq.to(device), sk.to(device))
    with pytest.raises(ValueError, match=r"run: the fp8 descales were given by position and by keyword; pass them "
                                         r"one way\.$"):
        w.run(q8.to(device), cache8, sq.to(device), sk.to(device), sv.to(device), scale_q=sq.to(device))
        # "one element" in any shape, as k_scale takes it: 0-d and [1, 1] give [1]'s bits
    for shaped in (lambda t: t.reshape(()), lambda t: t.reshape(1, 1)):
        again = w.run(q8.to(device), cache8, scale_q=shaped(sq).to(device) if sq.numel() == 1 else sq.to(device),
                      scale_k=shaped(sk).to(device), scale_v=shaped(sv).to(device))
        assert torch.equal(again, out)
    ref, _ = reference.batch_paged(_dequant(q8, sq).to(device), cache8.double() * 8, b.qo_indptr, b.kv_indptr,
                                   b.kv_indices, b.last_page_len, causal=True)
    assert rel_err(out, ref) < 5e-2


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_transposed_v_equals_direct_v_bitwise(enc, layout, device, monkeypatch):
    """fp8 attention reads V from a per-run transposed copy (prefill.transposed_v) where a request has several
    query tiles: the same values in another layout, so the result is bitwise the direct read's. Shuffled pages,
    partial last pages, an empty request, requests of one and of several query tiles."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"vt{enc}{layout}".encode()))
    b = make_paged_batch(gen, qo_lens=[70, 0, 3, 41], kv_lens=[150, 21, 3, 77], num_qo_heads=8, num_kv_heads=2,
                         head_dim=64, page_size=16, dtype=torch.float32, kv_layout=layout, device=device)
    q8, sq = _quantize(b.q.cpu(), enc, True)
    cache8 = (b.cache * 4).to(enc)
    one = torch.ones(1, device=device)
    outs = []
    for vt in ("1", "0"):
        monkeypatch.setenv("SERVEATTN_FP8_VT", vt)
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                          layout, backend="triton")
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
               q_data_type=enc, kv_data_type=enc)
        assert (w._plan.vt_work is not None) == (vt == "1")
        out = torch.full((b.q.shape[0], 8, 64), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((b.q.shape[0], 8), float("nan"), device=device)
        w.run(q8.to(device), cache8, scale_q=sq.to(device), scale_k=one * 0.5, scale_v=one * 3, out=out, lse=lse)
        outs.append((out, lse))
    (out, lse), (out_direct, lse_direct) = outs
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, out_direct) and torch.equal(lse, lse_direct)
    ref, _ = reference.batch_paged(_dequant(q8, sq).to(device), cache8.double(), b.qo_indptr, b.kv_indptr,
                                   b.kv_indices, b.last_page_len, causal=True, kv_layout=layout, k_scale=0.5,
                                   v_scale=3.0)
    assert rel_err(out, ref) < 5e-2


def test_transposed_v_only_where_it_pays(device):
    """No transposed copy of V under CUDA graphs (its size follows the batch) or when every request fits one
    query tile (V is read once anyway); the graph wrapper's result is still bitwise the eager one's."""
    enc = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(11)
    b = make_paged_batch(gen, qo_lens=[70, 5], kv_lens=[90, 40], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.float32, device=device)
    q8, cache8 = b.q.to(enc), (b.cache * 4).to(enc)
    one = torch.ones(1, device=device)
    outs = []
    for graph in (False, True):
        bufs = dict(qo_indptr_buf=b.qo_indptr.clone(), paged_kv_indptr_buf=b.kv_indptr.clone(),
                    paged_kv_indices_buf=b.kv_indices.clone(),
                    paged_kv_last_page_len_buf=b.last_page_len.clone()) if graph else {}
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                          use_cuda_graph=graph, backend="triton", **bufs)
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
               q_data_type=enc, kv_data_type=enc)
        assert (w._plan.vt_work is None) == graph
        outs.append(w.run(q8, cache8, scale_q=one, scale_k=one, scale_v=one))
    assert torch.equal(outs[0], outs[1])
    short = make_paged_batch(gen, qo_lens=[3, 5], kv_lens=[40, 9], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                             page_size=16, dtype=torch.float32, device=device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                      backend="triton")
    w.plan(short.qo_indptr, short.kv_indptr, short.kv_indices, short.last_page_len, 8, 2, 64, 16, causal=True,
           q_data_type=enc, kv_data_type=enc)
    assert w._plan.vt_work is None  # 5 tokens x 4 heads: one query tile


def test_fp8_attention_refusals(device):
    enc = torch.float8_e4m3fn
    q8 = torch.randn(4, 8, 64).to(enc).to(device)
    k8 = torch.randn(10, 2, 64).to(enc).to(device)
    one = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="scale_k has shape \\(3,\\).*of one element \\(per tensor\\) or of shape "
                                         "\\[2\\]"):
        _single(q8, k8, k8, one, torch.ones(3, device=device), one)
    with pytest.raises(ValueError, match="scale_q has shape \\(1,\\) and dtype torch.float16"):
        _single(q8, k8, k8, one.half(), one, one)
    with pytest.raises(ValueError, match="scaled twice"):
        serveattn.single_prefill_with_kv_cache(q8, k8, k8, scale_q=one, k_scale=2.0, backend="triton")
    with pytest.raises(NotImplementedError, match="an fp8 query\\) is served with an fp8 KV cache only"):
        serveattn.single_prefill_with_kv_cache(q8, k8.half(), k8.half(), backend="triton")
    with pytest.raises(NotImplementedError, match="with an fp8 query is not served"):
        serveattn.single_prefill_with_kv_cache(q8, k8, k8, pos_encoding_mode="ROPE_LLAMA", backend="triton")
    with pytest.raises(ValueError, match="apply to an fp8 query; this query is torch.float16"):
        serveattn.single_prefill_with_kv_cache(q8.half(), k8, k8, scale_k=one, backend="triton")
    if device != "cpu":
        return
    with pytest.raises(ValueError, match="a descale must be on"):
        _single(q8, k8, k8, one, one, torch.ones(1, device="meta"))


def test_mixed_encodings_are_exact(device):
    """An e4m3 query over an e5m2 cache: the e5m2 tiles reach the tensor cores as they are (mixed fp8 operands),
    not converted to e4m3, which would saturate values past 448 and flush those below 2^-9 (both present here)."""
    gen = torch.Generator().manual_seed(17)
    q, k, v = torch.randn(40, 4, 64, generator=gen), torch.randn(90, 2, 64, generator=gen), \
        torch.randn(90, 2, 64, generator=gen)
    q8, sq = _quantize(q, torch.float8_e4m3fn, False)
    k8 = (k * 2000).to(torch.float8_e5m2)  # |values| up to ~8000
    v8 = (v * 2 ** -12).to(torch.float8_e5m2)  # values down to e5m2's subnormals
    sk, sv = torch.tensor([1 / 2000]), torch.tensor([2.0 ** 12])
    ref, _ = reference.attention(_dequant(q8, sq), _dequant(k8, sk), _dequant(v8, sv), causal=True)
    out, _ = _single(q8.to(device), k8.to(device), v8.to(device), sq.to(device), sk.to(device), sv.to(device))
    assert rel_err(out, ref) < 5e-2


_KEY_ORDER_PROBE = """
import torch, triton, triton.language as tl
from serveattn.kernels.common import vt_column
@triton.jit
def columns(o):
    n = tl.arange(0, 64)
    tl.store(o + n, vt_column(n))
o = torch.zeros(64, dtype=torch.int32)
columns[(1,)](o)
pos = o.tolist()
assert sorted(pos) == list(range(64)) and all(p // 32 == n // 32 for n, p in enumerate(pos))
for a in range(32):  # position a = 16 h + 4 c + e of the fp8 A operand holds key 16 h + 8 (e // 2) + 2 c + e % 2
    h, c, e = a // 16, a % 16 // 4, a % 4
    assert pos[16 * h + 8 * (e // 2) + 2 * c + e % 2] == a
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the switch; the GPU runs it as a step")
def test_fp8_key_order_is_a_permutation_and_off_still_serves():
    """SERVEATTN_FP8_KEY_ORDER (on by default, for the warp-specialized kernel's shuffle-free P operand): the
    transposed V copy holds each 32 keys in the accumulator order of S, a permutation within the 32 (checked
    here), and prefill_kernel reads it back in key order, so this file's fp8 tests pass with it on (the suite)
    and off (here), bitwise the graph path, which makes no copy."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", SERVEATTN_FP8_KEY_ORDER="1", PYTHONPATH=root)
    run = subprocess.run([sys.executable, "-c", _KEY_ORDER_PROBE], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
    env["SERVEATTN_FP8_KEY_ORDER"] = "0"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "transposed_v or calibrated_against_bf16"], capture_output=True, text=True, env=env,
                         timeout=900, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:]


def test_missing_descales_are_ones_made_once(device):
    """A descale not given is a float32 one, made once per device (not a fill launch per call); a given one is
    the caller's tensor. The same call without scale_q equals it with scale_q = 1."""
    from serveattn import policy
    e4m3 = torch.float8_e4m3fn
    first = policy.check_descales("t", q_dtype=e4m3, device=device, num_qo_heads=8, num_kv_heads=2)
    again = policy.check_descales("t", q_dtype=e4m3, device=device, num_qo_heads=8, num_kv_heads=2)
    assert all(a is b for a, b in zip(first, again)) and all(a.tolist() == [1.0] for a in first)
    given = torch.full((2,), 0.5, device=device)
    assert policy.check_descales("t", scale_k=given, scale_v=given, q_dtype=e4m3, device=device,
                                 num_qo_heads=8, num_kv_heads=2)[1] is given
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 64, generator=gen) for n, h in ((16, 8), (40, 2), (40, 2)))
    (q8, _), (k8, sk), (v8, sv) = (_quantize(x, e4m3, False) for x in (q, k, v))
    args = [t.to(device) for t in (q8, k8, v8)]
    out, _ = _single(*args, None, sk.to(device), sv.to(device))
    ones, _ = _single(*args, torch.ones(1, device=device), sk.to(device), sv.to(device))
    assert torch.equal(out, ones)


@pytest.mark.parametrize("wrapper", ["decode", "ragged"])
def test_positional_descales_on_the_other_wrappers(wrapper, device):
    """FlashInfer 0.7's run(q, ..., scale_q, scale_k, scale_v) by position on the decode wrapper's tensor-core route
    and the ragged wrapper: the keyword call's bits."""
    gen = torch.Generator().manual_seed(61)
    enc = torch.float8_e4m3fn
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    if wrapper == "decode":
        b = make_paged_batch(gen, qo_lens=[1, 1], kv_lens=[40, 9], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                             page_size=16, dtype=torch.float32, device=device)
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=enc, kv_data_type=enc)
        kv = ((b.cache / 4).to(enc),)
        q = b.q
    else:
        q = torch.randn(12, 8, 64, generator=gen)
        kv = tuple((torch.randn(30, 2, 64, generator=gen) / 4).to(enc).to(device) for _ in range(2))
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="triton")
        indptr = torch.tensor([0, 12], dtype=torch.int32, device=device)
        w.plan(indptr, torch.tensor([0, 30], dtype=torch.int32, device=device), 8, 2, 64, causal=True,
               q_data_type=enc, kv_data_type=enc)
    q8, sq = _quantize(q.cpu(), enc, True)
    q8, sq = q8.to(device), sq.to(device)
    sk, sv = torch.tensor([4.0], device=device), torch.tensor([0.5], device=device)
    want = w.run(q8, *kv, scale_q=sq, scale_k=sk, scale_v=sv)
    assert torch.equal(w.run(q8, *kv, sq, sk, sv), want)
