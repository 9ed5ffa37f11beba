"""Context-parallel decode (serveattn.distributed): shard_page_table, the verify split, refusals, and 2 / 4 gloo
ranks in spawned processes (torch backend and the Triton kernels through the interpreter) against the float64
reference and the single-process decode wrapper. Each rank's cache holds NaN outside its own shard's pages."""
import os
import tempfile
import zlib
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import serveattn
from serveattn import distributed as cpd
from serveattn import reference
from serveattn.distributed import ContextParallelDecode, shard_page_table, split_for_verify
from helpers import check_lse, make_paged_batch, nan_like, rel_err, tolerance

I32 = torch.int32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _table(kv_lens, page_size, perm_seed=0):
    """A CSR page table over shuffled page ids (int32, CPU)."""
    n = [-(-k // page_size) for k in kv_lens]
    ids = torch.randperm(sum(n) + 2, generator=torch.Generator().manual_seed(perm_seed))[: sum(n)]
    indptr = torch.tensor([0] + np.cumsum(n).tolist(), dtype=I32)
    last = torch.tensor([k - (m - 1) * page_size if m else 0 for k, m in zip(kv_lens, n)], dtype=I32)
    return indptr, ids.to(I32), last


# ---------------------------------------------------------------- shard_page_table (no processes)

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_concatenate_to_the_table(world):
    kv_lens = [37, 0, 4, 5, 64, 1]
    indptr, indices, last = _table(kv_lens, 4)
    shards = [shard_page_table(indptr, indices, last, 4, world, r) for r in range(world)]
    for i, kv in enumerate(kv_lens):
        pages, lens = [], []
        for s_indptr, s_indices, s_last in shards:
            assert s_indptr.dtype == I32 and s_indices.dtype == I32 and s_last.dtype == I32
            own = s_indices[s_indptr[i]:s_indptr[i + 1]].tolist()
            pages += own
            lens.append((len(own) - 1) * 4 + int(s_last[i]) if own else 0)
            if not own:
                assert int(s_last[i]) == 0
        assert pages == indices[indptr[i]:indptr[i + 1]].tolist()  # contiguous runs, rank order
        assert sum(lens) == kv
        n = int(indptr[i + 1] - indptr[i])
        assert [int(s[0][i + 1] - s[0][i]) for s in shards] == [(r + 1) * n // world - r * n // world
                                                               for r in range(world)]


def test_uneven_shards_with_empty_ranks():
    indptr, indices, last = _table([37, 9, 3], 4)  # 10, 3, 1 pages
    counts = [[0, 7, 3], [3, 0, 0], [0, 0, 1]]
    shards = [shard_page_table(indptr, indices, last, 4, 3, r, pages_per_rank=counts) for r in range(3)]
    assert shards[0][0].tolist() == [0, 0, 3, 3] and shards[0][2].tolist() == [0, 1, 0]
    assert shards[1][0].tolist() == [0, 7, 7, 7] and shards[1][2].tolist() == [4, 0, 0]
    assert shards[2][0].tolist() == [0, 3, 3, 4] and shards[2][2].tolist() == [1, 0, 3]
    assert shards[2][1].tolist() == indices[7:10].tolist() + indices[13:14].tolist()
    again = shard_page_table(indptr, indices, last, 4, 3, 1, pages_per_rank=torch.tensor(counts))
    assert all(torch.equal(a, b) for a, b in zip(again, shards[1]))


SHARD_REFUSALS = [
    ("rank_out_of_range", dict(world_size=2, rank=2), "rank=2 must lie in 0..world_size-1=1"),
    ("negative_rank", dict(world_size=2, rank=-1), "rank=-1 must lie in 0..world_size-1=1"),
    ("world_zero", dict(world_size=0, rank=0), "world_size=0 must be at least 1"),
    ("world_float", dict(world_size=2.0, rank=0), "world_size=2.0 must be an int"),
    ("counts_shape", dict(world_size=2, rank=0, pages_per_rank=[[1, 1, 1], [1, 0, 0]]),
     r"pages_per_rank has shape \(2, 3\); expected \(batch, world_size\) = \(2, 2\)"),
    ("counts_ragged", dict(world_size=2, rank=0, pages_per_rank=[[1, 1], [1]]),
     r"pages_per_rank must be a \(batch, world_size\) = \(2, 2\) table of page counts; its rows differ"),
    ("counts_sum", dict(world_size=2, rank=0, pages_per_rank=[[2, 1], [1, 0]]),
     "pages_per_rank\\[0\\] sums to 3 but request 0 owns 2 pages"),
    ("counts_negative", dict(world_size=2, rank=0, pages_per_rank=[[3, -1], [1, 0]]), "negative page count"),
    ("counts_float", dict(world_size=2, rank=0, pages_per_rank=torch.ones(2, 2)), "page counts must be integers"),
    ("counts_float_list", dict(world_size=2, rank=0, pages_per_rank=[[1.0, 1.0], [1.0, 0.0]]),
     "pages_per_rank holds float64 values; page counts must be integers"),
    ("int64", dict(world_size=2, rank=0, int64=True), "must be int32"),
    ("last_page_len", dict(world_size=2, rank=0, last=[5, 1]), ": last_page_len\\[0\\]=5"),
]


@pytest.mark.parametrize("case", SHARD_REFUSALS, ids=[c[0] for c in SHARD_REFUSALS])
def test_shard_page_table_refusals(case):
    _, kw, match = case
    kw = dict(kw)
    indptr, indices, last = _table([8, 3], 4)
    if kw.pop("int64", False):
        indptr = indptr.long()
    if "last" in kw:
        last = torch.tensor(kw.pop("last"), dtype=I32)
    with pytest.raises(ValueError, match=match):
        shard_page_table(indptr, indices, last, 4, **kw)


# ---------------------------------------------------------------- the verify split (no processes)

def _covered(fold, verify, rows, shard_len, offset, total, k, page_size):
    """The global keys each row reads from one shard, from split_for_verify's lists for one request."""
    seen = [[] for _ in range(k)]
    for _, n_pages, n in fold:
        assert n <= n_pages * page_size and n_pages * page_size - n < page_size and n <= shard_len
        for r in range(k):
            seen[r] += range(offset, offset + n)
    for _ in verify:
        assert shard_len >= k and offset + shard_len == total  # the last shard, holding all k draft positions
        for r in range(k):
            seen[r] += range(offset, offset + shard_len - k + r + 1)
    for _, r, first, n in rows:
        assert first * page_size + n <= shard_len and n > 0
        seen[r] += range(offset + first * page_size, offset + first * page_size + n)
    return seen


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_verify_split_is_exactly_the_causal_mask(k, page_size):
    """Every row reads exactly the keys the bottom-right causal mask lets it see, each once, whatever the cut."""
    gen = torch.Generator().manual_seed(k * 100 + page_size)
    for _ in range(60):
        world = int(torch.randint(1, 5, (1,), generator=gen))
        total = int(torch.randint(k, 70, (1,), generator=gen))
        n_pages = -(-total // page_size)
        if _ % 2:  # page-aligned cuts (shard_page_table's): only the request's end is partial
            cuts = [c * page_size for c in torch.randint(0, n_pages + 1, (world - 1,), generator=gen).tolist()]
        else:  # cuts anywhere: shards ending in a partial page before the last
            cuts = torch.randint(0, total + 1, (world - 1,), generator=gen).tolist()
        bounds = [0] + sorted(cuts) + [total]
        lens = np.diff(np.minimum(bounds, total))
        seen = [[] for _ in range(k)]
        for r in range(world):
            offset = int(lens[:r].sum())
            f, v, rows = split_for_verify(np.array([lens[r]]), np.array([offset]), np.array([total]), k, page_size)
            for row, part in enumerate(_covered(f, v, rows, int(lens[r]), offset, total, k, page_size)):
                seen[row] += part
        for r in range(k):
            assert sorted(seen[r]) == list(range(total - k + r + 1)), (lens.tolist(), r)


def test_verify_split_routes():
    """The three routes of the module docstring, on one request of 40 keys, k = 3, page size 4."""
    route = lambda n, a: split_for_verify(np.array([n]), np.array([a]), np.array([40]), 3, 4)  # noqa: E731
    assert route(24, 0) == ([(0, 6, 24)], [], [])            # ends before the masked keys 38, 39: no mask
    assert route(38, 0) == ([(0, 10, 38)], [], [])           # ends at key 37, the first draft position
    assert route(16, 24) == ([], [0], [])                     # the last shard, 16 >= 3 keys: verify route
    assert route(39, 0) == ([(0, 9, 36)], [], [(0, 0, 9, 2), (0, 1, 9, 3), (0, 2, 9, 3)])  # ends at key 38
    assert route(1, 39) == ([], [], [(0, 2, 0, 1)])           # a last shard shorter than k: row 2 sees key 39
    assert route(0, 40) == ([], [], [])                       # no pages: an empty state


# ---------------------------------------------------------------- one rank, in this process

@pytest.fixture(scope="module")
def solo_group():
    """A one-rank gloo group in this process (world_size 1: every collective is a copy)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _solo_batch(k, kv_lens=(13, 0, 30), dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(90 + k)
    return make_paged_batch(gen, qo_lens=[k] * len(kv_lens), kv_lens=list(kv_lens), num_qo_heads=4, num_kv_heads=2,
                            head_dim=64, page_size=4, dtype=dtype)


@pytest.mark.parametrize("k", [1, 2])
def test_one_rank_equals_the_decode_wrapper_bitwise(solo_group, k):
    b = _solo_batch(k, (13, 0, 30) if k == 1 else (13, 2, 30))
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    cp = ContextParallelDecode(solo_group, ws, backend="torch")
    cp.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4, q_data_type=torch.bfloat16, q_len_per_req=k)
    assert cp.rank == 0 and cp.world_size == 1 and cp.backend == "torch"
    assert cp.kv_lens.tolist() == b.kv_lens and cp.kv_offsets.tolist() == [0] * 3
    out, lse = cp.run(b.q, b.cache, return_lse=True)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="torch")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4, q_data_type=torch.bfloat16, q_len_per_req=k)
    ref_out, ref_lse = w.run(b.q, b.cache, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)  # one state merges into itself exactly
    if k == 1:  # the empty request: output 0, lse -inf
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    o2, l2 = nan_like(out.shape, out.dtype, "cpu"), nan_like(lse.shape, torch.float32, "cpu")
    assert cp.run(b.q, b.cache, out=o2, lse=l2, return_lse=True)[0] is o2
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    assert torch.equal(cp.run(b.q, b.cache), out)


def test_empty_batch(solo_group):
    cp = ContextParallelDecode(solo_group, torch.empty(1 << 16, dtype=torch.uint8), backend="torch")
    empty = torch.zeros(0, dtype=I32)
    cp.plan(torch.zeros(1, dtype=I32), empty, empty, 4, 2, 64, 4, q_data_type=torch.bfloat16, q_len_per_req=2)
    out, lse = cp.run(torch.empty(0, 4, 64, dtype=torch.bfloat16), torch.empty(1, 2, 4, 2, 64, dtype=torch.bfloat16),
                      return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


PLAN_REFUSALS = [
    ("rope", dict(pos_encoding_mode="ROPE_LLAMA"), NotImplementedError,
     "pos_encoding_mode='ROPE_LLAMA' is not served across ranks"),
    ("window", dict(window_left=8), NotImplementedError, "window_left=8 is not served across ranks"),
    ("tree", dict(tree_parents=[[-1, 0]]), NotImplementedError, "tree_parents \\(tree verify\\) is not served"),
    ("kwarg", dict(use_fp16_qk_reduction=True), NotImplementedError,
     "argument\\(s\\) use_fp16_qk_reduction are not served"),
    ("q_len", dict(q_len_per_req=0), ValueError, "q_len_per_req=0 must be a positive int"),
    ("fp8_query", dict(q_data_type=E4M3, kv_data_type=E4M3), NotImplementedError, "an fp8 query is not served"),
    ("head_dim", dict(head_dim=96), NotImplementedError, "head_dim=96 is not served"),
    ("heads", dict(num_qo_heads=3), ValueError, "num_qo_heads=3 is not a multiple of num_kv_heads=2"),
    ("int64", dict(indptr="int64"), ValueError, "indptr has dtype torch.int64"),
    ("short_for_verify", dict(q_len_per_req=3), ValueError,
     "q_len_per_req=3 needs kv_len >= 3 for every request .* request 1 has kv_len=2 over all ranks"),
]


@pytest.mark.parametrize("case", PLAN_REFUSALS, ids=[c[0] for c in PLAN_REFUSALS])
def test_plan_refusals(solo_group, case):
    _, over, exc, match = case
    b = _solo_batch(1, (13, 2, 30))
    args = dict(indptr=b.kv_indptr, indices=b.kv_indices, last_page_len=b.last_page_len, num_qo_heads=4,
                num_kv_heads=2, head_dim=64, page_size=4, q_data_type=torch.bfloat16)
    args.update(over)
    if over.get("indptr") == "int64":
        args["indptr"] = b.kv_indptr.long()
    cp = ContextParallelDecode(solo_group, torch.empty(1 << 16, dtype=torch.uint8), backend="torch")
    cp.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4, q_data_type=torch.bfloat16)
    before = cp._plan
    with pytest.raises(exc, match=f"ContextParallelDecode.plan: {match}"):
        cp.plan(**args)
    assert cp._plan is before  # a refused plan leaves the previous one


def test_constructor_and_run_refusals(solo_group, monkeypatch):
    ws = torch.empty(1 << 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_layout='NCHW' is not a layout"):
        ContextParallelDecode(solo_group, ws, "NCHW")
    with pytest.raises(NotImplementedError, match="backend='cudnn' is FlashInfer's and not served here"):
        ContextParallelDecode(solo_group, ws, backend="cudnn")
    with pytest.raises(NotImplementedError, match="use_cuda_graph=True is not served"):
        ContextParallelDecode(solo_group, ws, use_cuda_graph=True)
    with pytest.raises(ValueError, match="workspace_buffer must be a torch.Tensor"):
        ContextParallelDecode(solo_group, bytearray(16))
    with monkeypatch.context() as m:
        m.setattr(cpd, "_backend_name", lambda group: "nccl")
        with pytest.raises(ValueError, match="backend 'nccl' cannot exchange CPU tensors"):
            ContextParallelDecode(solo_group, ws)
    with monkeypatch.context() as m:
        m.setattr(dist, "is_initialized", lambda: False)
        with pytest.raises(ValueError, match="torch.distributed is not initialized"):
            ContextParallelDecode(None, ws)
    with monkeypatch.context() as m:  # a group this process is not in (get_rank's -1): one rank cannot build it
        m.setattr(dist, "get_rank", lambda group=None: -1)
        with pytest.raises(ValueError, match="this process is not a member of process_group"):
            ContextParallelDecode(solo_group, ws)
    with monkeypatch.context() as m:  # a metadata group over other ranks: one rank cannot build it either
        spans = iter([[0, 1], [1, 0]])
        m.setattr(dist, "get_process_group_ranks", lambda group: next(spans))
        with pytest.raises(ValueError, match=r"metadata_group spans global ranks \[1, 0\] but process_group spans "
                                             r"\[0, 1\]; both must hold the same ranks in the same order"):
            ContextParallelDecode(solo_group, ws, metadata_group=solo_group)
    cp = ContextParallelDecode(solo_group, ws, backend="torch")
    b = _solo_batch(2, (13, 2, 30))
    with pytest.raises(ValueError, match="ContextParallelDecode.run: run\\(\\) was called before plan\\(\\)"):
        cp.run(b.q, b.cache)
    cp.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4, q_data_type=torch.bfloat16, q_len_per_req=2)
    with pytest.raises(ValueError, match=r"q has shape \(3, 4, 64\); expected \(6, 4, 64\)"):
        cp.run(b.q[:3], b.cache)
    with pytest.raises(ValueError, match="q has dtype torch.float16; expected torch.bfloat16"):
        cp.run(b.q.half(), b.cache)
    with pytest.raises(ValueError, match="out has dtype torch.float16"):
        cp.run(b.q, b.cache, out=torch.empty(b.q.shape, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"lse has shape \(6, 3\)"):
        cp.run(b.q, b.cache, lse=torch.empty(6, 3), return_lse=True)
    with pytest.raises(NotImplementedError, match="run\\(\\) argument\\(s\\) scale_q are not served"):
        cp.run(b.q, b.cache, scale_q=torch.ones(1))
    with pytest.raises(NotImplementedError, match="run\\(\\) takes q, paged_kv_cache and the keywords"):
        cp.run(b.q, b.cache, torch.ones(1))
    with pytest.raises(ValueError, match="window_left=4 given to run\\(\\) differs from the plan's -1"):
        cp.run(b.q, b.cache, window_left=4)
    # FlashInfer's decode run() keywords: q_scale (as k_scale), enable_pdl, window_left=-1, sinks=None
    assert torch.equal(cp.run(b.q, b.cache, q_scale=2.0, enable_pdl=True, window_left=-1, sinks=None),
                       cp.run(b.q, b.cache, k_scale=2.0))
    with pytest.raises(ValueError, match="ContextParallelDecode.run: k cache has dtype torch.float16"):
        cp.run(b.q, b.cache.half())
    with pytest.raises(ValueError, match="k has dtype torch.float8_e4m3fn but v has dtype torch.bfloat16"):
        cp.run(b.q, (b.cache[:, 0].to(E4M3), b.cache[:, 1]))
    with pytest.raises(ValueError, match="k_scale=-1.0 must be a positive finite float"):
        cp.run(b.q, b.cache, k_scale=-1.0)
    with pytest.raises(ValueError, match="ContextParallelDecode.run: k cache is on meta; expected cpu"):
        cp.run(b.q, b.cache.to("meta"))
    with pytest.raises(ValueError, match=r"ContextParallelDecode.run: k cache has shape \(17, 4, 2, 32\)"):
        cp.run(b.q, torch.zeros(17, 2, 4, 2, 32, dtype=torch.bfloat16))


# ---------------------------------------------------------------- several ranks, spawned (gloo on the CPU)

# name -> case; pages_per_rank rows are requests, columns ranks (None: the default cut).
CASES = {
    # 2 ranks, torch backend
    "w2-torch-k1": dict(backend="torch", k=1, kv_lens=[37, 0, 3, 60], ppr=None,  # request 2: rank 0 holds nothing
                        meta=True),
    "w2-torch-k3-uneven": dict(backend="torch", k=3, kv_lens=[37, 9, 33, 60],
                               ppr=[[9, 1], [0, 3], [8, 1], [15, 0]]),
    "w2-torch-k2-fp8-hnd": dict(backend="torch", k=2, kv_lens=[30, 9, 17], ppr=[[7, 1], [1, 2], [0, 5]],
                                kv_dtype=E4M3, layout="HND", dtype=torch.float16),
    # 2 ranks, the Triton kernels (interpreter)
    "w2-triton-k1-split": dict(backend="triton", k=1, kv_lens=[70, 0, 5], ppr=[[10, 8], [0, 0], [2, 0]],
                               dtype=torch.float16, split=dict(fixed_split_size=4)),  # 4 pages of 4 keys
    "w2-triton-k3-uneven": dict(backend="triton", k=3, kv_lens=[33, 9, 18, 60], ppr=[[8, 1], [3, 0], [4, 1], [14, 1]]),
    "w2-triton-k2-fp8-tc": dict(backend="triton", k=2, kv_lens=[21, 7], ppr=[[5, 1], [0, 2]], kv_dtype=E5M2,
                                tc=True, tuple_cache=True),
    # 4 ranks
    "w4-torch-k1": dict(backend="torch", k=1, kv_lens=[61, 6, 0, 17], ppr=None),
    "w4-torch-k3-uneven-softcap": dict(backend="torch", k=3, kv_lens=[45, 6, 30],
                                       ppr=[[3, 0, 8, 1], [0, 1, 0, 1], [2, 3, 0, 3]],
                                       opts=dict(logits_soft_cap=5.0, sm_scale=0.2)),
    "w4-triton-k2-fp8": dict(backend="triton", k=2, kv_lens=[29, 40], ppr=[[1, 4, 0, 3], [0, 9, 1, 0]],
                             kv_dtype=E4M3),
}
HEADS, HEAD_DIM, PAGE_SIZE, SCALES = (4, 2), 64, 4, (0.6, 1.7)
GPU_CASES = {
    "gpu-k1": dict(backend="triton", k=1, kv_lens=[4000, 0, 1500, 33], ppr=None, heads=(32, 8), head_dim=128,
                   page_size=16),
    "gpu-k3-uneven": dict(backend="triton", k=3, kv_lens=[3000, 700], ppr=[[180, 8], [43, 1]], heads=(32, 8),
                          head_dim=128, page_size=16, meta=True),
    "gpu-k2-fp8": dict(backend="triton", k=2, kv_lens=[2049, 5000], ppr=None, heads=(32, 8), head_dim=128,
                       page_size=16, kv_dtype=E4M3),
}


def _case_batch(name, c, device):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    k, dtype, kv_dtype = c["k"], c.get("dtype", torch.bfloat16), c.get("kv_dtype")
    hq, hkv = c.get("heads", HEADS)
    b = make_paged_batch(gen, qo_lens=[k] * len(c["kv_lens"]), kv_lens=c["kv_lens"], num_qo_heads=hq,
                         num_kv_heads=hkv, head_dim=c.get("head_dim", HEAD_DIM),
                         page_size=c.get("page_size", PAGE_SIZE),
                         dtype=torch.float32, kv_layout=c.get("layout", "NHD"), tuple_cache=c.get("tuple_cache", False))
    b.q = b.q.to(dtype)
    b.cache = tuple(t.to(kv_dtype or dtype) for t in b.cache) if isinstance(b.cache, tuple) else \
        b.cache.to(kv_dtype or dtype)
    return b


def _poisoned(cache, keep):
    """A copy of the cache on which every page outside `keep` is NaN: a rank must read only its own pages."""
    parts = cache if isinstance(cache, tuple) else (cache,)
    out = []
    for t in parts:
        p = t.float().clone()
        others = torch.ones(p.shape[0], dtype=torch.bool)
        others[keep.long()] = False
        p[others] = float("nan")
        out.append(p.to(t.dtype))
    return tuple(out) if isinstance(cache, tuple) else out[0]


def _check_case(name, c, group, meta, rank, world, device):
    b = _case_batch(name, c, "cpu")
    k, dtype, layout = c["k"], c.get("dtype", torch.bfloat16), c.get("layout", "NHD")
    hq, hkv = c.get("heads", HEADS)
    d, ps = c.get("head_dim", HEAD_DIM), c.get("page_size", PAGE_SIZE)
    kv_dtype = c.get("kv_dtype")
    scales = dict(zip(("k_scale", "v_scale"), SCALES)) if kv_dtype is not None else {}
    shard = shard_page_table(b.kv_indptr, b.kv_indices, b.last_page_len, ps, world, rank, pages_per_rank=c["ppr"])
    mine = _poisoned(b.cache, shard[1])
    to = (lambda t: tuple(x.to(device) for x in t) if isinstance(t, tuple) else t.to(device))
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    cp = ContextParallelDecode(group, ws, layout, use_tensor_cores=c.get("tc", False), backend=c["backend"],
                               metadata_group=meta if c.get("meta") else None)
    assert (cp.rank, cp.world_size) == (rank, world)
    opts = c.get("opts", {})
    cp.plan(*shard, hq, hkv, d, ps, q_data_type=dtype, kv_data_type=kv_dtype, q_len_per_req=k, **opts,
            **c.get("split", {}))
    q = b.q.to(device)
    out, lse = nan_like(q.shape, dtype, device), nan_like(q.shape[:2], torch.float32, device)
    cp.run(q, to(mine), out=out, lse=lse, return_lse=True, **scales)
    assert not torch.isnan(out).any(), name

    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             kv_layout=layout, causal=k > 1, **scales, **opts)
    assert rel_err(out, ref_out) < tolerance(dtype), (name, rank, rel_err(out, ref_out))
    check_lse(lse, ref_lse)
    # the single-process wrapper on the whole table, same backend: equal within the merge's rounding
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=c.get("tc", False),
                                                     backend=c["backend"])
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, ps, q_data_type=dtype, kv_data_type=kv_dtype,
           q_len_per_req=k, **opts)
    one_out, one_lse = w.run(q, to(b.cache), return_lse=True, **scales)
    assert rel_err(out, one_out) < tolerance(dtype), (name, rank, rel_err(out, one_out))
    check_lse(lse, one_lse)
    # every rank holds the same answer, bitwise, and a second run repeats it
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out, group=group)
    assert all(torch.equal(g, out) for g in gathered), name
    if c["backend"] == "torch":  # (the interpreter is slow: the kernels' repeatability is tested elsewhere)
        out2, lse2 = cp.run(q, to(mine), return_lse=True, **scales)
        assert torch.equal(out2, out) and torch.equal(lse2, lse), name


def _expect(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _cross_rank_refusals(group, rank, world, device):
    """Refusals that only several ranks can see: each raises on every rank, and nothing is installed."""
    assert world == 2
    b = _case_batch("refusals", dict(k=1, kv_lens=[14, 9]), "cpu")
    shard = shard_page_table(b.kv_indptr, b.kv_indices, b.last_page_len, 4, world, rank)
    args = (4, 2, 64, 4)
    cp = ContextParallelDecode(group, torch.empty(1 << 16, dtype=torch.uint8), backend="torch")
    cp.plan(*shard, *args, q_data_type=torch.bfloat16)
    before = cp.run(b.q, b.cache)
    plan = cp._plan
    one = shard_page_table(b.kv_indptr[:2], b.kv_indices, b.last_page_len[:1], 4, world, rank)
    _expect(ValueError, r"plan: batch differs between ranks \(rank 0: 2, rank 1: 1\); every rank must plan",
            lambda: cp.plan(*(shard if rank == 0 else one), *args, q_data_type=torch.bfloat16))
    _expect(ValueError, r"kv_data_type differs between ranks \(rank 0: bfloat16, rank 1: float8_e4m3fn\)",
            lambda: cp.plan(*shard, *args, q_data_type=torch.bfloat16,
                            kv_data_type=E4M3 if rank else None))
    _expect(ValueError, "plan: indptr has dtype torch.int64" if rank == 0 else
            r"rank 0 refused its plan\(\) arguments \(its own error names them\); no rank installed this plan",
            lambda: cp.plan(shard[0].long() if rank == 0 else shard[0], *shard[1:], *args,
                            q_data_type=torch.bfloat16))
    _expect(NotImplementedError, "pos_encoding_mode='ROPE_LLAMA' is not served" if rank == 1 else
            r"rank 1 refused its plan\(\) arguments",
            lambda: cp.plan(*shard, *args, q_data_type=torch.bfloat16,
                            pos_encoding_mode="ROPE_LLAMA" if rank else "NONE"))
    _expect(ValueError, "q_len_per_req=3 needs kv_len >= 3 for every request .* request 1 has kv_len=2 over all",
            lambda: _short_verify(cp, rank, world))
    assert cp._plan is plan and torch.equal(cp.run(b.q, b.cache), before)
    # refused late, by one rank's decode wrapper (its workspace is too small for the split): raised everywhere
    long = shard_page_table(*_table([140, 9], 4), 4, world, rank)  # 70 keys a rank: split in 8-page chunks
    small = ContextParallelDecode(group, torch.empty(64 if rank else 1 << 16, dtype=torch.uint8), backend="triton")
    _expect(ValueError, r"float_workspace_buffer holds 64 bytes" if rank else r"rank 1 refused its plan\(\)",
            lambda: small.plan(*long, *args, q_data_type=torch.bfloat16, fixed_split_size=8))
    assert small._plan is None


def _short_verify(cp, rank, world):
    """q_len_per_req=3 over a request of 2 keys in all (rank 0 holds them): every rank refuses the same way."""
    indptr, indices, last = _table([8, 2], 4)
    shard = shard_page_table(indptr, indices, last, 4, world, rank, pages_per_rank=[[1, 1], [1, 0]])
    cp.plan(*shard, 4, 2, 64, 4, q_data_type=torch.bfloat16, q_len_per_req=3)


def _worker(rank, world, store_path, dist_backend, device_kind, steps):
    """steps: (ranks, case names) in order; a step over fewer ranks than the world runs on a new_group of them
    (every rank creates it; the others go on to the next step and wait there)."""
    device = "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(dist_backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for ranks, names in steps:
            group = dist.new_group(ranks, backend=dist_backend) if len(ranks) < world else None
            meta = dist.new_group(ranks, backend="gloo")  # plan()'s exchanges on the CPU, for cases with "meta"
            if rank not in ranks:
                continue
            for name in names:
                if name == "refusals":
                    _cross_rank_refusals(group, ranks.index(rank), len(ranks), device)
                else:
                    _check_case(name, {**CASES, **GPU_CASES}[name], group, meta, ranks.index(rank), len(ranks),
                                device)
    finally:
        dist.destroy_process_group()


def _spawn(world, tmp_path, steps, dist_backend="gloo", device_kind="cpu"):
    # CPU ranks run the Triton kernels through the interpreter also on a GPU machine: the spawned processes
    # read TRITON_INTERPRET when they import triton, so it is set in the environment they inherit.
    saved = os.environ.get("TRITON_INTERPRET")
    if device_kind == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        mp.spawn(_worker, args=(world, str(tmp_path / "store"), dist_backend, device_kind, steps), nprocs=world)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.mark.skipif(tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4),
                    reason="CPU ranks run Triton's interpreter, which fails on numpy >= 2.4 (scripts/test.sh pins "
                           "numpy<2.4; the GPU machine ships 2.4)")
def test_two_and_four_ranks_gloo(tmp_path):
    """One spawn of 4 processes (process start-up is most of the cost): first 2 ranks on a subgroup (both
    backends, k = 1, 2, 3, uneven and empty shards, fp8 caches, HND, a tuple cache, and the cross-rank
    refusals), then all 4 on the default group."""
    _spawn(4, tmp_path, [([0, 1], [n for n in CASES if n.startswith("w2-")] + ["refusals"]),
                         ([0, 1, 2, 3], [n for n in CASES if n.startswith("w4-")])])


@pytest.mark.gpu
def test_two_ranks_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs for 2 NCCL ranks; this machine has {torch.cuda.device_count()}")
    _spawn(2, tmp_path, [([0, 1], list(GPU_CASES))], dist_backend="nccl", device_kind="cuda")


def test_plan_binds_by_position_in_flashinfer_07_order(solo_group):
    """As the decode wrapper: the optional arguments after page_size bind by position in FlashInfer 0.7's order
    (o_data_type sixth), at most 16 of them."""
    b = _solo_batch(1, (13, 2, 30))
    cp = ContextParallelDecode(solo_group, torch.empty(1 << 16, dtype=torch.uint8), backend="torch")
    with pytest.raises(ValueError, match="plan\\(\\) takes at most 16 optional arguments by position after page_size"):
        cp.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4, "NONE", -1, None, torch.bfloat16, None,
                *([None] * 12))
    cp.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4, "NONE", -1, None, torch.bfloat16, None,
            torch.bfloat16)
    assert cp._plan is not None and cp._plan.o_dtype == torch.bfloat16
    cp.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4, "NONE", -1, None, torch.bfloat16, None,
            window_right=0)  # a FlashInfer keyword at its no-op value
    assert cp._plan is not None
