"""Every request the prefill entry points cannot serve raises before any launch, with a sentence."""
import pytest
import torch

import serveattn
from helpers import make_paged_batch

I32 = torch.int32


def _batch(device, dtype=torch.float16):
    gen = torch.Generator().manual_seed(1)
    return make_paged_batch(gen, qo_lens=[3, 5], kv_lens=[10, 20], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                            page_size=4, dtype=dtype, device=device)


def _paged(device, **ctor):
    return serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(4096, dtype=torch.uint8, device=device), **ctor)


def _plan_args(b, **over):
    args = dict(qo_indptr=b.qo_indptr, paged_kv_indptr=b.kv_indptr, paged_kv_indices=b.kv_indices,
                paged_kv_last_page_len=b.last_page_len, num_qo_heads=4, num_kv_heads=2, head_dim_qk=64,
                page_size=4, q_data_type=torch.float16)
    args.update(over)
    return args


PLAN_REFUSALS = [
    # (id, overrides, exception, sentence fragment)
    ("head_dim", dict(head_dim_qk=96), NotImplementedError, "head_dim=96 is not served"),
    ("head_dim_vo", dict(head_dim_vo=128), NotImplementedError, "head_dim_vo=128 differs"),
    ("heads", dict(num_qo_heads=6, num_kv_heads=4), ValueError, "not a multiple of num_kv_heads"),
    ("int64_indptr", "int64", ValueError, "must be int32"),
    ("alibi", dict(pos_encoding_mode="ALIBI"), NotImplementedError, "ALIBI"),
    ("bad_pos", dict(pos_encoding_mode="XPOS"), ValueError, "not a mode"),
    ("q_fp32", dict(q_data_type=torch.float32), NotImplementedError, "float32 inputs are not served"),
    ("q_int8", dict(q_data_type=torch.int8), NotImplementedError, "integer caches are not served"),
    ("fnuz", dict(q_data_type=torch.float16, kv_data_type=torch.float8_e4m3fnuz), NotImplementedError, "fnuz"),
    ("kv_mismatch", dict(kv_data_type=torch.bfloat16), NotImplementedError, "differs from the query dtype"),
    ("fp8_out", dict(o_data_type=torch.float8_e4m3fn), NotImplementedError, "o_data_type"),
    ("last_page_len", "last0", ValueError, "paged_kv_last_page_len\\[0\\]=0"),
    ("causal_short", dict(causal=True, qo_indptr="long"), ValueError, "causal=True with kv_len=10 < qo_len=11"),
    ("window", dict(window_left=-2), ValueError, "window_left=-2"),
    ("soft_cap", dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap=-1.0"),
    ("sm_scale", dict(sm_scale=float("nan")), ValueError, "sm_scale=nan"),
    ("dtype_name", dict(q_data_type="float17"), ValueError, "q_data_type='float17' is not a dtype"),
    ("both_masks", "both_masks", ValueError, "custom_mask and packed_custom_mask were both given"),
    ("mask_size", "mask_size", ValueError, "custom_mask has 3 elements"),
    ("unknown_kwarg", dict(prefix_len_ptr=1), NotImplementedError, "prefix_len_ptr"),
    ("batch_mismatch", "batch_mismatch", ValueError, "describes 1 requests"),
    ("negative_page", "neg_page", ValueError, "negative page index"),
]


@pytest.mark.parametrize("case", PLAN_REFUSALS, ids=[c[0] for c in PLAN_REFUSALS])
def test_paged_plan_refusals(case, device):
    _, over, exc, match = case
    b = _batch(device)
    if over == "int64":
        args = _plan_args(b, paged_kv_indptr=b.kv_indptr.to(torch.int64))
    elif over == "last0":
        args = _plan_args(b, paged_kv_last_page_len=torch.zeros_like(b.last_page_len))
    elif over == "both_masks":
        args = _plan_args(b, custom_mask=torch.ones(3 * 10 + 5 * 20, dtype=torch.bool),
                          packed_custom_mask=torch.ones(30, dtype=torch.uint8))
    elif over == "mask_size":
        args = _plan_args(b, custom_mask=torch.ones(3, dtype=torch.bool))
    elif over == "batch_mismatch":
        args = _plan_args(b, qo_indptr=torch.tensor([0, 3], dtype=I32, device=device))
    elif over == "neg_page":
        args = _plan_args(b, paged_kv_indices=-torch.ones_like(b.kv_indices))
    else:
        over = dict(over)
        if over.get("qo_indptr") == "long":
            over["qo_indptr"] = torch.tensor([0, 11, 16], dtype=I32, device=device)
        args = _plan_args(b, **over)
    w = _paged(device, backend="triton")
    with pytest.raises(exc, match=match):
        w.plan(**args)
    assert w._plan is None  # nothing was installed
    # API.md: a plan() that raises leaves the wrapper exactly as it was: its previous plan runs, with the same bits
    w.plan(**_plan_args(b))
    before = w.run(b.q, b.cache, return_lse=True)
    with pytest.raises(exc, match=match):
        w.plan(**args)
    after = w.run(b.q, b.cache, return_lse=True)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


RUN_REFUSALS = [
    ("q_dtype", "q_dtype", ValueError, "q has dtype torch.bfloat16; expected torch.float16"),
    ("q_shape", "q_shape", ValueError, "q has shape"),
    ("out_dtype", "out_dtype", ValueError, "out has dtype torch.bfloat16"),
    ("out_shape", "out_shape", ValueError, "out has shape"),
    ("lse_dtype", "lse_dtype", ValueError, "lse has dtype torch.float16"),
    ("kv_dtype", "kv_dtype", ValueError, "k cache has dtype torch.bfloat16 but the plan declared"),
    ("kv_mixed", "kv_mixed", ValueError, "K and V must share one dtype"),
    ("cache_shape", "cache_shape", ValueError, "k cache has shape"),
    ("cache_pages", "cache_pages", ValueError, "beyond the cache's 2 pages"),
    ("cache_5d", "cache_5d", ValueError, "expected a 5-D"),
    ("tensor_scale", "tensor_scale", ValueError, "k_scale is a tensor of shape \\(2,\\) and dtype torch.float32; "
                                                 "a tensor scale must be one float32 element"),
    ("scale_dtype", "scale_dtype", ValueError, "v_scale is a tensor of shape \\(1,\\) and dtype torch.float16"),
    ("scale_value", "scale_value", ValueError, "k_scale=-1.0 must be a positive finite float"),
]


@pytest.mark.parametrize("case", RUN_REFUSALS, ids=[c[0] for c in RUN_REFUSALS])
def test_paged_run_refusals(case, device):
    _, what, exc, match = case
    b = _batch(device)
    w = _paged(device, backend="triton")
    w.plan(**_plan_args(b))
    q, cache, kw = b.q, b.cache, {}
    if what == "q_dtype":
        q = q.to(torch.bfloat16)
    elif what == "q_shape":
        q = q[:-1]
    elif what == "out_dtype":
        kw["out"] = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    elif what == "out_shape":
        kw["out"] = torch.empty(q.shape[0] + 1, *q.shape[1:], dtype=q.dtype, device=device)
    elif what == "lse_dtype":
        kw["lse"], kw["return_lse"] = torch.empty(q.shape[:2], dtype=torch.float16, device=device), True
    elif what == "kv_dtype":
        cache = cache.to(torch.bfloat16)
    elif what == "kv_mixed":
        cache = (cache[:, 0], cache[:, 1].to(torch.bfloat16))
    elif what == "cache_shape":
        cache = cache[:, :, :2]
    elif what == "cache_pages":
        cache = cache[:2]
    elif what == "cache_5d":
        cache = cache[:, 0]
    elif what == "tensor_scale":
        kw["k_scale"] = torch.tensor([0.5, 1.0], device=device)
    elif what == "scale_dtype":
        kw["v_scale"] = torch.tensor([0.5], device=device, dtype=torch.float16)
    elif what == "scale_value":
        kw["k_scale"] = -1.0
    with pytest.raises(exc, match=match):
        w.run(q, cache, **kw)


def test_run_before_plan(device):
    b = _batch(device)
    with pytest.raises(ValueError, match="run\\(\\) was called before plan\\(\\)"):
        _paged(device).run(b.q, b.cache)


def test_constructor_refusals(device):
    ws = torch.empty(16, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="kv_layout='NDH' is not a layout"):
        serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NDH")
    with pytest.raises(NotImplementedError, match="backend='cudnn' is FlashInfer's and not served here"):
        serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="cudnn")
    with pytest.raises(ValueError, match="backend='cudnn2' is not a backend"):
        serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="cudnn2")


def test_single_prefill_refusals(device):
    q = torch.randn(4, 4, 64, device=device, dtype=torch.float16)
    k = torch.randn(6, 2, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="k has dtype torch.float16 but v has dtype torch.bfloat16"):
        serveattn.single_prefill_with_kv_cache(q, k, k.to(torch.bfloat16))
    with pytest.raises(ValueError, match="causal=True with kv_len=3 < qo_len=4"):
        serveattn.single_prefill_with_kv_cache(q, k[:3], k[:3], causal=True)
    with pytest.raises(NotImplementedError, match="head_dim=32 is not served"):
        serveattn.single_prefill_with_kv_cache(q[..., :32], k[..., :32], k[..., :32])
    with pytest.raises(NotImplementedError, match="float32 inputs are not served"):
        serveattn.single_prefill_with_kv_cache(q.float(), k.float(), k.float())
    with pytest.raises(ValueError, match="q must be a 3-D tensor"):
        serveattn.single_prefill_with_kv_cache(q[0], k, k)


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(4, 4, 64, dtype=torch.float16)
    k = torch.randn(6, 2, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="backend='triton' needs CUDA tensors"):
        serveattn.single_prefill_with_kv_cache(q, k, k, backend="triton")


def test_ragged_run_refusals(device):
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=device))
    w.plan(torch.tensor([0, 2], dtype=I32), torch.tensor([0, 5], dtype=I32), 4, 2, 64, q_data_type=torch.float16)
    q = torch.randn(2, 4, 64, device=device, dtype=torch.float16)
    k = torch.randn(6, 2, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="k has shape \\(6, 2, 64\\); the plan \\(NHD\\) expects \\[5, 2, 64\\]"):
        w.run(q, k, k)
