"""Prefill family against the float64 reference: paged and ragged batches, single requests, both backends."""
import itertools
import zlib

import pytest
import torch

import serveattn
from serveattn import reference
from helpers import check_lse, make_paged_batch, nan_like, random_lengths, rel_err, tolerance

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
VARIANTS = ["plain", "causal", "custom_mask", "packed_mask", "window", "soft_cap", "rope"]
GQA = [(4, 4), (8, 2), (8, 1)]  # ratios 1, 4, 8
PAGE_SIZES = [1, 16, 5]


def _cases():
    """dtype x head dim x variant in full; layout, GQA ratio, page size and cache form cycle through it."""
    cases = []
    cycle = itertools.cycle(itertools.product(["NHD", "HND"], GQA, PAGE_SIZES, ["5d", "tuple", "view"]))
    for dtype, head_dim, variant in itertools.product(DTYPES, HEAD_DIMS, VARIANTS):
        layout, heads, page_size, form = next(cycle)
        cases.append(pytest.param(dtype, head_dim, variant, layout, heads, page_size, form,
                                  id=f"{str(dtype)[6:]}-d{head_dim}-{variant}-{layout}-g{heads[0] // heads[1]}"
                                     f"-p{page_size}-{form}"))
    return cases


def _options(variant, gen, qo_lens, kv_lens):
    """Keyword options for plan() and the reference; masks are drawn per request."""
    opts = {"causal": variant in ("causal", "window", "rope")}
    if variant in ("custom_mask", "packed_mask"):
        blocks = [torch.rand(q * k, generator=gen) < 0.6 for q, k in zip(qo_lens, kv_lens)]
        mask = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
        opts["custom_mask"] = mask
    if variant == "window":
        opts["window_left"] = 7
    if variant == "soft_cap":
        opts["logits_soft_cap"] = 5.0
        opts["sm_scale"] = 0.3
    if variant == "rope":
        opts["pos_encoding_mode"] = "ROPE_LLAMA"
        opts["rope_theta"] = 500.0
        opts["rope_scale"] = 2.0
    return opts


def _plan_kwargs(opts, variant):
    kw = dict(opts)
    seg = kw.pop("_seg", None)
    if variant == "packed_mask":
        mask = kw.pop("custom_mask")
        kw["packed_custom_mask"], _ = serveattn.segment_packbits(mask, seg, bitorder="little")
    return kw


def _mask_indptr(qo_lens, kv_lens):
    return torch.tensor([0] + torch.cumsum(torch.tensor([q * k for q, k in zip(qo_lens, kv_lens)]), 0).tolist(),
                        dtype=torch.int32)


@pytest.mark.parametrize("dtype,head_dim,variant,layout,heads,page_size,form", _cases())
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_paged_and_ragged_against_reference(dtype, head_dim, variant, layout, heads, page_size, form, backend,
                                            device):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{head_dim}{variant}{backend}".encode()))
    hq, hkv = heads
    causal = variant in ("causal", "window", "rope")
    qo_lens, kv_lens = random_lengths(gen, 4, 9, 40, causal)
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                         head_dim=head_dim, page_size=page_size, dtype=dtype, kv_layout=layout,
                         tuple_cache=form == "tuple", non_contiguous=form == "view", device=device)
    opts = _options(variant, gen, qo_lens, kv_lens)
    opts["_seg"] = _mask_indptr(qo_lens, kv_lens)
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices,
                                             b.last_page_len, kv_layout=layout,
                                             **{k: v for k, v in opts.items() if k != "_seg"})
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    wrapper = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=layout, backend=backend)
    wrapper.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, head_dim, page_size,
                 q_data_type=dtype, **_plan_kwargs(opts, variant))
    out = nan_like(b.q.shape, dtype, device)
    lse = nan_like(b.q.shape[:2], torch.float32, device)
    wrapper.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    assert not torch.isnan(out).any(), "an output element was not written"
    assert rel_err(out, ref_out) < tolerance(dtype)
    check_lse(lse, ref_lse)
    # determinism: a second run is bitwise identical
    out2, lse2 = wrapper.run(b.q, b.cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)

    # the ragged wrapper on the same requests' K/V, laid out contiguously
    k, v, kv_indptr = reference.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, layout)
    if layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    ragged = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout=layout, backend=backend)
    ragged.plan(b.qo_indptr, kv_indptr.to(torch.int32).to(device), hq, hkv, head_dim, q_data_type=dtype,
                **_plan_kwargs(opts, variant))
    r_out, r_lse = ragged.run(b.q, k.to(device), v.to(device), return_lse=True)
    assert rel_err(r_out, ref_out) < tolerance(dtype)
    check_lse(r_lse, ref_lse)

    # batch against single-request runs
    mask = opts.get("custom_mask")
    offset = 0
    for i, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        if qo == 0:
            continue
        q0 = int(b.qo_indptr[i])
        kk = k[:, int(kv_indptr[i]):int(kv_indptr[i + 1])] if layout == "HND" else \
            k[int(kv_indptr[i]):int(kv_indptr[i + 1])]
        vv = v[:, int(kv_indptr[i]):int(kv_indptr[i + 1])] if layout == "HND" else \
            v[int(kv_indptr[i]):int(kv_indptr[i + 1])]
        single_opts = {k_: v_ for k_, v_ in opts.items() if k_ not in ("_seg", "custom_mask")}
        if mask is not None:
            single_opts["custom_mask"] = mask[offset:offset + qo * kv].reshape(qo, kv).to(device)
        s_out, s_lse = serveattn.single_prefill_with_kv_cache(
            b.q[q0:q0 + qo], kk.to(device), vv.to(device), kv_layout=layout, backend=backend, return_lse=True,
            **single_opts)
        assert rel_err(s_out, out[q0:q0 + qo]) < tolerance(dtype)
        check_lse(s_lse, lse[q0:q0 + qo])
        offset += qo * kv


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_single_prefill_return_lse_and_scales(backend, device):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(12, 8, 128, generator=gen).to(torch.bfloat16).to(device)
    k = torch.randn(30, 2, 128, generator=gen).to(torch.bfloat16).to(device)
    v = torch.randn(30, 2, 128, generator=gen).to(torch.bfloat16).to(device)
    out, lse = serveattn.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True, backend=backend,
                                                                 k_scale=0.5, v_scale=2.0)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, k_scale=0.5, v_scale=2.0)
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse)


def test_triton_matches_torch_backend_bitwise_deterministic(device):
    """Two wrappers planned alike give identical bits; the two backends agree to tolerance."""
    gen = torch.Generator().manual_seed(11)
    b = make_paged_batch(gen, qo_lens=[5, 0, 17, 3], kv_lens=[20, 9, 40, 3], num_qo_heads=8, num_kv_heads=2,
                         head_dim=64, page_size=16, dtype=torch.float16, device=device)
    outs = []
    for backend in ("triton", "triton", "torch"):
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8, device=device),
                                                          backend=backend)
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
               q_data_type=torch.float16)
        outs.append(w.run(b.q, b.cache))
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], outs[2].double()) < 2e-3


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_run_twice_is_bitwise_identical(causal, device):
    """The ragged wrapper (random lengths, an empty request) into poisoned caller buffers: fully written, near the
    reference, and a second run gives the same bits."""
    gen = torch.Generator().manual_seed(13 + causal)
    qo_lens, kv_lens = random_lengths(gen, 4, 9, 40, causal)
    i32 = dict(dtype=torch.int32, device=device)
    qo_indptr = torch.tensor([0] + torch.cumsum(torch.tensor(qo_lens), 0).tolist(), **i32)
    kv_indptr = torch.tensor([0] + torch.cumsum(torch.tensor(kv_lens), 0).tolist(), **i32)
    q = torch.randn(sum(qo_lens), 4, 64, generator=gen).to(torch.bfloat16).to(device)
    k, v = (torch.randn(sum(kv_lens), 2, 64, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                       backend="triton")
    w.plan(qo_indptr, kv_indptr, 4, 2, 64, causal=causal, q_data_type=torch.bfloat16)
    out, lse = nan_like(q.shape, torch.bfloat16, device), nan_like(q.shape[:2], torch.float32, device)
    w.run(q, k, v, out=out, lse=lse, return_lse=True)
    assert not torch.isnan(out).any(), "an output element was not written"
    ref_out, ref_lse = reference.batch_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal)
    assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
    check_lse(lse, ref_lse)
    out2, lse2 = w.run(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_rejected_plan_leaves_previous_plan_runnable(device):
    gen = torch.Generator().manual_seed(3)
    b = make_paged_batch(gen, qo_lens=[4, 6], kv_lens=[20, 33], num_qo_heads=4, num_kv_heads=4, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8, device=device),
                                                      backend="triton")
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 4, 64, 16, causal=True,
           q_data_type=torch.bfloat16)
    before = w.run(b.q, b.cache)
    # a different page table that is rejected late (causal kv < qo): nothing of it may be installed
    bad_indices = torch.flip(b.kv_indices, [0])
    bad_last = torch.tensor([1, 1], dtype=torch.int32, device=device)
    bad_indptr = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="causal=True with kv_len=1 < qo_len=4"):
        w.plan(b.qo_indptr, bad_indptr, bad_indices, bad_last, 4, 4, 64, 16, causal=True,
               q_data_type=torch.bfloat16)
    after = w.run(b.q, b.cache)
    assert torch.equal(before, after)


@pytest.mark.parametrize("causal", [True, False])
def test_work_list_keeps_each_request_together_costliest_first(causal):
    """prefill.build_work: every (request, query tile) once; requests in order of their costliest tile, each
    request's tiles contiguous and costliest first (the programs in flight then share one request's K/V in L2)."""
    from serveattn.prefill import build_work
    group, block_m = 4, 128
    qo = torch.tensor([64, 0, 300, 10, 300, 33], dtype=torch.int32)
    kv = torch.tensor([64, 5, 300, 400, 900, 33], dtype=torch.int32)
    work, n = build_work(qo, kv, group, block_m, causal)
    pairs = [tuple(p) for p in work.reshape(-1, 2).tolist()]
    tiles = [(int(q) * group + block_m - 1) // block_m for q in qo]
    assert n == len(pairs) == sum(tiles)
    assert sorted(pairs) == [(r, t) for r in range(len(tiles)) for t in range(tiles[r])]

    def keys(r, t):
        q, k = int(qo[r]), int(kv[r])
        return min(k, k - q + min((t + 1) * block_m // group, q)) if causal else k

    reqs = [r for i, (r, _) in enumerate(pairs) if i == 0 or pairs[i - 1][0] != r]
    assert len(reqs) == len(set(reqs)), "a request's tiles are not contiguous"
    req_cost = [max(keys(r, t) for t in range(tiles[r])) for r in reqs]
    assert req_cost == sorted(req_cost, reverse=True)
    for r in reqs:
        costs = [keys(r, t) for rr, t in pairs if rr == r]
        assert costs == sorted(costs, reverse=True)


@pytest.mark.parametrize("cap", [0.5, 50.0, 1e3, 1e8])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_soft_cap_small_and_large(cap, kind, device):
    """c * tanh(logit / c) stays accurate at any cap: a large one (every logit far inside it) once lost the logits
    to cancellation in 1 - 2 / (exp(2t) + 1) (cap 1e8: all flat); a small one saturates every logit. Caps above
    common.SERIES_CAP take the series near 0; the realistic ones keep the cheaper form (and their bits)."""
    from serveattn.kernels.common import SERIES_CAP, soft_cap_mode
    assert soft_cap_mode(cap) == (2 if cap > SERIES_CAP else 1) and soft_cap_mode(0.0) == 0
    gen = torch.Generator().manual_seed(zlib.crc32(f"cap{cap}{kind}".encode()))
    b = make_paged_batch(gen, qo_lens=[6, 1] if kind == "prefill" else [1, 1], kv_lens=[40, 23], num_qo_heads=8,
                         num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16, device=device)
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True, logits_soft_cap=cap)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    if kind == "prefill":
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
               logits_soft_cap=cap, q_data_type=torch.bfloat16)
    else:
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, logits_soft_cap=cap,
               q_data_type=torch.bfloat16)
    out, lse = w.run(b.q, b.cache, return_lse=True)
    assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_caller_reusing_its_mask_and_page_table_after_plan_changes_nothing(backend, device):
    """plan() keeps its own copies: rewriting the custom mask or the page indices in place between plan() and
    run() (a caller preparing its next batch) leaves run()'s answer the plan's (the torch route read them)."""
    gen = torch.Generator().manual_seed(31)
    b = make_paged_batch(gen, qo_lens=[6, 5], kv_lens=[13, 9], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=4, dtype=torch.float16, device=device)
    mask = (torch.rand(6 * 13 + 5 * 9, generator=gen) < 0.5).to(device)
    want, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                    custom_mask=mask.clone())
    indices = b.kv_indices.clone()
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                      backend=backend)
    w.plan(b.qo_indptr, b.kv_indptr, indices, b.last_page_len, 4, 2, 64, 4, custom_mask=mask,
           q_data_type=torch.float16)
    mask.logical_not_()
    indices.copy_(indices.flip(0))
    assert rel_err(w.run(b.q, b.cache), want) < tolerance(torch.float16)


@pytest.mark.parametrize("wrapper", ["paged", "ragged"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_custom_mask_overrides_causal(wrapper, backend, device):
    """API.md: a mask overrides causal. With custom_mask or packed_custom_mask, causal=True gives causal=False's
    bits and the reference's masked answer, rows the mask leaves empty 0 / -inf, every row written; a request with
    fewer keys than rows (which causal alone refuses) is served under a mask."""
    gen = torch.Generator().manual_seed(57)
    qo_lens, kv_lens = [6, 5, 3], [13, 9, 2]  # request 2: 3 rows over 2 keys
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=4, dtype=torch.float16, device=device)
    mask = torch.rand(sum(q * k for q, k in zip(qo_lens, kv_lens)), generator=gen) < 0.6
    mask[6 * 13:6 * 13 + 9] = False  # request 1's first row sees no key
    mask = mask.to(device)
    want, want_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                           custom_mask=mask)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    if wrapper == "paged":
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend=backend)
        head, args = (b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4), (b.q, b.cache)
    else:
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend=backend)
        kv_indptr = torch.tensor([0, 13, 22, 24], dtype=torch.int32, device=device)
        k, v = (torch.randn(24, 2, 64, generator=gen).to(torch.float16).to(device) for _ in range(2))
        want, want_lse = reference.batch_ragged(b.q, k, v, b.qo_indptr, kv_indptr, custom_mask=mask)
        head, args = (b.qo_indptr, kv_indptr, 4, 2, 64), (b.q, k, v)
    sizes = torch.tensor([0] + [q * k for q, k in zip(qo_lens, kv_lens)]).cumsum(0).to(torch.int32).to(device)
    packed, _ = serveattn.segment_packbits(mask, sizes, "little")  # FlashInfer's form: each request's bits padded
    results = []
    for causal, masks in ((False, dict(custom_mask=mask)), (True, dict(custom_mask=mask)),
                          (True, dict(packed_custom_mask=packed))):
        w.plan(*head, causal=causal, q_data_type=torch.float16, **masks)
        out = nan_like(b.q.shape, torch.float16, device)
        lse = nan_like(b.q.shape[:2], torch.float32, device)
        w.run(*args, out=out, lse=lse, return_lse=True)
        results.append((out, lse))
    for out, lse in results:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    out, lse = results[0]
    assert not out.isnan().any() and rel_err(out, want) < tolerance(torch.float16)
    check_lse(lse, want_lse)
    assert (out[6] == 0).all() and (lse[6] == float("-inf")).all()


@pytest.mark.parametrize("kind", ["paged-causal", "paged-window", "ragged", "decode-tc", "tree"])
def test_int32_kv_offsets_move_no_bit(kind, device, monkeypatch):
    """SERVEATTN_PREFILL_KV_OFFSETS_32 (kernels/attention.PREFILL_OFF32, on by default for tiles of 64 rows and
    more): prefill_kernel with int32 K/V offsets at every tile (MIN_ROWS 0; where the cache fits,
    attention.fits_int32) gives the int64 kernel's bits, every row written: paged
    (HND, a window), ragged, the decode wrapper's tensor-core route and a tree."""
    from serveattn.kernels import attention as attention_kernel
    gen = torch.Generator().manual_seed(zlib.crc32(f"off32-{kind}".encode()))
    decode_like = kind in ("decode-tc", "tree")
    kv_lens = [90, 300, 0, 33] if kind == "decode-tc" else [90, 300, 7, 33]
    qo_lens = [1] * 4 if decode_like else [5, 70, 7, 33]
    b = make_paged_batch(gen, qo_lens=[3] * 4 if kind == "tree" else qo_lens, kv_lens=kv_lens, num_qo_heads=8,
                         num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16,
                         kv_layout="HND" if kind == "paged-window" else "NHD", device=device)
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    k, v = (torch.randn(sum(kv_lens), 2, 64, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    results = {}
    for off32 in (False, True):
        monkeypatch.setattr(attention_kernel, "PREFILL_OFF32", off32)
        monkeypatch.setattr(attention_kernel, "PREFILL_OFF32_MIN_ROWS", 0)
        if decode_like:
            w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
            w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
                   **({"tree_parents": [[-1, 0, 0]] * 4} if kind == "tree" else {}))
            args = (b.q, b.cache)
        elif kind == "ragged":
            kv_indptr = torch.tensor([0] + torch.cumsum(torch.tensor(kv_lens), 0).tolist(), dtype=torch.int32,
                                     device=device)
            w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="triton")
            w.plan(b.qo_indptr, kv_indptr, 8, 2, 64, causal=True, q_data_type=torch.bfloat16)
            args = (b.q, k, v)
        else:
            w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, "HND" if kind == "paged-window" else "NHD",
                                                              backend="triton")
            w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
                   q_data_type=torch.bfloat16, **({"window_left": 20} if kind == "paged-window" else {}))
            args = (b.q, b.cache)
        out, lse = nan_like(b.q.shape, torch.bfloat16, device), nan_like(b.q.shape[:2], torch.float32, device)
        w.run(*args, out=out, lse=lse, return_lse=True)
        assert not out.isnan().any()
        results[off32] = out, lse
    assert torch.equal(results[False][0], results[True][0]) and torch.equal(results[False][1], results[True][1])
