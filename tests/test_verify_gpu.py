"""Speculative verify on the GPU: chain (q_len_per_req) and native tree verify at serving sizes, bf16 and fp8
caches, under CUDA graph capture with replays after re-plans (new page tables, new tree shapes)."""
import pytest
import torch

import serveattn
from serveattn import reference
from helpers import check_lse, rel_err

pytestmark = pytest.mark.gpu

HQ, HKV, D, PS = 32, 8, 128, 16


def _table(gen, kv_lens, num_pages):
    n = [(k + PS - 1) // PS for k in kv_lens]
    indices = torch.randperm(num_pages, generator=gen)[: sum(n)].to(torch.int32)
    indptr = torch.tensor([0] + torch.cumsum(torch.tensor(n), 0).tolist(), dtype=torch.int32)
    last = torch.tensor([k - (m - 1) * PS if m else 0 for k, m in zip(kv_lens, n)], dtype=torch.int32)
    return indptr.cuda(), indices.cuda(), last.cuda()


def _random_tree(gen, size):
    return [int(torch.randint(-1, t, (1,), generator=gen)) if t else -1 for t in range(size)]


def _reference(q, cache, table, sizes, trees, k_scale, v_scale):
    """float64 oracle on the dequantized cache: chains causal, trees through their dense mask."""
    kv_lens = [int(x) for x in ((table[0][1:] - table[0][:-1] - 1) * PS + table[2]).tolist()]
    qo = torch.tensor([0] + torch.cumsum(torch.tensor(sizes), 0).tolist(), dtype=torch.int32)
    wide = cache.to(torch.float64) * torch.tensor([k_scale, v_scale], dtype=torch.float64,
                                                  device=cache.device).reshape(1, 2, 1, 1, 1)
    if trees is None:
        return reference.batch_paged(q, wide, qo, *table, causal=True)
    mask, _, _ = serveattn.tree_parents_to_mask(trees, [k - n for k, n in zip(kv_lens, sizes)])
    return reference.batch_paged(q, wide, qo, *table, custom_mask=mask)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("mode", ["chain4", "chain4-bandwidth", "tree16", "chain64"])
def test_verify_graph_replays_after_replans(mode, kv_dtype):
    gen = torch.Generator().manual_seed(5)
    batch, num_pages = 16, 12000
    k_scale, v_scale = (0.5, 2.0) if kv_dtype != torch.bfloat16 else (1.0, 1.0)
    cache = torch.randn(num_pages, 2, PS, HKV, D, generator=gen).to(kv_dtype).cuda()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    # backend="triton": use_tensor_cores literally, each route (under auto it is a speed hint, routing.py)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        ws, use_cuda_graph=True, use_tensor_cores=mode != "chain4-bandwidth", backend="triton",
        paged_kv_indptr_buffer=torch.empty(batch + 1, **i32), paged_kv_indices_buffer=torch.empty(num_pages, **i32),
        paged_kv_last_page_len_buffer=torch.empty(batch, **i32))
    rows = {"chain4": 4, "chain4-bandwidth": 4, "tree16": 16, "chain64": 64}[mode]
    q = torch.randn(batch * rows, HQ, D, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    lse = torch.empty(batch * rows, HQ, dtype=torch.float32, device="cuda")

    def plan(kv_lens):
        table = _table(gen, kv_lens, num_pages)
        trees = None if mode.startswith("chain") else [_random_tree(gen, rows) for _ in range(batch)]
        kw = dict(q_len_per_req=rows) if trees is None else dict(tree_parents=trees)
        w.plan(*table, HQ, HKV, D, PS, q_data_type=torch.bfloat16, kv_data_type=kv_dtype, **kw)
        return table, trees

    table, trees = plan([int(x) for x in torch.randint(rows, 3000, (batch,), generator=gen)])
    if mode == "chain64" and kv_dtype == torch.bfloat16:  # the warp-specialized kernel's plan: no split items
        assert w._prefill._plan.merge_rows is None
    w.run(q, cache, out=out, lse=lse, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out, lse=lse, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    for step, kv_max in enumerate([3000, 40, 9000]):
        table, trees = plan([int(x) for x in torch.randint(rows, max(kv_max, rows) + 1, (batch,), generator=gen)])
        assert (w._prefill is None) == (mode == "chain4-bandwidth")
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(q, cache, table, [rows] * batch, trees, k_scale, v_scale)
        assert rel_err(out, ref_out) < 1e-2, step
        check_lse(lse, ref_lse)
    # eager runs of the same plan are bitwise the replay (one kernel, one schedule)
    again_out, again_lse = w.run(q, cache, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(again_out, out) and torch.equal(again_lse, lse)


@pytest.mark.parametrize("mode", ["chain4", "chain8", "chain16", "tree64"])
def test_verify_serving_size(mode):
    """batch 16, KV 8192 (the benchmark's shape), against the reference; a 64-node tree per request."""
    gen = torch.Generator().manual_seed(9)
    batch, kv_len = 16, 8192
    num_pages = batch * kv_len // PS + 7
    cache = torch.randn(num_pages, 2, PS, HKV, D, generator=gen).to(torch.bfloat16).cuda()
    table = _table(gen, [kv_len] * batch, num_pages)
    trees = [_random_tree(gen, 64) for _ in range(batch)] if mode == "tree64" else None
    rows = 64 if trees else int(mode[5:])
    q = torch.randn(batch * rows, HQ, D, generator=gen).to(torch.bfloat16).cuda()
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    kw = dict(q_len_per_req=rows) if trees is None else dict(tree_parents=trees)
    w.plan(*table, HQ, HKV, D, PS, q_data_type=torch.bfloat16, **kw)
    out, lse = w.run(q, cache, return_lse=True)
    ref_out, ref_lse = _reference(q, cache, table, [rows] * batch, trees, 1.0, 1.0)
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse)
