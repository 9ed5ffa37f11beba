"""run()'s per-cache memo of the paged wrappers (decode._cache_views, prefill._cache_views: the K/V views and what
the checks read of them), for decode and paged prefill alike: a cache changed in place is split anew, a dead cache's
entry goes with it, and every run still checks the cache against the plan it runs, naming the tensor at fault."""
import weakref

import pytest
import torch

import serveattn
from helpers import make_paged_batch

KINDS = ["decode", "prefill"]


def _batch(kind, device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    qo_lens = [1] * 3 if kind == "decode" else [5, 1, 9]
    return make_paged_batch(gen, qo_lens=qo_lens, kv_lens=[40, 9, 77], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                            page_size=16, dtype=torch.float16, device=device)


def _plan(kind, w, b, num_kv_heads=2, q_dtype=torch.float16):
    if kind == "decode":  # fixed_split_size: requests split over several programs, merged
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, num_kv_heads, 64, 16, q_data_type=q_dtype,
               fixed_split_size=2)
    else:
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, num_kv_heads, 64, 16, causal=True,
               q_data_type=q_dtype)
    return w


def _wrapper(kind, b, device):
    cls = serveattn.BatchDecodeWithPagedKVCacheWrapper if kind == "decode" else \
        serveattn.BatchPrefillWithPagedKVCacheWrapper
    return _plan(kind, cls(torch.empty(1 << 20, dtype=torch.uint8, device=device), backend="triton"), b)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_changed_in_place_is_split_anew(kind, device):
    b, other = _batch(kind, device), _batch(kind, device, seed=4).cache
    w = _wrapper(kind, b, device)
    cache = b.cache.clone()
    assert torch.equal(w.run(b.q, cache), _wrapper(kind, b, device).run(b.q, b.cache))
    cache.set_(other.clone().untyped_storage(), 0, other.shape, other.stride())  # new storage, same object
    assert torch.equal(w.run(b.q, cache), _wrapper(kind, b, device).run(b.q, other))
    cache.data = cache.view(torch.bfloat16)  # same address, shape and strides; another dtype
    with pytest.raises(ValueError, match="k cache has dtype torch.bfloat16 but the plan declared torch.float16"):
        w.run(b.q, cache)
    cache.data = cache.view(torch.float16)[:2]  # too few pages for the page table
    with pytest.raises(ValueError,
                       match="indices \\(given to plan\\(\\)\\) refers to page \\d+, beyond the cache's 2 pages"):
        w.run(b.q, cache)


@pytest.mark.parametrize("kind", KINDS)
def test_every_plan_checks_the_kept_cache(kind, device):
    b = _batch(kind, device)
    w = _wrapper(kind, b, device)
    w.run(b.q, b.cache)
    _plan(kind, w, b, num_kv_heads=1)
    with pytest.raises(ValueError, match="k cache has shape \\(\\d+, 16, 2, 64\\); the plan \\(NHD\\) expects "
                                         "\\[num_pages, 16, 1, 64\\]"):
        w.run(b.q, b.cache)
    _plan(kind, w, b, q_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k cache has dtype torch.float16 but the plan declared torch.bfloat16"):
        w.run(b.q.to(torch.bfloat16), b.cache)


@pytest.mark.parametrize("kind", KINDS)
def test_dead_cache_leaves_no_entry(kind, device):
    b = _batch(kind, device)
    w = _wrapper(kind, b, device)
    caches = [b.cache.clone() for _ in range(3)]
    for cache in caches:
        w.run(b.q, cache)
    assert len(w._caches) == 3
    dead = weakref.ref(caches[0])
    del caches[0], cache
    assert dead() is None and len(w._caches) == 2  # the kept views do not hold the cache (nor its storage)


@pytest.mark.parametrize("kind", KINDS)
def test_pairs_take_the_same_checks(kind, device):
    """A (k, v) pair alike in dtype, shape and strides is checked through the fast path, any other pair through the
    full checks: the same bits, and each refusal names the tensor at fault."""
    b = _batch(kind, device)
    w = _wrapper(kind, b, device)
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
