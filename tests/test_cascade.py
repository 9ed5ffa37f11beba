"""Merging attention states and multi-level cascade attention, against the float64 reference."""
import pytest
import torch

from serveattn import cascade, reference
from serveattn.kernels import merge as merge_kernel
from helpers import check_lse, make_paged_batch, nan_like, rel_err, tolerance

I32 = torch.int32
V_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BACKENDS = ["triton", "torch"]
NEG_INF = float("-inf")


def _v_tol(dtype):
    return 1e-5 if dtype == torch.float32 else tolerance(dtype)


def _states(seed, rows, num_states, num_heads, head_dim, dtype, device):
    """Random states with empty ones: row 0 all empty, row 1 state 0 empty (its v finite garbage),
    row 2 all but the last empty, row 3 mixed per head; the rest ordinary."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, num_states, num_heads, head_dim, generator=gen)
    s = torch.randn(rows, num_states, num_heads, generator=gen) * 6
    s[0] = NEG_INF
    s[1, 0] = NEG_INF
    v[1, 0] = 3e4  # garbage that must not leak into the merge (finite in every dtype)
    s[2, :-1] = NEG_INF
    s[3, :, 0] = NEG_INF
    s[3, 0, 1:] = NEG_INF
    return v.to(dtype).to(device), s.to(device)


def _check(v, s, ref_v, ref_s, dtype):
    assert v.dtype == dtype and s.dtype == torch.float32
    assert not torch.isnan(v).any() and not torch.isnan(s).any()
    empty = torch.isinf(ref_s)
    assert torch.equal(torch.isinf(s.cpu()), empty), "-inf LSE exactly where every state is empty"
    assert torch.equal(v.cpu()[empty], torch.zeros_like(v.cpu()[empty])), "an all-empty row must come out 0"
    assert (s.cpu()[~empty].double() - ref_s[~empty]).abs().max().item() < 1e-5
    assert rel_err(v, ref_v) < _v_tol(dtype)


@pytest.mark.parametrize("dtype", V_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_states_against_reference(dtype, backend, device):
    v, s = _states(1, 7, 5, 3, 96, dtype, device)  # 3 heads and head dim 96: partial tiles
    ref_v, ref_s = reference.merge_states(v.cpu(), s.cpu())
    out_v, out_s = cascade.merge_states(v, s, backend=backend)
    _check(out_v, out_s, ref_v, ref_s, dtype)
    again_v, again_s = cascade.merge_states(v, s, backend=backend)
    assert torch.equal(out_v, again_v) and torch.equal(out_s, again_s), "not bitwise reproducible"
    # a strided view (head_dim stride 2) gives the bits of its contiguous copy
    strided = torch.stack([v, torch.zeros_like(v)], -1)[..., 0]
    assert strided.stride(-1) == 2
    s_v, s_s = cascade.merge_states(strided, s, backend=backend)
    assert torch.equal(s_v, out_v) and torch.equal(s_s, out_s)


@pytest.mark.parametrize("dtype", V_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_state_and_in_place(dtype, backend, device):
    v, s = _states(2, 9, 2, 4, 64, dtype, device)
    v_a, s_a, v_b, s_b = v[:, 0], s[:, 0], v[:, 1], s[:, 1]
    ref_v, ref_s = reference.merge_states(v.cpu(), s.cpu())
    out_v, out_s = cascade.merge_state(v_a, s_a, v_b, s_b, backend=backend)
    _check(out_v, out_s, ref_v, ref_s, dtype)
    again = cascade.merge_state(v_a, s_a, v_b, s_b, backend=backend)
    assert torch.equal(out_v, again[0]) and torch.equal(out_s, again[1])
    # the other order: the same state (merging is symmetric up to rounding)
    swap_v, swap_s = cascade.merge_state(v_b, s_b, v_a, s_a, backend=backend)
    _check(swap_v, swap_s, ref_v, ref_s, dtype)

    # in place without a mask: the out-of-place bits
    iv, is_ = v_a.clone(), s_a.clone()
    assert cascade.merge_state_in_place(iv, is_, v_b, s_b, backend=backend) is None
    assert torch.equal(iv, out_v) and torch.equal(is_, out_s)
    # in place with a mask (bool and uint8): rows left out are untouched, bit for bit
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool, device=device)
    for mask in (keep, keep.to(torch.uint8)):
        iv, is_ = v_a.clone(), s_a.clone()
        cascade.merge_state_in_place(iv, is_, v_b, s_b, mask=mask, backend=backend)
        assert torch.equal(iv[keep], out_v[keep]) and torch.equal(is_[keep], out_s[keep])
        assert torch.equal(iv[~keep], v_a[~keep]) and torch.equal(is_[~keep], s_a[~keep])


@pytest.mark.parametrize("dtype", V_DTYPES, ids=lambda d: str(d)[6:])
def test_merge_kernels_write_every_output_element(dtype, device):
    """Outputs poisoned with NaN come back fully written (the kernels' own launch, no torch fallback)."""
    v, s = _states(3, 6, 3, 5, 64, dtype, device)
    ref_v, ref_s = reference.merge_states(v.cpu(), s.cpu())
    out_v, out_s = nan_like((6, 5, 64), dtype, device), nan_like((6, 5), torch.float32, device)
    merge_kernel.merge_many(v, s, out_v, out_s)
    _check(out_v, out_s, ref_v, ref_s, dtype)
    ref2_v, ref2_s = reference.merge_states(v[:, :2].cpu(), s[:, :2].cpu())
    out_v, out_s = nan_like((6, 5, 64), dtype, device), nan_like((6, 5), torch.float32, device)
    merge_kernel.merge_two(v[:, 0], s[:, 0], v[:, 1], s[:, 1], out_v, out_s)
    _check(out_v, out_s, ref2_v, ref2_s, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_edge_sizes(backend, device):
    v, s = _states(4, 4, 1, 2, 64, torch.float16, device)
    one_v, one_s = cascade.merge_states(v, s, backend=backend)  # one state: itself (empty ones -> 0)
    assert torch.equal(one_s, s[:, 0])
    live = ~torch.isinf(s[:, 0])
    assert torch.equal(one_v[live], v[:, 0][live]) and not one_v[~live].any()
    none_v, none_s = cascade.merge_states(v[:, :0], s[:, :0], backend=backend)  # no states: empty everywhere
    assert not none_v.any() and torch.isinf(none_s).all()
    zero_v, zero_s = cascade.merge_state(v[:0, 0], s[:0, 0], v[:0, 0], s[:0, 0], backend=backend)
    assert zero_v.shape == (0, 2, 64) and zero_s.shape == (0, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_of_a_nan_or_inf_state_is_nan(bad, backend, device):
    """A NaN or +inf LSE is a broken state, not an empty one: the merged row is NaN in v and s (once it came out
    v = 0, s = -inf, dropping the other, valid state silently); rows without it keep their bits."""
    v, s = _states(4, 4, 3, 2, 64, torch.float16, device)
    s[:] = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(5)).to(device)  # every state live
    s[1, 2, 0] = bad
    v_m, s_m = cascade.merge_states(v, s, backend=backend)
    assert torch.isnan(v_m[1, 0]).all() and torch.isnan(s_m[1, 0])
    clean_v, clean_s = cascade.merge_states(v[[0, 2, 3]], s[[0, 2, 3]], backend=backend)
    assert torch.equal(v_m[[0, 2, 3]], clean_v) and torch.equal(s_m[[0, 2, 3]], clean_s)
    assert not torch.isnan(v_m[1, 1]).any()
    pair_v, pair_s = cascade.merge_state(v[:, 0], s[:, 0], v[:, 2], s[:, 2], backend=backend)
    assert torch.isnan(pair_v[1, 0]).all() and torch.isnan(pair_s[1, 0])
    assert not torch.isnan(pair_v[0]).any()


# ---------------------------------------------------------------- cascade

def _cascade_batch(seed, *, qo_lens, level_groups, level_kv_lens, heads, head_dim, page_size, dtype, layout,
                   tuple_cache, device):
    """One shuffled paged cache holding every KV segment of every level.

    level_groups[l]: how many consecutive requests share each of level l's segments (the last level: all 1);
    level_kv_lens[l]: the segments' lengths. Returns q, the cache, per-level plan arrays, and each request's
    segments (level order) as (level, segment) pairs."""
    gen = torch.Generator().manual_seed(seed)
    segments = [k for lens in level_kv_lens for k in lens]
    b = make_paged_batch(gen, qo_lens=[0] * len(segments), kv_lens=segments, num_qo_heads=heads[0],
                         num_kv_heads=heads[1], head_dim=head_dim, page_size=page_size, dtype=dtype,
                         kv_layout=layout, tuple_cache=tuple_cache, device=device)
    q = torch.randn(sum(qo_lens), heads[0], head_dim, generator=gen).to(dtype).to(device)
    arrays = {"qo": [], "indptr": [], "indices": [], "last": []}
    first = 0
    for groups, lens in zip(level_groups, level_kv_lens):
        assert sum(groups) == len(qo_lens) and len(groups) == len(lens)
        a, z = first, first + len(lens)
        rows, req = [0], 0
        for g in groups:
            rows.append(rows[-1] + sum(qo_lens[req:req + g]))
            req += g
        arrays["qo"].append(torch.tensor(rows, dtype=I32, device=device))
        arrays["indptr"].append(b.kv_indptr[a:z + 1] - b.kv_indptr[a])
        arrays["indices"].append(b.kv_indices[int(b.kv_indptr[a]):int(b.kv_indptr[z])])
        arrays["last"].append(b.last_page_len[a:z])
        first = z
    return q, b, arrays


def _flat_reference(q, b, qo_lens, level_groups, level_kv_lens, causal):
    """Each request's attention over the concatenation of its segments, level by level."""
    k_all, v_all, kv_indptr = reference.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len,
                                                     b.kv_layout)
    k_all, v_all = k_all.cpu(), v_all.cpu()
    owner = []  # owner[l][r]: global segment index that request r reads at level l
    first = 0
    for groups, lens in zip(level_groups, level_kv_lens):
        owner.append([first + j for j, g in enumerate(groups) for _ in range(g)])
        first += len(lens)
    outs, lses, row = [], [], 0
    for r, qo in enumerate(qo_lens):
        segs = [owner[lv][r] for lv in range(len(level_groups))]
        k = torch.cat([k_all[int(kv_indptr[j]):int(kv_indptr[j + 1])] for j in segs])
        v = torch.cat([v_all[int(kv_indptr[j]):int(kv_indptr[j + 1])] for j in segs])
        out, lse = reference.attention(q[row:row + qo], k, v, causal=causal)
        outs.append(out)
        lses.append(lse)
        row += qo
    return torch.cat(outs), torch.cat(lses)


CASCADES = [
    # (id, qo_lens, level_groups, level_kv_lens, causal, layout, tuple_cache, dtype, page_size)
    ("2lvl-fp16-nhd", [3, 0, 5, 2], [[4], [1, 1, 1, 1]], [[13], [6, 4, 9, 0]], False, "NHD", False,
     torch.float16, 4),
    ("3lvl-bf16-hnd-causal", [2, 4, 1, 3, 2], [[5], [2, 3], [1, 1, 1, 1, 1]], [[9], [5, 0], [3, 6, 2, 7, 4]],
     True, "HND", True, torch.bfloat16, 4),
]


@pytest.mark.parametrize("case", CASCADES, ids=[c[0] for c in CASCADES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cascade_against_flat_attention(case, backend, device):
    name, qo_lens, groups, kv_lens, causal, layout, tuple_cache, dtype, page_size = case
    heads, head_dim = (4, 2), 64
    q, b, arr = _cascade_batch(len(name), qo_lens=qo_lens, level_groups=groups, level_kv_lens=kv_lens,
                               heads=heads, head_dim=head_dim, page_size=page_size, dtype=dtype, layout=layout,
                               tuple_cache=tuple_cache, device=device)
    ref_out, ref_lse = _flat_reference(q.cpu(), b, qo_lens, groups, kv_lens, causal)
    w = cascade.MultiLevelCascadeAttentionWrapper(len(groups), torch.empty(1 << 16, dtype=torch.uint8,
                                                                          device=device), layout, backend=backend)
    w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], heads[0], heads[1], head_dim, page_size,
           causal=causal, q_data_type=dtype)
    assert w.backend == backend
    out = nan_like(q.shape, dtype, device)
    lse = nan_like(q.shape[:2], torch.float32, device)
    got = w.run(q, b.cache, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert not torch.isnan(out).any(), "an output element was not written"
    assert rel_err(out, ref_out) < tolerance(dtype)
    check_lse(lse, ref_lse)
    # determinism, and the forms without caller buffers
    out2 = w.forward(q, b.cache)
    assert torch.equal(out2, out)
    out3, lse3 = w.run(q, b.cache, return_lse=True)
    assert torch.equal(out3, out) and torch.equal(lse3, lse)


def test_cascade_one_level_is_paged_prefill(device):
    from serveattn.prefill import BatchPrefillWithPagedKVCacheWrapper
    q, b, arr = _cascade_batch(5, qo_lens=[3, 4], level_groups=[[1, 1]], level_kv_lens=[[10, 7]], heads=(4, 4),
                               head_dim=64, page_size=4, dtype=torch.float16, layout="NHD", tuple_cache=False,
                               device=device)
    ws = torch.empty(1 << 16, dtype=torch.uint8, device=device)
    w = cascade.MultiLevelCascadeAttentionWrapper(1, ws, backend="triton")
    w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 4, 64, 4, causal=True)
    p = BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    p.plan(arr["qo"][0], arr["indptr"][0], arr["indices"][0], arr["last"][0], 4, 4, 64, 4, causal=True)
    assert torch.equal(w.run(q, b.cache), p.run(q, b.cache))


def _two_level(device, seed=7):
    return _cascade_batch(seed, qo_lens=[2, 3, 1], level_groups=[[3], [1, 1, 1]], level_kv_lens=[[11], [4, 6, 3]],
                          heads=(4, 2), head_dim=64, page_size=4, dtype=torch.float16, layout="NHD",
                          tuple_cache=False, device=device)


def test_rejected_plan_leaves_every_level_as_it_was(device):
    q, b, arr = _two_level(device)
    w = cascade.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 16, dtype=torch.uint8, device=device),
                                                  backend="triton")
    w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4, causal=True)
    before = w.run(q, b.cache)
    # level 0 valid (and different), level 1 refused: level 0 must not have been installed
    other_prefix = [arr["indptr"][0], torch.flip(arr["indices"][0], [0]), arr["last"][0]]
    bad_last = arr["last"][1].clone()
    bad_last[1] = 5
    with pytest.raises(ValueError, match=r"\(level 1\): paged_kv_last_page_len\[1\]=5"):
        w.plan(arr["qo"], [other_prefix[0], arr["indptr"][1]], [other_prefix[1], arr["indices"][1]],
               [other_prefix[2], bad_last], 4, 2, 64, 4, causal=True)
    short_qo = [torch.tensor([0, 5], dtype=I32), arr["qo"][1]]
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[1\]\[-1\]=6 but qo_indptr_arr\[0\]\[-1\]=5"):
        w.plan(short_qo, [other_prefix[0], arr["indptr"][1]], [other_prefix[1], arr["indices"][1]],
               [other_prefix[2], arr["last"][1]], 4, 2, 64, 4, causal=True)
    assert torch.equal(w.run(q, b.cache), before)


def test_graph_mode_rejected_replan_leaves_buffers(device):
    """Under use_cuda_graph a level's commit overwrites its fixed buffers: a level that would overflow its
    buffer must be refused before any level (here level 0, with a new page table) is installed."""
    q, b, arr = _two_level(device)
    ws = torch.empty(1 << 16, dtype=torch.uint8, device=device)
    bufs = dict(qo_indptr_buf_arr=[torch.empty(4, dtype=I32, device=device) for _ in range(2)],
                paged_kv_indptr_buf_arr=[torch.empty(4, dtype=I32, device=device) for _ in range(2)],
                paged_kv_indices_buf_arr=[torch.empty(n, dtype=I32, device=device) for n in (3, 4)],
                paged_kv_last_page_len_buf_arr=[torch.empty(3, dtype=I32, device=device) for _ in range(2)])
    w = cascade.MultiLevelCascadeAttentionWrapper(2, ws, use_cuda_graph=True, backend="triton", **bufs)
    assert w.is_cuda_graph_enabled
    w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4, causal=True)
    out = nan_like(q.shape, torch.float16, device)
    w.run(q, b.cache, out=out)
    before = out.clone()
    ref_out, _ = _flat_reference(q.cpu(), b, [2, 3, 1], [[3], [1, 1, 1]], [[11], [4, 6, 3]], True)
    assert rel_err(out, ref_out) < tolerance(torch.float16)
    # level 1 now needs 5 page entries but its indices buffer holds 4
    long_last = arr["last"][1].clone()
    long_last[2] = 4
    long_indptr = arr["indptr"][1].clone()
    long_indptr[3] += 1
    long_indices = torch.cat([arr["indices"][1], arr["indices"][0][:1]])
    with pytest.raises(ValueError, match=r"\(level 1\): under use_cuda_graph=True the plan needs 5 entries in "
                                         r"its kv_indices buffer, which holds 4"):
        w.plan(arr["qo"], [arr["indptr"][0], long_indptr], [torch.flip(arr["indices"][0], [0]), long_indices],
               [arr["last"][0], long_last], 4, 2, 64, 4, causal=True)
    with pytest.raises(ValueError, match="may change only"):
        w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4, causal=True, sm_scale=0.5)
    w.run(q, b.cache, out=out)
    assert torch.equal(out, before)


def test_graph_mode_first_plan_allocates_each_level_once(device, monkeypatch):
    """Every level is checked before any commits; the buffers a level's first check allocates are the ones its
    commit writes and the captured graph reads (not allocated a second time at commit)."""
    q, b, arr = _two_level(device)
    w = cascade.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 16, dtype=torch.uint8, device=device),
                                                  use_cuda_graph=True, backend="triton")
    made = []
    for level in w._levels:
        real = level._allocate_graph_buffers
        monkeypatch.setattr(level, "_allocate_graph_buffers",
                            lambda *a, real=real: made.append(real(*a)) or made[-1])
    w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4, causal=True)
    assert len(made) == 2
    for level, bufs in zip(w._levels, made):
        assert all(level._graph_bufs[name] is t for name, t in bufs.items())
    out = w.run(q, b.cache)
    ref_out, _ = _flat_reference(q.cpu(), b, [2, 3, 1], [[3], [1, 1, 1]], [[11], [4, 6, 3]], True)
    assert rel_err(out, ref_out) < tolerance(torch.float16)
    w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4, causal=True)  # a re-plan: none
    assert len(made) == 2


# ---------------------------------------------------------------- refusals

def _state_args(device, rows=3, heads=2, dim=64, dtype=torch.float16):
    v = torch.zeros(rows, heads, dim, dtype=dtype, device=device)
    s = torch.zeros(rows, heads, dtype=torch.float32, device=device)
    return v, s


MERGE_REFUSALS = [
    # (id, function, argument builder, exception, sentence fragment)
    ("v_b_shape", "merge_state", lambda v, s: (v, s, v[:, :1], s[:, :1]), ValueError,
     r"v_b has shape \(3, 1, 64\) but v_a has \(3, 2, 64\)"),
    ("s_a_shape", "merge_state", lambda v, s: (v, s[:2], v, s), ValueError,
     r"s_a has shape \(2, 2\); expected \(3, 2\)"),
    ("s_fp16", "merge_state", lambda v, s: (v, s.half(), v, s), ValueError,
     "s_a has dtype torch.float16; the LSE must be float32"),
    ("v_fp64", "merge_state", lambda v, s: (v.double(), s, v.double(), s), NotImplementedError,
     "v_a has dtype torch.float64; supported: float16, bfloat16, float32"),
    ("v_int8", "merge_state", lambda v, s: (v.to(torch.int8), s, v.to(torch.int8), s), NotImplementedError,
     "v_a has dtype torch.int8"),
    ("v_mixed", "merge_state", lambda v, s: (v, s, v.bfloat16(), s), ValueError, "must share one dtype"),
    ("v_2d", "merge_state", lambda v, s: (v[:, 0], s, v, s), ValueError, "v_a has shape \\(3, 64\\); expected a 3-D"),
    ("not_tensor", "merge_state", lambda v, s: (v, s, [1.0], s), ValueError, "v_b has shape list"),
    ("zero_dim", "merge_state", lambda v, s: (v[..., :0], s, v[..., :0], s), ValueError, "head_dim must be positive"),
    ("mask_shape", "merge_state_in_place", lambda v, s: (v, s, v, s, torch.ones(2, dtype=torch.bool)), ValueError,
     r"mask has shape \(2,\); expected \(3,\)"),
    ("mask_dtype", "merge_state_in_place", lambda v, s: (v, s, v, s, torch.ones(3, dtype=torch.int32)),
     ValueError, "mask has dtype torch.int32; it must be bool or uint8"),
    ("other_shape", "merge_state_in_place", lambda v, s: (v, s, v[:2], s[:2]), ValueError,
     "v_other has shape"),
    ("expanded_v", "merge_state_in_place", lambda v, s: (v[:1].expand(v.shape), s, v.clone(), s.clone()),
     ValueError, "v is an expanded view \\(a zero stride\\); it is written in place"),
    ("other_in_v", "merge_state_in_place", lambda v, s: (v[1:], s[1:], v[:-1], s[1:].clone()), ValueError,
     "v_other overlaps v, which is written in place"),
    ("s_other_in_s", "merge_state_in_place", lambda v, s: (v, s, v.clone(), s.as_strided((3, 2), (1, 1))), ValueError,
     "s_other overlaps s, which is written in place"),
    ("states_3d", "merge_states", lambda v, s: (v, s), ValueError, "expected a 4-D tensor"),
    ("states_s", "merge_states", lambda v, s: (v[:, None], s), ValueError,
     r"s has shape \(3, 2\); expected \(3, 1, 2\)"),
]


@pytest.mark.parametrize("case", MERGE_REFUSALS, ids=[c[0] for c in MERGE_REFUSALS])
def test_merge_refusals(case, device):
    _, fn, build, exc, match = case
    v, s = _state_args(device)
    with pytest.raises(exc, match=match):
        getattr(cascade, fn)(*build(v, s))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_merge_in_place_with_itself_and_masked_rows_keep_their_bits(backend, device):
    """A state merged with itself (the very same views: each row read before it is written) is allowed: its LSE
    grows by one, its values stay; rows a mask leaves out keep their exact bits, a NaN's payload included."""
    gen = torch.Generator().manual_seed(7)
    v = torch.randn(3, 2, 64, generator=gen).half().to(device)
    s = torch.randn(3, 2, generator=gen).to(device)
    v0, s0 = v.clone(), s.clone()
    cascade.merge_state_in_place(v, s, v, s, backend=backend)
    assert rel_err(v, v0) < 1e-2 and torch.allclose(s, s0 + 1)
    v[1] = float("nan")
    before = v[1].clone()
    mask = torch.tensor([True, False, True], device=device)
    cascade.merge_state_in_place(v, s, v0, s0, mask, backend=backend)
    assert torch.equal(v[1].view(torch.int16), before.view(torch.int16))


def test_merge_refuses_unknown_backend(device):
    v, s = _state_args(device)
    with pytest.raises(NotImplementedError, match="backend='cudnn' is FlashInfer's and not served here"):
        cascade.merge_state(v, s, v, s, backend="cudnn")


def test_cascade_refusals(device):
    q, b, arr = _two_level(device)
    ws = torch.empty(1 << 16, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="num_levels=0 must be a positive int"):
        cascade.MultiLevelCascadeAttentionWrapper(0, ws)
    with pytest.raises(ValueError, match="qo_indptr_buf_arr has 1 entries for num_levels=2"):
        cascade.MultiLevelCascadeAttentionWrapper(2, ws, use_cuda_graph=True, qo_indptr_buf_arr=[arr["qo"][0]])
    with pytest.raises(ValueError, match="kv_layout='NDH' is not a layout"):
        cascade.MultiLevelCascadeAttentionWrapper(2, ws, "NDH")
    w = cascade.MultiLevelCascadeAttentionWrapper(3, ws)
    with pytest.raises(ValueError, match="run\\(\\) was called before plan\\(\\)"):
        w.run(q, b.cache)
    with pytest.raises(ValueError, match="qo_indptr_arr has 2 entries but the wrapper was built with num_levels=3"):
        w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4)
    w = cascade.MultiLevelCascadeAttentionWrapper(2, ws)
    with pytest.raises(ValueError, match="paged_kv_last_page_len has a Tensor"):
        w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"][1], 4, 2, 64, 4)
    with pytest.raises(NotImplementedError, match=r"\(level 0\): head_dim=96 is not served"):
        w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 96, 4)
    with pytest.raises(ValueError, match=r"\(level 1\): paged_kv_indptr has dtype torch.int64"):
        w.plan(arr["qo"], [arr["indptr"][0], arr["indptr"][1].long()], arr["indices"], arr["last"], 4, 2, 64, 4)
    # a level sees only its own keys: a window or RoPE positions would not count from the concatenated KV's
    with pytest.raises(NotImplementedError, match=r"window_left=8 with num_levels=2 is not served: each level would "
                                                  r"measure the window from its own keys"):
        w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4, window_left=8)
    with pytest.raises(NotImplementedError, match=r"pos_encoding_mode='ROPE_LLAMA' with num_levels=2 is not served"):
        w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4, pos_encoding_mode="ROPE_LLAMA")
    w.plan(arr["qo"], arr["indptr"], arr["indices"], arr["last"], 4, 2, 64, 4)
    with pytest.raises(ValueError, match=r"q has shape \(5, 4, 64\); expected \(6, 4, 64\)"):
        w.run(q[:5], b.cache)
    top = max(int(arr["indices"][0].max()), int(arr["indices"][1].max()))
    level = 0 if int(arr["indices"][0].max()) == top else 1
    with pytest.raises(ValueError, match=rf"paged_kv_indices_arr\[{level}\] refers to page {top}, beyond the "
                                         rf"cache's {top} pages"):
        w.run(q, b.cache[:top])
    with pytest.raises(ValueError, match="lse has dtype torch.float16"):
        w.run(q, b.cache, lse=torch.zeros(6, 4, dtype=torch.float16), return_lse=True)


@pytest.mark.parametrize("num_levels", [1, 2])
def test_cascade_run_refusals_name_the_cascade_entry(num_levels, device):
    """run()'s checks are made by the levels (paged prefill wrappers); their sentences name the entry the caller
    used, MultiLevelCascadeAttentionWrapper.run, not the wrapper inside."""
    q, b, arr = _two_level(device)
    w = cascade.MultiLevelCascadeAttentionWrapper(num_levels, torch.empty(1 << 16, dtype=torch.uint8, device=device))
    w.plan(*(a[-num_levels:] for a in (arr["qo"], arr["indptr"], arr["indices"], arr["last"])), 4, 2, 64, 4)
    entry = r"^MultiLevelCascadeAttentionWrapper\.run: "
    with pytest.raises(ValueError, match=entry + r"q has dtype torch.bfloat16; expected torch.float16"):
        w.run(q.bfloat16(), b.cache)
    with pytest.raises(ValueError, match=entry + r"k cache has dtype torch.bfloat16 but the plan declared"):
        w.run(q, b.cache.bfloat16())
    with pytest.raises(ValueError, match=entry + r"k_scale=-1.0 must be a positive finite float"):
        w.run(q, b.cache, k_scale=-1.0)
    with pytest.raises(ValueError, match=entry + r"out has dtype torch.float32; expected torch.float16"):
        w.run(q, b.cache, out=torch.empty(q.shape, device=device))
