"""The call sequences two serving engines make on FlashInfer's wrappers, run on ours after changing the import,
against the float64 reference: SGLang's (begin_forward without per-layer settings, then forward /
forward_return_lse with them; an extend step over a cached prefix as a causal ragged part and a non-causal paged
part merged with merge_state) and vLLM's (plan with every setting and the split arguments, run into the engine's
out buffer with float scales). Shapes from the engines' defaults, small enough for the interpreter."""
import pytest
import torch

import serveattn
from serveattn import reference
from helpers import check_lse, make_paged_batch, rel_err, tolerance

BF16 = torch.bfloat16
HQ, HKV, D, PAGE = 8, 2, 64, 16


@pytest.mark.parametrize("backend", ["fa2", "triton"])
def test_sglang_extend_over_a_cached_prefix(backend, device):
    """SGLang's extend with a radix-cache prefix: the new tokens attend to themselves causally (ragged) and to the
    cached prefix fully (paged), and merge_state joins the two states."""
    gen = torch.Generator().manual_seed(41)
    new_lens, prefix_lens = [5, 0, 9, 3], [30, 17, 0, 40]
    b = make_paged_batch(gen, qo_lens=new_lens, kv_lens=prefix_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                         page_size=PAGE, dtype=BF16, device=device)
    k_new = torch.randn(sum(new_lens), HKV, D, generator=gen).to(BF16).to(device)
    v_new = torch.randn(sum(new_lens), HKV, D, generator=gen).to(BF16).to(device)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    ragged = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
    paged = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    ragged.begin_forward(b.qo_indptr, b.qo_indptr, HQ, HKV, D, q_data_type=BF16)
    paged.begin_forward(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=BF16,
                        non_blocking=True)
    scale, cap = 0.11, 30.0
    o1, s1 = ragged.forward_return_lse(b.q, k_new, v_new, causal=True, sm_scale=scale, logits_soft_cap=cap)
    o2, s2 = paged.forward_return_lse(b.q, b.cache, causal=False, sm_scale=scale, logits_soft_cap=cap, k_scale=1.0,
                                      v_scale=1.0)
    out, _ = serveattn.merge_state(o1, s1, o2, s2)
    # the reference: each request's whole context (prefix, then its new tokens), bottom-right causal
    k_pre, v_pre, pre_indptr = reference.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, "NHD")
    ks, vs, ctx = [], [], [0]
    for i, n in enumerate(new_lens):
        lo, hi = int(pre_indptr[i]), int(pre_indptr[i + 1])
        q_lo, q_hi = int(b.qo_indptr[i]), int(b.qo_indptr[i + 1])
        ks += [k_pre[lo:hi].cpu(), k_new[q_lo:q_hi].cpu()]  # the reference in float64 on the CPU
        vs += [v_pre[lo:hi].cpu(), v_new[q_lo:q_hi].cpu()]
        ctx.append(ctx[-1] + (hi - lo) + n)
    ref, _ = reference.batch_ragged(b.q.cpu(), torch.cat(ks), torch.cat(vs), b.qo_indptr.cpu(),
                                    torch.tensor(ctx, dtype=torch.int32), causal=True, sm_scale=scale,
                                    logits_soft_cap=cap)
    rows = b.qo_indptr[-1]
    assert not torch.isnan(out[:rows]).any()
    assert rel_err(out, ref) < tolerance(BF16)


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_sglang_decode(use_tensor_cores, device):
    gen = torch.Generator().manual_seed(43)
    b = make_paged_batch(gen, qo_lens=[1] * 4, kv_lens=[33, 1, 70, 16], num_qo_heads=HQ, num_kv_heads=HKV,
                         head_dim=D, page_size=PAGE, dtype=BF16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8, device=device), "NHD",
                                                     use_tensor_cores=use_tensor_cores)
    w.begin_forward(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, data_type=BF16, q_data_type=BF16,
                    non_blocking=True)
    out = w.forward(b.q, b.cache, sm_scale=0.2, logits_soft_cap=0.0, k_scale=0.5, v_scale=2.0)
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   sm_scale=0.2, k_scale=0.5, v_scale=2.0)
    assert rel_err(out, ref) < tolerance(BF16)


# vLLM's split arguments (decode fixed size, prefill fixed size, disable_split_kv): -1 / False outside its
# batch-invariant mode (FlashInfer's "not set"), 2048 / 4096 / True in it
VLLM_SPLITS = {"normal": (-1, -1, False), "batch-invariant": (2048, 4096, True)}


@pytest.mark.parametrize("mode", sorted(VLLM_SPLITS))
def test_vllm_prefill_and_decode(mode, device):
    """vLLM's FlashInfer backend: plan() with every setting (and the split arguments it passes in either mode),
    run() into slices of its output buffer with float scales, decode and prefill in one step."""
    dec_split, pre_split, disable = VLLM_SPLITS[mode]
    gen = torch.Generator().manual_seed(47)
    b = make_paged_batch(gen, qo_lens=[1, 1, 6, 4], kv_lens=[50, 7, 20, 4], num_qo_heads=HQ, num_kv_heads=HKV,
                         head_dim=D, page_size=PAGE, dtype=BF16, device=device)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    output = torch.full_like(b.q, float("nan"))
    i32 = dict(dtype=torch.int32, device=device)
    # decode: the first two requests (one token each)
    # its fast_plan_decode's plan() call: host indptr / last_page_len, device indices, and 15 optional arguments
    # by position in FlashInfer 0.7's order (o_data_type, data_type, ..., block_tables, seq_lens, the splits)
    dec = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    dec.plan(b.kv_indptr[:3].cpu(), b.kv_indices, b.last_page_len[:2].cpu(), HQ, HKV, D, PAGE, "NONE", -1, None,
             BF16, BF16, BF16, None, 0.125, None, None, True, None, None, dec_split, disable)
    # vLLM's forward() asserts these FlashInfer attributes of the planned wrapper before every run()
    assert (dec._window_left, dec._logits_soft_cap, dec._sm_scale) == (-1, 0.0, 0.125)
    dec.run(b.q[:2], b.cache, k_scale=1.0, v_scale=1.0, out=output[:2])
    by_keyword = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    by_keyword.plan(b.kv_indptr[:3], b.kv_indices, b.last_page_len[:2], HQ, HKV, D, PAGE, pos_encoding_mode="NONE",
                    sm_scale=0.125, window_left=-1, logits_soft_cap=None, q_data_type=BF16, kv_data_type=BF16,
                    o_data_type=BF16, fixed_split_size=dec_split, disable_split_kv=disable)
    assert torch.equal(by_keyword.run(b.q[:2], b.cache, k_scale=1.0, v_scale=1.0), output[:2])
    # prefill: the other two, their page table rebased to its own indptr
    pre_indptr = b.kv_indptr[2:] - b.kv_indptr[2]
    pre_indices = b.kv_indices[int(b.kv_indptr[2]):]
    qo = torch.tensor([0, 6, 10], **i32)
    pre = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    pre.plan(qo, pre_indptr, pre_indices, b.last_page_len[2:], HQ, HKV, D, PAGE, causal=True, sm_scale=0.125,
             window_left=-1, logits_soft_cap=None, q_data_type=BF16, kv_data_type=BF16, fixed_split_size=pre_split,
             disable_split_kv=disable)
    assert (pre._window_left, pre._logits_soft_cap, pre._sm_scale, pre._causal) == (-1, 0.0, 0.125, True)
    pre.run(b.q[2:], b.cache, k_scale=1.0, v_scale=1.0, out=output[2:])
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   causal=True, sm_scale=0.125)
    assert not torch.isnan(output).any()
    assert rel_err(output, ref) < tolerance(BF16)
    check_lse(dec.run_return_lse(b.q[:2], b.cache)[1],
              reference.batch_paged(b.q[:2], b.cache, torch.arange(3, **i32).cpu(), b.kv_indptr[:3].cpu(),
                                    b.kv_indices.cpu(), b.last_page_len[:2].cpu(), sm_scale=0.125)[1])



@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_page_size_one_caches_without_the_slot_axis(layout, backend, device):
    """SGLang's token pools: page size 1, K and V as [tokens, Hkv, D] each (or one [tokens, 2, Hkv, D] tensor), the
    slot axis left out, which FlashInfer takes (its _expand_4d / _expand_5d; the same shape in either layout).
    Decode on both routes, paged prefill, cascade and append give the bits of the same cache with its slot axis;
    another page size is still refused."""
    gen = torch.Generator().manual_seed(71)
    tokens = 64
    k, v = (torch.randn(tokens, HKV, D, generator=gen).to(BF16).to(device) for _ in range(2))
    axis = 1 if layout == "NHD" else 2  # where the slot axis of 1 sits in [pages, ., ., D]
    forms = {"slot axis": (k.unsqueeze(axis), v.unsqueeze(axis)), "3-D pair": (k, v),
             "4-D single": torch.stack([k, v], 1)}
    i32 = dict(dtype=torch.int32, device=device)
    indices = torch.randperm(tokens, generator=gen)[:40].to(**i32)
    indptr, last = torch.tensor([0, 9, 39, 40], **i32), torch.ones(3, **i32)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    q1 = torch.randn(3, HQ, D, generator=gen).to(BF16).to(device)
    qo = torch.tensor([0, 2, 7, 8], **i32)
    q = torch.randn(8, HQ, D, generator=gen).to(BF16).to(device)

    def outputs(cache):
        got = []
        for tc in (False, True):
            w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=tc, backend=backend)
            w.plan(indptr, indices, last, HQ, HKV, D, 1, q_data_type=BF16)
            got.append(w.run(q1, cache))
        p = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, layout, backend=backend)
        p.plan(qo, indptr, indices, last, HQ, HKV, D, 1, causal=True, q_data_type=BF16)
        got.append(p.run(q, cache))
        # level 0: request 0's first token, shared by every row; level 1: the rest of each request's tokens
        c = serveattn.MultiLevelCascadeAttentionWrapper(2, ws, layout, backend=backend)
        c.plan([torch.tensor([0, 8], **i32), qo], [torch.tensor([0, 1], **i32), torch.tensor([0, 8, 38, 39], **i32)],
               [indices[:1], indices[1:]], [torch.ones(1, **i32), last], HQ, HKV, D, 1, causal=True,
               q_data_type=BF16)
        got.append(c.run(q, cache))
        return got

    want = outputs(forms["slot axis"])
    for name in ("3-D pair", "4-D single"):
        assert all(torch.equal(g, r) for g, r in zip(outputs(forms[name]), want)), name
    # append three tokens to request 1 (its positions 27..29): the same slots written in every form
    new_k, new_v = (torch.randn(3, HKV, D, generator=gen).to(BF16).to(device) for _ in range(2))
    written = []
    for name, form in forms.items():
        cache = tuple(t.clone() for t in form) if isinstance(form, tuple) else form.clone()
        serveattn.append_paged_kv_cache(new_k, new_v, torch.ones(3, **i32), torch.tensor([27, 28, 29], **i32), cache,
                                        indices, indptr, last, layout)
        pair = cache if isinstance(cache, tuple) else cache.unbind(1)
        written.append(tuple(t.reshape(tokens, HKV, D) for t in pair))
    for other in written[1:]:
        assert torch.equal(other[0], written[0][0]) and torch.equal(other[1], written[0][1])
    assert not torch.equal(written[0][0], k)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, layout, backend=backend)
    w.plan(torch.tensor([0, 1], **i32), indices[:1], torch.ones(1, **i32), HQ, HKV, D, 16, q_data_type=BF16)
    with pytest.raises(ValueError, match="k cache has shape"):
        w.run(q1[:1], forms["3-D pair"])
