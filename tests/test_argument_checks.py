"""Arguments of odd types and mismatched pairs (found by an adversarial sweep of the public API in session 30):
each is refused with a sentence before anything runs, or served right; FlashInfer's later keywords at their no-op
values, its q_scale, reset_workspace_buffer and is_cuda_graph_enabled behave as FlashInfer's."""
import re

import numpy as np
import pytest
import torch

import serveattn
from helpers import make_paged_batch

F16 = torch.float16
I32 = torch.int32


def _ws(device, nbytes=1 << 22):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _batch(device, seed=3, qo_lens=(3, 0, 5), kv_lens=(40, 9, 23), tuple_cache=False):
    gen = torch.Generator().manual_seed(seed)
    return make_paged_batch(gen, qo_lens=list(qo_lens), kv_lens=list(kv_lens), num_qo_heads=4, num_kv_heads=2,
                            head_dim=64, page_size=16, dtype=F16, device=device, tuple_cache=tuple_cache)


def _decode(device, b, use_tensor_cores=False):
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), use_tensor_cores=use_tensor_cores,
                                                     backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, q_data_type=F16)
    return w


def _paged(device, b):
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton")
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, causal=True, q_data_type=F16)
    return w


def _decode_q(b, device):
    return torch.randn(len(b.kv_lens), 4, 64, generator=torch.Generator().manual_seed(9)).to(F16).to(device)


@pytest.mark.parametrize("wrapper", ["decode", "paged"])
def test_kv_pair_of_other_shapes_or_none_is_refused(wrapper, device):
    """A (k_cache, v_cache) pair indexed by one page table: a v_cache with fewer pages was read out of bounds."""
    b = _batch(device, tuple_cache=True)
    w, q = (_decode(device, b), _decode_q(b, device)) if wrapper == "decode" else (_paged(device, b), b.q)
    k_cache, v_cache = b.cache
    with pytest.raises(ValueError, match="v cache has 2 pages but k cache has \\d+; one page table indexes both"):
        w.run(q, (k_cache, v_cache[:2]))
    with pytest.raises(ValueError, match="v is a NoneType; K and V must be tensors"):
        w.run(q, (k_cache, None))


def test_ragged_run_with_k_none_is_refused(device):
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
    w.plan(torch.tensor([0, 5], dtype=I32), torch.tensor([0, 7], dtype=I32), 4, 2, 64, q_data_type=F16)
    v = torch.randn(7, 2, 64, dtype=F16, device=device)
    with pytest.raises(ValueError, match="k is a NoneType; K and V must be tensors"):
        w.run(torch.randn(5, 4, 64, dtype=F16, device=device), None, v)


@pytest.mark.parametrize("indptr", [np.array([0, 5, 3, 8], np.int32), np.array([0.0, 3.0, 5.0, 8.0])])
def test_numpy_qo_indptr_is_refused_as_not_a_tensor(indptr, device):
    """Only the decode wrapper's own query rows skip the checks (prefill.PlannedRows); a caller's numpy array
    once did too: a decreasing one ran and wrote garbage."""
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
    with pytest.raises(ValueError, match="qo_indptr must be an int32 torch.Tensor, got ndarray"):
        w.plan(indptr, torch.tensor([0, 4, 6, 13], dtype=I32), 4, 2, 64, q_data_type=F16)


def test_single_decode_refuses_a_strided_head_dim(device):
    """The bandwidth kernel reads q's head dim at unit stride: a transposed q was read wrong, silently."""
    q = torch.randn(64, 4, dtype=F16, device=device).t()
    k = torch.randn(30, 2, 64, dtype=F16, device=device)
    with pytest.raises(ValueError, match="q must have a contiguous last dimension"):
        serveattn.single_decode_with_kv_cache(q, k, k.clone(), backend="triton")


@pytest.mark.parametrize("head_dim", [np.int64(64), 64.0, True])
def test_head_dim_must_be_a_python_int(head_dim, device):
    b = _batch(device)
    for make in (lambda: serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend="triton").plan(
                     b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, head_dim, 16, q_data_type=F16),
                 lambda: serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="torch").plan(
                     torch.tensor([0, 5], dtype=I32), torch.tensor([0, 7], dtype=I32), 4, 2, head_dim,
                     q_data_type=F16)):
        with pytest.raises(ValueError, match=f"head_dim={re.escape(repr(head_dim))} \\({type(head_dim).__name__}"
                                             f"\\) must be a Python int"):
            make()


@pytest.mark.parametrize("over, match", [
    (dict(num_qo_heads=True), "num_qo_heads=True must be a positive int"),
    (dict(page_size=True), "page_size"),
    (dict(window_left=True), "window_left=True must be an int >= -1"),
    (dict(sm_scale=True), "sm_scale=True must be a positive finite float"),
    (dict(sm_scale=1e-300), "sm_scale=1e-300 must be a positive finite float within float32's normal range"),
    (dict(sm_scale=1e39), "sm_scale=1e\\+39 must be a positive finite float within float32's normal range"),
    (dict(logits_soft_cap=1e39), "logits_soft_cap=1e\\+39 must be a finite float >= 0 within float32's"),
    (dict(logits_soft_cap=3e38), "logits_soft_cap=3e\\+38 with sm_scale=None: sm_scale / logits_soft_cap and "
                                 "logits_soft_cap \\* log2\\(e\\) must be positive finite"),
    (dict(logits_soft_cap=1e-35, sm_scale=1e4), "logits_soft_cap=1e-35 with sm_scale=10000.0"),
    (dict(rope_theta=1e-300), "rope_theta=1e-300 must be a positive finite float within float32's"),
])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_scalars_of_the_wrong_type_or_outside_float32_are_refused(over, match, backend, device):
    b = _batch(device)
    args = dict(num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, page_size=16, causal=True, q_data_type=F16)
    args.update(over)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend=backend)
    with pytest.raises(ValueError, match=match):
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, **args)


def test_run_scale_outside_float32_is_refused(device):
    b = _batch(device)
    w = _decode(device, b)
    with pytest.raises(ValueError, match="k_scale=1e\\+39 must be a positive finite float \\(a normal float32\\)"):
        w.run(_decode_q(b, device), b.cache, k_scale=1e39)


def test_custom_mask_shape_and_type(device):
    """A [qo_len, kv_len] mask for one request is taken as it is; a transposed one (same numel) and a list are
    refused, not reinterpreted row-major or failed on inside."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(5, 4, 64, generator=gen).to(F16).to(device)
    k, v = (torch.randn(7, 2, 64, generator=gen).to(F16).to(device) for _ in range(2))
    mask = torch.rand(5, 7, generator=gen) > 0.3
    mask[:, 0] = True
    two_d = serveattn.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.to(device), backend="triton")
    flat = serveattn.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.reshape(-1).to(device),
                                                  backend="triton")
    assert torch.equal(two_d, flat)
    with pytest.raises(ValueError, match="custom_mask has shape \\(7, 5\\), \\[kv_len, qo_len\\]; a request's mask is "
                                         "\\[qo_len, kv_len\\] = \\[5, 7\\]"):
        serveattn.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.t().contiguous().to(device))
    with pytest.raises(ValueError, match="custom_mask is a list; it must be a torch.Tensor"):
        serveattn.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.tolist())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_merge_in_place_reads_a_strided_mask(backend, device):
    gen = torch.Generator().manual_seed(6)
    v, v_other = (torch.randn(5, 4, 64, generator=gen).to(F16).to(device) for _ in range(2))
    s, s_other = (torch.randn(5, 4, generator=gen).to(device) for _ in range(2))
    rows = torch.tensor([True, False, True, False, True], device=device)
    strided = torch.stack([rows, ~rows], 1)[:, 0]
    assert not strided.is_contiguous()
    want_v, want_s, got_v, got_s = v.clone(), s.clone(), v.clone(), s.clone()
    serveattn.merge_state_in_place(want_v, want_s, v_other, s_other, mask=rows, backend=backend)
    serveattn.merge_state_in_place(got_v, got_s, v_other, s_other, mask=strided, backend=backend)
    assert torch.equal(got_v, want_v) and torch.equal(got_s, want_s)
    assert torch.equal(got_v[1], v[1]) and not torch.equal(got_v[0], v[0])


def test_flashinfer_later_keywords_pass_at_their_no_op_values(device):
    """An engine that forwards every FlashInfer keyword passes its later ones at their defaults: served as if
    absent (bitwise); any other value is still refused by name."""
    b = _batch(device)
    q = _decode_q(b, device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, q_data_type=F16, window_right=0,
           block_tables=None, seq_lens=None, is_causal=None)
    want = _decode(device, b).run(q, b.cache)
    assert torch.equal(w.run(q, b.cache, sinks=None, kv_cache_sf=None, skip_softmax_threshold_scale_factor=None),
                       want)
    with pytest.raises(NotImplementedError, match="argument\\(s\\) window_right are not served at these values"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, q_data_type=F16, window_right=3)
    with pytest.raises(NotImplementedError, match="argument\\(s\\) not_a_flashinfer_argument are not served\\.$"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, q_data_type=F16,
               not_a_flashinfer_argument=None)
    p = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton", jit_kwargs=None,
                                                      variant_owns_mask=False)
    p.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, causal=True, q_data_type=F16,
           prefix_len_ptr=None, token_pos_in_items_len=0, block_tables=None, seq_lens_q=None, uniform_q_len=None)
    out = p.run(b.q, b.cache, sinks=None, kv_cache_sf=None, use_fp16_softmax=None, uses_spcompress=None)
    assert torch.equal(out, _paged(device, b).run(b.q, b.cache))
    with pytest.raises(NotImplementedError, match="variant_owns_mask"):
        serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), variant_owns_mask=True)
    r = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
    r.plan(torch.tensor([0, 5], dtype=I32), torch.tensor([0, 7], dtype=I32), 4, 2, 64, q_data_type=F16,
           v_indptr=None, o_indptr=None, seq_lens=None)
    kv = torch.randn(7, 2, 64, dtype=F16, device=device)
    r.run(torch.randn(5, 4, 64, dtype=F16, device=device), kv, kv, o_scale=None, kv_cache_sf=None)
    q1 = torch.randn(5, 4, 64, dtype=F16, device=device)
    serveattn.single_prefill_with_kv_cache(q1, kv, kv, kv_cache_sf=None, backend="triton")


@pytest.mark.parametrize("wrapper", ["decode", "paged"])
def test_seq_lens_must_agree_with_the_page_table(wrapper, device):
    """FlashInfer's seq_lens (its trtllm-gen / cuDNN backends' KV lengths): the page table decides what a request
    attends to, so a seq_lens that agrees is served as if absent (bitwise), and one that disagrees, or is not a 1-D
    int tensor, is refused with a sentence; the refused plan leaves the previous one."""
    b = _batch(device)
    q = _decode_q(b, device) if wrapper == "decode" else b.q
    planned = _decode(device, b) if wrapper == "decode" else _paged(device, b)
    want = planned.run(q, b.cache)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend="triton") if wrapper == "decode" else \
        serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton")
    head = (b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16) if wrapper == "decode" else \
        (b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16)
    opts = dict(q_data_type=F16) if wrapper == "decode" else dict(causal=True, q_data_type=F16)
    for dtype in (I32, torch.int64):
        w.plan(*head, **opts, seq_lens=torch.tensor([40, 9, 23], dtype=dtype, device=device))
        assert torch.equal(w.run(q, b.cache), want)
    for bad, match in ((torch.tensor([40, 9, 22], dtype=I32, device=device),
                        r"seq_lens\[2\]=22 but the page table gives request 2 23 keys; the page metadata decides "
                        r"what a request attends to, so the two must agree \(or pass seq_lens=None\)\.$"),
                       (torch.tensor([40, 9], dtype=I32, device=device), r"seq_lens has 2 entries for a batch of 3\."),
                       (torch.tensor([40.0, 9.0, 23.0], device=device),
                        r"seq_lens must be a 1-D int32 tensor of each request's KV length, or None; got a 1-D "
                        r"torch.float32 tensor\."),
                       ([40, 9, 23], r"or None; got list\.")):
        with pytest.raises(ValueError, match=match):
            w.plan(*head, **opts, seq_lens=bad)
        assert torch.equal(w.run(q, b.cache), want)


@pytest.mark.parametrize("wrapper,position,name", [
    ("paged", 0, "qo_indptr"), ("paged", 1, "paged_kv_indptr"), ("paged", 2, "paged_kv_indices"),
    ("paged", 3, "paged_kv_last_page_len"), ("ragged", 0, "qo_indptr"), ("ragged", 1, "kv_indptr"),
    ("decode", 0, "indptr"), ("decode", 1, "indices"), ("decode", 2, "last_page_len")])
def test_int64_index_tensors_are_refused_by_name(wrapper, position, name, device):
    """API.md: index tensors are int32 and int64 is refused, never cast: every index argument of the three batch
    wrappers' plan(), by its name, and the refused plan leaves the previous one."""
    b = _batch(device)
    if wrapper == "ragged":
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
        args, opts = [b.qo_indptr, torch.tensor([0, 40, 49, 72], dtype=I32, device=device), 4, 2, 64], {}
    elif wrapper == "paged":
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton")
        args, opts = [b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16], dict(causal=True)
    else:
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend="triton")
        args, opts = [b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16], {}
    w.plan(*args, **opts, q_data_type=F16)
    before = w._plan
    args[position] = args[position].long()
    with pytest.raises(ValueError, match=rf"plan: {name} has dtype torch.int64; index tensors must be int32 "
                                         rf"\(int64 is not cast\)\.$"):
        w.plan(*args, **opts, q_data_type=F16)
    assert w._plan is before


def test_single_prefill_refusals_name_the_function(device):
    """A refusal raised by single_prefill_with_kv_cache's inner plan or run names the function the caller called,
    not the wrapper's methods."""
    q = torch.randn(4, 8, 64, dtype=F16, device=device)
    kv = torch.randn(9, 2, 64, dtype=F16, device=device)
    with pytest.raises(ValueError, match=r"^single_prefill_with_kv_cache: window_left=-5 must be an int >= -1"):
        serveattn.single_prefill_with_kv_cache(q, kv, kv, window_left=-5, backend="triton")
    with pytest.raises(ValueError, match=r"^single_prefill_with_kv_cache: scale_q apply to an fp8 query"):
        serveattn.single_prefill_with_kv_cache(q, kv, kv, scale_q=torch.ones(1, device=device), backend="triton")


def test_decode_is_causal_must_say_what_the_mask_does(device):
    """FlashInfer's decode plan(is_causal=...) must equal q_len_per_req > 1 (its mask follows q_len_per_req):
    served as if absent where it does, refused with a sentence (NotImplementedError, as FlashInfer) where not or
    beside a tree; resolved_backend names the route (the backend asked for before the first plan)."""
    b = _batch(device, qo_lens=(3, 3, 3))
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend="triton")
    assert w.resolved_backend == "triton"
    table = (b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16)
    for q_len, is_causal in ((1, False), (3, True), (1, 0)):
        w.plan(*table, q_data_type=F16, q_len_per_req=q_len, is_causal=is_causal)
        q = b.q if q_len == 3 else _decode_q(b, device)
        want = _decode(device, b).run(q, b.cache) if q_len == 1 else None
        got = w.run(q, b.cache)
        assert want is None or torch.equal(got, want)
    assert w.resolved_backend == w.backend == "triton"
    for q_len, is_causal, tree in ((1, True, None), (3, False, None), (1, False, [[-1, 0]] * 3)):
        with pytest.raises(NotImplementedError, match=rf"is_causal={is_causal} is not served: the decode mask follows "
                                                      rf"q_len_per_req .* pass is_causal=None\.$"):
            w.plan(*table, q_data_type=F16, q_len_per_req=q_len, is_causal=is_causal, tree_parents=tree)
    assert serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device)).resolved_backend == "auto"


def test_positional_descales_and_the_return_lse_spelling(device):
    """FlashInfer 0.7's run(q, cache, scale_q, scale_k, scale_v) is read for an fp8 query only (tests/
    test_fp8_attention.py serves it); with a 16-bit query, or other counts, a sentence, not Python's TypeError."""
    b = _batch(device)
    ones = torch.ones(1, device=device)
    with pytest.raises(NotImplementedError, match=r"run\(\) takes q, paged_kv_cache by position, then FlashInfer "
                                                  r"0.7's three fp8 descales \(scale_q, scale_k, scale_v\) for an fp8 "
                                                  r"query, and the rest by keyword; got 3 more by position\.$"):
        _paged(device, b).run(b.q, b.cache, ones, ones, ones)
    r = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
    r.plan(torch.tensor([0, 5], dtype=I32), torch.tensor([0, 7], dtype=I32), 4, 2, 64, q_data_type=F16)
    kv = torch.randn(7, 2, 64, dtype=F16, device=device)
    q = torch.randn(5, 4, 64, dtype=F16, device=device)
    with pytest.raises(NotImplementedError, match="run\\(\\) takes q, k, v by position"):
        r.run(q, kv, kv, ones, ones, ones)
    with pytest.raises(NotImplementedError, match="got 1 arguments after v by position"):
        serveattn.single_prefill_with_kv_cache_return_lse(q, kv, kv, ones)


def test_cascade_refuses_unknown_keywords_with_a_sentence(device):
    w = serveattn.MultiLevelCascadeAttentionWrapper(2, _ws(device))
    with pytest.raises(NotImplementedError, match="argument\\(s\\) custom_mask are not served"):
        w.plan([torch.tensor([0, 5], dtype=I32)] * 2, [torch.tensor([0, 1], dtype=I32)] * 2,
               [torch.tensor([0], dtype=I32)] * 2, [torch.tensor([3], dtype=I32)] * 2, 4, 2, 64, 16,
               q_data_type=F16, custom_mask=torch.ones(5, dtype=torch.bool))


@pytest.mark.parametrize("route", ["decode", "decode-tc", "paged", "ragged", "single-decode"])
def test_q_scale_scales_the_logits_as_k_scale_does(route, device):
    """FlashInfer's q_scale (a float): sm_scale * q_scale * k_scale; so q_scale=2 is k_scale=2, bitwise."""
    b = _batch(device)
    if route.startswith("decode"):
        w, q = _decode(device, b, route == "decode-tc"), _decode_q(b, device)
        call = lambda **kw: w.run(q, b.cache, return_lse=True, **kw)  # noqa: E731
    elif route == "paged":
        w = _paged(device, b)
        call = lambda **kw: w.run(b.q, b.cache, return_lse=True, **kw)  # noqa: E731
    elif route == "ragged":
        kv = torch.randn(9, 2, 64, dtype=F16, device=device)
        q = torch.randn(4, 4, 64, dtype=F16, device=device)
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
        w.plan(torch.tensor([0, 4], dtype=I32), torch.tensor([0, 9], dtype=I32), 4, 2, 64, causal=True,
               q_data_type=F16)
        call = lambda **kw: w.run(q, kv, kv, return_lse=True, **kw)  # noqa: E731
    else:
        k, v = (torch.randn(30, 2, 64, dtype=F16, device=device) for _ in range(2))
        q = torch.randn(4, 64, dtype=F16, device=device)
        call = lambda **kw: serveattn.single_decode_with_kv_cache(q, k, v, backend="triton",  # noqa: E731
                                                                  return_lse=True, **kw)
    out, lse = call(q_scale=2.0)
    want_out, want_lse = call(k_scale=2.0)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out, lse = call(q_scale=2.0, k_scale=0.25)
    want_out, want_lse = call(k_scale=0.5)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    plain_out, _ = call()
    assert not torch.equal(out, plain_out)


@pytest.mark.parametrize("wrapper", ["decode", "decode-tc", "paged", "cascade"])
def test_reset_workspace_buffer(wrapper, device):
    """FlashInfer's reset_workspace_buffer(float, int): the next plan works in the new buffer; the old plan is
    dropped (run() before a new plan() is refused); refused under use_cuda_graph=True."""
    b = _batch(device)
    if wrapper.startswith("decode"):
        w, q = _decode(device, b, wrapper == "decode-tc"), _decode_q(b, device)
        replan = lambda: w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16,  # noqa: E731
                                q_data_type=F16)
        cache_run = lambda: w.run(q, b.cache)  # noqa: E731
    elif wrapper == "paged":
        w = _paged(device, b)
        replan = lambda: w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64,  # noqa: E731
                                16, causal=True, q_data_type=F16)
        cache_run = lambda: w.run(b.q, b.cache)  # noqa: E731
    else:
        w = serveattn.MultiLevelCascadeAttentionWrapper(1, _ws(device), backend="triton")
        replan = lambda: w.plan([b.qo_indptr], [b.kv_indptr], [b.kv_indices], [b.last_page_len],  # noqa: E731
                                4, 2, 64, 16, causal=True, q_data_type=F16)
        replan()
        cache_run = lambda: w.run(b.q, b.cache)  # noqa: E731
    assert w.is_cuda_graph_enabled is False
    before = cache_run()
    w.reset_workspace_buffer(_ws(device), torch.empty(1 << 10, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="run\\(\\) was called before plan\\(\\)"):
        cache_run()
    replan()
    assert torch.equal(cache_run(), before)
    with pytest.raises(ValueError, match="float_workspace_buffer is a NoneType"):
        w.reset_workspace_buffer(None, None)


def test_reset_workspace_buffer_is_refused_under_cuda_graphs(device):
    bufs = [torch.zeros(n, dtype=I32, device=device) for n in (9, 64, 8)]
    w = serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(_ws(device), *bufs)
    assert w.is_cuda_graph_enabled is True
    with pytest.raises(NotImplementedError, match="under use_cuda_graph=True the workspace holds what a captured"):
        w.reset_workspace_buffer(_ws(device), _ws(device))


def test_tree_mask_device_is_checked():
    with pytest.raises(ValueError, match="device='gpu' is not a torch device"):
        serveattn.tree_parents_to_mask([[-1, 0]], [1], device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' but CUDA is not available here"):
            serveattn.tree_parents_to_mask([[-1, 0]], [1], device="cuda")


def test_get_seq_lens_checks_a_host_page_table():
    ip, last = torch.tensor([0, 2, 3], dtype=I32), torch.tensor([0, 9], dtype=I32)
    with pytest.raises(ValueError, match="kv_last_page_len\\[0\\]=0; it must lie in 1..page_size=4"):
        serveattn.get_seq_lens(ip, last, 4)
    with pytest.raises(ValueError, match="kv_indptr decreases somewhere"):
        serveattn.get_seq_lens(torch.tensor([0, 3, 2], dtype=I32), torch.tensor([1, 1], dtype=I32), 4)
    assert serveattn.get_seq_lens(torch.tensor([0, 2, 2], dtype=I32), torch.tensor([3, 0], dtype=I32), 4).tolist() \
        == [7, 0]
    assert serveattn.get_seq_lens(torch.tensor([2, 4, 5], dtype=I32), torch.tensor([4, 1], dtype=I32), 4).tolist() \
        == [8, 1]  # a slice of an indptr: only differences are read


def _graph_decode(device, backend, cap=2, pages=4, **ctor):
    bufs = [torch.zeros(n, dtype=I32, device=device) for n in (cap + 1, pages, cap)]
    return serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), use_cuda_graph=True, backend=backend,
                                                        paged_kv_indptr_buffer=bufs[0],
                                                        paged_kv_indices_buffer=bufs[1],
                                                        paged_kv_last_page_len_buffer=bufs[2], **ctor)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_replans_keep_the_rules_on_every_route(backend, device):
    """backend='torch' under use_cuda_graph=True (on the CPU: it is refused on CUDA) keeps the re-plan rules of the
    captured routes: a plan over the buffers, or with other heads or window, is refused and the previous plan
    still runs; within them it equals a fresh wrapper. (Its plans were once never checked.)"""
    if backend == "torch" and device == "cuda":
        pytest.skip("refused on CUDA: test_torch_route_is_refused_under_cuda_graphs_on_cuda")
    cache = torch.randn(8, 2, 4, 2, 64, generator=torch.Generator().manual_seed(2)).half().to(device)
    w = _graph_decode(device, backend)
    t = lambda *a: torch.tensor(a, dtype=I32, device=device)  # noqa: E731
    w.plan(t(0, 1, 2), t(3, 5), t(4, 2), 4, 2, 64, 4, q_data_type=F16)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3)).half().to(device)
    before = w.run(q, cache)
    for args, kw, match in (
            ((t(0, 3, 6), t(*range(6)), t(4, 4)), {}, "needs 6 entries in its kv_indices buffer, which holds 4"),
            ((t(0, 1, 2, 3), t(0, 1, 2), t(4, 4, 4)), {},
             "needs 4 entries in its (qo|kv)_indptr buffer|has 3 query rows but"),
            ((t(0, 1, 2), t(3, 5), t(4, 2)), dict(window_left=3), "a re-plan may change only the batch's lengths")):
        with pytest.raises(ValueError, match=match):
            w.plan(*args, 4, 2, 64, 4, q_data_type=F16, **kw)
        assert torch.equal(w.run(q, cache), before)
    w.plan(t(0, 2, 2), t(6, 1), t(3, 1), 4, 2, 64, 4, q_data_type=F16)  # within the buffers: lengths change
    fresh = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend=backend)
    fresh.plan(t(0, 2, 2), t(6, 1), t(3, 1), 4, 2, 64, 4, q_data_type=F16)
    assert torch.equal(w.run(q, cache), fresh.run(q, cache))


def test_torch_route_is_refused_under_cuda_graphs_on_cuda():
    with pytest.raises(NotImplementedError, match="torch: under use_cuda_graph=True on CUDA the torch route is not"):
        serveattn.policy.check_graph_backend("x", "torch", True, "cuda")
    serveattn.policy.check_graph_backend("x", "torch", True, "cpu")
    serveattn.policy.check_graph_backend("x", "triton", True, "cuda")


def test_bandwidth_graph_replan_fits_the_captured_q(device):
    """The bandwidth route under CUDA graphs: a re-plan past the rows of the q its first run() (the captured one)
    had is refused, as the prefill wrappers do (replayed, the kernel would read q and write out past them)."""
    cache = torch.randn(8, 2, 4, 2, 64, generator=torch.Generator().manual_seed(2)).half().to(device)
    w = _graph_decode(device, "triton", cap=3)
    t = lambda *a: torch.tensor(a, dtype=I32, device=device)  # noqa: E731
    w.plan(t(0, 1, 2), t(3, 5), t(4, 2), 4, 2, 64, 4, q_data_type=F16)
    w.run(torch.randn(2, 4, 64, dtype=F16, device=device), cache)
    with pytest.raises(ValueError, match="the re-plan has 3 query rows but the first run\\(\\) had q of 2"):
        w.plan(t(0, 1, 2, 3), t(3, 5, 6), t(4, 2, 1), 4, 2, 64, 4, q_data_type=F16)
    w.plan(t(0, 1), t(3), t(4), 4, 2, 64, 4, q_data_type=F16)  # fewer rows: served


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cascade_refuses_out_over_q(backend, device):
    """With several levels the last level's output is written before the others read q: out=q gave wrong
    values; refused now (one level is a single launch, and takes it)."""
    b = _batch(device)
    w = serveattn.MultiLevelCascadeAttentionWrapper(2, _ws(device), backend=backend)
    shared = torch.tensor([0, 1], dtype=I32, device=device)
    w.plan([torch.tensor([0, 8], dtype=I32, device=device), b.qo_indptr], [shared, b.kv_indptr],
           [b.kv_indices[:1], b.kv_indices], [torch.tensor([5], dtype=I32, device=device), b.last_page_len],
           4, 2, 64, 16, causal=True, q_data_type=F16)
    q = b.q.clone()
    with pytest.raises(ValueError, match="out overlaps q"):
        w.run(q, b.cache, out=q)
    with pytest.raises(ValueError, match="out overlaps q"):
        w.run(q, b.cache, out=q[2:])
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    w.run(q, b.cache, out=out)
    assert torch.equal(out, w.run(q, b.cache))


@pytest.mark.parametrize("layout", ["NH", "HN"])
def test_a_callers_lse_is_written_in_the_asked_base_and_layout(layout, device):
    """lse_base='ln' / lse_layout='HN' with the caller's lse and return_lse=False: written as asked (was: base 2
    into an NH buffer, nothing into an HN one)."""
    b = _batch(device)
    w = _paged(device, b)
    _, want = w.run(b.q, b.cache, return_lse=True, lse_base="ln", lse_layout=layout)
    buf = torch.full(want.shape, float("nan"), device=device)
    out = w.run(b.q, b.cache, lse=buf, lse_base="ln", lse_layout=layout)
    assert isinstance(out, torch.Tensor) and torch.equal(buf, want)


def test_sampling_refuses_flashinfer_0_1s_uniform_samples():
    gen = torch.Generator().manual_seed(1)
    draft = torch.softmax(torch.randn(2, 3, 5, generator=gen), -1)
    target = torch.softmax(torch.randn(2, 4, 5, generator=gen), -1)
    ids = torch.randint(0, 5, (2, 3), generator=gen, dtype=I32)
    uniforms = torch.rand(2, 4, generator=gen)
    for call in (lambda: serveattn.chain_speculative_sampling(draft, ids, uniforms, target),
                 lambda: serveattn.chain_speculative_sampling(draft, ids, target, uniform_samples=uniforms)):
        with pytest.raises(NotImplementedError, match="uniform_samples \\(FlashInfer 0.1's argument"):
            call()


def test_masks_of_any_shape_are_read_flattened(device):
    """FlashInfer flattens any mask: [sum(qo_len), kv_len] (the stacked row-major blocks when every request has
    that kv_len) and [B, qo_len, kv_len] are served, bitwise the 1-D mask."""
    gen = torch.Generator().manual_seed(8)
    kv = 9  # requests of 3 and 4 query rows, both over 9 keys
    q = torch.randn(7, 4, 64, generator=gen).to(F16).to(device)
    k, v = (torch.randn(2 * kv, 2, 64, generator=gen).to(F16).to(device) for _ in range(2))
    mask = torch.rand(7, kv, generator=gen) > 0.4
    mask[:, 0] = True
    outs = []
    for m in (mask, mask.reshape(-1), mask.reshape(1, 7, kv)):
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
        w.plan(torch.tensor([0, 3, 7], dtype=I32), torch.tensor([0, kv, 2 * kv], dtype=I32), 4, 2, 64,
               custom_mask=m.to(device), q_data_type=F16)
        outs.append(w.run(q, k, v))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[1])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_no_window_sized_window_sees_every_key(backend, device):
    """window_left = 2^31 - 1 (a common "no window"): position - window_left wrapped in the prefill kernel's int32
    where kv_len < qo_len (negative positions) and emptied rows; a plan keeps windows at policy.WINDOW_CAP."""
    from serveattn import reference
    from helpers import rel_err, tolerance
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(20, 4, 64, generator=gen).to(F16).to(device)
    k, v = (torch.randn(5, 2, 64, generator=gen).to(F16).to(device) for _ in range(2))
    out, lse = serveattn.single_prefill_with_kv_cache(q, k, v, window_left=2 ** 31 - 1, backend=backend,
                                                      return_lse=True)
    ref, ref_lse = reference.attention(q.cpu().double(), k.cpu().double(), v.cpu().double())
    assert rel_err(out, ref) < tolerance(F16) and torch.isfinite(lse).all()
    b = _batch(device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend=backend)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, window_left=2 ** 31 - 1, q_data_type=F16)
    dq = _decode_q(b, device)
    assert torch.equal(w.run(dq, b.cache, window_left=2 ** 31 - 1), w.run(dq, b.cache))  # run()'s check agrees


def test_logit_scale_products_outside_float32_are_refused(device):
    b = _batch(device)
    for sm_scale, k_scale in ((1e20, 1e20), (1e-20, 1e-20)):  # each a normal float32, their product not
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, sm_scale=sm_scale, q_data_type=F16)
        with pytest.raises(ValueError, match=f"k_scale={re.escape(repr(k_scale))} makes the logit scale sm_scale \\* k_scale \\* "
                                             f"log2\\(e\\) = .*, outside float32's normal range"):
            w.run(_decode_q(b, device), b.cache, k_scale=k_scale)
    p = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="torch")
    with pytest.raises(ValueError, match="sm_scale=3e\\+38 must be a positive finite float"):
        p.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, sm_scale=3e38,
               q_data_type=F16)


def test_audit_refusals_name_the_entry_called_and_graph_buffers_are_int32(device):
    """single_prefill's backend refusal names single_prefill_with_kv_cache (not the wrapper it builds); a decode
    graph wrapper's index buffers are int32 (API.md: int64 is refused, not cast), refused at construction under
    the argument's own name; the cascade wrapper has FlashInfer's other spellings too."""
    q = torch.randn(3, 4, 64, dtype=F16, device=device)
    k = torch.randn(5, 2, 64, dtype=F16, device=device)
    with pytest.raises(ValueError, match=r"^single_prefill_with_kv_cache: backend='xla' is not a backend"):
        serveattn.single_prefill_with_kv_cache(q, k, k, backend="xla")
    i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"CUDAGraphBatchDecodeWithPagedKVCacheWrapper: paged_kv_indptr_buffer has "
                                         r"dtype torch.int64; index tensors must be int32"):
        serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(_ws(device), torch.empty(3, **i64),
                                                              torch.empty(8, **i32), torch.empty(2, **i32))
    w = serveattn.MultiLevelCascadeAttentionWrapper(2, _ws(device))
    assert all(callable(getattr(w, n)) for n in ("run_return_lse", "forward_return_lse", "end_forward"))


def test_single_decode_names_an_unknown_keyword(device):
    """single_decode_with_kv_cache, like the other entry points: FlashInfer's later keywords at their no-op value
    pass; any other keyword is refused by name (not a bare TypeError)."""
    k, v = (torch.randn(30, 2, 64, dtype=F16, device=device) for _ in range(2))
    q = torch.randn(4, 64, dtype=F16, device=device)
    plain = serveattn.single_decode_with_kv_cache(q, k, v, backend="triton")
    assert torch.equal(plain, serveattn.single_decode_with_kv_cache(q, k, v, backend="triton", sinks=None))
    with pytest.raises(NotImplementedError, match=r"^single_decode_with_kv_cache: argument\(s\) out are not served\.$"):
        serveattn.single_decode_with_kv_cache(q, k, v, backend="triton", out=torch.empty_like(q))
