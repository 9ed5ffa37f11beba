"""decode run()'s per-cache memo (decode._cache_views: the K/V views and what the checks read of them): a cache
changed in place is split anew, a dead cache's entry goes with it, and every run still checks the cache against the
plan it runs."""
import weakref

import pytest
import torch

import serveattn
from helpers import make_paged_batch


def _batch(device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return make_paged_batch(gen, qo_lens=[1] * 3, kv_lens=[40, 9, 77], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                            page_size=16, dtype=torch.float16, device=device)


def _wrapper(b, device, **plan_kwargs):
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                     backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.float16, **plan_kwargs)
    return w


def test_cache_changed_in_place_is_split_anew(device):
    b, other = _batch(device), _batch(device, seed=4).cache
    w = _wrapper(b, device, fixed_split_size=32)
    cache = b.cache.clone()
    assert torch.equal(w.run(b.q, cache), _wrapper(b, device, fixed_split_size=32).run(b.q, b.cache))
    cache.set_(other.clone().untyped_storage(), 0, other.shape, other.stride())  # new storage, same object
    assert torch.equal(w.run(b.q, cache), _wrapper(b, device, fixed_split_size=32).run(b.q, other))
    cache.data = cache.view(torch.bfloat16)  # same address, shape and strides; another dtype
    with pytest.raises(ValueError, match="k cache has dtype torch.bfloat16 but the plan declared torch.float16"):
        w.run(b.q, cache)
    cache.data = cache.view(torch.float16)[:2]  # too few pages for the page table
    with pytest.raises(ValueError, match="paged_kv_indices refers to page \\d+, beyond the cache's 2 pages"):
        w.run(b.q, cache)


def test_every_plan_checks_the_kept_cache(device):
    b = _batch(device)
    w = _wrapper(b, device)
    w.run(b.q, b.cache)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 1, 64, 16, q_data_type=torch.float16)
    with pytest.raises(ValueError, match="k cache has shape \\(\\d+, 16, 2, 64\\); the plan \\(NHD\\) expects "
                                         "\\[num_pages, 16, 1, 64\\]"):
        w.run(b.q, b.cache)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="k cache has dtype torch.float16 but the plan declared torch.bfloat16"):
        w.run(b.q.to(torch.bfloat16), b.cache)


def test_dead_cache_leaves_no_entry(device):
    b = _batch(device)
    w = _wrapper(b, device)
    caches = [b.cache.clone() for _ in range(3)]
    for cache in caches:
        w.run(b.q, cache)
    assert len(w._caches) == 3
    dead = weakref.ref(caches[0])
    del caches[0], cache
    assert dead() is None and len(w._caches) == 2  # the kept views do not hold the cache (nor its storage)


def test_pairs_take_the_same_checks(device):
    """A (k, v) pair alike in dtype, shape and strides is checked through the fast path, any other pair through the
    full checks: the same bits, and each refusal names the tensor at fault."""
    b = _batch(device)
    w = _wrapper(b, device)
    k, v = (t.contiguous() for t in b.cache.unbind(1))
    want = w.run(b.q, b.cache)
    assert torch.equal(w.run(b.q, (k, v)), want) and torch.equal(w.run(b.q, [k, v]), want)
    strided_v = v.transpose(1, 2).contiguous().transpose(1, 2)  # V with other strides
    assert torch.equal(w.run(b.q, (k, strided_v)), want)
    with pytest.raises(ValueError, match="v cache has shape \\(\\d+, 16, 1, 64\\)"):
        w.run(b.q, (k, v[:, :, :1].contiguous()))
    with pytest.raises(ValueError, match="K and V must share one dtype"):
        w.run(b.q, (k, v.to(torch.bfloat16)))
    with pytest.raises(ValueError, match="k cache has dtype torch.bfloat16 but the plan declared torch.float16"):
        w.run(b.q, (k.to(torch.bfloat16), v.to(torch.bfloat16)))
    with pytest.raises(ValueError, match="paged_kv_cache tuple has 3 tensors"):
        w.run(b.q, (k, v, v))
