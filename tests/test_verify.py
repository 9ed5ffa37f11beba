"""Chain verify through the decode wrapper: q_len_per_req draft rows per request, bottom-right causal."""
import pytest
import torch

import serveattn
from serveattn import reference
from helpers import check_lse, make_paged_batch, rel_err


def _batch(device, k, kv_lens, dtype=torch.bfloat16):
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
    assert torch.equal(out, p_out) and torch.equal(lse, p_lse)
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
