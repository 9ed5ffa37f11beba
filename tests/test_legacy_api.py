"""FlashInfer's other spellings of plan() and run(): begin_forward, forward / forward_return_lse (whose arguments set
the call's causal mode, positional encoding, window, soft cap and scales, defaults included, as FlashInfer's do),
run_return_lse, end_forward. SGLang's FlashInfer backend calls forward() with these arguments."""
import numpy as np
import pytest
import torch

import serveattn
from serveattn import reference
from helpers import check_lse, make_paged_batch, rel_err, tolerance

BF16 = torch.bfloat16


def _batch(device, qo_lens=(3, 0, 5), kv_lens=(40, 9, 23)):
    gen = torch.Generator().manual_seed(17)
    return make_paged_batch(gen, qo_lens=list(qo_lens), kv_lens=list(kv_lens), num_qo_heads=8, num_kv_heads=2,
                            head_dim=64, page_size=16, dtype=BF16, device=device)


def _paged(device, b, backend="triton", **plan_kw):
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8, device=device),
                                                      backend=backend)
    w.begin_forward(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=BF16,
                    **plan_kw)
    return w


SETTINGS = [dict(causal=True, sm_scale=0.2, logits_soft_cap=7.0),
            dict(causal=True, window_left=6),
            dict(causal=False, pos_encoding_mode="ROPE_LLAMA", rope_theta=300.0, rope_scale=2.0)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["scale-cap", "window", "rope"])
def test_paged_forward_settings_equal_a_plan_with_them(settings, backend, device):
    b = _batch(device)
    planned = _paged(device, b, backend, **settings)  # the same settings at plan(): bitwise the same call
    want_out, want_lse = planned.run_return_lse(b.q, b.cache, k_scale=0.5, v_scale=2.0)
    w = _paged(device, b, backend)  # planned with none of them (SGLang's habit)
    out, lse = w.forward_return_lse(b.q, b.cache, k_scale=0.5, v_scale=2.0, **settings)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(w.forward(b.q, b.cache, k_scale=0.5, v_scale=2.0, **settings), want_out)
    ref, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                         k_scale=0.5, v_scale=2.0, **settings)
    assert rel_err(out, ref) < tolerance(BF16)
    check_lse(lse, ref_lse)
    # the settings held for that call only: run() is the plan's again, and the variant was made once
    assert torch.equal(w.run(b.q, b.cache), _paged(device, b, backend).run(b.q, b.cache))
    w.forward(b.q, b.cache, **settings)
    assert len(w._variants.made) == 1  # one variant for one set of settings, however many calls
    w.end_forward()


def test_forward_defaults_are_flashinfers(device):
    """forward(q, cache) means causal=False, no window, no soft cap, 1/sqrt(d), whatever plan() said: FlashInfer's
    forward() sets them from its defaults."""
    b = _batch(device)
    causal = _paged(device, b, causal=True, sm_scale=0.3)
    plain = _paged(device, b)
    assert torch.equal(causal.forward(b.q, b.cache), plain.run(b.q, b.cache))
    assert not torch.equal(causal.run(b.q, b.cache), plain.run(b.q, b.cache))


def test_ragged_forward(device):
    b = _batch(device)
    k, v, kv_indptr = reference.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, "NHD")
    k, v, kv_indptr = k.to(device), v.to(device), kv_indptr.to(torch.int32).to(device)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    planned = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="triton")
    planned.plan(b.qo_indptr, kv_indptr, 8, 2, 64, causal=True, sm_scale=0.25, q_data_type=BF16)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="triton")
    w.begin_forward(b.qo_indptr, kv_indptr, 8, 2, 64, q_data_type=BF16)
    out, lse = w.forward_return_lse(b.q, k, v, causal=True, sm_scale=0.25, use_fp16_qk_reduction=True)
    want_out, want_lse = planned.run_return_lse(b.q, k, v)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_decode_forward_settings(use_tensor_cores, device):
    b = _batch(device, qo_lens=(1, 1, 1), kv_lens=(40, 0, 23))
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)

    def wrapper(**plan_kw):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=use_tensor_cores, backend="triton")
        w.begin_forward(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=BF16, **plan_kw)
        return w

    settings = dict(sm_scale=0.2, logits_soft_cap=6.0, window_left=11)
    want_out, want_lse = wrapper(**settings).run_return_lse(b.q, b.cache, k_scale=0.5)
    w = wrapper()
    out, lse = w.forward_return_lse(b.q, b.cache, k_scale=0.5, **settings)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(w.forward(b.q, b.cache, k_scale=0.5, **settings), want_out)
    assert torch.equal(w.run(b.q, b.cache), wrapper().run(b.q, b.cache))  # the plan's own settings again
    w.end_forward()


def test_forward_refusals(device):
    b = _batch(device, qo_lens=(3, 0, 5), kv_lens=(40, 9, 4))  # request 2: 5 rows over 4 keys
    w = _paged(device, b)
    with pytest.raises(ValueError, match="causal=True with kv_len=4 < qo_len=5 for request 2"):
        w.forward(b.q, b.cache, causal=True)
    with pytest.raises(ValueError, match=r"sm_scale=-1\.0 must be a positive finite float"):
        w.forward(b.q, b.cache, sm_scale=-1.0)
    with pytest.raises(NotImplementedError, match="pos_encoding_mode='ALIBI'"):
        w.forward(b.q, b.cache, pos_encoding_mode="ALIBI")
    out = w.forward(b.q, b.cache)  # a refused forward() left the plan as it was
    assert torch.equal(out, w.run(b.q, b.cache))
    d = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8, device=device),
                                                     backend="triton")
    db = _batch(device, qo_lens=(1, 1, 1), kv_lens=(40, 9, 4))
    d.plan(db.kv_indptr, db.kv_indices, db.last_page_len, 8, 2, 64, 16, q_data_type=BF16)
    with pytest.raises(NotImplementedError, match="bandwidth kernel, which serves no RoPE; pass it to plan()"):
        d.forward(db.q, db.cache, pos_encoding_mode="ROPE_LLAMA")
    fresh = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="forward\\(\\) was called before plan\\(\\)"):
        fresh.forward(b.q, b.cache)


def test_run_keywords_of_later_flashinfers(device):
    """enable_pdl accepted; window_left only as planned; lse_base / lse_layout as ours; others refused by name."""
    b = _batch(device)
    w = _paged(device, b, causal=True, window_left=6)
    out = w.run(b.q, b.cache)
    assert torch.equal(w.run(b.q, b.cache, enable_pdl=True, window_left=6, lse_base="log2", lse_layout="NH"), out)
    with pytest.raises(ValueError, match="window_left=3 given to run\\(\\) differs from the plan's 6; pass it to "
                                         "plan\\(\\)"):
        w.run(b.q, b.cache, window_left=3)
    with pytest.raises(NotImplementedError, match="run\\(\\) argument\\(s\\) sinks are not served"):
        w.run(b.q, b.cache, sinks=torch.zeros(8))
    k, v, kv_indptr = reference.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, "NHD")
    r = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8, device=device),
                                                       backend="triton")
    r.plan(b.qo_indptr, kv_indptr.to(torch.int32).to(device), 8, 2, 64, q_data_type=BF16)
    r.run(b.q, k.to(device), v.to(device), enable_pdl=False)
    with pytest.raises(NotImplementedError, match="run\\(\\) argument\\(s\\) o_scale are not served"):
        r.run(b.q, k.to(device), v.to(device), o_scale=2.0)
    db = _batch(device, qo_lens=(1, 1, 1), kv_lens=(40, 9, 4))
    for tc in (False, True):
        d = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8, device=device),
                                                         use_tensor_cores=tc, backend="triton")
        d.plan(db.kv_indptr, db.kv_indices, db.last_page_len, 8, 2, 64, 16, q_data_type=BF16)
        assert torch.equal(d.run(db.q, db.cache, enable_pdl=True, window_left=-1), d.run(db.q, db.cache))
        with pytest.raises(ValueError, match="window_left=5 given to run\\(\\) differs from the plan's -1"):
            d.run(db.q, db.cache, window_left=5)
        with pytest.raises(NotImplementedError, match="run\\(\\) argument\\(s\\) skip_softmax_threshold_scale_factor"):
            d.run(db.q, db.cache, skip_softmax_threshold_scale_factor=1.0)


def test_prefill_plan_takes_flashinfers_split_arguments(device):
    """vLLM passes fixed_split_size / disable_split_kv to prefill plans too (batch-invariant results; -1 and False
    otherwise): taken, and a fixed_split_size that is not a positive int (or -1) refused as decode's plan() does."""
    b = _batch(device)
    want = _paged(device, b).run(b.q, b.cache)
    # -1: FlashInfer's "not fixed", which vLLM passes outside its batch-invariant mode
    for kw in (dict(disable_split_kv=True), dict(fixed_split_size=4), dict(fixed_split_size=None),
               dict(fixed_split_size=-1, disable_split_kv=False)):
        assert torch.equal(_paged(device, b, **kw).run(b.q, b.cache), want)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match=rf"fixed_split_size={bad} must be a positive int \(KV pages per "
                                             rf"chunk, or tokens for ragged K/V; a Python int, not numpy's\), or -1 "
                                             rf"or None for the library's choice"):
            _paged(device, b, fixed_split_size=bad)
    with pytest.raises(ValueError, match=r"fixed_split_size=np.int64\(-1\) must be a positive int \(KV pages per "
                                         r"chunk, or tokens for ragged K/V; a Python int, not numpy's\)"):
        _paged(device, b, fixed_split_size=np.int64(-1))
    r = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="fixed_split_size=True must be a positive int"):
        r.plan(b.qo_indptr, b.qo_indptr, 8, 2, 64, q_data_type=BF16, fixed_split_size=True)


def test_lse_base_and_layout(device):
    """FlashInfer's lse_base="ln" (natural log) and lse_layout="HN" ([heads, rows], contiguous), into the caller's
    lse of that layout where given; other values refused."""
    import math
    b = _batch(device)
    w = _paged(device, b, causal=True)
    out, lse2 = w.run(b.q, b.cache, return_lse=True)
    o, ln = w.run(b.q, b.cache, return_lse=True, lse_base="ln")
    assert torch.equal(o, out) and torch.equal(ln, lse2 * math.log(2.0))
    o, hn = w.run(b.q, b.cache, return_lse=True, lse_layout="HN")
    assert hn.shape == (8, lse2.shape[0]) and hn.is_contiguous() and torch.equal(hn, lse2.t())
    mine = torch.full((8, lse2.shape[0]), float("nan"), device=device)
    o, hn = w.run_return_lse(b.q, b.cache, lse=mine, lse_base="ln", lse_layout="HN")
    assert hn is mine and torch.equal(mine, (lse2 * math.log(2.0)).t())
    assert torch.equal(w.run(b.q, b.cache, lse_layout="HN"), out)  # nothing returned: the output alone
    with pytest.raises(ValueError, match="lse_base='e' must be 'log2' \\(the default\\) or 'ln'"):
        w.run(b.q, b.cache, return_lse=True, lse_base="e")
    with pytest.raises(ValueError, match="lse_layout='HND' must be 'NH'"):
        w.run(b.q, b.cache, return_lse=True, lse_layout="HND")
    with pytest.raises(ValueError, match="lse"):  # not [heads, rows]
        w.run(b.q, b.cache, return_lse=True, lse=torch.empty(3, 5, device=device), lse_layout="HN")


def test_optional_plan_arguments_by_position(device):
    """The optional arguments bind by position as in FlashInfer 0.7: the decode plan() takes all 16 after
    page_size in its (deprecated there) order, as vLLM passes them, refusing more and a name given both ways; a
    caller of an older order, whose sm_scale lands on data_type, is refused by that name. Prefill plan() binds
    through non_blocking, past which FlashInfer's releases disagree."""
    b = _batch(device, qo_lens=(1, 1, 1), kv_lens=(40, 9, 4))
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(4)).to(BF16).to(device)
    d = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
    d.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, "NONE", -1, None, BF16, BF16)
    table = (b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16)
    d.plan(*table, q_data_type=BF16, kv_data_type=BF16, sm_scale=0.2, o_data_type=BF16, fixed_split_size=1,
           q_len_per_req=1)
    by_keyword = d.run(q, b.cache)
    positional = ("NONE", -1, None, BF16, BF16, BF16, None, 0.2, None, None, True, None, None, 1, False, 1)
    d.plan(*table, *positional)
    assert torch.equal(d.run(q, b.cache), by_keyword)
    with pytest.raises(ValueError, match="plan\\(\\) takes at most 16 optional arguments by position after "
                                         "page_size \\(FlashInfer 0.7's order: pos_encoding_mode, .*q_len_per_req\\); "
                                         "got 17\\."):
        d.plan(*table, *positional, 1)
    with pytest.raises(ValueError, match="plan\\(\\) got sm_scale by position and by keyword; pass it once\\."):
        d.plan(*table, *positional[:8], sm_scale=0.3)
    # FlashInfer 0.6's order (data_type right after kv_data_type): its sm_scale lands on 0.7's data_type
    with pytest.raises(ValueError, match="data_type=0.2 is not a dtype"):
        d.plan(*table, "NONE", -1, None, BF16, BF16, None, 0.2)
    p = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    with pytest.raises(NotImplementedError, match="plan\\(\\) got 1 arguments after non_blocking by position"):
        p.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, None, None, None, False,
               "NONE", False, None, -1, None, None, None, BF16, None, None, True, None)
    q = torch.randn(4, 8, 64).to(BF16).to(device)
    kv = torch.randn(9, 2, 64).to(BF16).to(device)
    with pytest.raises(NotImplementedError, match="single_prefill_with_kv_cache: got 1 arguments after v by position; "
                                                  "pass them by keyword"):
        serveattn.single_prefill_with_kv_cache(q, kv, kv, None)


def test_remaining_refusals(device):
    """The ragged plan()'s positional limit and a non-contiguous lse for lse_layout='HN'."""
    b = _batch(device)
    r = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    with pytest.raises(NotImplementedError, match="plan\\(\\) got 1 arguments after non_blocking by position; pass "
                                                  "them by keyword"):
        r.plan(b.qo_indptr, b.qo_indptr, 8, 2, 64, None, None, None, False, "NONE", False, -1, None, None, None,
               None, BF16, None, None, True, 64)
    w = _paged(device, b)
    rows = int(b.qo_indptr[-1])
    strided = torch.empty(8, 2 * rows, device=device)[:, :rows]  # [heads, rows] inside a wider buffer
    with pytest.raises(ValueError, match="lse for lse_layout='HN' must be contiguous"):
        w.run(b.q, b.cache, lse=strided, return_lse=True, lse_layout="HN")


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_decode_data_type_fills_whichever_dtype_is_not_given(use_tensor_cores, device):
    """FlashInfer's older `data_type` sets q_data_type and kv_data_type where they are not given (None): the same
    plan as naming both."""
    gen = torch.Generator().manual_seed(17)
    b = make_paged_batch(gen, qo_lens=[1] * 2, kv_lens=[40, 90], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    outs = []
    for kw in (dict(q_data_type=None, data_type=torch.bfloat16),
               dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                         use_tensor_cores=use_tensor_cores, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, **kw)
        outs.append(w.run(b.q, b.cache))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("wrapper", ["decode", "graph-decode", "paged", "ragged"])
def test_flashinfer_private_state_is_named_not_faked(wrapper, device):
    """Engine code that reaches into FlashInfer's wrappers (vLLM's fast_plan_decode under CUDA graphs reads
    _fixed_batch_size, writes _paged_kv_indptr_buf and calls _cached_module.plan) gets one sentence naming what it
    reached for; its own markers still read through getattr's default, and other missing names keep Python's line."""
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    w = {"decode": lambda: serveattn.BatchDecodeWithPagedKVCacheWrapper(ws),
         "graph-decode": lambda: serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
             ws, torch.zeros(5, **i32), torch.zeros(16, **i32), torch.zeros(4, **i32)),
         "paged": lambda: serveattn.BatchPrefillWithPagedKVCacheWrapper(ws),
         "ragged": lambda: serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws)}[wrapper]()
    for name in ("_fixed_batch_size", "_cached_module", "_paged_kv_indptr_buf"):
        with pytest.raises(AttributeError, match=f"{name} is FlashInfer's private wrapper state, which serveattn's "
                                                 f"wrappers do not have; .* must call plan\\(\\) instead\\."):
            getattr(w, name)
    assert getattr(w, "vllm_first_call", True) is True
    with pytest.raises(AttributeError, match="object has no attribute 'no_such_thing'"):
        w.no_such_thing


@pytest.mark.parametrize("wrapper", ["decode", "decode-tc", "paged", "ragged"])
def test_planned_settings_read_back_as_flashinfer_leaves_them(wrapper, device):
    """FlashInfer's plan() leaves _pos_encoding_mode, _window_left, _logits_soft_cap (None as 0.0), _sm_scale,
    _rope_scale, _rope_theta (and a prefill's _causal) on the wrapper, as given; vLLM asserts them before each
    run(). A refused plan leaves the last plan's."""
    b = _batch(device)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    names = ("_pos_encoding_mode", "_window_left", "_logits_soft_cap", "_sm_scale", "_rope_scale", "_rope_theta")
    if wrapper.startswith("decode"):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=wrapper == "decode-tc")

        def plan(**kw):
            w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=BF16, **kw)
    elif wrapper == "paged":
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws)
        names += ("_causal",)

        def plan(**kw):
            w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=BF16,
                   causal=True, **kw)
    else:
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws)
        names += ("_causal",)

        def plan(**kw):
            w.plan(b.qo_indptr, b.kv_indptr * 16, 8, 2, 64, q_data_type=BF16, **kw)
    plan()
    assert [getattr(w, n) for n in names[:6]] == ["NONE", -1, 0.0, None, None, None]
    plan(window_left=7, logits_soft_cap=30.0, sm_scale=0.1, rope_scale=2.0, rope_theta=5e5,
         **({"pos_encoding_mode": "ROPE_LLAMA"} if wrapper != "decode" else {}))
    settings = [getattr(w, n) for n in names]
    assert settings[1:6] == [7, 30.0, 0.1, 2.0, 5e5]
    with pytest.raises(ValueError):
        plan(sm_scale=-1.0)
    assert [getattr(w, n) for n in names] == settings
