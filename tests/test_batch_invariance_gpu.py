"""Batch invariance on the GPU: with FlashInfer's fixed_split_size / disable_split_kv given (vLLM's batch-invariant
mode passes them), a request's rows come out bitwise the same whether it is planned alone or beside longer
requests, under backend='auto' too. The fuzzer (scripts/fuzz.py) found that the prefill tiles (BLOCK_M, warps)
followed the batch's longest request, and auto's route (cuDNN or ours; decode's two kernels) follows the batch's
sizes: with either argument given, make_plan fixes the tiles and auto takes a route the batch does not choose."""
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


# fixed_split_size counts pages of 16 (FlashInfer's unit): 32 / 64 pages are chunks of 512 / 1024 keys. fixed 1024:
# request 0 (700 keys) is unsplit alone (the unsplit kernel) and an unsplit item of the batch's split plan
@pytest.mark.parametrize("split", [dict(disable_split_kv=True), dict(fixed_split_size=32),
                                   dict(fixed_split_size=64)], ids=["disable", "fixed512", "fixed1024"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_prefill_request_alone_is_its_rows_in_a_batch(split, causal, backend):
    gen = torch.Generator().manual_seed(7 + causal)
    qo_lens, kv_lens = [5, 900, 1, 0], [700, 1500, 3000, 40]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         page_size=16, dtype=torch.bfloat16, device="cuda")
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                      backend=backend)
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, causal=causal,
           q_data_type=torch.bfloat16, **split)
    out, lse = w.run(b.q, b.cache, return_lse=True)
    q, qo_indptr, kv_indptr, kv_indices, last = _alone(b, qo_lens[0], -(-kv_lens[0] // 16))
    w.plan(qo_indptr, kv_indptr, kv_indices, last, 32, 8, 128, 16, causal=causal, q_data_type=torch.bfloat16,
           **split)
    out1, lse1 = w.run(q, b.cache, return_lse=True)
    assert torch.equal(out1, out[: qo_lens[0]]) and torch.equal(lse1, lse[: qo_lens[0]])


@pytest.mark.parametrize("split", [dict(disable_split_kv=True), dict(fixed_split_size=16),
                                   dict(fixed_split_size=64)], ids=["disable", "fixed256", "fixed1024"])
@pytest.mark.parametrize("use_tensor_cores", [False, True])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_decode_request_alone_is_its_row_in_a_batch(split, use_tensor_cores, backend):
    gen = torch.Generator().manual_seed(11 + use_tensor_cores)
    # 40 requests x 8 KV heads: over the measured tensor-core crossover, which request 0 alone is under
    kv_lens = [700, 5000, 100, 3] + [64] * 36
    b = make_paged_batch(gen, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         page_size=16, dtype=torch.bfloat16, device="cuda")
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                     use_tensor_cores=use_tensor_cores, backend=backend)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16, **split)
    out, lse = w.run(b.q, b.cache, return_lse=True)
    q, _, kv_indptr, kv_indices, last = _alone(b, 1, -(-kv_lens[0] // 16))
    w.plan(kv_indptr, kv_indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, **split)
    out1, lse1 = w.run(q, b.cache, return_lse=True)
    assert torch.equal(out1, out[:1]) and torch.equal(lse1, lse[:1])


@pytest.mark.parametrize("split", [dict(disable_split_kv=True), dict(fixed_split_size=512)], ids=["disable", "fixed"])
def test_ragged_request_alone_is_its_rows_in_a_batch_under_auto(split):
    """768 causal rows alone are inside cuDNN's measured range (routing's H200 table), beside a shorter request
    they are not: the split arguments keep both plans on our kernel."""
    gen = torch.Generator().manual_seed(5)
    lens = [768, 300]
    q = torch.randn(sum(lens), 32, 128, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(sum(lens), 8, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    i32 = dict(dtype=torch.int32, device="cuda")
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    indptr = torch.tensor([0, lens[0], sum(lens)], **i32)
    w.plan(indptr, indptr, 32, 8, 128, causal=True, q_data_type=torch.bfloat16, **split)
    out, lse = w.run(q, k, v, return_lse=True)
    alone = torch.tensor([0, lens[0]], **i32)
    w.plan(alone, alone, 32, 8, 128, causal=True, q_data_type=torch.bfloat16, **split)
    assert w.backend == "triton"
    out1, lse1 = w.run(q[:lens[0]], k[:lens[0]], v[:lens[0]], return_lse=True)
    assert torch.equal(out1, out[:lens[0]]) and torch.equal(lse1, lse[:lens[0]])
