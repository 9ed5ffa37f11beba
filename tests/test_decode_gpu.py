"""Decode on the GPU at real sizes (KV to 128k, batch to 256) and under CUDA graph capture and replay."""
import zlib

import pytest
import torch

import serveattn
from serveattn import decode as decode_mod
from serveattn import reference
from helpers import check_lse, fp8_decode_runs, make_paged_batch, nan_like, rel_err

pytestmark = pytest.mark.gpu

CASES = [
    # (name, batch, max_kv, hq, hkv, head_dim)
    ("b1-kv128k", 1, 131072, 32, 8, 128),
    ("b256-kv2k", 256, 2048, 32, 8, 128),
    ("b16-kv32k-d64", 16, 32768, 16, 2, 64),
    ("b8-kv16k-d256-mqa", 8, 16384, 8, 1, 256),
    ("b64-kv8k-mha", 64, 8192, 8, 8, 128),
]


@pytest.mark.parametrize("use_tensor_cores", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decode_real_sizes(case, use_tensor_cores):
    name, batch, max_kv, hq, hkv, d = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    kv_lens = [max_kv] + [int(x) for x in torch.randint(0, max_kv + 1, (batch - 1,), generator=gen)]
    b = make_paged_batch(gen, qo_lens=[1] * batch, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                         page_size=16, dtype=torch.bfloat16, device="cuda")
    # backend="triton": use_tensor_cores taken literally (under "auto" the routing table may take tensor cores
    # for use_tensor_cores=False at large batch; tests/test_routing_gpu.py covers that)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                     use_tensor_cores=use_tensor_cores, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, 16, q_data_type=torch.bfloat16)
    out = nan_like(b.q.shape, torch.bfloat16, "cuda")
    lse = nan_like(b.q.shape[:2], torch.float32, "cuda")
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse)
    out2, lse2 = w.run(b.q, b.cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def _table(gen, kv_lens, num_pages, page_size=16):
    n = [(k + page_size - 1) // page_size for k in kv_lens]
    indices = torch.randperm(num_pages, generator=gen)[: sum(n)].to(torch.int32)
    indptr = torch.tensor([0] + torch.cumsum(torch.tensor(n), 0).tolist(), dtype=torch.int32)
    last = torch.tensor([k - (m - 1) * page_size if m else 0 for k, m in zip(kv_lens, n)], dtype=torch.int32)
    return indptr.cuda(), indices.cuda(), last.cuda()


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_cuda_graph_replay_with_changing_page_tables(use_tensor_cores):
    gen = torch.Generator().manual_seed(31)
    batch, hq, hkv, d, ps, num_pages = 32, 32, 8, 128, 16, 12000
    cache = torch.randn(num_pages, 2, ps, hkv, d, generator=gen).to(torch.bfloat16).cuda()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    indptr_buf = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
    indices_buf = torch.empty(num_pages, dtype=torch.int32, device="cuda")
    last_buf = torch.empty(batch, dtype=torch.int32, device="cuda")
    # backend="triton": each route exactly as use_tensor_cores names it (auto may take the tensor-core route
    # for the bandwidth kernel at this batch)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                                                     paged_kv_indptr_buffer=indptr_buf,
                                                     paged_kv_indices_buffer=indices_buf,
                                                     paged_kv_last_page_len_buffer=last_buf, backend="triton")
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device="cuda")

    def plan(kv_lens):
        table = _table(gen, kv_lens, num_pages)
        w.plan(*table, hq, hkv, d, ps, q_data_type=torch.bfloat16)
        return table

    table = plan([int(x) for x in torch.randint(1, 3000, (batch,), generator=gen)])
    if not use_tensor_cores:  # each program of the fixed grid reads a first work item before it knows the count
        assert w._graph_bufs["work"].numel() >= decode_mod.ITEM_INTS * decode_mod._grid_programs(q.device)
    w.run(q, cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out, lse=lse, return_lse=True)
    for step, kv_max in enumerate([3000, 40, 5500, 1]):
        kv_lens = [int(x) for x in torch.randint(1, kv_max + 1, (batch,), generator=gen)]
        if step == 2:
            kv_lens[0] = 0  # an empty request in a replay
        table = plan(kv_lens)
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        qo = torch.arange(batch + 1, dtype=torch.int32)
        ref_out, ref_lse = reference.batch_paged(q, cache, qo, *table)
        assert rel_err(out, ref_out) < 1e-2, step
        check_lse(lse, ref_lse)
    good_out, good_lse = out.clone(), lse.clone()
    # a rejected re-plan with another page table leaves the captured state replayable as it was
    bad_indptr, bad_indices, bad_last = _table(gen, [100] * batch, num_pages)
    bad_last[5] = 17
    with pytest.raises(ValueError, match="plan: last_page_len\\[5\\]=17"):
        w.plan(bad_indptr, bad_indices, bad_last, hq, hkv, d, ps, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="use_cuda_graph=True"):
        w.plan(*table, hq, hkv, d, ps, q_data_type=torch.bfloat16, logits_soft_cap=5.0)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, good_out) and torch.equal(lse, good_lse)


def _compiled_variants(jit_fn) -> int:
    return sum(len(caches[0]) for caches in jit_fn.device_caches.values())


def test_batch_sizes_share_one_compiled_kernel():
    """A serving loop's batch size moves every step: the plan's arrays keep their 16-byte alignment whatever the
    batch (staging._ALIGN), so Triton compiles one decode kernel variant, not one per alignment pattern."""
    from serveattn.kernels import decode as decode_kernels
    gen = torch.Generator().manual_seed(77)
    hq, hkv, d = 32, 8, 128
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                     backend="triton")
    before = None
    for batch in (2, 3, 5, 6, 7, 9, 13, 17):  # from 2: one request alone pipelines deeper (decode.SMALL_BATCH)
        kv_lens = [int(x) for x in torch.randint(1, 300, (batch,), generator=gen)]
        b = make_paged_batch(gen, qo_lens=[1] * batch, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                             head_dim=d, page_size=16, dtype=torch.bfloat16, device="cuda")
        # unsplit at every batch: the split (fused merge) is another variant by design
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, 16, q_data_type=torch.bfloat16,
               disable_split_kv=True)
        out = w.run(b.q, b.cache)
        torch.cuda.synchronize()
        ref_out, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)
        assert rel_err(out, ref_out) < 1e-2
        if before is None:
            before = _compiled_variants(decode_kernels.decode_kernel)
    assert _compiled_variants(decode_kernels.decode_kernel) == before, "a batch size compiled a new decode variant"


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_replans_of_one_wrapper_equal_fresh_wrappers(use_tensor_cores):
    """One wrapper planned step after step (its arrays copied into the buffer it keeps, staging.Kept) with a run
    queued behind a busy stream after each plan: every run bitwise equal to a fresh wrapper's on the same batch,
    the batch growing, shrinking and growing past the rooms it had."""
    gen = torch.Generator().manual_seed(37)
    hq, hkv, d, ps, num_pages = 32, 8, 128, 16, 6000
    cache = torch.randn(num_pages, 2, ps, hkv, d, generator=gen).to(torch.bfloat16).cuda()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kept_w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=use_tensor_cores, backend="triton")
    big = torch.randn(4096, 4096, device="cuda")
    outs, wanted = [], []
    for batch in (16, 17, 3, 64, 64, 1, 96):
        kv_lens = [int(x) for x in torch.randint(0, 1500, (batch,), generator=gen)]
        kv_lens[0] = max(kv_lens[0], 1)
        table = _table(gen, kv_lens, num_pages)
        q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16).cuda()
        big @ big  # the plan's copy and the run queue behind it
        kept_w.plan(*(t.cpu() for t in table), hq, hkv, d, ps, q_data_type=torch.bfloat16)
        outs.append(kept_w.run(q, cache))
        fresh = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty_like(ws),
                                                             use_tensor_cores=use_tensor_cores, backend="triton")
        fresh.plan(*(t.cpu() for t in table), hq, hkv, d, ps, q_data_type=torch.bfloat16)
        wanted.append(fresh.run(q, cache))
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(outs, wanted)):
        assert torch.equal(got, want), i


@pytest.mark.parametrize("pages", [65536, 65537], ids=["fits-int32", "past-int32"])
def test_pages_at_the_end_of_a_cache_past_2_31_elements(pages, monkeypatch):
    """A cache of pages x 2 x 16 x 8 x 128 bf16 (4.3 GB): at 65536 pages the K view's last element sits at 2^31 -
    16385 (int32 offsets, kernels/attention.fits_int32), at 65537 past 2^31 (int64 offsets). Requests whose pages
    are the cache's last ones (the largest offsets) give the reference on the bandwidth kernel (its offsets follow
    the rule) and on the tensor-core route, and so does a causal prefill on both prefill kernels."""
    from serveattn.kernels.attention import fits_int32
    gen = torch.Generator(device="cuda").manual_seed(pages)
    cache = torch.empty((pages, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    assert fits_int32(cache[:, 0]) == (pages == 65536)
    used = torch.arange(pages - 64, pages, dtype=torch.int32, device="cuda")  # the last 64 pages, two requests
    used = used[torch.randperm(64, generator=gen, device="cuda")]
    cache[used.long()] = torch.randn((64, 2, 16, 8, 128), generator=gen, device="cuda").to(torch.bfloat16)
    indptr = torch.tensor([0, 40, 64], dtype=torch.int32, device="cuda")
    last = torch.tensor([16, 5], dtype=torch.int32, device="cuda")
    q = torch.randn((2, 32, 128), generator=gen, device="cuda").to(torch.bfloat16)
    ref_out, ref_lse = reference.batch_paged(q, cache, torch.arange(3, dtype=torch.int32, device="cuda"), indptr,
                                             used, last)
    for tensor_cores in (False, True):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                         use_tensor_cores=tensor_cores, backend="triton")
        w.plan(indptr, used, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        out, lse = nan_like(q.shape, torch.bfloat16, "cuda"), nan_like(q.shape[:2], torch.float32, "cuda")
        w.run(q, cache, out=out, lse=lse, return_lse=True)
        assert not out.isnan().any()
        assert rel_err(out, ref_out) < 1e-2
        check_lse(lse, ref_lse)
    # causal prefill of 128 and 37 queries over the same pages: prefill_kernel's 64-row tiles take int32 offsets
    # where the cache fits (PREFILL_OFF32_MIN_ROWS), and the warp-specialized kernel
    qo_indptr = torch.tensor([0, 128, 165], dtype=torch.int32, device="cuda")
    q = torch.randn((165, 32, 128), generator=gen, device="cuda").to(torch.bfloat16)
    ref_out, ref_lse = reference.batch_paged(q, cache, qo_indptr, indptr, used, last, causal=True)
    for ws in ("0", "1"):
        monkeypatch.setenv("SERVEATTN_PREFILL_WS", ws)
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                          backend="triton")
        w.plan(qo_indptr, indptr, used, last, 32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16)
        out, lse = nan_like(q.shape, torch.bfloat16, "cuda"), nan_like(q.shape[:2], torch.float32, "cuda")
        w.run(q, cache, out=out, lse=lse, return_lse=True)
        assert not out.isnan().any(), ws
        assert rel_err(out, ref_out) < 1e-2, ws
        check_lse(lse, ref_lse)
    del cache
    torch.cuda.empty_cache()


def _serving_batch(seed: str, q_len: int, spread: int):
    """64 requests of q_len bf16 rows, one of 4096 keys and the rest random up to it (split and unsplit), GQA 32/8,
    head dim 128, pages of 16 (a float32 cache, to be cast); each row's query scaled by 2^-spread..2^spread."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    batch = 64
    kv_lens = [4096] + [int(x) for x in torch.randint(q_len, 4097, (batch - 1,), generator=gen)]
    b = make_paged_batch(gen, qo_lens=[q_len] * batch, kv_lens=kv_lens, num_qo_heads=32, num_kv_heads=8,
                         head_dim=128, page_size=16, dtype=torch.float32, device="cuda")
    scale = 2.0 ** torch.randint(-spread, spread + 1, (batch * q_len, 32, 1), generator=gen).float()
    b.q = (b.q * scale.cuda()).to(torch.bfloat16)
    return b


@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_len", [1, 4], ids=["decode", "chain4"])
def test_f16_scores_at_real_sizes_keep_the_dequantized_bits(enc, q_len, monkeypatch):
    """SERVEATTN_DECODE_F16_SCORES (kernels/decode.F16_SCORES) at serving sizes (64 requests to 4096 keys, GQA 32/8,
    head dim 128, split and unsplit requests): the f16 product of an exact query tile sums as the bf16 product on the
    dequantized cache, bit for bit, and so does the switch-off run; queries spread over f16's range (x 2^-12 to
    x 2^12) with a few inexact tiles (a value below f16's precision) for the bf16 branch."""
    from serveattn.kernels import decode as decode_kernel
    b = _serving_batch(f"f16-real-{enc}-{q_len}", q_len, 12)
    batch = 64
    b.q[::7, ::5, 3] = (1 + 2.0 ** -7) * 2.0 ** -20  # inexact in f16 (a bit at 2^-27): those tiles take the bf16 branch
    tiles = (b.q.to(torch.float16).to(torch.bfloat16) == b.q).view(batch, q_len, 8, 4, 128).permute(0, 2, 1, 3, 4)
    exact = tiles.flatten(2).all(2)  # per (request, KV head): the f16 branch where True
    assert exact.any() and not exact.all()
    b.cache = (b.cache * 4).to(enc)
    results = fp8_decode_runs(monkeypatch, decode_kernel, [{"F16_SCORES": False}, {"F16_SCORES": True}], b, enc,
                              (32, 8), 128, q_len, "cuda")
    out, lse = results[1, enc]
    assert not out.isnan().any() and not lse.isnan().any()
    for other in (results[0, enc], results[1, torch.bfloat16], results[0, torch.bfloat16]):
        assert torch.equal(out, other[0]) and torch.equal(lse, other[1])
