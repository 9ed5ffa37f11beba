"""Chain verify through the decode wrapper: q_len_per_req draft rows per request, bottom-right causal."""
import pytest
import torch

import serveattn
from serveattn import reference
from helpers import check_lse, make_paged_batch, rel_err


def _batch(device, k, kv_lens, dtype=torch.bfloat16):
    # shuffled pages, partial last pages; no empty request: a chain gives every request k rows, so kv_len >= k
    gen = torch.Generator().manual_seed(40 + k)
    return make_paged_batch(gen, qo_lens=[k] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2,
                            head_dim=64, page_size=16, dtype=dtype, device=device)


@pytest.mark.parametrize("use_tensor_cores", [True, False])
@pytest.mark.parametrize("k", [2, 4])
def test_chain_verify_matches_causal_prefill_and_reference(k, use_tensor_cores, device):
    b = _batch(device, k, [30, 17, 64])
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=use_tensor_cores, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16, q_len_per_req=k)
    out, lse = w.run(b.q, b.cache, return_lse=True)
    p = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    p.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
           q_data_type=torch.bfloat16)
    p_out, p_lse = p.run(b.q, b.cache, return_lse=True)
    if use_tensor_cores:  # the prefill kernel on the same rows: the same bits
        assert torch.equal(out, p_out) and torch.equal(lse, p_lse)
    else:
        assert w._prefill is None  # the bandwidth kernel served it
    ref, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                         causal=True)
    assert rel_err(out, ref) < 1e-2
    check_lse(lse, ref_lse)
    # run(q_len_per_req=k) still works, with a DeprecationWarning
    with pytest.warns(DeprecationWarning, match="q_len_per_req belongs to plan"):
        again = w.run(b.q, b.cache, q_len_per_req=k)
    assert torch.equal(again, out)


def test_chain_verify_refusals(device):
    b = _batch(device, 4, [30, 3])
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                     backend="triton")
    # kv_len >= q_len_per_req, from the page metadata
    with pytest.raises(ValueError, match="kv_len=3 < qo_len=4"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
               q_len_per_req=4)
    ok = _batch(device, 4, [30, 9])
    w.plan(ok.kv_indptr, ok.kv_indices, ok.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
           q_len_per_req=4)
    with pytest.raises(ValueError, match="q has shape \\(2, 8, 64\\); expected \\(8, 8, 64\\)"):
        w.run(ok.q[:2], ok.cache)
    with pytest.raises(ValueError, match="differs from the plan's 4"):
        with pytest.warns(DeprecationWarning):
            w.run(ok.q, ok.cache, q_len_per_req=2)


def test_graph_replan_with_another_q_len_is_refused(device):
    b = _batch(device, 2, [30, 40])
    i32 = dict(dtype=torch.int32, device=device)
    w = serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), torch.empty(3, **i32), torch.empty(64, **i32),
        torch.empty(2, **i32), use_tensor_cores=True)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16, q_len_per_req=2)
    with pytest.raises(ValueError, match="verify mode is fixed by the first plan "
                                         "\\(q_len_per_req or tree: 2\\); this plan asks for 3"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
               q_len_per_req=3)
    out = w.run(b.q, b.cache)  # the first plan still runs
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   causal=True)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("group,k", [(1, 3), (4, 2), (4, 8), (8, 4)])
@pytest.mark.parametrize("split", [None, 2])
def test_chain_on_the_bandwidth_kernel(group, k, split, device):
    """Chains of k x group <= 32 rows run on the bandwidth kernel (split-KV included): every element written,
    against the float64 reference, a window and a soft cap honoured, and bitwise repeatable."""
    gen = torch.Generator().manual_seed(70 + 10 * group + k)
    num_kv_heads = 2
    # 150 and 133 keys split into chunks of 2 pages (16 keys) rounded up to BLOCK_N (32 interpreted, 64 on the H200)
    b = make_paged_batch(gen, qo_lens=[k] * 4, kv_lens=[k, 150, 19, 133], num_qo_heads=group * num_kv_heads,
                         num_kv_heads=num_kv_heads, head_dim=64, page_size=8, dtype=torch.bfloat16, device=device)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    for window, cap in ((-1, None), (9, 30.0)):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, group * num_kv_heads, num_kv_heads, 64, 8,
               q_data_type=torch.bfloat16, q_len_per_req=k, fixed_split_size=split, window_left=window,
               logits_soft_cap=cap)
        assert w._prefill is None and (split is None or w._plan.num_slots > 0)
        out = torch.full_like(b.q, float("nan"))
        lse = torch.full(b.q.shape[:2], float("nan"), device=device)
        w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
        ref, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True, window_left=window, logits_soft_cap=cap)
        assert not out.isnan().any() and not lse.isnan().any()
        assert rel_err(out, ref) < 1e-2
        check_lse(lse, ref_lse)
        again, again_lse = w.run(b.q, b.cache, return_lse=True)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_chain_on_the_bandwidth_kernel_is_its_dequantized_run(enc, device):
    """API.md's fp8 contract on this route: an fp8 cache gives the bits of the same call on cache.to(q.dtype)."""
    gen = torch.Generator().manual_seed(80)
    b = make_paged_batch(gen, qo_lens=[4] * 3, kv_lens=[140, 4, 27], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=8, dtype=torch.bfloat16, device=device)
    cache8 = (b.cache * 3).to(enc)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    outs = []
    for cache in (cache8, cache8.to(torch.bfloat16)):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 8, q_data_type=torch.bfloat16,
               kv_data_type=cache.dtype, q_len_per_req=4, fixed_split_size=2)
        assert w._prefill is None and w._plan.num_slots > 0
        outs.append(w.run(b.q, cache, return_lse=True, k_scale=0.25, v_scale=1.5))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_prefer_tensor_cores_follows_the_bandwidth_tile():
    """The hint a serving engine asks: tensor cores only for chains past the bandwidth kernel's 32-row tile."""
    prefer = serveattn.decode.prefer_tensor_cores
    assert not prefer(32, 8, 1) and not prefer(32, 8, 8) and prefer(32, 8, 9)
    assert not prefer(8, 8, 32) and prefer(8, 8, 33)  # group 1
