"""backend='auto' on the GPU: the cuDNN route's numbers and base-2 LSE against the float64 reference, its
determinism, auto picking it (and the decode kernels) where the measured table says, and the same numbers
whichever route auto picks."""
import pytest
import torch

import serveattn
from serveattn import reference, routing, vendor
from helpers import check_lse, make_paged_batch, nan_like, rel_err, tolerance

pytestmark = pytest.mark.gpu
I32 = torch.int32


def _ragged(batch, qo_len, kv_len, hq, hkv, d, dtype, layout="NHD", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch * qo_len, hq, d, generator=gen).to(dtype).cuda()
    k = torch.randn(batch * kv_len, hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(batch * kv_len, hkv, d, generator=gen).to(dtype).cuda()
    qo = torch.arange(batch + 1, dtype=I32, device="cuda") * qo_len
    kv = torch.arange(batch + 1, dtype=I32, device="cuda") * kv_len
    kk, vv = (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()) if layout == "HND" else (k, v)
    return q, k, v, kk, vv, qo, kv


def _wrapper(layout="NHD", backend="auto"):
    return serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                          layout, backend=backend)


def _plan_cudnn(w, qo, kv, hq, hkv, d, causal, dtype):
    """Plans on the cuDNN route, or skips with the route's own reason (torch without it, an old cuDNN)."""
    try:
        with routing.forced(prefill="cudnn"):
            w.plan(qo, kv, hq, hkv, d, causal=causal, q_data_type=dtype)
    except NotImplementedError as exc:
        pytest.skip(f"the cuDNN route is not capable here: {exc}")
    assert w.backend == "cudnn"


CASES = [
    # (batch, qo_len, kv_len, hq, hkv, head_dim, causal)
    (1, 300, 300, 8, 8, 128, True),
    (3, 257, 257, 32, 8, 128, True),
    (2, 64, 333, 16, 2, 64, False),
    (4, 129, 129, 8, 1, 64, True),
]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}-q{c[1]}-kv{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-{'c' if c[6] else 'n'}"
                                            for c in CASES])
def test_cudnn_route_against_the_reference(case, dtype, layout):
    batch, qo_len, kv_len, hq, hkv, d, causal = case
    q, k, v, kk, vv, qo, kv = _ragged(batch, qo_len, kv_len, hq, hkv, d, dtype, layout)
    w = _wrapper(layout)
    _plan_cudnn(w, qo, kv, hq, hkv, d, causal, dtype)
    ref, ref_lse = reference.batch_ragged(q, k, v, qo, kv, causal=causal)
    out, lse = w.run(q, kk, vv, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(out, ref) < tolerance(dtype)
    check_lse(lse, ref_lse)  # base 2
    again = w.run(q, kk, vv, return_lse=True)  # a fixed shape: the same bits
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    # the caller's buffers, every element written; scales as floats and as one-element tensors
    ref_s, ref_s_lse = reference.batch_ragged(q, k, v, qo, kv, causal=causal, k_scale=0.5, v_scale=2.0)
    for ks, vs in ((0.5, 2.0), (torch.tensor([0.5], device="cuda"), torch.tensor([2.0], device="cuda"))):
        o, l_ = nan_like(q.shape, dtype, "cuda"), nan_like(q.shape[:2], torch.float32, "cuda")
        w.run(q, kk, vv, out=o, lse=l_, return_lse=True, k_scale=ks, v_scale=vs)
        assert rel_err(o, ref_s) < tolerance(dtype)
        check_lse(l_, ref_s_lse)
    assert w.backend == "cudnn"  # nothing fell back


def test_cudnn_route_with_a_device_k_scale_never_waits():
    """cuDNN takes the logits' scale as a host float: a k_scale on the device would be read back (a wait for the
    GPU, where run() only launches), so such a call runs our kernel on the plan's schedule instead, allocating
    nothing into the caller's buffer; the route stays cuDNN's."""
    q, k, v, kk, vv, qo, kv = _ragged(2, 300, 300, 32, 8, 128, torch.bfloat16, seed=9)
    w = _wrapper()
    _plan_cudnn(w, qo, kv, 32, 8, 128, True, torch.bfloat16)
    ks, vs = torch.tensor([0.5], device="cuda"), torch.tensor([2.0], device="cuda")
    out = nan_like(q.shape, torch.bfloat16, "cuda")
    w.run(q, kk, vv, out=out, k_scale=ks, v_scale=vs)  # the first call builds its launch state
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.run(q, kk, vv, out=out, k_scale=ks, v_scale=vs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated
    ref, _ = reference.batch_ragged(q, k, v, qo, kv, causal=True, k_scale=0.5, v_scale=2.0)
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
    assert w.backend == "cudnn"


def test_auto_picks_cudnn_where_the_table_says():
    cap = torch.cuda.get_device_capability()
    table = routing.table_for(cap)
    hq, hkv, d, dtype, seq = 32, 8, 128, torch.bfloat16, 2048
    q, k, v, _, _, qo, kv = _ragged(1, seq, seq, hq, hkv, d, dtype, seed=5)
    w = _wrapper()
    w.plan(qo, kv, hq, hkv, d, causal=True, q_data_type=dtype)
    gate = vendor.torch_declines(routing.Request(q_dtype=dtype, kv_dtype=dtype, o_dtype=dtype, head_dim=d,
                                                 num_qo_heads=hq, num_kv_heads=hkv, causal=True, batch=1,
                                                 min_qo_len=seq, max_qo_len=seq, min_kv_len=seq, max_kv_len=seq),
                                 "cuda")
    key = ("bfloat16", d, hq // hkv, True)
    min_rows = table.cudnn_min_rows.get(key) if table else None
    max_rows = table.cudnn_max_rows.get(key) if table else None
    if table is None:
        assert w.backend == "triton" and w.backend_fallback_reason == routing.unmeasured_arch("cudnn")
    elif min_rows is None or seq < min_rows or (max_rows is not None and seq >= max_rows):
        assert w.backend == "triton"
    elif gate is not None:
        assert w.backend == "triton" and w.backend_fallback_reason == gate
    else:
        assert w.backend == "cudnn" and w.backend_fallback_reason is None
    out, lse = w.run(q, k, v, return_lse=True)
    t = _wrapper(backend="triton")
    t.plan(qo, kv, hq, hkv, d, causal=True, q_data_type=dtype)
    ours, ours_lse = t.run(q, k, v, return_lse=True)
    assert rel_err(out, ours) < tolerance(dtype)  # the same numbers whichever route auto picks
    assert (lse - ours_lse).abs().max().item() < 2e-2
    single, single_lse = serveattn.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True)
    assert torch.equal(single, out) and torch.equal(single_lse, lse)  # the same route, the same bits


def test_cudnn_is_not_taken_for_paged_graphs_or_unequal_lengths():
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    b = make_paged_batch(gen, qo_lens=[2048], kv_lens=[2048], num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                         page_size=16, dtype=dtype, device="cuda")
    p = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
    p.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, 16, causal=True, q_data_type=dtype)
    assert p.backend == "triton" and p.backend_fallback_reason == routing.cudnn_paged()
    w = _wrapper()
    qo = torch.tensor([0, 2048, 4096 + 100], dtype=I32, device="cuda")
    w.plan(qo, qo, hq, hkv, d, causal=True, q_data_type=dtype)
    assert w.backend == "triton" and w.backend_fallback_reason == routing.cudnn_unequal_lengths()
    g = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                       use_cuda_graph=True)
    qo = torch.tensor([0, 2048], dtype=I32, device="cuda")
    g.plan(qo, qo, hq, hkv, d, causal=True, q_data_type=dtype)
    assert g.backend == "triton" and g.backend_fallback_reason == routing.cudnn_cuda_graph()


@pytest.mark.parametrize("batch", [4, 31, 32, 64])
def test_auto_decode_kernel_follows_the_table(batch):
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(batch)
    kv_lens = [int(x) for x in torch.randint(1, 600, (batch,), generator=gen)]
    b = make_paged_batch(gen, qo_lens=[1] * batch, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                         page_size=16, dtype=dtype, device="cuda")
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, 16, q_data_type=dtype)
    info = routing.device_info("cuda")
    table = routing.table_for(info.arch)
    threshold = table.decode_tc_min_programs_per_sm.get(("bfloat16", d, hq // hkv)) if table else None
    tc = threshold is not None and batch * hkv / info.num_sms >= threshold
    assert w._decision.kernel == ("tensor-core" if tc else "bandwidth")
    out, lse = w.run(b.q, b.cache, return_lse=True)
    ref, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)
    assert rel_err(out, ref) < tolerance(dtype)
    check_lse(lse, ref_lse)
    same = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                        use_tensor_cores=tc, backend="triton")
    same.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, 16, q_data_type=dtype)
    assert torch.equal(same.run(b.q, b.cache), out)  # auto's pick is that kernel, bit for bit
