"""kernels/launch.py's fast path on the GPU (SERVEATTN_FAST_LAUNCH=1, flipped here through launch.ENABLED): decode
and prefill outputs bitwise those of Triton's own launch path, repeatably, the second call taking the cache, and an
argument of another alignment class taking a new entry and still right."""
import zlib

import pytest
import torch

import serveattn
from serveattn.kernels import attention, decode, gather
from serveattn.kernels import launch as fast
from helpers import make_paged_batch, nan_like

pytestmark = pytest.mark.gpu


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def triton_path_calls(monkeypatch):
    """Counts, per kernel, the launches that went through JITFunction.run (Triton's own path)."""
    calls = {}
    kernels = [decode.decode_kernel, decode.merge_kernel, attention.prefill_kernel, attention.split_merge_kernel,
               attention.transpose_v_kernel,
               gather.gather_widen_kernel]
    if attention.attention_ws is not None:
        kernels.append(attention.attention_ws.prefill_ws_kernel)
    for jit_fn in kernels:
        real = jit_fn.run

        def counted(*args, _real=real, _name=jit_fn.fn.__name__, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(jit_fn, "run", counted)
    return calls


def _off_on_on(monkeypatch, calls, run):
    """run() on Triton's path, then twice on the fast path: all three bitwise equal, the second fast call a hit."""
    monkeypatch.setattr(fast, "ENABLED", False)
    ref = run()
    monkeypatch.setattr(fast, "ENABLED", True)
    first = run()
    before = dict(calls)
    second = run()
    assert calls == before, f"the second call went through Triton's path: {before} -> {calls}"
    assert not torch.isnan(ref[0]).any(), "an output element was not written"
    for r, a, b in zip(ref, first, second):
        assert torch.equal(r, a) and torch.equal(r, b), "the fast path changed the bits"
    return ref


DECODE_CASES = [
    # (name, kv_lens, hq, hkv, head_dim): one long request (split, merged), a mixed batch, many short ones
    ("b1-kv16k", [16384], 32, 8, 128),
    ("b9-mixed", [3000, 0, 17, 900, 4096, 1, 2048, 333, 64], 32, 8, 128),
    ("b64-d64-mha", [500] * 64, 8, 8, 64),
]


def _decode_wrapper(b, hq, hkv, d, use_tensor_cores):
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                     use_tensor_cores=use_tensor_cores, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, 16, q_data_type=torch.bfloat16)
    return w


def _decode_run(w, q, cache):
    def run():
        out = nan_like(q.shape, torch.bfloat16, "cuda")
        lse = nan_like(q.shape[:2], torch.float32, "cuda")
        w.run(q, cache, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        return out, lse
    return run


@pytest.mark.parametrize("use_tensor_cores", [False, True])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_bitwise(case, use_tensor_cores, monkeypatch, triton_path_calls):
    name, kv_lens, hq, hkv, d = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    b = make_paged_batch(gen, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                         head_dim=d, page_size=16, dtype=torch.bfloat16, device="cuda")  # shuffled pages
    w = _decode_wrapper(b, hq, hkv, d, use_tensor_cores)
    _off_on_on(monkeypatch, triton_path_calls, _decode_run(w, b.q, b.cache))


def _unaligned_copy(x):
    """x's values in a tensor whose data_ptr is 2 bytes past a 16-byte boundary (one bf16 element)."""
    y = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)[1:1 + x.numel()].view(x.shape)
    y.copy_(x)
    assert y.data_ptr() % 16
    return y


def _entries(jit_fn):
    launches = fast._launches_of(jit_fn)
    return set(launches.entries) if launches else set()


def _near(aligned, unaligned):
    """The same values through another specialization (load vectorization, or q by pointer instead of TMA in the
    warp-specialized kernel): the same result up to rounding order at most."""
    for a, u in zip(aligned, unaligned):
        torch.testing.assert_close(u, a, rtol=2e-2, atol=2e-2)


def test_decode_alignment_change_takes_a_new_entry(monkeypatch, triton_path_calls):
    gen = torch.Generator().manual_seed(5)
    kv_lens = [700, 2000, 33]
    b = make_paged_batch(gen, qo_lens=[1] * 3, kv_lens=kv_lens, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         page_size=16, dtype=torch.bfloat16, device="cuda")
    w = _decode_wrapper(b, 32, 8, 128, False)
    aligned = _off_on_on(monkeypatch, triton_path_calls, _decode_run(w, b.q, b.cache))
    before = _entries(decode.decode_kernel)
    unaligned = _off_on_on(monkeypatch, triton_path_calls, _decode_run(w, _unaligned_copy(b.q), b.cache))
    assert _entries(decode.decode_kernel) - before, "an unaligned q took the aligned q's entry"
    _near(aligned, unaligned)


def _prefill_paged(b, hq, hkv, d, kv_data_type=None, q_data_type=torch.bfloat16):
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                       b.kv_layout)
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, b.page_size, causal=True,
           q_data_type=q_data_type, kv_data_type=kv_data_type)
    return w


def _prefill_run(w, q, *kv, **run_kwargs):
    def run():
        out = nan_like(q.shape, torch.bfloat16, "cuda")
        lse = nan_like(q.shape[:2], torch.float32, "cuda")
        w.run(q, *kv, out=out, lse=lse, return_lse=True, **run_kwargs)
        torch.cuda.synchronize()
        return out, lse
    return run


@pytest.mark.parametrize("warp_specialized", ["1", "0"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-cache", "fp8-attention"])
def test_prefill_paged_bitwise(kind, warp_specialized, monkeypatch, triton_path_calls):
    """Paged prefill over shuffled pages: bf16, an fp8 cache (widened by gather_widen_kernel for the
    warp-specialized kernel), fp8 attention (V transposed by transpose_v_kernel)."""
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", warp_specialized)
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    b = make_paged_batch(gen, qo_lens=[600, 31, 0, 200], kv_lens=[900, 2000, 40, 200], num_qo_heads=16,
                         num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16, tuple_cache=True,
                         device="cuda")
    if kind == "bf16":
        run = _prefill_run(_prefill_paged(b, 16, 4, 128), b.q, b.cache)
    elif kind == "fp8-cache":
        fp8 = torch.float8_e4m3fn
        k8, v8 = (t.to(fp8) for t in b.cache)
        run = _prefill_run(_prefill_paged(b, 16, 4, 128, kv_data_type=fp8), b.q, (k8, v8), k_scale=0.5,
                           v_scale=3.0)
    else:
        enc = torch.float8_e4m3fn
        q8 = b.q.to(enc)
        k8, v8 = (t.to(enc) for t in b.cache)
        scales = {name: torch.full((1,), s, device="cuda") for name, s in (("scale_q", 0.5), ("scale_k", 0.25),
                                                                           ("scale_v", 2.0))}
        run = _prefill_run(_prefill_paged(b, 16, 4, 128, kv_data_type=enc, q_data_type=enc), q8, (k8, v8), **scales)
    _off_on_on(monkeypatch, triton_path_calls, run)


@pytest.mark.parametrize("warp_specialized", ["1", "0"])
def test_prefill_ragged_bitwise_and_alignment(warp_specialized, monkeypatch, triton_path_calls):
    """Ragged prefill (the 512-token shape of the host probe, and a batch), then q 2 bytes off a 16-byte
    boundary: a new entry of the launched kernel, and the aligned run's bits."""
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", warp_specialized)
    gen = torch.Generator().manual_seed(9)
    for qo_lens, kv_lens in (([512], [512]), ([300, 1, 77, 0], [700, 1, 900, 13])):
        i32 = dict(dtype=torch.int32, device="cuda")
        qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), **i32)
        kv_indptr = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), **i32)
        q = torch.randn(sum(qo_lens), 32, 128, generator=gen).to(torch.bfloat16).cuda()
        k = torch.randn(sum(kv_lens), 8, 128, generator=gen).to(torch.bfloat16).cuda()
        v = torch.randn(sum(kv_lens), 8, 128, generator=gen).to(torch.bfloat16).cuda()
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
        w.plan(qo_indptr, kv_indptr, 32, 8, 128, causal=True, q_data_type=torch.bfloat16)
        aligned = _off_on_on(monkeypatch, triton_path_calls, _prefill_run(w, q, k, v))
    kernels = [attention.prefill_kernel]
    if attention.attention_ws is not None:
        kernels.append(attention.attention_ws.prefill_ws_kernel)
    before = [_entries(jit_fn) for jit_fn in kernels]
    unaligned = _off_on_on(monkeypatch, triton_path_calls, _prefill_run(w, _unaligned_copy(q), k, v))
    assert any(_entries(jit_fn) - old for jit_fn, old in zip(kernels, before)), "an unaligned q took an aligned entry"
    _near(aligned, unaligned)


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
def test_warp_specialized_kernel_takes_the_fast_path(monkeypatch, triton_path_calls):
    """The Gluon kernel (host TensorDescriptor arguments) is cached too: a second call skips JITFunction.run."""
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "1")
    monkeypatch.setenv("SERVEATTN_PREFILL_GATHER", "0")
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT", "0")  # one request of 256 rows would split (its own route)
    gen = torch.Generator().manual_seed(17)
    b = make_paged_batch(gen, qo_lens=[256], kv_lens=[1024], num_qo_heads=16, num_kv_heads=4, head_dim=128,
                         page_size=16, dtype=torch.bfloat16, tuple_cache=True, device="cuda")
    _off_on_on(monkeypatch, triton_path_calls, _prefill_run(_prefill_paged(b, 16, 4, 128), b.q, b.cache))
    assert fast._launches_of(attention.attention_ws.prefill_ws_kernel).entries
    assert triton_path_calls.get("prefill_ws_kernel", 0) >= 1  # the off call at least


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
def test_warp_specialized_descriptors_follow_the_tensors(monkeypatch, triton_path_calls):
    """The fast path keeps the CUtensorMap of each descriptor it has encoded (launch._descriptor_launcher): two
    caches and two queries of one shape, taken in turn through one plan, give each pair's own result, bitwise
    Triton's own launch of that pair, however often the pairs alternate."""
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "1")
    monkeypatch.setenv("SERVEATTN_PREFILL_GATHER", "0")
    gen = torch.Generator().manual_seed(23)
    b = make_paged_batch(gen, qo_lens=[300, 77], kv_lens=[700, 900], num_qo_heads=16, num_kv_heads=4,
                         head_dim=128, page_size=16, dtype=torch.bfloat16, tuple_cache=True, device="cuda")
    w = _prefill_paged(b, 16, 4, 128)
    pairs = [(b.q, b.cache), (torch.randn_like(b.q), tuple(torch.randn_like(t) for t in b.cache))]
    monkeypatch.setattr(fast, "ENABLED", False)
    expected = [_prefill_run(w, q, cache)() for q, cache in pairs]
    monkeypatch.setattr(fast, "ENABLED", True)
    for i in [0, 1, 1, 0, 1, 0, 0]:
        got = _prefill_run(w, *pairs[i])()
        assert all(torch.equal(e, g) for e, g in zip(expected[i], got)), f"pair {i} got another pair's bits"
    assert not torch.equal(expected[0][0], expected[1][0])
    entries = fast._launches_of(attention.attention_ws.prefill_ws_kernel).entries
    assert any(e[0] is not e[4].run for e in entries.values()), "the descriptor launcher was not taken"

