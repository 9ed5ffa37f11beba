"""Split-KV on the prefill kernel: a plan whose programs would not fill the GPU cuts its long requests into KV
chunks whose partial states split_merge_kernel folds (prefill.split_chunk, build_split_work)."""
import itertools
import zlib

import numpy as np
import pytest
import torch

import serveattn
from serveattn import policy, prefill, reference
from helpers import check_lse, make_paged_batch, nan_like, rel_err, tolerance
from test_prefill import _mask_indptr, _options, _plan_kwargs

VARIANTS = ["plain", "causal", "custom_mask", "packed_mask", "window", "soft_cap", "rope"]


def _split_batch(gen, device, dtype, head_dim, heads, variant, layout="NHD", page_size=16):
    hq, hkv = heads
    causal = variant in ("causal", "window", "rope")
    qo_lens, kv_lens = [1, 0, 3, 5, 2], [300, 40, 211, 5, 0 if not causal else 2]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                         head_dim=head_dim, page_size=page_size, dtype=dtype, kv_layout=layout, device=device)
    opts = _options(variant, gen, qo_lens, kv_lens)
    opts["_seg"] = _mask_indptr(qo_lens, kv_lens)
    return b, opts


def _run(b, opts, variant, heads, head_dim, dtype, device, ws_bytes=1 << 22, layout="NHD"):
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=layout, backend="triton")
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, *heads, head_dim, b.page_size,
           q_data_type=dtype, **_plan_kwargs(opts, variant))
    out = nan_like(b.q.shape, dtype, device)
    lse = nan_like(b.q.shape[:2], torch.float32, device)
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    return w, out, lse


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype,head_dim,heads", [(torch.bfloat16, 64, (8, 2)), (torch.float16, 128, (4, 4))])
def test_split_against_reference_and_unsplit(variant, dtype, head_dim, heads, device, monkeypatch):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{variant}{dtype}{head_dim}".encode()))
    b, opts = _split_batch(gen, device, dtype, head_dim, heads, variant)
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             **{k: v for k, v in opts.items() if k != "_seg"})
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT_CHUNK", "64")
    w, out, lse = _run(b, opts, variant, heads, head_dim, dtype, device)
    plan = w._plan
    assert plan.split is not None and plan.num_merge == 1 + 3  # requests 0 and 2 split (300, 211 > 64 keys)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    assert rel_err(out, ref_out) < tolerance(dtype)
    check_lse(lse, ref_lse)
    out2, lse2 = w.run(b.q, b.cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "split-KV is not bitwise repeatable"
    # the same plan unsplit: equal within the merge's rounding
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT", "0")
    w0, out0, lse0 = _run(b, opts, variant, heads, head_dim, dtype, device)
    assert w0._plan.split is None
    assert rel_err(out, out0) < tolerance(dtype)
    check_lse(lse, lse0)


def test_ragged_split_and_lse_off(device, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    b, opts = _split_batch(gen, device, torch.bfloat16, 64, (8, 2), "causal")
    k, v, kv_indptr = reference.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, "NHD")
    ref_out, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                       causal=True)
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT_CHUNK", "128")
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8, device=device),
                                                       backend="triton")
    w.plan(b.qo_indptr, kv_indptr.to(torch.int32).to(device), 8, 2, 64, causal=True, q_data_type=torch.bfloat16)
    assert w._plan.split is not None
    out = nan_like(b.q.shape, torch.bfloat16, device)
    w.run(b.q, k.to(device), v.to(device), out=out)
    assert not torch.isnan(out).any() and rel_err(out, ref_out) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_split_equals_its_dequantized_run(enc, device, monkeypatch):
    """API.md: an fp8 cache gives bitwise the same call on cache.to(q.dtype); both split the same way."""
    gen = torch.Generator().manual_seed(5)
    b, opts = _split_batch(gen, device, torch.bfloat16, 64, (8, 2), "causal")
    cache8 = (b.cache.float() * 0.5).to(enc)
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT_CHUNK", "64")
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    outs = []
    for cache, kv_dtype in ((cache8, enc), (cache8.to(torch.bfloat16), torch.bfloat16)):
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
        assert w._plan.split is not None
        outs.append(w.run(b.q, cache, return_lse=True, k_scale=0.7, v_scale=1.3))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("mode", ["decode", "chain", "tree"])
def test_decode_tensor_core_route_splits(mode, device, monkeypatch):
    """The decode wrapper's tensor-core route (the prefill kernel) at small batch: split by the plan's own rule."""
    gen = torch.Generator().manual_seed(zlib.crc32(mode.encode()))
    k = {"decode": 1, "chain": 3, "tree": 3}[mode]
    kv_lens = [700, 0 if mode == "decode" else 4, 333]  # a chain or tree needs its k rows' keys
    monkeypatch.setattr(prefill, "SPLIT_PROGRAMS_PER_SM", 8)  # the interpreter's 2 "SMs": 16 programs wanted
    b = make_paged_batch(gen, qo_lens=[k] * 3, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    kw = dict(q_len_per_req=k) if mode == "chain" else dict(tree_parents=[[-1, 0, 0]] * 3) if mode == "tree" else {}
    # decode and chains pass every request's k rows (an empty request's too); pad q to that
    rows = torch.randn(3 * k, 8, 64, generator=gen).to(torch.bfloat16).to(device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16, **kw)
    plan = w._prefill._plan
    assert plan.split is not None, "3 requests x 2 KV heads under 8 x 2 programs: the rule splits"
    out, lse = w.run(rows, b.cache, return_lse=True)
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT", "0")
    w0 = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
    w0.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16, **kw)
    assert w0._prefill._plan.split is None
    out0, lse0 = w0.run(rows, b.cache, return_lse=True)
    assert rel_err(out, out0) < tolerance(torch.bfloat16)
    check_lse(lse, lse0)
    if mode != "tree":
        qo = torch.arange(0, 3 * k + 1, k, dtype=torch.int32)
        ref_out, ref_lse = reference.batch_paged(rows, b.cache, qo, b.kv_indptr, b.kv_indices, b.last_page_len,
                                                 causal=k > 1)
        assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
        check_lse(lse, ref_lse)


@pytest.mark.parametrize("mode", ["decode", "tree"])
def test_graph_replans_keep_split_items(mode, device, monkeypatch):
    """Under use_cuda_graph=True decode's tensor-core route always runs the split kernel from fixed buffers (work
    list in the wrapper's own buffer, partial states in the workspace, a merge list sized for every row): re-plans that
    split and re-plans that do not, with empty requests, each against the reference (the same calls a captured graph
    replays)."""
    monkeypatch.setattr(prefill, "SPLIT_PROGRAMS_PER_SM", 8)
    gen = torch.Generator().manual_seed(zlib.crc32(f"graph{mode}".encode()))
    cap, num_pages, rows = 4, 200, 1 if mode == "decode" else 3
    i32 = dict(dtype=torch.int32, device=device)
    cache = torch.randn(num_pages, 2, 16, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        ws, use_cuda_graph=True, use_tensor_cores=True, backend="triton", paged_kv_indptr_buffer=torch.empty(
            cap + 1, **i32), paged_kv_indices_buffer=torch.empty(num_pages, **i32),
        paged_kv_last_page_len_buffer=torch.empty(cap, **i32))
    splits = []
    # the first plan the largest (the captured q's rows)
    for kv_lens in ([64, 700, 5, 129], [500, 3, 300], [20, 30, 40, 50], [0 if mode == "decode" else 3, 900]):
        pages = [-(-n // 16) for n in kv_lens]
        perm = torch.randperm(num_pages, generator=gen)[: sum(pages)].to(torch.int32)
        indptr = torch.tensor([0] + np.cumsum(pages).tolist(), dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * 16 if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
        kw = dict(tree_parents=[[-1, 0, 0]] * len(kv_lens)) if mode == "tree" else {}
        w.plan(indptr.to(device), perm.to(device), last.to(device), 8, 2, 64, 16, q_data_type=torch.bfloat16, **kw)
        plan = w._prefill._plan
        assert plan.split is not None  # split items whether or not a request is cut
        splits.append(plan.num_merge > 0)
        q = torch.randn(len(kv_lens) * rows, 8, 64, generator=gen).to(torch.bfloat16).to(device)
        out = nan_like(q.shape, torch.bfloat16, device)
        lse = nan_like(q.shape[:2], torch.float32, device)
        w.run(q, cache, out=out, lse=lse, return_lse=True)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        if mode == "decode":
            qo = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
            ref_out, ref_lse = reference.batch_paged(q, cache, qo, indptr, perm, last)
            assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
            check_lse(lse, ref_lse)
        else:  # the same tree plan outside graphs, unsplit: equal within the merge's rounding
            monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT", "0")
            e = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws.clone(), use_tensor_cores=True, backend="triton")
            e.plan(indptr.to(device), perm.to(device), last.to(device), 8, 2, 64, 16, q_data_type=torch.bfloat16,
                   **kw)
            e_out, e_lse = e.run(q, cache, return_lse=True)
            monkeypatch.delenv("SERVEATTN_PREFILL_SPLIT")
            assert rel_err(out, e_out) < tolerance(torch.bfloat16)
            check_lse(lse, e_lse)
    assert any(splits) and not all(splits), splits


def test_graph_plans_the_warp_specialized_kernel_takes_keep_plain_items(device, monkeypatch):
    """Under use_cuda_graph=True a decode tensor-core plan the warp-specialized kernel would take (asked with
    graphed=True; faked here, the CPU has no such kernel) keeps the plain work list, never split items, whatever
    the batch: its captured kernel stays that kernel (chain verify k=64 ran 1.7x slower on split items, session
    31); the run still matches the reference."""
    monkeypatch.setattr(prefill, "SPLIT_PROGRAMS_PER_SM", 8)
    asked = []
    monkeypatch.setattr(prefill, "_warp_specialized", lambda plan, kv_lens, graphed: asked.append(graphed) or True)
    gen = torch.Generator().manual_seed(31)
    i32 = dict(dtype=torch.int32, device=device)
    cache = torch.randn(60, 2, 16, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 22, dtype=torch.uint8, device=device), use_cuda_graph=True, use_tensor_cores=True,
        backend="triton", paged_kv_indptr_buffer=torch.empty(3, **i32), paged_kv_indices_buffer=torch.empty(60, **i32),
        paged_kv_last_page_len_buffer=torch.empty(2, **i32))
    for kv_lens in ([700, 40], [900, 3]):  # each would split (see test_graph_replans_keep_split_items)
        pages = [-(-n // 16) for n in kv_lens]
        perm = torch.randperm(60, generator=gen)[: sum(pages)].to(torch.int32)
        indptr = torch.tensor([0] + np.cumsum(pages).tolist(), dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * 16 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
        w.plan(indptr.to(device), perm.to(device), last.to(device), 8, 2, 64, 16, q_data_type=torch.bfloat16,
               q_len_per_req=2)
        plan = w._prefill._plan
        assert plan.merge_rows is None and plan.split is None and plan.num_merge == 0
        q = torch.randn(4, 8, 64, generator=gen).to(torch.bfloat16).to(device)
        out = nan_like(q.shape, torch.bfloat16, device)
        w.run(q, cache, out=out)
        ref_out, _ = reference.batch_paged(q, cache, torch.tensor([0, 2, 4], dtype=torch.int32), indptr, perm, last,
                                           causal=True)
        assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
    assert asked and all(asked)


def test_split_rule_and_work_list():
    tiles = prefill.TileConfig(16, 64, 4, 2)
    kv = np.array([8192]); qo = np.array([1])
    # 1 item x 8 KV heads on 132 SMs: 132 programs wanted -> 32 splits of 256
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 1) == 256
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 8) == 2048  # 64 programs: 4 splits
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 16) is None  # 128 programs: no wave gained
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 9) is None  # 72 programs: more than half
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 17) is None  # 136 programs: full
    assert prefill.split_chunk(qo, np.array([256]), 4, tiles, 8, 132, 1) is None  # one chunk: nothing to cut
    assert prefill.split_chunk(qo, np.array([100000]), 4, tiles, 8, 132, 1) == 3136  # 32 splits, block-rounded
    # a plan the warp-specialized kernel serves stays unsplit, unless its chunks are fixed (batch invariance)
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 1, warp_specialized=lambda: True) is None
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 1, 1024, warp_specialized=lambda: True) == 1024
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 1, warp_specialized=lambda: False) == 256
    # asked only of a plan that would split
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 17, warp_specialized=lambda: 1 / 0) is None
    qo_lens, kv_lens = np.array([3, 0, 40, 1]), np.array([500, 77, 130, 64])
    work, n, merge, m, rows = prefill.build_split_work(qo_lens, kv_lens, 4, 16, 128)
    assert merge[0] == m == 3 + 40 and rows == 3 * 4 + 40 * 2
    work, merge = work.reshape(-1, 6), merge[1:].reshape(-1, 3)
    assert n == len(work) and len(merge) == m
    q_start = np.concatenate([[0], np.cumsum(qo_lens)])
    seen = {}
    for req, tile, lo, hi, row0, stride in work:
        tiles_r = -(-qo_lens[req] * 4 // 16)
        assert 0 <= tile < tiles_r
        seen.setdefault((req, tile), []).append((lo, hi, row0, stride))
    for (req, tile), chunks in seen.items():
        los = sorted(c[0] for c in chunks)
        if kv_lens[req] > 128:  # chunks of 128 cover the keys once, in order; the partial rows are base + c
            assert los == list(range(0, kv_lens[req], 128)) and all(c[1] == c[0] + 128 for c in chunks)
            assert all(c[3] == len(chunks) for c in chunks)
        else:
            assert chunks == [(0, kv_lens[req], -1, 0)]
    # each split token's merge row: its output row and its n consecutive partial rows, every partial row once
    used = []
    for out_row, first, count in merge:
        req = np.searchsorted(q_start, out_row, side="right") - 1
        assert count == -(-kv_lens[req] // 128) > 1
        used += list(range(first, first + count))
    assert sorted(used) == list(range(rows))


def test_ragged_split_rule(monkeypatch):
    """SERVEATTN_PREFILL_RAGGED_SPLIT (2 by default; 0 off): a decode-shaped plan (a tile a request) that fills
    the GPU cuts a request longer than its even share of the batch's keys (over 2 programs an SM) into
    power-of-two chunks of that share / the divisor; plans of more tiles than requests, equal lengths and plans
    the warp-specialized kernel serves are left whole."""
    tiles = prefill.TileConfig(16, 64, 4, 2)
    kv = np.array([1024] * 127 + [32768])  # per_program: (127 x 1024 + 32768) x 8 // 264 = 4933
    qo = np.ones(128, dtype=np.int64)
    monkeypatch.setenv("SERVEATTN_PREFILL_RAGGED_SPLIT", "0")
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 128) is None  # off
    monkeypatch.delenv("SERVEATTN_PREFILL_RAGGED_SPLIT", raising=False)
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 128) == 2048  # the default, 2
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 129) is None  # more tiles than requests: prefill
    assert prefill.split_chunk(qo, np.full(128, 4096), 4, tiles, 8, 132, 128) is None  # equal lengths
    # 0.5-2 programs an SM (16 or 32 requests x 8 KV heads on 132 SMs): still "full"; equal and near-equal lengths
    # stay whole (the share is the batch's mean there, and the longest must pass twice the others' mean)
    rng = np.random.default_rng(5)
    for batch, kv_len in itertools.product((9, 16, 32), (1000, 2048, 4096, 32768)):
        assert prefill.split_chunk(np.ones(batch), np.full(batch, kv_len), 4, tiles, 8, 132, batch) is None
        near = rng.integers(kv_len - kv_len // 10, kv_len + kv_len // 10 + 1, batch)
        assert prefill.split_chunk(np.ones(batch), near, 4, tiles, 8, 132, batch) is None
    few = np.array([1024] * 15 + [32768])  # mean 3008: 1024-key chunks (the power of two at or below 3008 / 2)
    assert prefill.split_chunk(np.ones(16), few, 4, tiles, 8, 132, 16) == 1024
    twice = np.array([1000] * 15 + [2000])  # the longest at twice the others' mean: whole; past it: cut
    assert prefill.split_chunk(np.ones(16), twice, 4, tiles, 8, 132, 16) is None
    assert prefill.split_chunk(np.ones(16), np.array([1000] * 15 + [2200]), 4, tiles, 8, 132, 16) == 512
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 128, warp_specialized=lambda: True) is None
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 128, disable_split_kv=True) is None
    monkeypatch.setenv("SERVEATTN_PREFILL_RAGGED_SPLIT", "1")
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 128) == 4096


def test_a_request_stands_out_past_twice_the_others_mean():
    """prefill.stands_out, the line both routes' small plans cut by: a batch of two where one is over twice the other,
    never near-equal lengths or one request."""
    def stands(lens):
        lens = np.array(lens)
        return prefill.stands_out(lens, int(lens.max()), int(lens.sum()))
    assert stands([377, 1]) and stands([1024] * 31 + [32768]) and stands([1000] * 15 + [2001])
    assert not stands([1000] * 15 + [2000]) and not stands([5000]) and not stands([10, 10])
    assert not stands(np.random.default_rng(0).integers(900, 1101, 64))


def test_ragged_split_of_a_small_decode_shaped_plan(monkeypatch):
    """A decode-shaped plan too small to fill the GPU cuts its longest request evenly into as many chunks as fill it,
    unless a chunk would carry more than a program's share plus a tile (prefill.uneven_chunk): then the ragged cut.
    SERVEATTN_PREFILL_RAGGED_SPLIT=0 keeps the even cut; equal lengths and prefill-shaped plans never change."""
    tiles = prefill.TileConfig(16, 64, 4, 2)
    kv = np.array([64] * 3 + [65536])  # 32 programs: 8 even chunks of 8192; per_program 65728 x 8 // 132 = 3983
    qo = np.ones(4, dtype=np.int64)
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 4) == 2048  # 3983 / 2: 1024, but at most 32 chunks
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 5) == 16384  # more tiles than requests: 40 programs, even
    mid = np.array([1000] * 3 + [8000])  # 8 even chunks of 1024 for a per_program of 666: over a share and a tile
    assert prefill.split_chunk(qo, mid, 4, tiles, 8, 132, 4) == 256
    monkeypatch.setenv("SERVEATTN_PREFILL_RAGGED_SPLIT", "0")
    assert prefill.split_chunk(qo, kv, 4, tiles, 8, 132, 4) == 8192
    even = {(b, k): prefill.split_chunk(np.ones(b), np.full(b, k), 4, tiles, 8, 132, b)
            for b in (1, 2, 3, 5, 8) for k in (1, 100, 1000, 4096, 32768, 100000)}
    monkeypatch.delenv("SERVEATTN_PREFILL_RAGGED_SPLIT")
    assert all(prefill.split_chunk(np.ones(b), np.full(b, k), 4, tiles, 8, 132, b) == c for (b, k), c in even.items())


@pytest.mark.parametrize("mode", ["decode", "tree"])
def test_ragged_split_on_the_decode_tensor_core_route(mode, device, monkeypatch):
    """The decode wrapper's tensor-core route under SERVEATTN_PREFILL_RAGGED_SPLIT=2 on a ragged batch that fills
    the (interpreter's 2-SM) GPU: the long request is split, the result matches the unsplit plan's and the
    reference."""
    gen = torch.Generator().manual_seed(zlib.crc32(b"ragged-" + mode.encode()))
    k = 3 if mode == "tree" else 1
    kv_lens = [900, 20, 3, 41, 7, 60]  # 6 requests x 2 KV heads on 2 SMs: full; per_program 344
    n = len(kv_lens)
    b = make_paged_batch(gen, qo_lens=[k] * n, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    kw = dict(tree_parents=[[-1, 0, 0]] * n) if mode == "tree" else {}
    results = {}
    for ragged in ("0", "2"):
        monkeypatch.setenv("SERVEATTN_PREFILL_RAGGED_SPLIT", ragged)
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16, **kw)
        if device == "cpu":
            assert (w._prefill._plan.split is not None) == (ragged == "2")
        out, lse = nan_like(b.q.shape, torch.bfloat16, device), nan_like(b.q.shape[:2], torch.float32, device)
        w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
        assert not out.isnan().any()
        results[ragged] = out, lse
    (out0, lse0), (out, lse) = results["0"], results["2"]
    assert rel_err(out, out0) < tolerance(torch.bfloat16)
    check_lse(lse, lse0)
    if mode == "decode":
        ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices,
                                                 b.last_page_len, causal=False)
        assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
        check_lse(lse, ref_lse)


def test_small_workspace_does_not_split(device, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    b, opts = _split_batch(gen, device, torch.bfloat16, 64, (8, 2), "plain")
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT_CHUNK", "64")
    w, out, lse = _run(b, opts, "plain", (8, 2), 64, torch.bfloat16, device, ws_bytes=1 << 10)
    assert w._plan.split is None and not torch.isnan(out).any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["decode-1-1-8192", "chain4-2-4-4096", "chunk-1-256-16384", "tree-1-5-8192"])
def test_split_real_sizes(case, monkeypatch):
    """GQA 32/8, head dim 128, bf16, page 16 (case: kind-batch-rows-kv): plans the rule splits on the H200 (the
    chunk's plan, one the warp-specialized kernel serves, through fixed_split_size), against the reference and
    against the same plan unsplit; bitwise repeatable."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    kind, batch, q_len, kv = case.split("-")
    batch, q_len, kv = int(batch), int(q_len), int(kv)
    b = make_paged_batch(gen, qo_lens=[q_len] * batch, kv_lens=[kv] * batch,
                         num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16,
                         device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def run():
        if kind == "chunk":
            w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
            w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, causal=True,
                   q_data_type=torch.bfloat16, fixed_split_size=256)  # pages: 4096 keys
            plan = w._plan
        else:
            w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
            kw = {"chain4": dict(q_len_per_req=4), "tree": dict(tree_parents=[[-1, 0, 0, 1, 1]] * batch)}.get(kind, {})
            w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16, **kw)
            plan = w._prefill._plan
        out = nan_like(b.q.shape, torch.bfloat16, "cuda")
        lse = nan_like(b.q.shape[:2], torch.float32, "cuda")
        w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
        return plan, out, lse

    plan, out, lse = run()
    assert plan.split is not None
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _, out2, lse2 = run()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    if kind != "tree":
        ref_out, ref_lse = reference.batch_paged(b.q.cpu(), b.cache.cpu(), b.qo_indptr.cpu(), b.kv_indptr.cpu(),
                                                 b.kv_indices.cpu(), b.last_page_len.cpu(), causal=q_len > 1)
        assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
        check_lse(lse, ref_lse)
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT", "0")
    plan0, out0, lse0 = run()
    assert plan0.split is None
    assert rel_err(out, out0) < tolerance(torch.bfloat16)
    check_lse(lse, lse0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["1-256-16384", "4-128-8192", "1-512-32768"])
def test_warp_specialized_plans_stay_unsplit(case):
    """Few long prefill requests (batch-rows-kv, GQA 32/8, head dim 128, page 16) that the warp-specialized kernel
    serves stay on it unsplit (it ran 1.25-2.4x the split prefill kernel there, session 28); the same plan with a
    custom mask (not served there) splits where its programs fill under half the GPU (1-256-16384: 8 tiles x 8 KV
    heads), not where they fill more (16 tiles x 8: split_chunk's rule)."""
    batch, q_len, kv = map(int, case.split("-"))
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    b = make_paged_batch(gen, qo_lens=[q_len] * batch, kv_lens=[kv] * batch, num_qo_heads=32, num_kv_heads=8,
                         head_dim=128, page_size=16, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    args = (b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16)
    w.plan(*args, causal=True, q_data_type=torch.bfloat16)
    assert w._plan.split is None and w._plan.num_merge == 0
    mask = torch.rand(batch * q_len * kv, generator=gen) < 0.9
    w.plan(*args, custom_mask=mask.cuda(), q_data_type=torch.bfloat16)
    assert (w._plan.num_merge > 0) == (case == "1-256-16384")


def test_warp_specialized_predicate_at_plan_time(monkeypatch):
    """attention_ws.takes_16bit: the plan-time question split_chunk asks (CPU: the H200's answers faked)."""
    from types import SimpleNamespace
    from serveattn.kernels import attention
    ws = attention.attention_ws
    if ws is None:
        pytest.skip("no Gluon in this Triton")
    monkeypatch.setattr(ws, "_enabled", lambda: True)
    monkeypatch.setattr(ws, "_capability", lambda device: (9, 0))
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    base = dict(device=torch.device("cuda"), q_dtype=bf16, kv_dtype=bf16, paged=True, page_size=16, head_dim=128,
                tiles=prefill.TileConfig(128, 128, 8, 2), has_mask=False, window_left=-1, soft_cap=0.0, rope=False,
                tree_mask=None, tree_mask_host=None)

    def takes(graphed=False, gather_fits=True, **change):
        return ws.takes_16bit(SimpleNamespace(**{**base, **change}), graphed, gather_fits)

    assert takes() and takes(paged=False) and takes(q_dtype=torch.float16, kv_dtype=torch.float16)
    assert takes(kv_dtype=e4m3) and not takes(graphed=True, kv_dtype=e4m3)  # an fp8 cache is copied: no graphs
    assert not takes(kv_dtype=e4m3, gather_fits=False) and takes(gather_fits=False)  # the copy's size limit
    assert not takes(kv_dtype=e4m3, paged=False)
    assert not takes(page_size=5) and not takes(page_size=4)  # copied only where it pays: decided at run()
    assert not takes(tiles=prefill.TileConfig(64, 64, 4, 2)) and not takes(head_dim=256)
    assert not takes(has_mask=True) and not takes(window_left=8) and not takes(soft_cap=30.0)
    assert not takes(rope=True) and not takes(tree_mask_host=torch.zeros(1))
    assert not takes(q_dtype=e4m3, kv_dtype=e4m3) and not takes(device=torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "tree"])
def test_split_under_a_captured_graph(mode):
    """decode's tensor-core route captured once, replayed over re-plans that split (1 x 8192) and do not (64 x
    512): against the same plans eager and unsplit."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"captured{mode}".encode()))
    cap, num_pages, rows = 64, 40000, 1 if mode == "decode" else 5
    i32 = dict(dtype=torch.int32, device="cuda")
    cache = torch.randn(num_pages, 2, 16, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        ws, use_cuda_graph=True, use_tensor_cores=True, backend="triton",
        paged_kv_indptr_buffer=torch.empty(cap + 1, **i32), paged_kv_indices_buffer=torch.empty(num_pages, **i32),
        paged_kv_last_page_len_buffer=torch.empty(cap, **i32))
    q = torch.randn(cap * rows, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")

    def table(kv_lens):
        pages = [-(-n // 16) for n in kv_lens]
        perm = torch.randperm(num_pages, generator=gen)[: sum(pages)].to(torch.int32)
        indptr = torch.tensor([0] + np.cumsum(pages).tolist(), dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * 16 if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
        kw = dict(tree_parents=[[-1, 0, 0, 1, 1]] * len(kv_lens)) if mode == "tree" else {}
        return (indptr.cuda(), perm.cuda(), last.cuda()), kw

    first, kw = table([512] * cap)
    w.plan(*first, 32, 8, 128, 16, q_data_type=torch.bfloat16, **kw)
    w.run(q, cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out, lse=lse, return_lse=True)
    for kv_lens in ([8192], [512] * cap, [3000, 7, 9000]):
        t, kw = table(kv_lens)
        w.plan(*t, 32, 8, 128, 16, q_data_type=torch.bfloat16, **kw)
        n = len(kv_lens) * rows
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT", "0")
        e = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                         use_tensor_cores=True, backend="triton")
        e.plan(*t, 32, 8, 128, 16, q_data_type=torch.bfloat16, **kw)
        e_out, e_lse = e.run(q[:n], cache, return_lse=True)
        monkeypatch.undo()
        assert not torch.isnan(out[:n]).any()
        assert rel_err(out[:n], e_out) < tolerance(torch.bfloat16), kv_lens
        check_lse(lse[:n], e_lse)


def test_flashinfers_split_arguments(device):
    """plan(fixed_split_size=N) cuts every request longer than N pages (FlashInfer's unit) whatever the batch;
    disable_split_kv=True forbids splitting (the decode wrapper's tensor-core route passes both on)."""
    gen = torch.Generator().manual_seed(23)
    b, opts = _split_batch(gen, device, torch.bfloat16, 64, (8, 2), "causal")
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
           q_data_type=torch.bfloat16, fixed_split_size=7)  # 7 pages, 112 keys, rounded up to the block: 128
    assert w._plan.num_merge == 1 + 3 and w._plan.split_rows == 3 + 3 * 2
    d = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
    for kw, split in ((dict(fixed_split_size=4), True), (dict(disable_split_kv=True), False)):
        d.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16, **kw)
        assert (d._prefill._plan.num_merge > 0) == split, kw
    # fixed_split_size promises the same chunks whatever the batch: partial states that do not fit are refused
    # (quietly unsplit, a long request's bits would follow the batch), and the wrapper's plan holds
    small = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(4096, dtype=torch.uint8, device=device),
                                                          backend="triton")
    small.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
               q_data_type=torch.bfloat16)  # the chunk left to the library: unsplit where it does not fit
    before = small._plan
    assert before.split is None
    with pytest.raises(ValueError, match=r"holds 4096 bytes for split-KV but fixed_split_size's chunks of 112 KV "
                                         r"tokens need \d+ bytes of partial states for this batch; pass a larger "
                                         r"workspace"):
        small.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, causal=True,
                   q_data_type=torch.bfloat16, fixed_split_size=7)
    assert small._plan is before


@pytest.mark.gpu
@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_split_fp8_cache_real_size(enc):
    """decode's tensor-core route at 1 x 8192 (split) over an fp8 cache: bitwise the same call on the dequantized
    cache (API.md), bitwise repeatable."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(enc).encode()))
    b = make_paged_batch(gen, qo_lens=[1], kv_lens=[8192], num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         page_size=16, dtype=torch.bfloat16, device="cuda")
    cache8 = (b.cache.float() * 0.25).to(enc)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    runs = []
    for cache, kv_dtype in ((cache8, enc), (cache8, enc), (cache8.to(torch.bfloat16), torch.bfloat16)):
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=True, backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16,
               kv_data_type=kv_dtype)
        assert w._prefill._plan.num_merge > 0
        runs.append(w.run(b.q, cache, return_lse=True, k_scale=0.7, v_scale=1.5))
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.parametrize("causal", [False, True])
def test_single_prefill_splits_a_short_query_over_a_long_kv(causal, device, monkeypatch):
    """single_prefill_with_kv_cache plans with a workspace (prefill.SINGLE_WORKSPACE_BYTES), so a few query rows over a long
    KV split like a batch; against the float64 reference and the same call unsplit."""
    gen = torch.Generator().manual_seed(21 + causal)
    q = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16).to(device)
    k = torch.randn(333, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    v = torch.randn(333, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal)
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT_CHUNK", "64")
    planned = []
    monkeypatch.setattr(prefill.BatchPrefillWithRaggedKVCacheWrapper, "_commit",
                        lambda self, plan, _commit=prefill.BatchPrefillWithRaggedKVCacheWrapper._commit:
                        (planned.append(plan), _commit(self, plan))[1])
    out, lse = serveattn.single_prefill_with_kv_cache(q, k, v, causal=causal, backend="triton", return_lse=True)
    assert planned[-1].split is not None, "the single call did not split"
    assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
    check_lse(lse, ref_lse)
    out2, lse2 = serveattn.single_prefill_with_kv_cache(q, k, v, causal=causal, backend="triton", return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "not bitwise repeatable"
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT", "0")
    out0 = serveattn.single_prefill_with_kv_cache(q, k, v, causal=causal, backend="triton")
    assert planned[-1].split is None
    assert rel_err(out, out0) < tolerance(torch.bfloat16)


def test_graph_wrapper_shares_its_workspace_with_a_splitting_wrapper(device, monkeypatch):
    """Engines share one float workspace between wrappers as scratch (SGLang plans several graph wrappers on one
    buffer before replaying them). A graph wrapper's work list lives in a buffer of its own: an eager prefill on
    the same workspace that splits (partial states from its first byte) leaves the graph wrapper's next run, with
    no re-plan, bitwise its first; a misaligned workspace keeps a plan unsplit (policy.workspace_room)."""
    monkeypatch.setattr(prefill, "SPLIT_PROGRAMS_PER_SM", 8)
    gen = torch.Generator().manual_seed(33)
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    dec = make_paged_batch(gen, qo_lens=[1, 1, 1], kv_lens=[500, 40, 300], num_qo_heads=8, num_kv_heads=2,
                           head_dim=64, page_size=16, dtype=torch.bfloat16, device=device)
    d = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        ws, use_cuda_graph=True, use_tensor_cores=True, backend="triton",
        paged_kv_indptr_buffer=torch.empty(5, **i32), paged_kv_indices_buffer=torch.empty(dec.cache.shape[0], **i32),
        paged_kv_last_page_len_buffer=torch.empty(4, **i32))
    d.plan(dec.kv_indptr, dec.kv_indices, dec.last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16)
    first_out, first_lse = d.run(dec.q, dec.cache, return_lse=True)
    work = d._prefill._plan.work
    assert not policy.overlaps(work, ws)
    pre = make_paged_batch(gen, qo_lens=[40], kv_lens=[900], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                           page_size=16, dtype=torch.bfloat16, device=device)
    p = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    p.plan(pre.qo_indptr, pre.kv_indptr, pre.kv_indices, pre.last_page_len, 8, 2, 64, 16, causal=True,
           q_data_type=torch.bfloat16, fixed_split_size=4)
    assert p._plan.num_merge > 0
    p_out = p.run(pre.q, pre.cache)
    ref, _ = reference.batch_paged(pre.q, pre.cache, pre.qo_indptr, pre.kv_indptr, pre.kv_indices,
                                   pre.last_page_len, causal=True)
    assert rel_err(p_out, ref) < tolerance(torch.bfloat16)
    again_out, again_lse = d.run(dec.q, dec.cache, return_lse=True)
    assert torch.equal(again_out, first_out) and torch.equal(again_lse, first_lse)
    odd = torch.empty((1 << 22) + 1, dtype=torch.uint8, device=device)[1:]
    o = serveattn.BatchPrefillWithPagedKVCacheWrapper(odd, backend="triton")
    o.plan(pre.qo_indptr, pre.kv_indptr, pre.kv_indices, pre.last_page_len, 8, 2, 64, 16, causal=True,
           q_data_type=torch.bfloat16)
    assert o._plan.num_merge == 0
    assert rel_err(o.run(pre.q, pre.cache), ref) < tolerance(torch.bfloat16)


def test_equal_lengths_build_the_general_split_work():
    """build_split_work's path for requests of one shape (broadcast from one request's items) gives the general
    path's work list, merge rows and counts exactly: empty and one-row requests, lengths at and past a chunk
    multiple, unsplit plans, groups and tiles of several sizes."""
    rng = np.random.default_rng(52)
    for _ in range(400):
        batch, qo_len = int(rng.integers(1, 20)), int(rng.choice([0, 1, 4, 64, int(rng.integers(0, 300))]))
        kv_len = qo_len + int(rng.choice([0, 1, 255, 256, 257, 8192, int(rng.integers(0, 9000))]))
        chunk, group, block_m = int(rng.choice([16, 64, 256, 1024])), int(rng.choice([1, 4, 8])), \
            int(rng.choice([16, 64, 128]))
        qo = np.full(batch, qo_len, dtype=rng.choice([np.int32, np.int64]))
        kv = np.full(batch, kv_len, dtype=rng.choice([np.int32, np.int64]))
        fast = prefill.build_split_work(qo, kv, group, block_m, chunk)
        general = prefill._general_split_work(qo.astype(np.int64), kv.astype(np.int64), group, block_m, chunk)
        assert fast[1] == general[1] and fast[3:] == general[3:]
        for a, b in ((fast[0], general[0]), (fast[2], general[2])):
            assert a.dtype == b.dtype == np.int32 and np.array_equal(a, b)
