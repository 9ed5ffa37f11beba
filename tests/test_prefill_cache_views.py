"""prefill run()'s own memos beside the paged cache views (tests/test_cache_views.py): the ragged wrapper's plain
checks, the per-plan launch memo, and attention_ws._kept_descriptor (the warp-specialized kernel's TMA descriptors
per cache tensor): a tensor changed in place is described anew, a dead one's entry goes with it."""
import gc
import weakref
from dataclasses import replace

import pytest
import torch

import serveattn
from helpers import make_paged_batch
from serveattn.kernels import attention_ws as ws


def _batch(device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return make_paged_batch(gen, qo_lens=[5, 1, 9], kv_lens=[40, 9, 77], num_qo_heads=8, num_kv_heads=2,
                            head_dim=64, page_size=16, dtype=torch.float16, device=device)


def _paged(b, device, num_kv_heads=2, q_dtype=torch.float16):
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                      backend="triton")
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, num_kv_heads, 64, 16, causal=True,
           q_data_type=q_dtype)
    return w


def test_ragged_plain_checks_refuse_as_before(device):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(12, 8, 64, generator=gen).to(torch.float16).to(device)
    k, v = (torch.randn(30, 2, 64, generator=gen).to(torch.float16).to(device) for _ in range(2))
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                       backend="triton")
    i32 = dict(dtype=torch.int32, device=device)
    w.plan(torch.tensor([0, 4, 12], **i32), torch.tensor([0, 10, 30], **i32), 8, 2, 64, causal=True,
           q_data_type=torch.float16)
    want = w.run(q, k, v)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    assert w.run(q, k, v, out=out) is out and torch.equal(out, want)
    with pytest.raises(ValueError, match="v has shape \\(29, 2, 64\\); the plan \\(NHD\\) expects \\[30, 2, 64\\]"):
        w.run(q, k, v[:29])
    with pytest.raises(ValueError, match="K and V must share one dtype"):
        w.run(q, k, v.to(torch.bfloat16))
    w.plan(torch.tensor([0, 4, 12], **i32), torch.tensor([0, 10, 31], **i32), 8, 2, 64, causal=True,
           q_data_type=torch.float16)
    with pytest.raises(ValueError, match="k has shape \\(30, 2, 64\\); the plan \\(NHD\\) expects \\[31, 2, 64\\]"):
        w.run(q, k, v)


def test_replaced_plan_gets_its_own_launch_memo(device):
    b = _batch(device)
    w = _paged(b, device)
    w._plan.launch_memo["x"] = 1
    assert replace(w._plan, paged=False).launch_memo == {}


def _cache(pages=6):
    return torch.randn(pages, 2, 16, 2, 64).to(torch.bfloat16).unbind(1)[0]


def test_kept_descriptor_follows_the_tensor():
    k = _cache()
    strides = (k.stride(0), k.stride(1), k.stride(2))
    got = ws._kept_descriptor(k, strides, 2, 16, 64)
    assert got[0] == ws._row_map(k, strides, 2, 64) and got[2] == ws._descriptor(k, got[0][0], 16, 64)[1]
    assert ws._kept_descriptor(k, strides, 2, 16, 64) is got  # kept
    assert got[1].base.data_ptr() == k.data_ptr() and got[1].base is not k
    other = _cache(8)
    k.set_(other.untyped_storage(), other.storage_offset(), other.shape, other.stride())  # in place: anew
    moved = ws._kept_descriptor(k, strides, 2, 16, 64)
    assert moved is not got and moved[1].base.data_ptr() == other.data_ptr() and moved[2] > got[2]
    assert ws._kept_descriptor(k, strides, 2, 8, 64)[1].block_shape == [8, 64]  # another box: its own descriptor
    bad = (k.stride(0), k.stride(1), 100)  # heads overlap within a slot row
    assert ws._kept_descriptor(k, bad, 2, 16, 64) == (None, None, None)


def test_kept_descriptor_does_not_keep_the_tensor():
    k = _cache()
    ws._kept_descriptor(k, (k.stride(0), k.stride(1), k.stride(2)), 2, 16, 64)
    key, dead = id(k), weakref.ref(k)
    assert key in ws._KEPT
    del k
    gc.collect()
    assert dead() is None and key not in ws._KEPT
