"""Native tree verify through the decode wrapper: plan(tree_parents=...) masks the draft tokens with one
ancestor word per token instead of a dense [q, kv] mask."""
import numpy as np
import pytest
import torch

import serveattn
from serveattn import reference
from serveattn.kernels.common import K_OPERAND
from serveattn.spec_tree import tree_ancestor_bits
from helpers import check_lse, make_paged_batch, nan_like, rel_err, tolerance

HQ, HKV, D, PAGE = 8, 2, 64, 16


def random_tree(gen, size):
    """A random parent array: node t hangs off the root (-1) or any earlier node."""
    return [int(torch.randint(-1, t, (1,), generator=gen)) if t else -1 for t in range(size)]


def _batch(device, trees, prefix_lens, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    sizes = [len(t) for t in trees]
    return make_paged_batch(gen, qo_lens=sizes, kv_lens=[p + n for p, n in zip(prefix_lens, sizes)],
                            num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE, dtype=dtype,
                            device=device)


def _reference(b, trees, prefix_lens):
    mask, _, _ = serveattn.tree_parents_to_mask(trees, prefix_lens)
    return reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                 custom_mask=mask)


def _tree_run(device, b, trees, backend="triton", use_tensor_cores=False, cache=None, **run_kw):
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=use_tensor_cores, backend=backend)
    cache = b.cache if cache is None else cache
    kv_dtype = (cache[0] if isinstance(cache, tuple) else cache).dtype
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=b.q.dtype,
           kv_data_type=kv_dtype, tree_parents=trees)
    out, lse = nan_like(b.q.shape, b.q.dtype, b.q.device), nan_like(b.q.shape[:2], torch.float32, b.q.device)
    w.run(b.q, cache, out=out, lse=lse, **run_kw)
    assert not out.isnan().any() and not lse.isnan().any()  # every element written
    return out, lse


def test_ancestor_bits_match_the_dense_mask():
    gen = torch.Generator().manual_seed(0)
    trees = [random_tree(gen, n) for n in (1, 7, 33)] + [[-1] + list(range(63))]  # the last: a 64-deep chain
    sizes, words = tree_ancestor_bits("t", trees)
    assert sizes.tolist() == [1, 7, 33, 64]
    dense, _, _ = serveattn.tree_parents_to_mask(trees, [0] * len(trees))
    start, row = 0, 0
    for n in sizes.tolist():
        block = dense[start:start + n * n].reshape(n, n).numpy()
        for t in range(n):
            got = [(int(words[row + t]) >> j) & 1 == 1 for j in range(n)]
            assert got == block[t].tolist()
        start, row = start + n * n, row + n
    assert int(words[-1]) == -1  # a 64-deep chain's last token sees all 64 bits, the sign bit included


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_trees_against_reference(backend, seed, device):
    gen = torch.Generator().manual_seed(100 + seed)
    sizes = [int(torch.randint(1, 20, (1,), generator=gen)) for _ in range(3)] + [0]
    trees = [random_tree(gen, n) for n in sizes]
    prefix = [int(torch.randint(0, 70, (1,), generator=gen)) for _ in sizes]
    b = _batch(device, trees, prefix, seed)
    out, lse = _tree_run(device, b, trees, backend=backend)
    ref, ref_lse = _reference(b, trees, prefix)
    assert rel_err(out, ref) < 1e-2
    check_lse(lse, ref_lse)
    again, again_lse = _tree_run(device, b, trees, backend=backend)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)  # bitwise repeatable


def test_a_64_node_tree(device):
    gen = torch.Generator().manual_seed(7)
    trees = [random_tree(gen, 64), [-1] + list(range(63))]
    prefix = [5, 40]
    b = _batch(device, trees, prefix, 7)
    out, lse = _tree_run(device, b, trees)
    ref, ref_lse = _reference(b, trees, prefix)
    assert rel_err(out, ref) < 1e-2
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("use_tensor_cores", [True, False])
def test_a_path_equals_chain_verify(use_tensor_cores, device):
    k = 5
    trees = [[-1] + list(range(k - 1))] * 3
    b = _batch(device, trees, [20, 0, 37], 11)
    out, lse = _tree_run(device, b, trees, use_tensor_cores=use_tensor_cores)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                     use_tensor_cores=use_tensor_cores, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=b.q.dtype, q_len_per_req=k)
    chain_out, chain_lse = w.run(b.q, b.cache, return_lse=True)
    if use_tensor_cores or not K_OPERAND.value:  # one kernel (prefill_kernel), or the same k-slots: bitwise
        assert torch.equal(out, chain_out) and torch.equal(lse, chain_lse)
    else:  # the chain on the bandwidth kernel, whose q.K^T takes the fp8 tile's k-slots (common.K_OPERAND)
        assert rel_err(out, chain_out) < tolerance(torch.bfloat16)
        check_lse(lse, chain_lse)


def test_a_branching_tree_differs_from_the_chain_route(device):
    """The modes cannot be confused: a tree run as a chain (causal among all draft tokens) is another answer."""
    trees = [[-1, -1, 0, 1, 1, -1]] * 2
    prefix = [9, 30]
    b = _batch(device, trees, prefix, 12)
    out, _ = _tree_run(device, b, trees)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                     backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=b.q.dtype, q_len_per_req=6)
    as_chain = w.run(b.q, b.cache)
    ref, _ = _reference(b, trees, prefix)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(as_chain, ref) > 5e-2


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_tree_is_bitwise_the_dequantized_run(fp8, device):
    gen = torch.Generator().manual_seed(13)
    trees = [random_tree(gen, 9), random_tree(gen, 4)]
    b = _batch(device, trees, [33, 2], 13)
    cache8 = (b.cache * 0.5).to(fp8)
    out, lse = _tree_run(device, b, trees, cache=cache8, k_scale=0.7, v_scale=1.9)
    deq_out, deq_lse = _tree_run(device, b, trees, cache=cache8.to(b.q.dtype), k_scale=0.7, v_scale=1.9)
    assert torch.equal(out, deq_out) and torch.equal(lse, deq_lse)


def test_tree_refusals(device):
    b = _batch(device, [[-1, 0, 0]], [10], 14)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                     backend="triton")
    args = (b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE)
    with pytest.raises(ValueError, match="give q_len_per_req \\(a chain\\) or tree_parents \\(a tree\\), not both"):
        w.plan(*args, q_data_type=torch.bfloat16, q_len_per_req=3, tree_parents=[[-1, 0, 0]])
    with pytest.raises(NotImplementedError, match="with tree_parents is not served: a tree token's position"):
        w.plan(*args, q_data_type=torch.bfloat16, pos_encoding_mode="ROPE_LLAMA", tree_parents=[[-1, 0, 0]])
    with pytest.raises(ValueError, match="plan: tree_parents\\[0\\]\\[2\\]=2; a parent must be -1"):
        w.plan(*args, q_data_type=torch.bfloat16, tree_parents=[[-1, 0, 2]])
    with pytest.raises(ValueError, match="tree_parents has 2 parent arrays for a batch of 1"):
        w.plan(*args, q_data_type=torch.bfloat16, tree_parents=[[-1], [-1]])
    with pytest.raises(NotImplementedError, match="tree 0 has 65 draft tokens; the native tree mode serves at "
                                                  "most 64"):
        w.plan(*args, q_data_type=torch.bfloat16, tree_parents=[[-1] * 65])
    with pytest.raises(ValueError, match="kv_len=13 < qo_len=20"):  # the tree must already be in the cache
        w.plan(*args, q_data_type=torch.bfloat16, tree_parents=[[-1] * 20])
    w.plan(*args, q_data_type=torch.bfloat16, tree_parents=[[-1, 0, 0]])
    with pytest.raises(ValueError, match="q has shape \\(2, 8, 64\\); expected \\(3, 8, 64\\)"):
        w.run(b.q[:2], b.cache)


def test_graph_wrapper_replans_trees_and_refuses_a_chain(device):
    gen = torch.Generator().manual_seed(15)
    i32 = dict(dtype=torch.int32, device=device)
    w = serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), torch.empty(3, **i32), torch.empty(64, **i32),
        torch.empty(2, **i32), use_tensor_cores=True)
    first = [random_tree(gen, 8), random_tree(gen, 8)]
    b = _batch(device, first, [30, 11], 15)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
           tree_parents=first)
    out = w.run(b.q, b.cache)
    assert rel_err(out, _reference(b, first, [30, 11])[0]) < 1e-2
    with pytest.raises(ValueError, match="verify mode is fixed by the first plan \\(q_len_per_req or tree: tree\\)"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
               q_len_per_req=2)
    second = [random_tree(gen, 10), random_tree(gen, 6)]  # same row count, other shapes and pages
    b2 = _batch(device, second, [3, 50], 16)
    w.plan(b2.kv_indptr, b2.kv_indices, b2.last_page_len, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
           tree_parents=second)
    out2 = w.run(b2.q, b2.cache)
    assert rel_err(out2, _reference(b2, second, [3, 50])[0]) < 1e-2
    assert np.isfinite(out2.float().cpu().numpy()).all()


@pytest.mark.parametrize("split", [dict(disable_split_kv=True), dict(fixed_split_size=4)])
def test_batch_invariant_tree_plans_keep_their_tiles(split, device):
    """Under FlashInfer's batch-invariance arguments a tree's tiles are those for 64 nodes whatever trees share its
    batch (tile rows and warps change the tensor-core instructions, hence the bits on the GPU): a 2-node tree
    alone and beside a 31-node tree plans the same tiles, and its rows are bitwise the same."""
    gen = torch.Generator().manual_seed(40)
    small, big = [-1, 0], random_tree(gen, 31)
    alone = _batch(device, [small], [30], 41)
    both = _batch(device, [small, big], [30, 50], 42)
    both.q[:2] = alone.q
    both.cache[both.kv_indices[: int(both.kv_indptr[1])].long()] = alone.cache[alone.kv_indices.long()]
    outs, tiles = [], []
    for b, trees in ((alone, [small]), (both, [small, big])):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                         use_tensor_cores=True, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=b.q.dtype,
               tree_parents=trees, **split)
        tiles.append(w._prefill._plan.tiles)
        outs.append(w.run(b.q, b.cache))
    assert tiles[0] == tiles[1]
    assert torch.equal(outs[0], outs[1][:2])


def test_graph_wrapper_takes_larger_trees_than_its_first_plan(device):
    """Under use_cuda_graph=True the trees' ancestor words have room for the batch capacity's 64-node trees, not
    only the first plan's nodes (a warm-up plan of small trees, then trees of 43 nodes in all)."""
    i32 = dict(dtype=torch.int32, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), use_cuda_graph=True, use_tensor_cores=True,
        backend="triton", paged_kv_indptr_buffer=torch.empty(5, **i32),
        paged_kv_indices_buffer=torch.empty(200, **i32), paged_kv_last_page_len_buffer=torch.empty(4, **i32))
    small = [[-1, 0, 0], [-1, 0, 1, 1, 2]]
    b = _batch(device, small, [100, 200], 21)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
           tree_parents=small)
    large = [[-1] + list(range(19)), [-1] * 20, [-1, 0], [-1]]
    b2 = _batch(device, large, [100, 200, 5, 9], 22)
    w.plan(b2.kv_indptr, b2.kv_indices, b2.last_page_len, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
           tree_parents=large)
    out = w.run(b2.q, b2.cache)
    assert rel_err(out, _reference(b2, large, [100, 200, 5, 9])[0]) < 1e-2
