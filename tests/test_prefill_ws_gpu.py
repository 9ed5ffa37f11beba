"""The warp-specialized Hopper prefill kernel (kernels/attention_ws.py) on the GPU: bitwise equal to
prefill_kernel (the contract that keeps an fp8 cache bitwise equal to its dequantized run), against the float64
reference, every element written, repeatable, and taken where it should be."""
import zlib

import pytest
import torch

import serveattn
from serveattn import reference
from serveattn.kernels import attention_ws, replay
from helpers import check_lse, make_paged_batch, nan_like, random_lengths, rel_err, tolerance

pytestmark = pytest.mark.gpu


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _spy(monkeypatch, module, name):
    """Replaces module.name by a wrapper recording what each call returned (whether it launched)."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        ran = real(*args, **kwargs)
        calls.append(ran)
        return ran
    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture(autouse=True)
def unsplit(monkeypatch):
    """These tests are the warp-specialized kernel's; split-KV (prefill.split_chunk) would take their small plans
    to the split prefill kernel (which of the two is faster there is scripts/probe_prefill_split.py's question)."""
    monkeypatch.setenv("SERVEATTN_PREFILL_SPLIT", "0")


@pytest.fixture
def ws_calls(monkeypatch):
    """Counts launches of the warp-specialized kernel: each call of attention_ws.launch (whether it launched), and
    each repeat of a plan's first plain launch of it (kernels/replay.py) that launched."""
    calls = _spy(monkeypatch, attention_ws, "launch")
    real = replay.Replay.__call__

    def spy(self, *args, **kwargs):
        ran = real(self, *args, **kwargs)
        if ran and self.descriptor is not None:  # the warp-specialized kernel's (prefill_kernel's has none)
            calls.append(True)
        return ran
    monkeypatch.setattr(replay.Replay, "__call__", spy)
    return calls


CASES = [
    # (name, qo_lens, kv_lens, hq, hkv, page_size, kv_layout, cache form, causal, head_dim)
    ("mixed-causal-gqa4", None, None, 32, 8, 16, "NHD", "interleaved", True, 128),
    ("mixed-noncausal-mha", None, None, 8, 8, 16, "NHD", "tuple", False, 128),
    ("hnd-gqa8-page32", None, None, 16, 2, 32, "HND", "interleaved", True, 128),
    ("page8-strided", None, None, 8, 2, 8, "NHD", "strided", True, 128),
    ("page256", [300, 0, 1000], [700, 5, 1000], 8, 2, 256, "NHD", "tuple", True, 128),
    ("page64-noncausal-tails", [1, 77, 130], [1, 190, 4000], 8, 1, 64, "HND", "tuple", False, 128),
    ("long-causal", [3000], [3000], 8, 2, 16, "NHD", "interleaved", True, 128),
    ("d64-mixed-causal-gqa4", None, None, 16, 4, 16, "NHD", "interleaved", True, 64),
    ("d64-hnd-noncausal", [129, 1, 500], [700, 33, 500], 8, 8, 32, "HND", "tuple", False, 64),
]


def _batch(case, dtype):
    name, qo_lens, kv_lens, hq, hkv, ps, layout, form, causal, head_dim = case
    gen = torch.Generator().manual_seed(zlib.crc32(f"ws{name}{dtype}".encode()))
    if qo_lens is None:
        qo_lens, kv_lens = random_lengths(gen, 9, 300, 1200, causal)
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                         head_dim=head_dim, page_size=ps, dtype=dtype, kv_layout=layout, tuple_cache=form == "tuple",
                         non_contiguous=form == "strided", device="cuda")
    return b, hq, hkv, causal, head_dim


def _run(w, b, dtype):
    out = nan_like(b.q.shape, dtype, "cuda")
    lse = nan_like(b.q.shape[:2], torch.float32, "cuda")
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_equals_prefill_kernel(case, dtype, ws_calls, monkeypatch):
    monkeypatch.setenv("SERVEATTN_PREFILL_GATHER", "0")  # the paged kernels themselves (the copy has its own test)
    b, hq, hkv, causal, head_dim = _batch(case, dtype)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                       b.kv_layout)
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, head_dim, b.page_size, causal=causal,
           q_data_type=dtype)
    out, lse = _run(w, b, dtype)
    assert ws_calls == [True], "the call did not take the warp-specialized kernel"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an element was not written"
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=causal, kv_layout=b.kv_layout)
    assert rel_err(out, ref_out) < tolerance(dtype)
    check_lse(lse, ref_lse)
    out2, lse2 = _run(w, b, dtype)  # the plan's repeated launch (kernels/replay.py)
    assert w._plan.launch_memo.get(replay.KEY) is not None
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "not repeatable"
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "0")
    out_t, lse_t = _run(w, b, dtype)
    assert ws_calls == [True, True], "SERVEATTN_PREFILL_WS=0 still took the warp-specialized kernel"
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t), "not bitwise prefill_kernel's result"


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_equals_prefill_kernel(causal, ws_calls, monkeypatch):
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(7 + causal)
    qo_lens, kv_lens = random_lengths(gen, 7, 400, 1500, causal)
    hq, hkv = 16, 4
    i32 = dict(dtype=torch.int32, device="cuda")
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), **i32)
    kv_indptr = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), **i32)
    q = torch.randn(sum(qo_lens), hq, 128, generator=gen).to(dtype).cuda()
    k = torch.randn(sum(kv_lens), hkv, 128, generator=gen).to(dtype).cuda()
    v = torch.randn(sum(kv_lens), hkv, 128, generator=gen).to(dtype).cuda()
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
    w.plan(qo_indptr, kv_indptr, hq, hkv, 128, causal=causal, q_data_type=dtype)

    def run(k=k, v=v):
        out = nan_like(q.shape, dtype, "cuda")
        lse = nan_like(q.shape[:2], torch.float32, "cuda")
        w.run(q, k, v, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        return out, lse

    out, lse = run()
    assert ws_calls == [True]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref_out, ref_lse = reference.batch_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal)
    assert rel_err(out, ref_out) < tolerance(dtype)
    check_lse(lse, ref_lse)
    # the plan's repeated launch (kernels/replay.py): new K/V tensors every step, as a server's
    out_r, lse_r = run(k.clone(), v.clone())
    assert ws_calls == [True, True] and torch.equal(out, out_r) and torch.equal(lse, lse_r)
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "0")
    out_t, lse_t = run()
    assert ws_calls == [True, True]
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
def test_nan_past_kv_len_stays_out(ws_calls):
    """Slots past a request's last key (the rest of a partial last page) may hold anything: NaN there must not
    reach the output (the kernel fetches whole pages and zeroes those V rows)."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    b = make_paged_batch(gen, qo_lens=[5, 40], kv_lens=[21, 333], num_qo_heads=8, num_kv_heads=2, head_dim=128,
                         page_size=16, dtype=dtype, tuple_cache=True, device="cuda")
    k, v = b.cache
    for r, kv_len in enumerate(b.kv_lens):  # poison the unused slots of each last page
        last = int(b.kv_indices[int(b.kv_indptr[r + 1]) - 1])
        k[last, kv_len % 16:] = float("nan")
        v[last, kv_len % 16:] = float("nan")
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, causal=True, q_data_type=dtype)
    out, lse = _run(w, b, dtype)
    assert ws_calls == [True]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref_out, _ = reference.batch_paged(b.q, (k.nan_to_num(0.0), v.nan_to_num(0.0)), b.qo_indptr, b.kv_indptr,
                                       b.kv_indices, b.last_page_len, causal=True)
    assert rel_err(out, ref_out) < tolerance(dtype)


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
def test_scales_and_graph_replay(ws_calls, monkeypatch):
    """k_scale / v_scale as device tensors under CUDA graph capture (programs stride over more work items than
    the grid holds, so the ring's phases run on across items); replay equals eager prefill_kernel."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    qo_lens, kv_lens = [2048] * 6, [2048 + 100 * i for i in range(6)]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         page_size=16, dtype=dtype, device="cuda")
    bufs = dict(qo_indptr_buf=torch.empty(8, dtype=torch.int32, device="cuda"),
                paged_kv_indptr_buf=torch.empty(8, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buf=torch.empty(b.kv_indices.numel() + 64, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buf=torch.empty(7, dtype=torch.int32, device="cuda"))
    ws = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True, **bufs)
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, causal=True, q_data_type=dtype)
    k_scale = torch.tensor([0.37], device="cuda")
    v_scale = torch.tensor([1.9], device="cuda")
    out = nan_like(b.q.shape, dtype, "cuda")
    lse = nan_like(b.q.shape[:2], torch.float32, "cuda")
    w.run(b.q, b.cache, out=out, lse=lse, return_lse=True, k_scale=k_scale, v_scale=v_scale)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(b.q, b.cache, out=out, lse=lse, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert ws_calls and all(ws_calls)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "0")
    e = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws)
    e.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, causal=True, q_data_type=dtype)
    out_t, lse_t = e.run(b.q, b.cache, return_lse=True, k_scale=0.37, v_scale=1.9)
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True, k_scale=0.37, v_scale=1.9)
    assert rel_err(out, ref_out) < tolerance(dtype)


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_equals_dequantized_run(fp8, dtype, ws_calls, monkeypatch):
    """API.md's fp8 contract on the warp-specialized kernel: an fp8 cache is widened into ragged rows
    (kernels/gather.py) and takes the kernel; its dequantized copy takes it paged; prefill_kernel on the fp8 cache
    (SERVEATTN_PREFILL_WS=0) gives the same bits too."""
    gen = torch.Generator().manual_seed(3)
    b = make_paged_batch(gen, qo_lens=[600, 31, 0], kv_lens=[900, 2000, 40], num_qo_heads=16, num_kv_heads=4,
                         head_dim=128, page_size=16, dtype=dtype, tuple_cache=True, device="cuda")
    k8, v8 = (t.to(fp8) for t in b.cache)
    ws = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    w8 = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws)
    w8.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 16, 4, 128, 16, causal=True, q_data_type=dtype,
            kv_data_type=fp8)
    o8, l8 = w8.run(b.q, (k8, v8), return_lse=True, k_scale=0.5, v_scale=3.0)
    assert ws_calls == [True], "the fp8 cache did not take the warp-specialized kernel"
    assert not torch.isnan(o8).any()
    wb = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws)
    wb.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 16, 4, 128, 16, causal=True, q_data_type=dtype)
    ob, lb = wb.run(b.q, (k8.to(dtype), v8.to(dtype)), return_lse=True, k_scale=0.5, v_scale=3.0)
    assert ws_calls == [True, True]
    assert torch.equal(o8, ob) and torch.equal(l8, lb)
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "0")
    ot, lt = w8.run(b.q, (k8, v8), return_lse=True, k_scale=0.5, v_scale=3.0)
    assert torch.equal(o8, ot) and torch.equal(l8, lt)


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_gathered_calls_replay_with_their_own_scales(scale_kind, monkeypatch):
    """An fp8 cache under a 16-bit query copies its pages into ragged rows at every call; a plan's later calls
    replay the copy and the launch (kernels/replay.Gathered) with their own q and k_scale/v_scale: bitwise the full
    path's result for the same call, whatever the scales of the call that made the replay."""
    from serveattn.kernels import attention
    gen = torch.Generator().manual_seed(31)
    b = make_paged_batch(gen, qo_lens=[600, 31, 0], kv_lens=[900, 2000, 40], num_qo_heads=16, num_kv_heads=4,
                         head_dim=128, page_size=16, dtype=torch.bfloat16, tuple_cache=True, device="cuda")
    cache8 = tuple(t.to(torch.float8_e4m3fn) for t in b.cache)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 16, 4, 128, 16, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)

    def scale(x):
        return x if scale_kind == "float" else torch.full((1,), x, device="cuda")

    def run(q, ks, vs):
        out = nan_like(q.shape, torch.bfloat16, "cuda")
        lse = nan_like(q.shape[:2], torch.float32, "cuda")
        w.run(q, cache8, out=out, lse=lse, return_lse=True, k_scale=scale(ks), v_scale=scale(vs))
        return out, lse

    run(b.q, 0.5, 3.0)
    assert replay.GATHERED in w._plan.launch_memo, "no replay kept"
    full = _spy(monkeypatch, attention, "_launch_gathered")
    q = torch.randn_like(b.q)
    outs = []
    for ks, vs in ((0.25, 2.0), (0.5, 3.0), (0.25, 2.0)):
        o1, l1 = run(q, ks, vs)
        assert full == [], "not replayed"
        kept = w._plan.launch_memo.pop(replay.GATHERED)
        o2, l2 = run(q, ks, vs)
        assert full == [True], "the full path did not copy the pages"
        full.clear()
        w._plan.launch_memo[replay.GATHERED] = kept
        assert not torch.isnan(o1).any() and not torch.isnan(l1).any(), "an element was not written"
        assert torch.equal(o1, o2) and torch.equal(l1, l2), "the replay is not the full path's result"
        outs.append(o1)
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
def test_layout_without_a_tma_view_falls_back(ws_calls, monkeypatch):
    """A cache whose head stride (130 elements, not a multiple of 16 bytes) has no [rows, slot stride] TMA view:
    the call takes prefill_kernel (launch returns False) and is still right."""
    monkeypatch.setenv("SERVEATTN_PREFILL_GATHER", "0")
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(13)
    qo_lens, kv_lens = [200, 77], [500, 300]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                         page_size=16, dtype=dtype, tuple_cache=True, device="cuda")
    k = torch.zeros(*b.cache[0].shape[:3], 130, dtype=dtype, device="cuda")[..., :128]
    v = torch.zeros(*b.cache[0].shape[:3], 130, dtype=dtype, device="cuda")[..., :128]
    k.copy_(b.cache[0])
    v.copy_(b.cache[1])
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, causal=True, q_data_type=dtype)
    out, lse = w.run(b.q, (k, v), return_lse=True)
    assert ws_calls == [False]
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True)
    assert rel_err(out, ref_out) < tolerance(dtype)
    check_lse(lse, ref_lse)


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
def test_gathered_16bit_cache_is_the_paged_run(monkeypatch):
    """A long bf16 prefill copies its pages into ragged rows when that pays (attention._launch_gathered); the
    result is bitwise the paged kernel's (SERVEATTN_PREFILL_GATHER=0) and prefill_kernel's."""
    from serveattn.kernels import attention
    b, hq, hkv, causal, head_dim = _batch(CASES[6], torch.bfloat16)  # one request of 3000 tokens
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, head_dim, 16, causal=True,
           q_data_type=torch.bfloat16)
    gathered = _spy(monkeypatch, attention, "_launch_gathered")
    out, lse = _run(w, b, torch.bfloat16)
    assert gathered == [True], "3000 causal tokens at GQA 4 should pay for the copy"
    monkeypatch.setenv("SERVEATTN_PREFILL_GATHER", "0")
    out_p, lse_p = _run(w, b, torch.bfloat16)
    assert gathered == [True, False]
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "0")
    out_t, lse_t = _run(w, b, torch.bfloat16)
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)


FP8_CASES = [CASES[0], CASES[2], CASES[3], CASES[5], CASES[7]]


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("enc", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_attention_equals_prefill_kernel(case, enc, per_head, ws_calls, monkeypatch):
    """fp8 q and K/V on the warp-specialized kernel (both products on fp8 wgmma, V from its transposed copy):
    bitwise prefill_kernel's FP8_QKV result on the same plan, repeatable, every element written, near the
    float64 reference of the dequantized inputs. (The default; SERVEATTN_PREFILL_WS_FP8=0 would keep it on prefill_kernel.)"""
    monkeypatch.setenv("SERVEATTN_PREFILL_WS_FP8", "1")
    name, qo_lens, kv_lens, hq, hkv, ps, layout, form, causal, head_dim = case
    gen = torch.Generator().manual_seed(zlib.crc32(f"ws8{name}{enc}{per_head}".encode()))
    b, hq, hkv, causal, head_dim = _batch(case, torch.float32)
    q8 = (b.q * 8).to(enc)
    cache8 = tuple((c * 4).to(enc) for c in b.cache) if isinstance(b.cache, tuple) else (b.cache * 4).to(enc)
    sq = (torch.rand(hq if per_head else 1, generator=gen) + 0.5).cuda() / 8
    sk = (torch.rand(hkv if per_head else 1, generator=gen) + 0.5).cuda() / 4
    sv = (torch.rand(hkv if per_head else 1, generator=gen) + 0.5).cuda() / 4
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                       b.kv_layout)
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, head_dim, b.page_size, causal=causal,
           q_data_type=enc, kv_data_type=enc)
    assert w._plan.vt_work is not None and w._plan.tiles.block_m == 128

    def run():
        out = nan_like(b.q.shape, torch.bfloat16, "cuda")
        lse = nan_like(b.q.shape[:2], torch.float32, "cuda")
        w.run(q8, cache8, scale_q=sq, scale_k=sk, scale_v=sv, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        return out, lse

    out, lse = run()
    assert ws_calls == [True], "fp8 attention did not take the warp-specialized kernel"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an element was not written"
    out2, lse2 = run()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "not repeatable"
    q_ref = q8.double() * sq.double().reshape(1, -1, 1)
    caches = cache8 if isinstance(cache8, tuple) else cache8.unbind(1)
    head_axis = 2 if b.kv_layout == "NHD" else 1
    shape = [1, 1, 1, 1]
    shape[head_axis] = -1
    k_ref = caches[0].double() * sk.double().reshape(shape)
    v_ref = caches[1].double() * sv.double().reshape(shape)
    ref_out, _ = reference.batch_paged(q_ref, (k_ref, v_ref), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                       b.last_page_len, causal=causal, kv_layout=b.kv_layout)
    assert rel_err(out, ref_out) < 5e-2
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "0")
    out_t, lse_t = run()
    assert ws_calls == [True, True], "SERVEATTN_PREFILL_WS=0 still took the warp-specialized kernel"
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t), "not bitwise prefill_kernel's result"


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
def test_fp8_attention_single_prefill_takes_the_kernel(ws_calls, monkeypatch):
    """single_prefill_with_kv_cache on fp8 q/K/V (a ragged plan): the warp-specialized kernel, bitwise
    prefill_kernel's result."""
    monkeypatch.setenv("SERVEATTN_PREFILL_WS_FP8", "1")
    gen = torch.Generator().manual_seed(21)
    enc = torch.float8_e4m3fn
    q8 = torch.randn(700, 16, 128, generator=gen).to(enc).cuda()
    k8 = torch.randn(900, 4, 128, generator=gen).to(enc).cuda()
    v8 = torch.randn(900, 4, 128, generator=gen).to(enc).cuda()
    s = torch.tensor([0.05], device="cuda")
    out = serveattn.single_prefill_with_kv_cache(q8, k8, v8, causal=True, scale_q=s, scale_k=s, scale_v=s,
                                                 backend="triton")
    assert ws_calls == [True]
    assert not torch.isnan(out).any()
    monkeypatch.setenv("SERVEATTN_PREFILL_WS", "0")
    out_t = serveattn.single_prefill_with_kv_cache(q8, k8, v8, causal=True, scale_q=s, scale_k=s, scale_v=s,
                                                 backend="triton")
    assert torch.equal(out, out_t)


@pytest.mark.skipif(not _hopper(), reason="the warp-specialized kernel is sm_90 only")
def test_balanced_grid_gives_the_same_bits(ws_calls, monkeypatch):
    """SERVEATTN_PREFILL_WS_BALANCE=1: eight equal causal requests, group 1, take a persistent grid below the SM
    count (attention_ws.persistent_programs; 128 on 132 SMs); every task is computed whole by one program, so
    the result is the one-program-an-SM grid's, bit for bit, and the reference's."""
    gen = torch.Generator().manual_seed(2048)
    qo_lens = [2048] * 8
    hq = hkv = 8
    i32 = dict(dtype=torch.int32, device="cuda")
    indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), **i32)
    q = torch.randn(sum(qo_lens), hq, 128, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(sum(qo_lens), hkv, 128, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(sum(qo_lens), hkv, 128, generator=gen).to(torch.bfloat16).cuda()
    results = {}
    for balance in ("0", "1"):
        monkeypatch.setenv("SERVEATTN_PREFILL_WS_BALANCE", balance)
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                           backend="triton")
        w.plan(indptr, indptr, hq, hkv, 128, causal=True, q_data_type=torch.bfloat16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        if balance == "1":
            assert w._plan.ws_programs is not None and w._plan.ws_programs <= sms
            if sms == 132:
                assert w._plan.ws_programs == 128
        else:
            assert w._plan.ws_programs is None
        out = nan_like(q.shape, torch.bfloat16, "cuda")
        lse = nan_like(q.shape[:2], torch.float32, "cuda")
        w.run(q, k, v, out=out, lse=lse, return_lse=True)
        again = w.run(q, k, v, return_lse=True)  # the plan's repeated launch keeps the grid
        torch.cuda.synchronize()
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
        results[balance] = (out, lse)
    assert all(ws_calls)
    assert torch.equal(results["0"][0], results["1"][0]) and torch.equal(results["0"][1], results["1"][1])
    out, lse = results["1"]
    assert not torch.isnan(out).any()
    ref_out, ref_lse = reference.batch_ragged(q, k, v, indptr, indptr, causal=True)
    assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
    check_lse(lse, ref_lse)
