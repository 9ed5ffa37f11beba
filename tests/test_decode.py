"""Decode family against the float64 reference: both routes, split-KV forced off / 2 chunks / many chunks."""
import itertools
import zlib

import numpy as np
import pytest
import torch

import serveattn
from serveattn import decode, reference
from helpers import check_lse, fp8_decode_runs, make_paged_batch, nan_like, rel_err, run_under_switch, tolerance

GQA = [(4, 4), (8, 2), (8, 1)]
SPLITS = ["off", "two", "many"]


def _cases():
    cases = []
    cycle = itertools.cycle(itertools.product(["NHD", "HND"], GQA, [1, 16, 5], ["5d", "tuple", "view"],
                                              ["plain", "window", "soft_cap"]))
    for dtype, head_dim, split in itertools.product([torch.float16, torch.bfloat16], [64, 128, 256], SPLITS):
        layout, heads, page_size, form, variant = next(cycle)
        cases.append(pytest.param(dtype, head_dim, split, layout, heads, page_size, form, variant,
                                  id=f"{str(dtype)[6:]}-d{head_dim}-split_{split}-{layout}-g{heads[0] // heads[1]}"
                                     f"-p{page_size}-{form}-{variant}"))
    return cases


def _opts(variant):
    return {"plain": {}, "window": {"window_left": 9}, "soft_cap": {"logits_soft_cap": 4.0, "sm_scale": 0.2}}[variant]


def _split_kwargs(split, kv_lens, page_size):
    """plan()'s split arguments; fixed_split_size counts pages (FlashInfer's unit)."""
    if split == "off":
        return {"disable_split_kv": True}
    if split == "two":  # about half the longest request's pages
        return {"fixed_split_size": -(-((max(kv_lens) + 1) // 2) // page_size)}
    return {"fixed_split_size": 1}  # one page: the kernel's block, many chunks


@pytest.mark.parametrize("dtype,head_dim,split,layout,heads,page_size,form,variant", _cases())
@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_decode_against_reference(dtype, head_dim, split, layout, heads, page_size, form, variant, use_tensor_cores,
                                  device):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{head_dim}{split}{use_tensor_cores}".encode()))
    hq, hkv = heads
    kv_lens = [int(x) for x in torch.randint(1, 300, (4,), generator=gen)]
    kv_lens[0] = 300
    kv_lens[1] = 0  # an empty request: its row comes out 0 / -inf
    b = make_paged_batch(gen, qo_lens=[1] * 4, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                         page_size=page_size, dtype=dtype, kv_layout=layout, tuple_cache=form == "tuple",
                         non_contiguous=form == "view", device=device)
    opts = _opts(variant)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device), layout,
                                                     use_tensor_cores=use_tensor_cores, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, head_dim, page_size, q_data_type=dtype,
           **opts, **_split_kwargs(split, kv_lens, page_size))
    if not use_tensor_cores and split != "off":
        chunk = w._plan.chunk  # the split really happened, into as many chunks as the chunk size says
        assert chunk is not None and w._plan.num_slots == sum(-(-kv // chunk) for kv in kv_lens if kv > chunk)
        assert w._plan.num_slots >= 2
    out = nan_like(b.q.shape, dtype, device)
    lse = nan_like(b.q.shape[:2], torch.float32, device)
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    assert not torch.isnan(out).any()
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             kv_layout=layout, **opts)
    assert rel_err(out, ref_out) < tolerance(dtype)
    check_lse(lse, ref_lse)
    out2, lse2 = w.run(b.q, b.cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)

    # batch against single-request decode on each request's contiguous K/V
    k, v, kv_indptr = reference.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, layout)
    for i, kv in enumerate(kv_lens):
        if kv == 0:
            continue
        ki, vi = k[int(kv_indptr[i]):int(kv_indptr[i + 1])], v[int(kv_indptr[i]):int(kv_indptr[i + 1])]
        if layout == "HND":
            ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)
        s_out, s_lse = serveattn.single_decode_with_kv_cache(b.q[i], ki, vi, kv_layout=layout, backend="triton",
                                                             use_tensor_cores=use_tensor_cores, return_lse=True,
                                                             **opts)
        assert rel_err(s_out, out[i]) < tolerance(dtype)
        check_lse(s_lse[None], lse[i:i + 1])


def test_split_counts_agree(device):
    """1, 2 and many chunks all match the reference; each split setting is bitwise repeatable."""
    gen = torch.Generator().manual_seed(21)
    kv_lens = [300, 5, 0, 129]  # request 2 empty: its row 0 / -inf under every split
    b = make_paged_batch(gen, qo_lens=[1] * 4, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    for kw in ({"disable_split_kv": True}, {"fixed_split_size": 10}, {"fixed_split_size": 2}, {}):  # pages of 16
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16, **kw)
        out, lse = w.run(b.q, b.cache, return_lse=True)
        assert rel_err(out, ref_out) < 1e-2, kw
        check_lse(lse, ref_lse)
        again = w.run(b.q, b.cache, return_lse=True)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


def test_fixed_split_size_counts_pages(device):
    """FlashInfer's unit (its planners multiply the chunk by page_size): fixed_split_size=N cuts a paged cache into
    chunks of N pages, N x page_size keys rounded up to the kernel's block, on both decode routes and in the paged
    prefill wrapper; the ragged wrapper's K/V rows count one each."""
    gen = torch.Generator().manual_seed(31)
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)

    def rounded(keys, block):
        return -(-keys // block) * block

    for page_size in (4, 16):
        b = make_paged_batch(gen, qo_lens=[1, 1], kv_lens=[900, 77], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                             page_size=page_size, dtype=torch.bfloat16, device=device)
        table = (b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, page_size)
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(*table, q_data_type=torch.bfloat16, fixed_split_size=5)
        assert w._plan.chunk == rounded(5 * page_size, w._plan.tiles.block_n), page_size
        tc = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
        tc.plan(*table, q_data_type=torch.bfloat16, fixed_split_size=5)
        inner = tc._prefill._plan
        assert inner.split_chunk == rounded(5 * page_size, inner.tiles.block_n), page_size
        p = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
        p.plan(b.qo_indptr, *table, causal=True, q_data_type=torch.bfloat16, fixed_split_size=5)
        assert p._plan.split_chunk == rounded(5 * page_size, p._plan.tiles.block_n), page_size
    r = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="triton")
    qo, kv = (torch.tensor(x, dtype=torch.int32, device=device) for x in ([0, 1, 2], [0, 900, 977]))
    r.plan(qo, kv, 8, 2, 64, causal=True, q_data_type=torch.bfloat16, fixed_split_size=5)
    assert r._plan.split_chunk == rounded(5, r._plan.tiles.block_n)


def test_split_rule_and_its_measuring_knobs(monkeypatch):
    """choose_chunk on the H200's 132 SMs: split while batch x KV heads is under 2 programs an SM, into a power of
    two of chunks of at least MIN_CHUNK tokens (multiples of the tile), at most MAX_SLOTS (32) a request;
    SERVEATTN_DECODE_MAX_SLOTS overrides the cap (measuring only; 0: no cap)."""
    from serveattn.decode import choose_chunk

    def chunk(kv_lens, heads=8):
        return choose_chunk(np.array(kv_lens), heads, 132, 64, None, False)
    assert (chunk([16384]), chunk([8192]), chunk([4096] * 8), chunk([2048] * 32), chunk([1024] * 64)) == \
        (512, 256, 512, 1024, None)
    assert (chunk([32768]), chunk([16384], heads=1), chunk([16384] * 2)) == (1024, 512, 512)
    monkeypatch.setenv("SERVEATTN_DECODE_MAX_SLOTS", "16")
    assert (chunk([16384]), chunk([8192]), chunk([4096] * 8)) == (1024, 512, 512)
    monkeypatch.setenv("SERVEATTN_DECODE_MAX_SLOTS", "0")
    assert (chunk([16384]), chunk([32768])) == (256, 512)


def test_ragged_split_of_a_full_gpu(monkeypatch):
    """A batch that fills the GPU (batch x KV heads >= 2 programs an SM) is split only where its longest request
    holds more keys than a program would with the batch spread evenly (per_program): into power-of-two chunks of
    per_program / SERVEATTN_DECODE_RAGGED_SPLIT (2 by default; 0: off), never below MIN_CHUNK nor into more than
    MAX_SLOTS chunks; equal lengths are never split."""
    from serveattn.decode import choose_chunk

    def chunk(kv_lens, heads=8):
        return choose_chunk(np.array(kv_lens), heads, 132, 64, None, False)
    outlier = [1024] * 127 + [32768]  # per_program: (127 x 1024 + 32768) x 8 // 264 = 4933 keys
    monkeypatch.setenv("SERVEATTN_DECODE_RAGGED_SPLIT", "0")
    assert chunk(outlier) is None
    monkeypatch.setenv("SERVEATTN_DECODE_RAGGED_SPLIT", "1")
    assert (chunk(outlier), chunk([1024] * 127 + [4096]), chunk([1024] * 127 + [3072]), chunk([8192] * 33)) == \
        (4096, 2048, None, None)  # per_program 4065 and 4033
    assert chunk([1] * 200 + [32768]) == 1024  # per_program 1017: 512, but at most 32 chunks of 32768
    monkeypatch.setenv("SERVEATTN_DECODE_RAGGED_SPLIT", "2")
    assert (chunk(outlier), chunk([16] * 300 + [600])) == (2048, 256)  # per_program 163: 64, below MIN_CHUNK
    monkeypatch.delenv("SERVEATTN_DECODE_RAGGED_SPLIT")
    assert chunk(outlier) == 2048  # the default


def test_ragged_split_of_a_small_batch(monkeypatch):
    """A batch too small to fill the GPU cuts its longest request into as many chunks as fill it, unless that leaves
    a chunk of more than a program's share plus a tile (one long request among short ones): then the ragged cut
    (prefill.uneven_chunk). SERVEATTN_DECODE_RAGGED_SPLIT=0 keeps the even cut; equal lengths never change."""
    from serveattn.decode import choose_chunk

    def chunk(kv_lens, heads=8):
        return choose_chunk(np.array(kv_lens), heads, 132, 64, None, False)
    outlier = [1024] * 31 + [32768]  # 256 programs; per_program (31 x 1024 + 32768) x 8 // 264 = 1954 keys
    assert (chunk(outlier), chunk([1024] * 15 + [32768])) == (1024, 1024)
    assert chunk([100] * 3 + [20000]) == 640  # per_program 615: 256, but at most 32 chunks of 20000
    assert chunk([4096] * 7 + [8192]) == 1024  # per_program 1117: 1117 + 64 > 1024, the even cut holds
    near = [8192 - 800 + 100 * i for i in range(17)]  # 17 x 8192 +-10%, 4 KV heads: even 2304 > share 2110 + 64
    assert chunk(near, 4) == 2304  # no request stands out (prefill.stands_out): the even cut holds (ragged: 1024)
    mid = [2000] * 15 + [6000]  # 4 even chunks of 1536 for a per_program of 1090: over a share and a tile
    assert chunk(mid) == 512
    monkeypatch.setenv("SERVEATTN_DECODE_RAGGED_SPLIT", "0")
    assert (chunk(outlier), chunk([100] * 3 + [20000])) == (16384, 1280)
    even = {}
    for heads, batch, kv in itertools.product((1, 2, 8), (1, 2, 3, 7, 16, 32), (1, 63, 257, 1000, 4096, 32768)):
        even[heads, batch, kv] = chunk([kv] * batch, heads)
    monkeypatch.delenv("SERVEATTN_DECODE_RAGGED_SPLIT")
    assert all(chunk([kv] * batch, heads) == c for (heads, batch, kv), c in even.items())


@pytest.mark.parametrize("chunk", [None, 64])
def test_work_items_carry_their_requests_kv(chunk):
    """Each work item holds what the kernel would otherwise read after it (a dependent trip to memory): its
    request's first page and KV length, and its first slot and slot count, the same as the request arrays the merge
    kernel reads; chunks tile each request's KV in order."""
    from serveattn.decode import build_decode_work
    from serveattn.kernels.decode import ITEM_INTS

    kv = np.array([200, 0, 64, 65, 9])
    start = np.array([3, 17, 17, 21, 26])  # pages: any increasing starts
    work, n, first_slot, num_slots, total = build_decode_work(kv, start, chunk)
    items = work.reshape(n, ITEM_INTS)
    assert work.dtype == np.int32 and n == len(items)
    req, lo, hi, slot, kv_start, kv_len, item_first, item_slots = items.T
    assert np.array_equal(kv_start, start[req]) and np.array_equal(kv_len, kv[req])
    assert np.array_equal(item_first, first_slot[req]) and np.array_equal(item_slots, num_slots[req])
    for r in range(kv.size):
        mine = items[req == r]
        assert mine[0, 1] == 0 and mine[-1, 2] == kv[r] and np.array_equal(mine[1:, 1], mine[:-1, 2])
        split = len(mine) > 1
        assert num_slots[r] == (len(mine) if split else 0)
        assert np.array_equal(mine[:, 3], first_slot[r] + np.arange(len(mine)) if split else [-1])
    assert total == num_slots.sum() == (4 + 2 if chunk else 0)


def test_equal_lengths_build_the_general_work_list():
    """build_decode_work's path for requests of one length (broadcast from one request's chunks) gives the general
    split path's arrays, dtypes and counts exactly: lengths at, below and past a chunk multiple, empty requests, one
    chunk, both orders, int32 and int64 inputs."""
    from serveattn.decode import _split_decode_work, build_decode_work

    rng = np.random.default_rng(52)
    for _ in range(400):
        batch, kv_len = int(rng.integers(1, 40)), int(rng.choice([0, 1, 255, 256, 257, 4096, int(rng.integers(0, 9000))]))
        chunk = int(rng.choice([16, 64, 256, 1000, 4096]))
        kv = np.full(batch, kv_len, dtype=rng.choice([np.int32, np.int64]))
        start = np.sort(rng.integers(0, 10 ** 6, batch)).astype(rng.choice([np.int32, np.int64]))
        for costliest_first in (False, True):
            fast, general = build_decode_work(kv, start, chunk, costliest_first), \
                _split_decode_work(kv, start, chunk, costliest_first)
            assert fast[1] == general[1] and fast[4] == general[4]
            for a, b in ((fast[0], general[0]), (fast[2], general[2]), (fast[3], general[3])):
                assert a.dtype == b.dtype == np.int32 and np.array_equal(a, b)


@pytest.mark.parametrize("q_len", [1, 3])
def test_fused_merge_is_the_merge_kernel(q_len, device, monkeypatch):
    """The split-KV fold done by each (request, KV head)'s last decode program gives the merge kernel's bits (one
    request with many chunks, one with two, one empty (decode) or short, one unsplit); its completion counts are
    zero after every run, so the next run (or graph replay) starts clean; the result matches the reference."""
    from serveattn.kernels import decode as decode_kernel

    gen = torch.Generator().manual_seed(33 + q_len)
    kv_lens = [700, 100, 0 if q_len == 1 else q_len, 20]  # a chain needs kv_len >= its draft tokens
    b = make_paged_batch(gen, qo_lens=[q_len] * 4, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(decode_kernel, "MERGE_MODE", "1" if fused else "0")
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
               fixed_split_size=2, q_len_per_req=q_len)
        chunk = w._plan.chunk  # 2 pages of 16 keys, rounded up to the kernel's block
        assert w._plan.num_slots == sum(-(-kv // chunk) for kv in kv_lens if kv > chunk) >= 4
        out = nan_like(b.q.shape, torch.bfloat16, device)
        lse = nan_like(b.q.shape[:2], torch.float32, device)
        w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
        again = w.run(b.q, b.cache, return_lse=True)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
        assert (w._done_count is not None) == fused
        if fused:
            assert int(w._done_count.abs().sum()) == 0
        results[fused] = (out, lse)
    assert torch.equal(results[False][0], results[True][0]) and torch.equal(results[False][1], results[True][1])
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True)
    assert rel_err(results[True][0], ref_out) < 1e-2
    check_lse(results[True][1], ref_lse)


@pytest.mark.parametrize("q_len", [1, 3])
def test_merge_a_query_head_a_program(q_len, device, monkeypatch):
    """SERVEATTN_DECODE_FUSED_MERGE=heads: merge_kernel folds each query head in a program of its own (GROUP 1 and
    one row a draft token): every row written, the reference's result, the same bits run to run."""
    from serveattn.kernels import decode as decode_kernel

    monkeypatch.setattr(decode_kernel, "MERGE_MODE", "heads")
    gen = torch.Generator().manual_seed(44 + q_len)
    kv_lens = [500, 0 if q_len == 1 else q_len, 90]
    b = make_paged_batch(gen, qo_lens=[q_len] * 3, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device),
                                                      backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
           fixed_split_size=4, q_len_per_req=q_len)
    assert w._plan.num_slots >= 8 and w._done_count is None
    out = nan_like(b.q.shape, torch.bfloat16, device)
    lse = nan_like(b.q.shape[:2], torch.float32, device)
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    again = w.run(b.q, b.cache, return_lse=True)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True)
    assert not out.isnan().any() and rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse)


def test_merge_kind_follows_the_rows_a_kv_head(monkeypatch):
    """Unforced, a split request is folded in the decode kernel below 8 rows a KV head (group x draft tokens); from 8
    rows by merge_kernel a query head a program where a request has 16 chunks or more, or where the batch must not
    decide (fixed_split_size; the fused fold is serial in its rows and chunks; docs/performance.md)."""
    from serveattn.kernels import decode as decode_kernel

    monkeypatch.setattr(decode_kernel, "MERGE_MODE", "auto")
    kind = decode_kernel.merge_kind
    # the batch may not decide (fixed_split_size): the rows alone
    assert [kind(g, 1, None) for g in (1, 2, 4, 8, 16)] == ["fused"] * 3 + ["heads"] * 2
    assert kind(4, 2, None) == kind(1, 8, None) == "heads" and kind(1, 7, None) == "fused"
    # a default plan: from 16 chunks a request (the fused fold's wait grows with rows x chunks)
    assert [kind(8, 1, np.array([0, c])) for c in (0, 2, 8, 15, 16, 32)] == ["fused"] * 4 + ["heads"] * 2
    assert kind(4, 1, np.array([32])) == "fused" and kind(4, 2, np.array([16])) == "heads"
    assert kind(8, 1, np.zeros(0, dtype=np.int32)) == "fused"  # an empty batch
    for mode, forced in (("1", "fused"), ("0", "kv_heads"), ("heads", "heads")):
        monkeypatch.setattr(decode_kernel, "MERGE_MODE", mode)
        assert kind(8, 1, None) == kind(1, 1, np.array([32])) == kind(8, 1, np.array([2])) == forced


def test_cuda_graph_plans_pick_the_merge_by_their_capacity():
    """Under CUDA graphs the fold follows the batch the graph was captured for: the chunks a long request gets when
    the batch fills the capacity (H200: 132 SMs, 264 programs the split's target), so group 8 takes merge_kernel a
    query head up to 4 requests of 8 KV heads (16 chunks or more) and the fused fold from 8 (8 chunks, 2 at 32, the
    ragged split's regime from 33)."""
    from serveattn.kernels import decode as decode_kernel
    chunks = [int(decode.capacity_chunks(cap, 8, 132)[0]) for cap in (1, 2, 4, 5, 8, 32, 33, 256)]
    assert chunks == [32, 32, 16, 8, 8, 2, 0, 0]
    kinds = [decode_kernel.merge_kind(8, 1, decode.capacity_chunks(cap, 8, 132)) for cap in (1, 4, 5, 32, 64)]
    assert kinds == ["heads", "heads", "fused", "fused", "fused"]
    assert decode_kernel.merge_kind(4, 1, decode.capacity_chunks(1, 8, 132)) == "fused"  # 4 rows: fused always


def test_capacity_chunks_memo_follows_the_split_switches(monkeypatch):
    """capacity_chunks is memoized (each CUDA-graph re-plan asks) on its arguments and the split switches it reads:
    the same read-only array again, a new answer once a switch changes."""
    first = decode.capacity_chunks(4, 8, 132)
    assert decode.capacity_chunks(4, 8, 132) is first and not first.flags.writeable
    monkeypatch.setenv("SERVEATTN_DECODE_MAX_SLOTS", "8")
    assert int(decode.capacity_chunks(4, 8, 132)[0]) == 8
    monkeypatch.setenv("SERVEATTN_DECODE_PROGRAMS_PER_SM", "1")
    assert int(decode.capacity_chunks(4, 8, 132)[0]) == 8 and int(decode.capacity_chunks(17, 8, 132)[0]) == 0
    monkeypatch.delenv("SERVEATTN_DECODE_MAX_SLOTS")
    monkeypatch.delenv("SERVEATTN_DECODE_PROGRAMS_PER_SM")
    assert decode.capacity_chunks(4, 8, 132) is first


def test_default_plans_pick_the_merge_by_their_chunks(device, monkeypatch):
    """Group 8 without a fixed split (the H200's 132 SMs): one long request cut into many chunks is folded by
    merge_kernel, a batch whose requests have few chunks by the decode kernel; both give the reference's result with
    every row written."""
    monkeypatch.setattr(decode, "_num_sms", lambda _device: 132)
    gen = torch.Generator().manual_seed(61)
    for kv_lens, want in (([4000], "heads"), ([300] * 3, "fused")):
        b = make_paged_batch(gen, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=16, num_kv_heads=2,
                             head_dim=64, page_size=16, dtype=torch.bfloat16, device=device)
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device),
                                                          backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 16, 2, 64, 16, q_data_type=torch.bfloat16)
        assert w._plan.merge == want and w._plan.num_slots, (kv_lens, w._plan.merge, w._plan.num_slots)
        out = nan_like(b.q.shape, torch.bfloat16, device)
        w.run(b.q, b.cache, out=out)
        ref_out, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                           causal=True)
        assert not out.isnan().any() and rel_err(out, ref_out) < 1e-2


def test_one_wrapper_moves_between_merge_kinds(device):
    """A wrapper re-planned from a group that folds in the kernel (group 2) to one that launches merge_kernel (group
    8) and back: each plan's result is a fresh wrapper's bits and the reference's; the completion counts stay zero."""
    gen = torch.Generator().manual_seed(57)
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
    for num_qo_heads in (4, 16, 4):
        b = make_paged_batch(gen, qo_lens=[1] * 3, kv_lens=[600, 0, 130], num_qo_heads=num_qo_heads,
                             num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16, device=device)
        outs = []
        for wrapper in (w, serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty_like(ws), backend="triton")):
            wrapper.plan(b.kv_indptr, b.kv_indices, b.last_page_len, num_qo_heads, 2, 64, 16,
                         q_data_type=torch.bfloat16, fixed_split_size=4)
            assert wrapper._plan.merge == ("heads" if num_qo_heads == 16 else "fused") and wrapper._plan.num_slots
            out = nan_like(b.q.shape, torch.bfloat16, device)
            wrapper.run(b.q, b.cache, out=out)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
        assert w._done_count is None or int(w._done_count.abs().sum()) == 0
        ref_out, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                           causal=True)
        assert rel_err(outs[0], ref_out) < 1e-2


@pytest.mark.parametrize("split", [None, 4])
def test_costliest_first_order_moves_no_bit(split, device, monkeypatch):
    """SERVEATTN_DECODE_ORDER=cost (the default): the plan lists its items with the most keys first (a split
    request's chunks among them); each item carries its own slot, so the result is the request-order plan's, bit
    for bit, every row written, the reference's."""
    gen = torch.Generator().manual_seed(71)
    kv_lens = [90, 700, 0, 330, 41]
    b = make_paged_batch(gen, qo_lens=[1] * 5, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    def planned(order):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device),
                                                          backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
               fixed_split_size=split, disable_split_kv=split is None)
        items = w._plan.work.cpu().numpy().reshape(-1, decode.ITEM_INTS)
        keys = items[:, 2] - items[:, 1]
        assert (np.all(np.diff(keys) <= 0) if order == "cost" else list(items[:, 0]) == sorted(items[:, 0]))
        return w
    results = run_under_switch(monkeypatch, "SERVEATTN_DECODE_ORDER", ("request", "cost"), planned, b.q, b.cache,
                               device)
    assert torch.equal(results["request"][0], results["cost"][0]) and \
        torch.equal(results["request"][1], results["cost"][1])
    out, lse, _ = results["cost"]
    assert not out.isnan().any()
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True)
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("kv_lens,heads,q_len", [
    ([40, 1500, 0, 77, 1, 260], (8, 2), 1),  # on 2 SMs: per_program 939 keys, the 1500-key request in 256s
    ([5000, 30, 7, 100, 64, 3], (8, 1), 1),  # group 8: per_program 1301, 5000 keys in 10 chunks of 512
    ([3, 900, 2, 2, 40], (4, 2), 2),  # a chain of 2 drafts a request: 900 keys in 256s
], ids=["g4", "g8", "chain2"])
def test_ragged_split_against_the_reference(kv_lens, heads, q_len, device):
    """A ragged batch that fills the GPU (on the interpreter's 2 SMs: 4 programs) is split where a request
    outlasts the rest (prefill.ragged_chunk); its rows, long and short, match the reference, every row written, and a
    second run gives the same bits."""
    gen = torch.Generator().manual_seed(36 + len(kv_lens))
    hq, hkv = heads
    b = make_paged_batch(gen, qo_lens=[q_len] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                         head_dim=64, page_size=16, dtype=torch.bfloat16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device),
                                                      backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, 64, 16, q_data_type=torch.bfloat16,
           q_len_per_req=q_len)
    if device == "cpu":
        assert w._plan.chunk is not None
    out, lse = nan_like(b.q.shape, b.q.dtype, device), nan_like(b.q.shape[:2], torch.float32, device)
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    assert not out.isnan().any()
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True)
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse)
    again = w.run(b.q, b.cache, return_lse=True)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


def test_one_plan_serves_every_kind_of_call(device):
    """run() keeps the kernel arguments it derives from the plan per kind of call (with or without the LSE, float or
    tensor scales, K/V of one tensor or two with other strides): every kind, in any order on one plan, gives the
    bits of a fresh plan's first call of that kind."""
    gen = torch.Generator().manual_seed(41)
    b = make_paged_batch(gen, qo_lens=[1] * 3, kv_lens=[200, 7, 90], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    ws = torch.empty(4 << 20, dtype=torch.uint8, device=device)
    k, v = b.cache.unbind(1)
    split_kv = (k.contiguous(), v.clone().transpose(1, 2).contiguous().transpose(1, 2))  # V with other strides
    scales = dict(k_scale=torch.tensor([0.6], device=device), v_scale=torch.tensor([1.7], device=device))
    calls = [
        ("plain", (b.cache,), {}),
        ("lse", (b.cache,), dict(return_lse=True)),
        ("tensor scales", (b.cache,), dict(scales)),
        ("float scales + lse", (b.cache,), dict(k_scale=0.6, v_scale=1.7, return_lse=True)),
        ("two tensors", (split_kv,), {}),
        ("plain again", (b.cache,), {}),
    ]

    def planned():
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
               fixed_split_size=2)
        return w

    def results(r):
        return r if isinstance(r, tuple) else (r,)

    shared = planned()
    for name, args, kwargs in calls:
        got = results(shared.run(b.q, *args, **kwargs))
        want = results(planned().run(b.q, *args, **kwargs))
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want)), name
        scaled = "scales" in name
        ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices,
                                                 b.last_page_len, k_scale=0.6 if scaled else 1.0,
                                                 v_scale=1.7 if scaled else 1.0)
        assert rel_err(got[0], ref_out) < 1e-2, name
        if len(got) == 2:
            check_lse(got[1], ref_lse)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_backends_and_scales(backend, device):
    gen = torch.Generator().manual_seed(4)
    b = make_paged_batch(gen, qo_lens=[1] * 3, kv_lens=[17, 64, 33], num_qo_heads=16, num_kv_heads=2, head_dim=128,
                         page_size=16, dtype=torch.float16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                     backend=backend)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 16, 2, 128, 16, q_data_type=torch.float16,
           o_data_type=torch.bfloat16, fixed_split_size=2)
    assert w.backend == backend
    out, lse = w.run(b.q, b.cache, k_scale=0.7, v_scale=1.5, return_lse=True)
    assert out.dtype == torch.bfloat16
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             k_scale=0.7, v_scale=1.5)
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse)


def test_decode_rope_on_tensor_cores(device):
    gen = torch.Generator().manual_seed(8)
    b = make_paged_batch(gen, qo_lens=[1] * 2, kv_lens=[40, 77], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 16, dtype=torch.uint8, device=device),
                                                     use_tensor_cores=True, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, pos_encoding_mode="ROPE_LLAMA",
           q_data_type=torch.bfloat16)
    out = w.run(b.q, b.cache)
    ref_out, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                       pos_encoding_mode="ROPE_LLAMA")
    assert rel_err(out, ref_out) < 1e-2


def test_rejected_decode_plan_leaves_previous_plan(device):
    gen = torch.Generator().manual_seed(2)
    b = make_paged_batch(gen, qo_lens=[1] * 2, kv_lens=[300, 500], num_qo_heads=4, num_kv_heads=4, head_dim=64,
                         page_size=16, dtype=torch.float16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                     backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 4, 64, 16, q_data_type=torch.float16, fixed_split_size=8)
    before = w.run(b.q, b.cache)
    # another page table, rejected late (its workspace need is too large): nothing of it may be installed
    tiny = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8, device=device),
                                                        backend="triton")
    with pytest.raises(ValueError, match=r"float_workspace_buffer holds 64 bytes but this plan's split-KV partial "
                                         r"states need \d+ bytes"):
        tiny.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 4, 64, 16, q_data_type=torch.float16,
                  fixed_split_size=8)
    with pytest.raises(ValueError, match="plan: last_page_len\\[1\\]=17"):
        w.plan(b.kv_indptr, torch.flip(b.kv_indices, [0]), torch.tensor([3, 17], dtype=torch.int32, device=device),
               4, 4, 64, 16, q_data_type=torch.float16)
    assert torch.equal(before, w.run(b.q, b.cache))


def test_decode_refusals(device):
    gen = torch.Generator().manual_seed(2)
    b = make_paged_batch(gen, qo_lens=[1] * 2, kv_lens=[5, 7], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=4, dtype=torch.float16, device=device)
    ws = torch.empty(1 << 16, dtype=torch.uint8, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
    args = (b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4)
    with pytest.raises(ValueError, match="q_len_per_req=0 must be a positive int"):
        w.plan(*args, q_data_type=torch.float16, q_len_per_req=0)
    with pytest.raises(NotImplementedError, match="ROPE_LLAMA' is served on the tensor-core route only"):
        w.plan(*args, q_data_type=torch.float16, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(NotImplementedError, match="head_dim=80 is not served"):
        w.plan(*args[:5], 80, 4, q_data_type=torch.float16)
    with pytest.raises(ValueError, match="fixed_split_size=0 must be a positive int"):
        w.plan(*args, q_data_type=torch.float16, fixed_split_size=0)
    serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton").plan(  # FlashInfer's "not fixed" (vLLM's)
        *args, q_data_type=torch.float16, fixed_split_size=-1)
    with pytest.raises(ValueError, match="must be int32"):
        w.plan(b.kv_indptr.long(), *args[1:], q_data_type=torch.float16)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs paged_kv_indptr_buffer"):
        serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs paged_kv_indptr_buffer"):  # one of the three
        serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True,
                                                     paged_kv_last_page_len_buffer=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="run\\(\\) was called before plan\\(\\)"):
        w.run(b.q[:2], b.cache)
    w.plan(*args, q_data_type=torch.float16)
    with pytest.raises(ValueError, match="q has shape \\(3, 4, 64\\); expected \\(2, 4, 64\\)"):
        w.run(torch.cat([b.q, b.q[:1]]), b.cache)
    with pytest.raises(ValueError, match="q has dtype torch.bfloat16; expected torch.float16"):
        w.run(b.q.to(torch.bfloat16), b.cache)
    with pytest.raises(ValueError, match="out has dtype torch.bfloat16"):
        w.run(b.q, b.cache, out=torch.empty(b.q.shape, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="k cache has dtype torch.bfloat16 but the plan declared torch.float16"):
        w.run(b.q, b.cache.to(torch.bfloat16))
    with pytest.raises(ValueError, match="q_scale=-1.0 must be a positive finite float"):
        w.run(b.q, b.cache, q_scale=-1.0)
    with pytest.raises(NotImplementedError, match="q_scale beside a tensor k_scale is not served"):
        w.run(b.q, b.cache, q_scale=2.0, k_scale=torch.ones(1, device=device))
    with pytest.raises(ValueError, match="q_scale and scale_q/scale_k/scale_v were both given"):
        w.run(b.q, b.cache, q_scale=2.0, scale_q=torch.ones(1, device=device))
    with pytest.raises(ValueError, match="q must be a 2-D"):
        serveattn.single_decode_with_kv_cache(b.q, b.cache[:, 0], b.cache[:, 1])


def test_small_batches_pipeline_deeper_without_changing_the_bits():
    """decode_tiles: at most SMALL_BATCH requests (the capacity under CUDA graphs) take 7 stages, the same BLOCK_N
    and warps as both dtypes' usual tiles, so an fp8 cache stays bitwise its dequantized run; and the depth fits
    sm_90's shared memory where every stage but one buffers a 16-bit K and V tile (8 stages took 235520 bytes of
    232448 on the H200: 7 buffered stages plus 6 KB)."""
    from serveattn import decode as dec
    cuda = torch.device("cuda")  # the table for the GPU; no device is touched
    small = [dec.decode_tiles(128, cuda, kv, batch_cap=1) for kv in (torch.bfloat16, torch.float8_e4m3fn)]
    usual = [dec.decode_tiles(128, cuda, kv, batch_cap=dec.SMALL_BATCH + 1) for kv in (torch.bfloat16,
                                                                                        torch.float8_e4m3fn)]
    assert small[0] == small[1] and small[0].num_stages == 7
    assert (small[0].num_stages - 1) * 2 * small[0].block_n * 128 * 2 + 6144 <= 232448
    assert {(t.block_n, t.num_warps) for t in small + usual} == {(64, 2)}
    assert usual[0].num_stages == 4 and usual[1].num_stages == 6
    assert dec.decode_tiles(128, cuda, torch.bfloat16) == usual[0]


DECODE_PLAN_REFUSALS = [
    # (id, plan keywords or a named change, exception, sentence fragment, the routes it applies to)
    ("q_len", dict(q_len_per_req=0), ValueError, "q_len_per_req=0 must be a positive int", (False, True)),
    ("rope", dict(pos_encoding_mode="ROPE_LLAMA"), NotImplementedError, "served on the tensor-core route only",
     (False,)),
    ("head_dim", "head_dim", NotImplementedError, "head_dim=80 is not served", (False, True)),
    ("split", dict(fixed_split_size=0), ValueError, "fixed_split_size=0 must be a positive int", (False, True)),
    ("int64", "int64", ValueError, "must be int32", (False, True)),
    ("last_page_len", "last17", ValueError, "plan: last_page_len\\[1\\]=17", (False, True)),
    ("kv_dtype", dict(kv_data_type=torch.bfloat16), NotImplementedError, "differs from the query dtype",
     (False, True)),
    ("window", dict(window_left=-2), ValueError, "window_left=-2", (False, True)),
    ("fp8_out", dict(o_data_type=torch.float8_e4m3fn), NotImplementedError, "o_data_type", (False, True)),
    ("chain_and_tree", dict(q_len_per_req=2, tree_parents=[[-1], [-1]]), ValueError,
     "give q_len_per_req \\(a chain\\) or tree_parents", (False, True)),
    ("unknown_kwarg", dict(prefix_len_ptr=1), NotImplementedError, "prefix_len_ptr", (False, True)),
]


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["bandwidth", "tensor_cores"])
@pytest.mark.parametrize("case", DECODE_PLAN_REFUSALS, ids=[c[0] for c in DECODE_PLAN_REFUSALS])
def test_refused_decode_plan_leaves_the_wrapper_as_it_was(case, tensor_cores, device):
    """API.md: a plan() that raises leaves the wrapper exactly as it was: after each refusal the previous plan runs
    again with the same bits, on both routes."""
    _, change, exc, match, routes = case
    if tensor_cores not in routes:
        pytest.skip("served on this route")
    gen = torch.Generator().manual_seed(5)
    b = make_paged_batch(gen, qo_lens=[1] * 2, kv_lens=[9, 30], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=4, dtype=torch.float16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                     use_tensor_cores=tensor_cores, backend="triton")
    args, kw = [b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4], dict(q_data_type=torch.float16)
    w.plan(*args, **kw, fixed_split_size=2)  # 2 pages of 4 keys: split-KV, so the partial states must stay too
    before = w.run(b.q, b.cache, return_lse=True)
    if change == "head_dim":
        args[5] = 80
    elif change == "int64":
        args[0] = b.kv_indptr.long()
    elif change == "last17":
        args[2] = torch.tensor([3, 17], dtype=torch.int32, device=device)
        args[1] = torch.flip(b.kv_indices, [0])
    else:
        kw.update(change)
    with pytest.raises(exc, match=match):
        w.plan(*args, **kw)
    after = w.run(b.q, b.cache, return_lse=True)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_misaligned_workspace_serves_unsplit_and_refuses_a_split(device):
    """A float workspace no float32 view can start at (a byte slice at offset 1, policy.workspace_room): a plan
    that does not split runs as usual; one that must (fixed_split_size) is refused with a sentence, never torch's
    view error."""
    gen = torch.Generator().manual_seed(12)
    b = make_paged_batch(gen, qo_lens=[1] * 2, kv_lens=[300, 500], num_qo_heads=4, num_kv_heads=4, head_dim=64,
                         page_size=16, dtype=torch.float16, device=device)
    ws = torch.empty((1 << 20) + 1, dtype=torch.uint8, device=device)[1:]
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 4, 64, 16, q_data_type=torch.float16,
           disable_split_kv=True)
    out = w.run(b.q, b.cache)
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)
    assert rel_err(out, ref) < tolerance(torch.float16)
    with pytest.raises(ValueError, match=r"float_workspace_buffer cannot hold this plan's split-KV partial states "
                                         r"\(\d+ bytes\): a float workspace must be contiguous and start on a "
                                         r"16-byte boundary"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 4, 64, 16, q_data_type=torch.float16,
               fixed_split_size=8)
    assert torch.equal(out, w.run(b.q, b.cache))  # the refused plan left the previous one


def test_a_split_the_workspace_cannot_hold_stays_unsplit(device, monkeypatch):
    """The bandwidth route's own split (no fixed_split_size) needs partial-state slots; a workspace too small for
    them (1 KB) serves the plan unsplit, as the tensor-core route does, instead of refusing it."""
    monkeypatch.setattr(decode, "_num_sms", lambda device: 132)  # one request: the rule splits it
    gen = torch.Generator().manual_seed(13)
    b = make_paged_batch(gen, qo_lens=[1], kv_lens=[900], num_qo_heads=4, num_kv_heads=4, head_dim=64,
                         page_size=16, dtype=torch.float16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8, device=device),
                                                     backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 4, 64, 16, q_data_type=torch.float16)
    assert w._plan.num_slots == 0
    roomy = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                         backend="triton")
    roomy.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 4, 64, 16, q_data_type=torch.float16)
    assert roomy._plan.num_slots > 0  # with room, the same plan splits
    out = w.run(b.q, b.cache)
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)
    assert rel_err(out, ref) < tolerance(torch.float16)


def test_a_refused_graph_replan_keeps_the_counts_its_graph_reads(device):
    """Under use_cuda_graph=True the bandwidth kernel's fused fold counts (per request and KV head) are what a
    captured graph increments: a re-plan refused by the graph's rules (more KV heads) leaves that very tensor, and
    the previous plan runs as before."""
    gen = torch.Generator().manual_seed(14)
    b = make_paged_batch(gen, qo_lens=[1] * 2, kv_lens=[300, 500], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.float16, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), use_cuda_graph=True, backend="triton",
        paged_kv_indptr_buffer=torch.empty(3, **i32), paged_kv_indices_buffer=torch.empty(100, **i32),
        paged_kv_last_page_len_buffer=torch.empty(2, **i32))
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, q_data_type=torch.float16)
    before = w.run(b.q, b.cache)
    counts = w._done_count
    with pytest.raises(ValueError, match="a re-plan may change only the batch's lengths and page table"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 16, 8, 64, 16, q_data_type=torch.float16)
    assert w._done_count is counts
    assert torch.equal(w.run(b.q, b.cache), before)


def test_ragged_split_under_cuda_graph_replans(device):
    """A CUDA-graph wrapper (its fixed grid striding over the work list) re-planned between ragged batches that fill
    the GPU (the interpreter's 2 SMs) and take the ragged split, and one that does not: each run matches the
    reference, every row written; planned back, the first batch's bits again."""
    gen = torch.Generator().manual_seed(3636)
    batches = [make_paged_batch(gen, qo_lens=[1] * len(kv), kv_lens=kv, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                                page_size=16, dtype=torch.bfloat16, device=device)
               for kv in ([40, 1500, 0, 77, 1, 260], [700, 3, 9, 5, 1, 2], [50, 60, 70, 80, 90, 100])]
    i32 = dict(dtype=torch.int32, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(8 << 20, dtype=torch.uint8, device=device), use_cuda_graph=True, backend="triton",
        paged_kv_indptr_buffer=torch.empty(7, **i32), paged_kv_indices_buffer=torch.empty(200, **i32),
        paged_kv_last_page_len_buffer=torch.empty(6, **i32))
    outs = []
    for b in (*batches, batches[0]):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16)
        out, lse = nan_like(b.q.shape, b.q.dtype, device), nan_like(b.q.shape[:2], torch.float32, device)
        w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
        assert not out.isnan().any()
        ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices,
                                                 b.last_page_len, causal=True)
        assert rel_err(out, ref_out) < 1e-2
        check_lse(lse, ref_lse)
        outs.append((out, lse))
    if device == "cpu":
        assert w._plan.chunk is not None  # the first batch's plan, again: split
    assert torch.equal(outs[0][0], outs[-1][0]) and torch.equal(outs[0][1], outs[-1][1])


def test_int32_kv_offsets_rule():
    """SERVEATTN_KV_OFFSETS_32 (kernels/decode.OFF32_ENABLED): int32 offsets only where every element of the cache
    lies within 2^31 - 1 of its first (attention.fits_int32, read from the shape and strides, not from a plan's
    pages, so a captured graph stays right for any later plan), HND or NHD, strided views included."""
    from serveattn.kernels.attention import fits_int32
    small = torch.empty((64, 2, 16, 8, 128), device="meta").unbind(1)[0]
    assert fits_int32(small)
    # pages of 2 x 16 x 8 x 128: the K view's last element sits at (pages - 1) * 32768 + 16383
    assert fits_int32(torch.empty((65536, 2, 16, 8, 128), device="meta").unbind(1)[0])  # 2^31 - 16385
    assert not fits_int32(torch.empty((65537, 2, 16, 8, 128), device="meta").unbind(1)[0])  # 2^31 + 16383
    # an HND view of 16 x 8 x 128 pages: (pages - 1) * 16384 + 16383, at most 2^31 - 1
    assert fits_int32(torch.empty((131072, 16, 8, 128), device="meta").transpose(1, 2))
    assert not fits_int32(torch.empty((131073, 16, 8, 128), device="meta").transpose(1, 2))


def _runs_under(monkeypatch, attr: str, values, b, device, **plan_kw):
    """{value: (out, lse, wrapper)}: a bandwidth-route decode wrapper planned and run (into poisoned buffers) with
    kernels/decode's module attribute `attr` at each value (read at a plan's first run)."""
    from serveattn.kernels import decode as decode_kernel
    results = {}
    for value in values:
        monkeypatch.setattr(decode_kernel, attr, value)
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device),
                                                         backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16, **plan_kw)
        out, lse = nan_like(b.q.shape, b.q.dtype, device), nan_like(b.q.shape[:2], torch.float32, device)
        w.run(b.q, b.cache, out=out, lse=lse)
        results[value] = out, lse, w
    return results


def _same_bits_and_the_reference(results, b, **opts):
    (out0, lse0, _), (out1, lse1, _) = results.values()
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    assert not out1.isnan().any()
    ref_out, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                       causal=True, **opts)
    assert rel_err(out1, ref_out) < 1e-2


@pytest.mark.parametrize("split", [None, 4])
def test_int32_kv_offsets_move_no_bit(split, device, monkeypatch):
    """The decode kernel with int32 K/V offsets (OFF32, where the cache fits) gives the int64 kernel's bits, every
    row written, split or not, on a tuple cache with a non-contiguous view."""
    gen = torch.Generator().manual_seed(72)
    b = make_paged_batch(gen, qo_lens=[1] * 4, kv_lens=[90, 300, 0, 33], num_qo_heads=8, num_kv_heads=2,
                         head_dim=64, page_size=16, dtype=torch.bfloat16, tuple_cache=True, non_contiguous=True,
                         device=device)
    results = _runs_under(monkeypatch, "OFF32_ENABLED", (False, True), b, device, fixed_split_size=split,
                          disable_split_kv=split is None)
    for off32, (_, _, w) in results.items():
        assert [kind[5] for kind in w._plan.launch_memo if isinstance(kind, tuple)] == [off32]
    _same_bits_and_the_reference(results, b)


@pytest.mark.parametrize("q_len,opts,split", [
    (1, {}, None), (1, {}, 4), (3, {}, None), (4, {}, 2), (1, {"window_left": 40}, None),
    (1, {"logits_soft_cap": 5.0}, 4)], ids=["decode", "decode-split", "chain3", "chain4-split", "window", "softcap"])
def test_q_held_moves_no_bit(q_len, opts, split, device, monkeypatch):
    """SERVEATTN_DECODE_Q_HELD (kernels/decode.Q_HELD, measuring): q's operand held in registers over the KV loop;
    the result is the default kernel's, bit for bit, every row written, the reference's, with an empty request.
    (It acts under K_OPERAND only, which the CPU interpreter leaves off: the bits are compared on the GPU.)"""
    gen = torch.Generator().manual_seed(zlib.crc32(f"q-held-{q_len}-{opts}-{split}".encode()))
    kv_lens = [129, 64, 0, 300, 128, 5] if q_len == 1 else [129, 64, 300, 128, 5]
    b = make_paged_batch(gen, qo_lens=[q_len] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2,
                         head_dim=64, page_size=16, dtype=torch.bfloat16, device=device)
    results = _runs_under(monkeypatch, "Q_HELD", (False, True), b, device, q_len_per_req=q_len,
                          fixed_split_size=split, disable_split_kv=split is None, **opts)
    _same_bits_and_the_reference(results, b, **opts)


@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_q_held_keeps_the_fp8_contract(enc, device, monkeypatch):
    """Under Q_HELD (fp8 caches' default, Q_HELD_FP8; the bf16 copy keeps the default kernel) an fp8 cache's decode
    stays, bit for bit, the run on its dequantized (bf16) copy, and both the runs without the switch; split requests
    included (compared on the GPU, as above)."""
    from serveattn.kernels import decode as decode_kernel
    gen = torch.Generator().manual_seed(zlib.crc32(f"q-held-fp8-{enc}".encode()))
    kv_lens = [90, 0, 200, 33, 129, 64]
    b = make_paged_batch(gen, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2,
                         head_dim=64, page_size=16, dtype=torch.float32, device=device)
    b.cache, b.q = b.cache.to(enc), b.q.to(torch.bfloat16)
    results = fp8_decode_runs(monkeypatch, decode_kernel, [{"Q_HELD": False, "Q_HELD_FP8": False},
                                                           {"Q_HELD": False, "Q_HELD_FP8": True}], b, enc,
                              (8, 2), 64, 1, device, dict(fixed_split_size=4))
    out, lse = results[1, enc]
    assert not out.isnan().any() and not lse.isnan().any()
    for other in (results[1, torch.bfloat16], results[0, enc], results[0, torch.bfloat16]):
        assert torch.equal(out, other[0]) and torch.equal(lse, other[1])


@pytest.mark.parametrize("merge", ["1", "heads"], ids=["fused-fold", "merge-kernel"])
@pytest.mark.parametrize("split", [None, 4])
def test_one_item_grid_keeps_the_bits(split, merge, device, monkeypatch):
    """ONE_ITEM (kernels/decode, on for eager launches): a program reads its one work item with no loop over the
    work list; the same bits as the strided loop (a CUDA graph's fixed grid), its items inlined or called
    (ITEM_CALL), split or not, under either fold, bf16 and fp8 caches (the fp8 run still its dequantized copy's),
    an empty request included, every row written."""
    from serveattn.kernels import decode as decode_kernel
    monkeypatch.setattr(decode_kernel, "MERGE_MODE", merge)
    gen = torch.Generator().manual_seed(zlib.crc32(f"one-item-{split}-{merge}".encode()))
    kv_lens = [90, 0, 200, 33, 129, 64]
    b = make_paged_batch(gen, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2,
                         head_dim=64, page_size=16, dtype=torch.float32, device=device)
    b.cache, b.q = b.cache.to(torch.float8_e4m3fn), b.q.to(torch.bfloat16)
    settings = [{"ONE_ITEM": False, "ITEM_CALL": False}, {"ONE_ITEM": False, "ITEM_CALL": True}, {"ONE_ITEM": True}]
    results = fp8_decode_runs(monkeypatch, decode_kernel, settings, b, torch.float8_e4m3fn, (8, 2), 64, 1, device,
                              dict(fixed_split_size=split, disable_split_kv=split is None))
    for kv_dtype in (torch.float8_e4m3fn, torch.bfloat16):
        for i in (1, 2):
            out, lse = results[i, kv_dtype]
            assert not out.isnan().any() and not lse.isnan().any()
            assert torch.equal(out, results[0, kv_dtype][0]) and torch.equal(lse, results[0, kv_dtype][1])
    assert torch.equal(results[2, torch.float8_e4m3fn][0], results[2, torch.bfloat16][0])


@pytest.mark.parametrize("group", [4, 1])
def test_fold_call_keeps_the_bits(group, device, monkeypatch):
    """FOLD_CALL (kernels/decode, on by default): the fused fold of split requests as a called function folds the
    same slots in the same order as inlined: the same bits, bf16 and fp8 caches alike, an empty request included,
    every row written (the fold's rows are the group's: 4 and 1 query heads a KV head)."""
    from serveattn.kernels import decode as decode_kernel
    gen = torch.Generator().manual_seed(zlib.crc32(f"fold-call-{group}".encode()))
    kv_lens = [90, 0, 200, 33, 129, 64]
    b = make_paged_batch(gen, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=2 * group, num_kv_heads=2,
                         head_dim=64, page_size=16, dtype=torch.float32, device=device)
    b.cache, b.q = b.cache.to(torch.float8_e4m3fn), b.q.to(torch.bfloat16)
    results = fp8_decode_runs(monkeypatch, decode_kernel, [{"FOLD_CALL": False}, {"FOLD_CALL": True}], b,
                              torch.float8_e4m3fn, (2 * group, 2), 64, 1, device, dict(fixed_split_size=4))
    for kv_dtype in (torch.float8_e4m3fn, torch.bfloat16):
        out, lse = results[1, kv_dtype]
        assert not out.isnan().any() and not lse.isnan().any()
        assert torch.equal(out, results[0, kv_dtype][0]) and torch.equal(lse, results[0, kv_dtype][1])
    assert torch.equal(results[1, torch.float8_e4m3fn][0], results[1, torch.bfloat16][0])
