"""The prefill family on the GPU at real sizes, and under CUDA graph capture and replay."""
import zlib

import pytest
import torch

import serveattn
from serveattn import reference
from helpers import check_lse, make_paged_batch, nan_like, rel_err, tolerance

pytestmark = pytest.mark.gpu

BIG = [
    # (name, qo_lens, kv_lens, hq, hkv, head_dim, opts)
    ("batch64-causal", None, None, 32, 8, 128, {"causal": True}),
    ("kv32k-causal-d64", [512], [32768], 8, 2, 64, {"causal": True}),
    ("kv32k-window-d128", [256], [32768], 8, 1, 128, {"causal": True, "window_left": 4000}),
    ("kv16k-softcap-d256", [300], [16384], 8, 2, 256, {"causal": True, "logits_soft_cap": 30.0}),
    ("prefill8k-causal", [8192], [8192], 8, 2, 128, {"causal": True}),
    ("prefill4k-rope", [4096], [4096], 8, 8, 128, {"causal": True, "pos_encoding_mode": "ROPE_LLAMA",
                                                   "rope_theta": 5e5}),
    ("ragged-noncausal-d256", [700, 1, 0, 64], [2000, 5000, 17, 64], 16, 4, 256, {}),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", BIG, ids=[c[0] for c in BIG])
def test_real_sizes_against_reference(case, dtype):
    name, qo_lens, kv_lens, hq, hkv, head_dim, opts = case
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}{dtype}".encode()))
    if qo_lens is None:  # batch 64 of mixed lengths up to 4k keys
        qo_lens = torch.randint(1, 65, (64,), generator=gen).tolist()
        kv_lens = [q + int(torch.randint(0, 4033, (1,), generator=gen)) for q in qo_lens]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                         head_dim=head_dim, page_size=16, dtype=dtype, device="cuda")
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, head_dim, 16, q_data_type=dtype,
           **opts)
    assert w.backend == "triton"
    out = nan_like(b.q.shape, dtype, "cuda")
    lse = nan_like(b.q.shape[:2], torch.float32, "cuda")
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices,
                                             b.last_page_len, **opts)
    assert rel_err(out, ref_out) < tolerance(dtype)
    check_lse(lse, ref_lse)
    out2, lse2 = w.run(b.q, b.cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def _graph_wrapper(b, hq, hkv, head_dim, capacity_pages, batch_capacity):
    ws = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    bufs = dict(
        qo_indptr_buf=torch.empty(batch_capacity + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indptr_buf=torch.empty(batch_capacity + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buf=torch.empty(capacity_pages, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buf=torch.empty(batch_capacity, dtype=torch.int32, device="cuda"))
    return serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True, **bufs)


def test_cuda_graph_capture_replay_and_replan():
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, ps = 32, 8, 128, 16
    qo_lens, kv_lens = [1, 1, 1, 1, 1, 1, 1, 1], [300, 1000, 17, 4096, 1, 64, 2000, 900]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                         page_size=ps, dtype=torch.bfloat16, device="cuda", spare_pages=400)
    w = _graph_wrapper(b, hq, hkv, d, capacity_pages=b.kv_indices.numel() + 400, batch_capacity=8)
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, ps, causal=True,
           q_data_type=torch.bfloat16)
    q = b.q.clone()
    out = torch.empty_like(q)
    w.run(q, b.cache, out=out)  # warm-up compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, b.cache, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = reference.batch_paged(q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, causal=True)
    assert rel_err(out, ref) < 1e-2

    # re-plan with another, longer page table into the same buffers; new queries in the captured q
    kv2 = [4000, 16, 333, 1200, 64, 5000, 2, 700]
    pages_needed = sum((k + ps - 1) // ps for k in kv2)
    perm = torch.randperm(b.cache.shape[0], generator=gen)[:pages_needed]
    indptr2 = torch.tensor([0] + torch.cumsum(torch.tensor([(k + ps - 1) // ps for k in kv2]), 0).tolist(),
                           dtype=torch.int32, device="cuda")
    last2 = torch.tensor([k - ((k + ps - 1) // ps - 1) * ps for k in kv2], dtype=torch.int32, device="cuda")
    idx2 = perm.to(torch.int32).cuda()
    w.plan(b.qo_indptr, indptr2, idx2, last2, hq, hkv, d, ps, causal=True, q_data_type=torch.bfloat16)
    q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref2, _ = reference.batch_paged(q, b.cache, b.qo_indptr, indptr2, idx2, last2, causal=True)
    assert rel_err(out, ref2) < 1e-2
    good = out.clone()

    # a rejected re-plan (different page table, then a late error) leaves the buffers as they were
    with pytest.raises(ValueError, match="kv_len=1 < qo_len=2"):
        bad_qo = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 8], dtype=torch.int32, device="cuda")  # request 6: 2 rows
        w.plan(bad_qo, indptr2, torch.flip(idx2, [0]), torch.ones_like(last2), hq, hkv, d, ps, causal=True,
               q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="use_cuda_graph=True"):
        w.plan(b.qo_indptr, indptr2, idx2, last2, hq, hkv, d, ps, causal=False, q_data_type=torch.bfloat16)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, good)


def test_ragged_cuda_graph_replay():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(96, 16, 64, generator=gen).to(torch.float16).cuda()
    k = torch.randn(600, 4, 64, generator=gen).to(torch.float16).cuda()
    v = torch.randn(600, 4, 64, generator=gen).to(torch.float16).cuda()
    ws = torch.empty(1 << 22, dtype=torch.uint8, device="cuda")
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, use_cuda_graph=True)
    qo = torch.tensor([0, 32, 64, 96], dtype=torch.int32)
    kv = torch.tensor([0, 100, 400, 600], dtype=torch.int32)
    w.plan(qo, kv, 16, 4, 64, causal=True, q_data_type=torch.float16)
    out = torch.empty_like(q)
    w.run(q, k, v, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, k, v, out=out)
    kv2 = torch.tensor([0, 300, 350, 600], dtype=torch.int32)
    w.plan(qo, kv2, 16, 4, 64, causal=True, q_data_type=torch.float16)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref, _ = reference.batch_ragged(q, k, v, qo, kv2, causal=True)
    assert rel_err(out, ref) < 2e-3
