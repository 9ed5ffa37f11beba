"""Paged KV cache utilities: append (both backends, bitwise against the reference), index helpers, packbits."""
import numpy as np
import pytest
import torch

from serveattn import page, reference
from serveattn.quantization import packbits, segment_packbits

I32 = torch.int32


def make_batch(seed, page_size, old_lens, append_lens, spare_pages=3):
    """A shuffled page table for requests that grow from old_lens by append_lens tokens."""
    g = torch.Generator().manual_seed(seed)
    new_lens = [o + a for o, a in zip(old_lens, append_lens)]
    pages_per_req = [-(-n // page_size) for n in new_lens]
    num_pages = sum(pages_per_req) + spare_pages
    kv_indices = torch.randperm(num_pages, generator=g)[: sum(pages_per_req)].to(I32)
    kv_indptr = torch.tensor(np.cumsum([0] + pages_per_req), dtype=I32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(new_lens, pages_per_req)], dtype=I32)
    append_indptr = torch.tensor(np.cumsum([0] + list(append_lens)), dtype=I32)
    return g, num_pages, kv_indices, kv_indptr, last, append_indptr, new_lens


def make_cache(g, form, layout, num_pages, page_size, heads, head_dim, dtype, device="cpu"):
    """Random cache (never zeros) on `device`. "*_view" forms are slices of a larger buffer; the buffers
    are returned too, so that the test can check that nothing outside the view was written."""
    inner = (page_size, heads) if layout == "NHD" else (heads, page_size)
    lo = 1 if form.endswith("_view") else 0  # spare pages and head_dim columns around the view
    pages = slice(lo, lo + num_pages)
    cols = slice(8 * lo, 8 * lo + head_dim)
    kv_axis = (2,) if form.startswith("tensor") else ()
    bufs = [torch.randn(num_pages + 4 * lo, *kv_axis, *inner, head_dim + 16 * lo, generator=g).to(dtype).to(device)
            for _ in range(1 if kv_axis else 2)]
    views = [b[pages, ..., cols] for b in bufs]
    return (views[0] if kv_axis else tuple(views)), bufs, (pages, cols)


def as_tuple(cache):
    return cache if isinstance(cache, tuple) else (cache,)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("form", ["tensor", "tuple", "tensor_view", "tuple_view"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_append_matches_reference(dtype, layout, form, page_size, backend, device):
    heads, head_dim = 2, 64
    # Request 1 appends nothing, request 3 owns no pages at all; lengths leave partial last pages.
    old_lens, append_lens = [3, 7, 0, 0, 16], [5, 0, 17, 0, 1]
    seed = 100 * page_size + 10 * (layout == "HND") + ["tensor", "tuple", "tensor_view", "tuple_view"].index(form)
    g, num_pages, kv_indices, kv_indptr, last, append_indptr, new_lens = make_batch(
        seed, page_size, old_lens, append_lens)
    cache, bufs, (pages, cols) = make_cache(g, form, layout, num_pages, page_size, heads, head_dim, dtype, device)
    seq_lens = page.get_seq_lens(kv_indptr, last, page_size)
    assert seq_lens.tolist() == new_lens
    nnz = sum(append_lens)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    # Tokens need not arrive grouped by request: shuffle them (with their targets).
    order = torch.randperm(nnz, generator=g)
    batch_indices, positions = batch_indices[order].contiguous(), positions[order].contiguous()
    key = torch.randn(nnz, heads, head_dim, generator=g).to(dtype)
    value = torch.randn(nnz, heads, head_dim, generator=g).to(dtype)

    cpu_cache = tuple(c.cpu() for c in cache) if isinstance(cache, tuple) else cache.cpu()
    want = reference.append_paged_kv_cache(key, value, batch_indices, positions, cpu_cache, kv_indices, kv_indptr,
                                           last, layout)
    bufs_before = [b.clone() for b in bufs]
    args = [t.to(device) for t in (key, value, batch_indices, positions)]
    page.append_paged_kv_cache(*args, cache, kv_indices.to(device), kv_indptr.to(device), last.to(device), layout,
                               backend=backend)
    for got, expected in zip(as_tuple(cache), as_tuple(want)):
        assert torch.equal(got.cpu(), expected)
    # Exactly the nnz * heads target rows differ from before (values are random, so all of them do).
    changed_rows = sum(int((b != b0).any(-1).sum()) for b, b0 in zip(bufs, bufs_before))
    assert changed_rows == 2 * nnz * heads
    # The reference wrote only the targets, and the view's surroundings in the buffer are untouched.
    for b, b0 in zip(bufs, bufs_before):
        outside = torch.ones_like(b, dtype=torch.bool)
        outside[pages, ..., cols] = False
        assert torch.equal(b[outside], b0[outside])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_odd_head_dim_and_strided_keys(backend, device):
    """head_dim 40 (not a power of two) and K/V that are slices of a fused QKV buffer, one with a
    non-unit head_dim stride."""
    g, num_pages, kv_indices, kv_indptr, last, append_indptr, _ = make_batch(5, 4, [2, 9], [6, 3])
    cache = torch.randn(num_pages, 2, 3, 4, 40, generator=g).half()  # HND
    seq_lens = page.get_seq_lens(kv_indptr, last, 4)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, seq_lens, 9)
    qkv = torch.randn(9, 5 + 3 + 3, 40, generator=g).half()
    key = qkv[:, 5:8]
    value = torch.randn(9, 3, 80, generator=g).half()[..., ::2]
    want = reference.append_paged_kv_cache(key, value, batch_indices, positions, cache, kv_indices, kv_indptr,
                                           last, "HND")
    on_device = [t.to(device) for t in (key, value, batch_indices, positions, cache, kv_indices, kv_indptr, last)]
    page.append_paged_kv_cache(*on_device, "HND", backend=backend)
    assert torch.equal(on_device[4].cpu(), want)


def test_append_nothing_and_auto_backend():
    g, num_pages, kv_indices, kv_indptr, last, append_indptr, _ = make_batch(6, 16, [4], [0])
    cache = torch.randn(num_pages, 2, 16, 2, 64, generator=g).half()
    before = cache.clone()
    empty = torch.zeros(0, dtype=I32)
    page.append_paged_kv_cache(cache.new_zeros(0, 2, 64), cache.new_zeros(0, 2, 64), empty, empty, cache,
                               kv_indices, kv_indptr, last)
    assert torch.equal(cache, before)


def test_get_batch_indices_positions_by_hand(device):
    append_indptr = torch.tensor([0, 1, 3, 3, 6, 10], dtype=I32, device=device)
    seq_lens = torch.tensor([5, 5, 2, 3, 4], dtype=I32, device=device)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, seq_lens, 10)
    assert batch_indices.dtype == I32 and positions.dtype == I32
    assert batch_indices.tolist() == [0, 1, 1, 3, 3, 3, 4, 4, 4, 4]
    assert positions.tolist() == [4, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    out_b, out_p = torch.full((10,), -1, dtype=I32, device=device), torch.full((10,), -1, dtype=I32, device=device)
    got = page.get_batch_indices_positions(append_indptr, seq_lens, 10, out_b, out_p)
    assert got[0] is out_b and got[1] is out_p and out_p.tolist() == positions.tolist()
    b, p = page.get_batch_indices_positions(torch.zeros(1, dtype=I32), torch.zeros(0, dtype=I32), 0)
    assert b.shape == (0,) and p.shape == (0,)


def test_get_seq_lens_by_hand(device):
    kv_indptr = torch.tensor([0, 2, 2, 5, 6], dtype=I32, device=device)
    last = torch.tensor([3, 0, 16, 1], dtype=I32, device=device)
    seq_lens = page.get_seq_lens(kv_indptr, last, 16)
    assert seq_lens.dtype == I32 and seq_lens.tolist() == [19, 0, 48, 1]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 101])
def test_packbits_matches_numpy(n):
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    want = np.packbits(x.numpy(), bitorder="little")
    got = packbits(x, bitorder="little")
    assert got.dtype == torch.uint8 and got.tolist() == want.tolist()
    assert packbits(x.to(torch.int32), bitorder="little").tolist() == want.tolist()
    assert torch.equal(got, reference.packbits(x))
    # FlashInfer's default order is "big", as numpy's
    assert packbits(x).tolist() == np.packbits(x.numpy()).tolist()


def test_segment_packbits_matches_numpy():
    g = torch.Generator().manual_seed(11)
    seg_lens = [3, 0, 8, 9, 1, 16, 0, 21]
    indptr = torch.tensor(np.cumsum([0] + seg_lens), dtype=I32)
    x = torch.rand(sum(seg_lens), generator=g) > 0.5
    packed, new_indptr = segment_packbits(x, indptr, bitorder="little")
    lo = indptr.tolist()
    big, _ = segment_packbits(x, indptr)
    assert big.tolist() == np.concatenate([np.packbits(x[lo[i]:lo[i + 1]].numpy())
                                           for i in range(len(seg_lens))]).tolist()
    want = [np.packbits(x[lo[i]:lo[i + 1]].numpy(), bitorder="little") for i in range(len(seg_lens))]
    assert new_indptr.dtype == I32 and new_indptr.tolist() == np.cumsum([0] + [w.size for w in want]).tolist()
    assert packed.tolist() == np.concatenate(want).tolist()
    ref_packed, ref_indptr = reference.segment_packbits(x, indptr)
    assert torch.equal(packed, ref_packed) and torch.equal(new_indptr, ref_indptr)
    empty, empty_indptr = segment_packbits(x[:0], torch.zeros(3, dtype=I32))
    assert empty.numel() == 0 and empty_indptr.tolist() == [0, 0, 0]


# ---------------------------------------------------------------- refusals


@pytest.fixture
def setup():
    g, num_pages, kv_indices, kv_indptr, last, append_indptr, _ = make_batch(12, 4, [1, 2], [2, 3])
    cache = torch.randn(num_pages, 2, 4, 2, 64, generator=g).half()
    seq_lens = page.get_seq_lens(kv_indptr, last, 4)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, seq_lens, 5)
    key, value = torch.randn(5, 2, 64, generator=g).half(), torch.randn(5, 2, 64, generator=g).half()
    return dict(append_key=key, append_value=value, batch_indices=batch_indices, positions=positions,
                paged_kv_cache=cache, kv_indices=kv_indices, kv_indptr=kv_indptr, kv_last_page_len=last)


def changed(**how):
    """A mutation of the valid arguments: name -> function of the old value."""
    return lambda kw: {**kw, **{name: f(kw.get(name)) for name, f in how.items()}}


def first_to(value):
    return lambda t: torch.where(torch.arange(t.numel()) == 0, value, t).to(I32)


@pytest.mark.parametrize("mutate,error,match", [
    (changed(batch_indices=torch.Tensor.long), ValueError,
     r"batch_indices has dtype torch.int64; index tensors must be int32"),
    (changed(positions=torch.Tensor.long), ValueError, r"positions has dtype torch.int64"),
    (changed(kv_indptr=torch.Tensor.long), ValueError, r"kv_indptr has dtype torch.int64"),
    (changed(kv_indices=torch.Tensor.long), ValueError, r"kv_indices has dtype torch.int64"),
    (changed(append_key=torch.Tensor.bfloat16, append_value=torch.Tensor.bfloat16), ValueError,
     r"append_key has dtype torch.bfloat16 but paged_kv_cache has torch.float16"),
    (changed(append_value=torch.Tensor.bfloat16), ValueError, r"K and V must share one dtype"),
    (changed(kv_layout=lambda _: "NDH"), ValueError, r"kv_layout='NDH' is not a layout; supported: 'NHD', 'HND'"),
    (changed(paged_kv_cache=lambda c: c.to(torch.float8_e4m3fn)), ValueError,
     r"append_key has dtype torch.float16 but paged_kv_cache has torch.float8_e4m3fn"),
    (changed(paged_kv_cache=torch.Tensor.float), NotImplementedError,
     r"paged_kv_cache dtype torch.float32 is not served"),
    (changed(paged_kv_cache=lambda c: c[:, 0]), ValueError, r"a single-tensor cache is 5-D"),
    (changed(paged_kv_cache=lambda c: (c[:, 0], c[:, 1, :2])), ValueError, r"both must be the same 4-D shape"),
    (changed(append_key=lambda t: t[:, :1]), ValueError, r"append_key has shape \(5, 1, 64\); expected \[nnz, 2, 64\]"),
    (changed(positions=first_to(99)), ValueError, r"positions\[0\]=99 for request 0, which owns 1 pages"),
    (changed(batch_indices=first_to(2)), ValueError, r"batch_indices holds 2; requests are numbered 0..1"),
    (changed(kv_indices=first_to(50)), ValueError, r"kv_indices holds page 50 outside the cache's"),
    (changed(backend=lambda _: "cuda"), ValueError, r"backend='cuda' is not a backend"),
])
def test_append_refusals(setup, mutate, error, match):
    cache_before = setup["paged_kv_cache"].clone()
    with pytest.raises(error, match=match):
        page.append_paged_kv_cache(**mutate(setup))
    assert torch.equal(setup["paged_kv_cache"], cache_before)


def test_index_helper_refusals():
    append_indptr = torch.tensor([0, 2, 5], dtype=I32)
    seq_lens = torch.tensor([4, 5], dtype=I32)
    with pytest.raises(ValueError, match=r"append_indptr has dtype torch.int64"):
        page.get_batch_indices_positions(append_indptr.long(), seq_lens, 5)
    with pytest.raises(ValueError, match=r"nnz=4 but append_indptr\[-1\]=5"):
        page.get_batch_indices_positions(append_indptr, seq_lens, 4)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=2 is smaller than the 3 tokens request 1 appends"):
        page.get_batch_indices_positions(append_indptr, torch.tensor([4, 2], dtype=I32), 5)
    with pytest.raises(ValueError, match=r"kv_last_page_len has dtype torch.int64"):
        page.get_seq_lens(append_indptr, seq_lens.long(), 16)
    with pytest.raises(ValueError, match=r"page_size=0 must be a positive int"):
        page.get_seq_lens(append_indptr, seq_lens, 0)


def test_packbits_refusals():
    x = torch.tensor([1, 0, 1], dtype=torch.bool)
    with pytest.raises(ValueError, match=r"segment_packbits: bitorder='LE' is not a bit order"):
        segment_packbits(x, torch.tensor([0, 3], dtype=I32), bitorder="LE")
    with pytest.raises(ValueError, match=r"bitorder='middle' is not a bit order"):
        packbits(x, bitorder="middle")
    with pytest.raises(ValueError, match=r"x must be a 1-D tensor"):
        packbits(x.reshape(1, 3))
    with pytest.raises(ValueError, match=r"indptr has dtype torch.int64"):
        segment_packbits(x, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"indptr\[-1\]=4 exceeds the 3 entries"):
        segment_packbits(x, torch.tensor([0, 4], dtype=I32))


@pytest.mark.gpu
def test_append_cuda_cache_beyond_2_pow_31_elements():
    """A 4.3 GB cache: the last pages sit past element 2**31, where int32 address math would wrap."""
    page_size, heads, head_dim = 16, 8, 128
    num_pages = (2**31) // (2 * page_size * heads * head_dim) + 4
    cache = torch.empty(num_pages, 2, page_size, heads, head_dim, dtype=torch.float16, device="cuda")
    last_pages = torch.tensor([num_pages - 1, num_pages - 3], dtype=I32, device="cuda")
    kv_indptr = torch.tensor([0, 1, 2], dtype=I32, device="cuda")
    last = torch.tensor([page_size, 3], dtype=I32, device="cuda")
    batch_indices = torch.tensor([0, 1, 0], dtype=I32, device="cuda")
    positions = torch.tensor([page_size - 1, 2, 0], dtype=I32, device="cuda")
    key = torch.randn(3, heads, head_dim, device="cuda").half()
    value = torch.randn(3, heads, head_dim, device="cuda").half()
    cache[-4:] = 7.0
    page.append_paged_kv_cache(key, value, batch_indices, positions, cache, last_pages, kv_indptr, last,
                               backend="triton")
    assert torch.equal(cache[num_pages - 1, 0, page_size - 1], key[0])
    assert torch.equal(cache[num_pages - 3, 1, 2], value[1])
    assert torch.equal(cache[num_pages - 1, 1, 0], value[2])
    assert int((cache[-4:] != 7.0).any(-1).sum()) == 3 * 2 * heads
