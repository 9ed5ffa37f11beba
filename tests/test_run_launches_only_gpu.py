"""API.md: run() only launches kernels and allocates nothing when buffers are given (out, and lse where it is
returned). A run() after a first one (which may build launch state on the host, never device memory) runs under
torch's sync debug mode "error" (any wait for the GPU raises) and the CUDA caching allocator's allocation counter.
The eager paths that do allocate (README: the warp-specialized prefill kernel's ragged copy of a paged cache, an
fp8 cache's widened or a 16-bit cache's where the copy pays; fp8 attention's transposed V; descales given in mixed
forms) are counted as such."""
import pytest
import torch

import serveattn
from helpers import make_paged_batch, nan_like

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
HQ, HKV, D, PAGE = 32, 8, 128, 16


def _allocations(fn) -> int:
    """Device allocations fn makes; a wait for the GPU inside it raises."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


def _run_twice(run) -> int:
    run()  # a plan's first run() builds its launch memo (host objects)
    return _allocations(run)


def _workspace():
    return torch.empty(128 << 20, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("case", ["unsplit", "split", "tensor-cores", "chain"])
def test_decode_run_allocates_nothing_and_never_waits(case):
    gen = torch.Generator().manual_seed(3)
    batch, kv = {"unsplit": (64, 512), "split": (2, 4096), "tensor-cores": (16, 1024), "chain": (8, 2048)}[case]
    q_len = 4 if case == "chain" else 1
    b = make_paged_batch(gen, qo_lens=[q_len] * batch, kv_lens=[kv - 7 * i for i in range(batch)],
                         num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE, dtype=BF16, device="cuda")
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_workspace(), use_tensor_cores=case == "tensor-cores",
                                                     backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=BF16, q_len_per_req=q_len,
           **({"disable_split_kv": True} if case == "unsplit" else {}))
    if case == "split":
        assert w._plan.chunk is not None  # the plan splits, so the partial states are in play
    q = b.q if q_len > 1 else b.q.view(batch, HQ, D)
    out, lse = nan_like(q.shape, BF16, "cuda"), nan_like(q.shape[:2], torch.float32, "cuda")
    assert _run_twice(lambda: w.run(q, b.cache, out=out, lse=lse, return_lse=True)) == 0
    assert not out.isnan().any()


@pytest.mark.parametrize("case", ["paged", "ragged", "cascade"])
def test_prefill_run_allocates_nothing_and_never_waits(case):
    gen = torch.Generator().manual_seed(5)
    qo_lens, kv_lens = [300, 77], [700, 77]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                         page_size=PAGE, dtype=BF16, device="cuda")
    out, lse = nan_like(b.q.shape, BF16, "cuda"), nan_like(b.q.shape[:2], torch.float32, "cuda")
    expected = 0
    if case == "paged":
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(), backend="triton")
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, causal=True,
               q_data_type=BF16)
        args = (b.q, b.cache)
    elif case == "ragged":
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), backend="triton")
        kv_indptr = torch.tensor([0, kv_lens[0], sum(kv_lens)], dtype=torch.int32, device="cuda")
        k, v = (torch.randn(sum(kv_lens), HKV, D, generator=gen).to("cuda", BF16) for _ in range(2))
        w.plan(b.qo_indptr, kv_indptr, HQ, HKV, D, causal=True, q_data_type=BF16)
        args = (b.q, k, v)
    else:  # level 0: request 0's first 8 pages shared by every row; level 1: the rest of each request's pages
        w = serveattn.MultiLevelCascadeAttentionWrapper(2, _workspace(), backend="triton")
        i32 = dict(dtype=torch.int32, device="cuda")
        end = int(b.kv_indptr[2])
        w.plan([torch.tensor([0, int(b.qo_indptr[-1])], **i32), b.qo_indptr],
               [torch.tensor([0, 8], **i32), b.kv_indptr[:3] - torch.tensor([0, 8, 8], **i32)],
               [b.kv_indices[:8], b.kv_indices[8:end]], [torch.tensor([PAGE], **i32), b.last_page_len],
               HQ, HKV, D, PAGE, causal=True, q_data_type=BF16)
        args = (b.q, b.cache)
    if case == "paged":
        run = lambda: w.run(*args, out=out, lse=lse, return_lse=True)  # noqa: E731
        run()
        gathered = w._plan.gathered
        expected = 2 if gathered is not None and gathered.pays else 0  # K and V's ragged copy, where it pays
        assert _allocations(run) == expected
    else:
        assert _run_twice(lambda: w.run(*args, out=out, lse=lse, return_lse=True)) == expected
    assert not out.isnan().any()

