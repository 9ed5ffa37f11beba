"""Paged KV cache utilities: append (both backends, bitwise against the reference), index helpers, packbits."""
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from serveattn import page, reference
from serveattn.kernels import page as page_kernels
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


@pytest.mark.parametrize("strided", ["batch_indices", "positions", "kv_indices", "kv_indptr"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_reads_strided_index_tensors(strided, backend, device):
    """An index tensor that is a strided view (a column of a table, x[::2]) holding the same values: the same
    cache as with contiguous indices (the Triton kernel reads them at unit stride, so they are copied first)."""
    g, num_pages, kv_indices, kv_indptr, last, append_indptr, _ = make_batch(5, 4, [2, 9], [6, 3])
    cache = torch.randn(num_pages, 2, 4, 3, 64, generator=g).half()
    seq_lens = page.get_seq_lens(kv_indptr, last, 4)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, seq_lens, 9)
    key, value = torch.randn(2, 9, 3, 64, generator=g).half()
    index = dict(batch_indices=batch_indices, positions=positions, kv_indices=kv_indices, kv_indptr=kv_indptr)
    want = reference.append_paged_kv_cache(key, value, batch_indices, positions, cache, kv_indices, kv_indptr, last)
    wide = torch.full((2 * index[strided].numel(),), 1, dtype=torch.int32)  # the gaps: valid-looking ints
    wide[::2] = index[strided]
    index[strided] = wide[::2]
    assert not index[strided].is_contiguous()
    on_device = {n: t.to(device) for n, t in index.items()}
    on_device[strided] = wide.to(device)[::2]
    got = cache.to(device)
    page.append_paged_kv_cache(key.to(device), value.to(device), on_device["batch_indices"], on_device["positions"],
                               got, on_device["kv_indices"], on_device["kv_indptr"], last.to(device), backend=backend)
    assert torch.equal(got.cpu(), want)


def test_append_nothing_and_auto_backend():
    g, num_pages, kv_indices, kv_indptr, last, append_indptr, _ = make_batch(6, 16, [4], [0])
    cache = torch.randn(num_pages, 2, 16, 2, 64, generator=g).half()
    before = cache.clone()
    empty = torch.zeros(0, dtype=I32)
    page.append_paged_kv_cache(cache.new_zeros(0, 2, 64), cache.new_zeros(0, 2, 64), empty, empty, cache,
                               kv_indices, kv_indptr, last)
    assert torch.equal(cache, before)


# ---------------------------------------------------------------- quantizing append into an fp8 cache

FP8_ENCODINGS = [torch.float8_e4m3fn, torch.float8_e5m2]


def every_value(dtype, gen):
    """All 65536 bit patterns of a 16-bit dtype (normals, subnormals, +-0, +-inf, NaNs), shuffled."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    return bits[torch.randperm(1 << 16, generator=gen)].view(dtype)


def fp8_grid(enc):
    """The non-negative finite fp8 values, ascending, in float64."""
    grid = torch.arange(128, dtype=torch.int32).to(torch.uint8).view(enc).double()
    return grid[torch.isfinite(grid)].sort().values


def fp8_fields(q, enc):
    """(exponent field, mantissa field) of fp8 values."""
    mbits = reference.FP8_FORMATS[enc][0]
    b = q.view(torch.uint8).to(torch.int32)
    return (b >> mbits) & (0x7F >> mbits), b & ((1 << mbits) - 1)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("enc", FP8_ENCODINGS)
def test_append_quantizes_into_fp8_bitwise(enc, in_dtype, layout, device):
    """Every 16-bit value, as K with a power-of-two scale (so fp8 midpoints are exact ties) and as V with
    an arbitrary scale: the Triton kernel, the torch path and the float64 quantizer store the same bits."""
    seed = 10 * FP8_ENCODINGS.index(enc) + 2 * (in_dtype == torch.bfloat16) + (layout == "HND")
    heads, head_dim, page_size = 2, 64, 16
    old_lens, append_lens = [3, 0, 20, 7, 5], [200, 0, 150, 162, 0]  # 512 tokens = 65536 / (2 * 64)
    g, num_pages, kv_indices, kv_indptr, last, append_indptr, _ = make_batch(seed, page_size, old_lens, append_lens)
    nnz = sum(append_lens)
    seq_lens = page.get_seq_lens(kv_indptr, last, page_size)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    order = torch.randperm(nnz, generator=g)
    batch_indices, positions = batch_indices[order].contiguous(), positions[order].contiguous()
    key = every_value(in_dtype, g).reshape(nnz, heads, head_dim)
    value = every_value(in_dtype, g).reshape(nnz, heads, head_dim)
    k_scale = 2.0 ** -3
    v_scale = 0.0371 if enc == torch.float8_e4m3fn else 2.3e-3
    form = ["tensor", "tuple_view"][seed % 2]
    cache, bufs, (pages, cols) = make_cache(g, form, layout, num_pages, page_size, heads, head_dim, enc, device)

    k8, v8 = reference.quantize_fp8(key, k_scale, enc), reference.quantize_fp8(value, v_scale, enc)
    cpu_cache = tuple(c.cpu() for c in cache) if isinstance(cache, tuple) else cache.cpu()
    want = reference.append_paged_kv_cache(k8, v8, batch_indices, positions, cpu_cache, kv_indices, kv_indptr, last,
                                           layout)
    # The sweep holds what the test is about (checked on the float64 side, in the quantized values).
    fmax = reference.FP8_FORMATS[enc][2]
    k64 = key.double() / k_scale
    exp_field, mant = fp8_fields(k8, enc)
    grid = fp8_grid(enc)
    a = k64.abs().clamp(max=fmax).nan_to_num(0.0)
    above = torch.searchsorted(grid, a).clamp(1, grid.numel() - 1)
    tie = (a > 0) & (a == (grid[above - 1] + grid[above]) / 2)  # exactly between two fp8 neighbours
    assert int(tie.sum()) > 100 and bool((mant[tie] % 2 == 0).all())  # ties went to the even neighbour
    assert int(((exp_field == 0) & (mant != 0)).sum()) > 100  # fp8 subnormals
    assert bool((k8.double().abs()[k64.abs() > fmax] == fmax).all()) and int((k64.abs() > fmax).sum()) > 100
    assert bool((k8.view(torch.uint8)[torch.isnan(key)] == 0x7F).all()) and bool(torch.isnan(key).any())

    bufs_before = [b.clone() for b in bufs]
    for backend in ("torch", "triton"):
        for b, b0 in zip(bufs, bufs_before):
            b.copy_(b0)
        scales = (k_scale, v_scale) if backend == "torch" else \
            tuple(torch.tensor([s], dtype=torch.float32, device=device) for s in (k_scale, v_scale))
        if backend == "triton" and seed % 4 >= 2:  # a 0-d tensor too
            scales = (scales[0], torch.tensor(v_scale, dtype=torch.float32, device=device))
        page.append_paged_kv_cache(key.to(device), value.to(device), batch_indices.to(device), positions.to(device),
                                   cache, kv_indices.to(device), kv_indptr.to(device), last.to(device), layout,
                                   k_scale=scales[0], v_scale=scales[1], backend=backend)
        for got, expected in zip(as_tuple(cache), as_tuple(want)):
            assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8)), backend
        for b, b0 in zip(bufs, bufs_before):  # nothing around the view was written
            outside = torch.ones(b.shape, dtype=torch.bool)
            outside[pages, ..., cols] = False
            assert torch.equal(b.cpu().view(torch.uint8)[outside], b0.cpu().view(torch.uint8)[outside])


# Worked out by hand: x, and the fp8 bits of x / scale (sign | exponent field | mantissa).
BY_HAND = {
    torch.float8_e4m3fn: (1.0, [  # bias 7, 3 mantissa bits: 1.0 = 0x38, subnormals k * 2^-9, max 448 = 0x7E
        (1.0625, 0x38),  # tie between 1 and 1.125: to the even mantissa, 1
        (1.1875, 0x3A),  # tie between 1.125 and 1.25: 1.25
        (0.2998046875, 0x2A),  # 9.59 * 2^-5 -> 10 * 2^-5 = 0.3125
        (448.0, 0x7E), (464.0, 0x7E), (1e4, 0x7E), (-float("inf"), 0xFE),  # saturated (480 would be NaN)
        (2.0 ** -10, 0x00),  # tie between 0 and the smallest subnormal 2^-9: 0
        (3 * 2.0 ** -10, 0x02),  # tie between 1 and 2 * 2^-9: 2
        (15 * 2.0 ** -10, 0x08),  # tie between 7 * 2^-9 and 2^-6 (the smallest normal): 2^-6
        (-2.0 ** -11, 0x80), (-0.0, 0x80), (float("nan"), 0x7F)]),
    torch.float8_e5m2: (0.5, [  # bias 15, 2 mantissa bits: 1.0 = 0x3C, subnormals k * 2^-16, max 57344 = 0x7B
        (0.5625, 0x3C),  # x / s = 1.125, tie between 1 and 1.25: 1
        (0.6875, 0x3E),  # 1.375, tie between 1.25 and 1.5: 1.5
        (0.1500244140625, 0x35),  # 0.30005 = 4.8 * 2^-4 -> 5 * 2^-4
        (28672.0, 0x7B), (30720.0, 0x7B), (6e4, 0x7B), (-float("inf"), 0xFB),  # 61440 would round to inf
        (2.0 ** -18, 0x00),  # 2^-17, tie between 0 and 2^-16: 0
        (3 * 2.0 ** -18, 0x02),  # 3 * 2^-17: 2 * 2^-16
        (7 * 2.0 ** -18, 0x04),  # 3.5 * 2^-16: 4 * 2^-16 = 2^-14, the smallest normal
        (-2.0 ** -18, 0x80), (-0.0, 0x80), (float("nan"), 0x7F)]),
}


@pytest.mark.parametrize("enc", FP8_ENCODINGS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_quantizes_by_hand(backend, enc, device):
    scale, table = BY_HAND[enc]
    x = torch.tensor([v for v, _ in table], dtype=torch.float16)
    bits = [b for _, b in table]
    assert reference.quantize_fp8(x, scale, enc).view(torch.uint8).tolist() == bits
    n = x.numel()
    cache = torch.zeros(1, 2, n, 1, 64, dtype=enc, device=device)
    key = x[:, None, None].expand(n, 1, 64).contiguous().to(device)
    i32 = dict(dtype=I32, device=device)
    page.append_paged_kv_cache(key, -key, torch.zeros(n, **i32), torch.arange(n, **i32), cache,
                               torch.zeros(1, **i32), torch.tensor([0, 1], **i32), torch.tensor([n], **i32),
                               k_scale=scale, v_scale=scale, backend=backend)
    got = cache.cpu().view(torch.uint8)
    assert got[0, 0, :, 0, 0].tolist() == bits
    assert bool((got[0, 0, :, 0, :] == got[0, 0, :, 0, :1]).all())
    assert got[0, 1, :, 0, 0].tolist() == [b if b == 0x7F else b ^ 0x80 for b in bits]  # -x: the sign flips


@pytest.mark.parametrize("enc", FP8_ENCODINGS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_quantizes_bf16_subnormals(backend, enc, device):
    """bf16 subnormals (below 2^-126) under a scale that brings them into the fp8 range: the widening to
    float32 must be exact (the interpreter's own bf16 -> fp32 conversion garbles these)."""
    bits = torch.arange(-127, 128, dtype=torch.int32)
    bits = torch.where(bits < 0, 0x8000 - bits, bits).to(torch.int16)  # +-1..127: every subnormal, and 0
    x = bits.view(torch.bfloat16)
    n = x.numel()
    key = x[:, None, None].expand(n, 1, 64).contiguous().to(device)
    cache = torch.zeros(1, 2, n, 1, 64, dtype=enc, device=device)
    i32 = dict(dtype=I32, device=device)
    scale = 2.0 ** -125 if enc == torch.float8_e4m3fn else 2.0 ** -118
    page.append_paged_kv_cache(key, key, torch.zeros(n, **i32), torch.arange(n, **i32), cache, torch.zeros(1, **i32),
                               torch.tensor([0, 1], **i32), torch.tensor([n], **i32), k_scale=scale, v_scale=scale,
                               backend=backend)
    want = reference.quantize_fp8(x, scale, enc).view(torch.uint8)
    assert int((want & 0x7F).count_nonzero()) > 100  # most of them are not rounded to zero
    assert torch.equal(cache[0, 0, :, 0, 0].cpu().view(torch.uint8), want)


@triton.jit
def _quantizer_kernel(x_ptr, out_ptr, n, scale, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, page_kernels._quantize(x, scale, FP8_MAX, out_ptr.dtype.element_ty), mask=i < n)


def test_triton_quantizer_on_float32_values(device):
    """The kernel's quantizer (float32 quotient, saturation, fp8 rounding) on random float32 bit patterns and
    on the exact midpoints between fp8 values (and their float32 neighbours), against the float64 quantizer:
    under the interpreter this checks the encoder workaround, on a GPU the hardware conversion."""
    g = torch.Generator().manual_seed(21)
    rand = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    for enc in FP8_ENCODINGS:
        fmax = reference.FP8_FORMATS[enc][2]
        grid = fp8_grid(enc)
        grid = torch.cat([-grid.flip(0), grid])
        grid = torch.cat([grid, torch.tensor([2 * fmax - grid[-2].item()], dtype=torch.float64)])  # past max
        mids = ((grid[1:] + grid[:-1]) / 2).float()  # exact in float32
        near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, math.inf)),
                          torch.nextafter(mids, torch.full_like(mids, -math.inf))])
        for scale in (1.0, 0.0371):
            s32 = torch.tensor(scale, dtype=torch.float32).double()
            # x / scale within an ulp or two of a midpoint: a reciprocal multiply or an approximate divide
            # would round some of these quotients to the other side
            times = (near.double() * s32).float()
            times = torch.cat([times, torch.nextafter(times, times * 2), torch.nextafter(times, times / 2)])
            x = torch.cat([rand.view(torch.float32), near, times]).to(device)
            out = torch.empty(x.numel(), dtype=enc, device=device)
            block = 1 << 14
            _quantizer_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), scale, FP8_MAX=fmax, BLOCK=block)
            want = reference.quantize_fp8(x.cpu(), scale, enc)
            assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8)), (enc, scale)


def test_get_batch_indices_positions_by_hand(device):
    append_indptr = torch.tensor([0, 1, 3, 3, 6, 10], dtype=I32, device=device)
    seq_lens = torch.tensor([5, 5, 2, 3, 4], dtype=I32, device=device)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, seq_lens, 10)
    assert batch_indices.dtype == I32 and positions.dtype == I32
    assert batch_indices.tolist() == [0, 1, 1, 3, 3, 3, 4, 4, 4, 4]
    assert positions.tolist() == [4, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    # seq_lens are lengths, not an index: int64 ones (FlashInfer's own example passes them) give the same answer
    wide = page.get_batch_indices_positions(append_indptr, seq_lens.long(), 10)
    assert torch.equal(wide[0], batch_indices) and torch.equal(wide[1], positions)
    out_b, out_p = torch.full((10,), -1, dtype=I32, device=device), torch.full((10,), -1, dtype=I32, device=device)
    got = page.get_batch_indices_positions(append_indptr, seq_lens, 10, out_b, out_p)
    assert got[0] is out_b and got[1] is out_p and out_p.tolist() == positions.tolist()
    b, p = page.get_batch_indices_positions(torch.zeros(1, dtype=I32), torch.zeros(0, dtype=I32), 0)
    assert b.shape == (0,) and p.shape == (0,)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_tokens_are_request_minus_one_and_not_written(backend, device):
    """nnz past append_indptr[-1] (a batch padded to a CUDA graph's size): the extra tokens get request -1 and
    position 0, as FlashInfer's, and append_paged_kv_cache skips them: the cache is bitwise the unpadded
    append's (the padded K/V rows hold other values). Once they went to the last request past its pages."""
    g, num_pages, kv_indices, kv_indptr, last, append_indptr, _ = make_batch(7, 4, [2, 9, 5], [3, 0, 2])
    seq_lens = page.get_seq_lens(kv_indptr, last, 4)
    nnz, padded = 5, 8
    b, p = page.get_batch_indices_positions(append_indptr.to(device), seq_lens.to(device), padded)
    want_b, want_p = page.get_batch_indices_positions(append_indptr.to(device), seq_lens.to(device), nnz)
    assert b[:nnz].tolist() == want_b.tolist() and p[:nnz].tolist() == want_p.tolist()
    assert b[nnz:].tolist() == [-1] * 3 and p[nnz:].tolist() == [0] * 3
    key, value = (torch.randn(padded, 2, 64, generator=g).half().to(device) for _ in range(2))
    cache = torch.randn(num_pages, 2, 4, 2, 64, generator=g).half().to(device)
    want = cache.clone()
    tables = [t.to(device) for t in (kv_indices, kv_indptr, last)]
    page.append_paged_kv_cache(key[:nnz], value[:nnz], want_b, want_p, want, *tables, backend=backend)
    page.append_paged_kv_cache(key, value, b, p, cache, *tables, backend=backend)
    assert torch.equal(cache, want)
    if device == "cpu":
        with pytest.raises(ValueError, match="batch_indices holds -2; requests are numbered 0..2, and -1 marks"):
            page.append_paged_kv_cache(key, value, b - 1, p, cache, *tables, backend=backend)


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


def to_fp8(t):
    return t.to(torch.float8_e4m3fn)


def fp8_scales(k_scale, v_scale):
    """16-bit K/V into an fp8 cache with the given scales."""
    return changed(paged_kv_cache=to_fp8, k_scale=lambda _: k_scale, v_scale=lambda _: v_scale)


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
     r"append_key has dtype torch.float16 but paged_kv_cache has torch.float8_e4m3fn; quantizing 16-bit K/V "
     r"into an fp8 cache needs both k_scale and v_scale \(k_scale and v_scale not given\)"),
    (changed(paged_kv_cache=lambda c: c.to(torch.float8_e5m2), k_scale=lambda _: 0.5), ValueError,
     r"needs both k_scale and v_scale \(v_scale not given\)"),
    (changed(k_scale=lambda _: 0.5, v_scale=lambda _: 0.5), ValueError,
     r"k_scale and v_scale given, but append_key and paged_kv_cache are both torch.float16: the values are "
     r"copied as they are and a scale would be ignored"),
    (changed(append_key=to_fp8, append_value=to_fp8, paged_kv_cache=to_fp8, v_scale=lambda _: 2.0), ValueError,
     r"v_scale given, but append_key and paged_kv_cache are both torch.float8_e4m3fn"),
    (changed(append_key=torch.Tensor.float, append_value=torch.Tensor.float, paged_kv_cache=to_fp8,
             k_scale=lambda _: 1.0, v_scale=lambda _: 1.0), ValueError,
     r"append_key has dtype torch.float32 but paged_kv_cache has torch.float8_e4m3fn; appended K/V must have "
     r"the cache's dtype, or be float16/bfloat16 into an fp8 cache"),
    (fp8_scales(0.0, 1.0), ValueError, r"k_scale=0.0 is 0.0 in float32; a scale must be a positive finite"),
    (fp8_scales(1.0, -2.0), ValueError, r"v_scale=-2.0 is -2.0 in float32; a scale must be a positive"),
    (fp8_scales(float("nan"), 1.0), ValueError, r"k_scale=nan is nan in float32"),
    (fp8_scales(1.0, float("inf")), ValueError, r"v_scale=inf is inf in float32"),
    (fp8_scales(1e-50, 1.0), ValueError, r"k_scale=1e-50 is 0.0 in float32"),
    (fp8_scales(1e39, 1.0), ValueError, r"k_scale=1e\+39 is inf in float32"),
    (fp8_scales(10**400, 1.0), ValueError, r"k_scale=1000.* is inf in float32"),
    (fp8_scales("0.5", 1.0), ValueError, r"k_scale must be a Python float or a one-element float32 tensor, got str"),
    (fp8_scales(True, 1.0), ValueError, r"k_scale must be a Python float or a one-element float32 tensor, got bool"),
    (fp8_scales(torch.tensor([0.5], dtype=torch.float64), 1.0), ValueError,
     r"k_scale is a tensor of dtype torch.float64 and shape \(1,\); a tensor scale must be one float32 element"),
    (fp8_scales(1.0, torch.tensor([0.5, 0.5])), ValueError, r"v_scale is a tensor of dtype torch.float32 and shape \(2,\)"),
    (fp8_scales(1.0, torch.tensor(0.0)), ValueError, r"v_scale=0.0; a scale must be a positive finite float32 value"),
    (fp8_scales(torch.tensor([float("inf")]), 1.0), ValueError, r"k_scale=inf; a scale must be a positive finite"),
    (changed(paged_kv_cache=torch.Tensor.float), NotImplementedError,
     r"paged_kv_cache dtype torch.float32 is not served"),
    (changed(paged_kv_cache=lambda c: c[:, 0]), ValueError, r"a single-tensor cache is 5-D"),
    (changed(paged_kv_cache=lambda c: (c[:, 0], c[:, 1, :2])), ValueError, r"both must be the same 4-D shape"),
    (changed(paged_kv_cache=lambda c: (c[:, 0], c[:, 0])), ValueError,
     r"k_cache and v_cache are the same memory, so appending would write V over K"),
    (changed(append_key=lambda t: t[:, :1]), ValueError, r"append_key has shape \(5, 1, 64\); expected \[nnz, 2, 64\]"),
    (changed(positions=first_to(99)), ValueError, r"positions\[0\]=99 for request 0, which owns 1 pages"),
    (changed(batch_indices=first_to(2)), ValueError, r"batch_indices holds 2; requests are numbered 0..1"),
    (changed(kv_indices=first_to(50)), ValueError, r"kv_indices holds page 50 outside the cache's"),
    (changed(positions=first_to(2)), ValueError,
     r"appended tokens 0 and 1 both go to page \d+, slot 2; each slot takes at most one token per call"),
    (changed(kv_last_page_len=first_to(0)), ValueError,
     r"kv_last_page_len\[0\]=0; it must lie in 1..page_size=4 for a request that owns pages"),
    (changed(kv_last_page_len=first_to(5)), ValueError, r"kv_last_page_len\[0\]=5; it must lie in 1..page_size=4"),
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


def test_index_helper_refuses_overlapping_result_buffers():
    """The results are written after the inputs are read (positions after batch_indices): one buffer passed as both,
    or one over an input, would return silently wrong indices."""
    append_indptr = torch.tensor([0, 1, 3], dtype=I32)
    seq_lens = torch.tensor([5, 5], dtype=I32)
    buf = torch.empty(3, dtype=I32)
    with pytest.raises(ValueError, match=r"get_batch_indices_positions: positions overlaps batch_indices; pass the "
                                         r"results in memory of their own"):
        page.get_batch_indices_positions(append_indptr, seq_lens, 3, buf, buf)
    with pytest.raises(ValueError, match=r"batch_indices overlaps append_indptr"):
        page.get_batch_indices_positions(append_indptr, seq_lens, 3, append_indptr[:3], None)
    out = torch.empty(6, dtype=I32)
    batch_indices, positions = page.get_batch_indices_positions(append_indptr, seq_lens, 3, out[:3], out[3:])
    assert batch_indices.tolist() == [0, 1, 1] and positions.tolist() == [4, 3, 4]


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


def test_append_refusal_names_the_index_past_padding():
    """A position outside its request's pages behind a padding token (request -1): the sentence names the entry's
    own index in positions (host tensors: the value checks run on CPU inputs)."""
    i32 = dict(dtype=torch.int32)
    cache = torch.zeros(6, 2, 4, 2, 64, dtype=torch.float16)
    key = torch.randn(2, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"positions\[1\]=99 for request 0, which owns 2 pages"):
        page.append_paged_kv_cache(key, key, torch.tensor([-1, 0], **i32), torch.tensor([0, 99], **i32), cache,
                                   torch.tensor([4, 1, 2], **i32), torch.tensor([0, 2, 3], **i32),
                                   torch.tensor([2, 4], **i32), backend="torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_refuses_two_tokens_for_one_slot_of_a_shared_page(backend):
    """Two requests that share a page (prefix sharing) and append at one position would race for its slot: the cache
    would keep whichever write landed last. The sentence names the tokens' own indices (padding counted)."""
    i32 = dict(dtype=torch.int32)
    cache = torch.zeros(4, 2, 4, 2, 64, dtype=torch.float16)
    key = torch.randn(3, 2, 64, dtype=torch.float16)
    args = (torch.tensor([0, -1, 1], **i32), torch.tensor([5, 0, 5], **i32), cache, torch.tensor([1, 3, 2, 3], **i32),
            torch.tensor([0, 2, 4], **i32), torch.tensor([2, 2], **i32))
    with pytest.raises(ValueError, match=r"appended tokens 0 and 2 both go to page 3, slot 1"):
        page.append_paged_kv_cache(key, key, *args, backend=backend)
    assert not cache.any()
