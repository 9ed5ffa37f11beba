"""Batch invariance on the GPU: with FlashInfer's fixed_split_size / disable_split_kv given (vLLM's batch-invariant
mode passes them), a request's rows come out bitwise the same whether it is planned alone or beside longer
requests. The fuzzer (scripts/fuzz.py) found on the CPU that the prefill tiles (BLOCK_M, warps) follow the batch's
longest request; whether that changes a row's bits on tensor cores only a GPU says: this test does."""
import pytest
import torch

import serveattn
from helpers import make_paged_batch

pytestmark = pytest.mark.gpu

WORKSPACE = 1 << 26


def _alone(b, qo, pages):
    """Request 0's own plan arrays: its query rows and its part of the batch's page table."""
    i32 = dict(dtype=torch.int32, device="cuda")
    return (b.q[:qo], torch.tensor([0, qo], **i32), torch.tensor([0, pages], **i32), b.kv_indices[:pages],
            b.last_page_len[:1])


@pytest.mark.parametrize("split", [dict(disable_split_kv=True), dict(fixed_split_size=512)], ids=["disable", "fixed"])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_request_alone_is_its_rows_in_a_batch(split, causal):
    gen = torch.Generator().manual_seed(7 + causal)
    qo_lens, kv_lens = [5, 900, 1, 0], [700, 1500, 3000, 40]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         page_size=16, dtype=torch.bfloat16, device="cuda")
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                      backend="triton")
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, causal=causal,
           q_data_type=torch.bfloat16, **split)
    out, lse = w.run(b.q, b.cache, return_lse=True)
    q, qo_indptr, kv_indptr, kv_indices, last = _alone(b, qo_lens[0], -(-kv_lens[0] // 16))
    w.plan(qo_indptr, kv_indptr, kv_indices, last, 32, 8, 128, 16, causal=causal, q_data_type=torch.bfloat16,
           **split)
    out1, lse1 = w.run(q, b.cache, return_lse=True)
    assert torch.equal(out1, out[: qo_lens[0]]) and torch.equal(lse1, lse[: qo_lens[0]])


@pytest.mark.parametrize("split", [dict(disable_split_kv=True), dict(fixed_split_size=256)], ids=["disable", "fixed"])
@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_decode_request_alone_is_its_row_in_a_batch(split, use_tensor_cores):
    gen = torch.Generator().manual_seed(11 + use_tensor_cores)
    kv_lens = [700, 5000, 100, 3]
    b = make_paged_batch(gen, qo_lens=[1] * 4, kv_lens=kv_lens, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         page_size=16, dtype=torch.bfloat16, device="cuda")
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                     use_tensor_cores=use_tensor_cores, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16, **split)
    out, lse = w.run(b.q, b.cache, return_lse=True)
    q, _, kv_indptr, kv_indices, last = _alone(b, 1, -(-kv_lens[0] // 16))
    w.plan(kv_indptr, kv_indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, **split)
    out1, lse1 = w.run(q, b.cache, return_lse=True)
    assert torch.equal(out1, out[:1]) and torch.equal(lse1, lse[:1])
