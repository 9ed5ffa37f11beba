"""Refusals of the attention wrappers and single-request calls at construction, plan() and run(), each type and
sentence (the cases scripts/refusal_audit.py found no other test raising)."""
import numpy as np
import pytest
import torch

import serveattn
from helpers import make_paged_batch

F16, I32 = torch.float16, torch.int32
E4M3 = torch.float8_e4m3fn
HQ, HKV, D, PS = 4, 2, 64, 4


def _ws(device, nbytes=1 << 20):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _batch(device, dtype=F16, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return make_paged_batch(gen, qo_lens=[3, 5], kv_lens=[10, 20], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                            page_size=PS, dtype=dtype, device=device)


def _rand(*shape, dtype=F16, device="cpu"):
    return torch.randn(*shape).to(dtype).to(device)


def _strided_cache(b):
    """b's 5-D cache with the head dim not at unit stride (shape unchanged)."""
    c = b.cache
    return c.transpose(-1, -2).contiguous().transpose(-1, -2)


def _paged_plan(b, w, **kw):
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PS,
           q_data_type=kw.pop("q_data_type", F16), **kw)
    return w


def _decode_plan(b, w, **kw):
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PS, q_data_type=F16, **kw)
    return w


def _decode_q(b, device):
    return _rand(len(b.kv_lens), HQ, D, device=device)


# ---------------------------------------------------------------- constructors

CTORS = {
    "decode": serveattn.BatchDecodeWithPagedKVCacheWrapper,
    "paged": serveattn.BatchPrefillWithPagedKVCacheWrapper,
    "ragged": serveattn.BatchPrefillWithRaggedKVCacheWrapper,
}
CTOR_REFUSALS = [
    # (id, wrapper, workspace is a tensor, constructor keywords, exception, fragment); the paged and ragged
    # wrappers share _PrefillWrapper.__init__
    ("decode-jit_args", "decode", True, dict(jit_args=("mod",)), NotImplementedError,
     r"BatchDecodeWithPagedKVCacheWrapper: jit_args is not served; kernels are compiled by Triton\."),
    ("decode-workspace-list", "decode", False, {}, ValueError,
     r"BatchDecodeWithPagedKVCacheWrapper: float_workspace_buffer must be a torch\.Tensor\."),
    ("paged-jit_args", "paged", True, dict(jit_args=("mod",)), NotImplementedError,
     r"BatchPrefillWithPagedKVCacheWrapper: jit_args is not served; kernels are compiled by Triton\."),
    ("paged-workspace-list", "paged", False, {}, ValueError,
     r"BatchPrefillWithPagedKVCacheWrapper: float_workspace_buffer must be a torch\.Tensor\."),
    ("ragged-jit_args", "ragged", True, dict(jit_args=("mod",)), NotImplementedError,
     r"BatchPrefillWithRaggedKVCacheWrapper: jit_args is not served"),
    ("ragged-workspace-numpy", "ragged", False, {}, ValueError,
     r"BatchPrefillWithRaggedKVCacheWrapper: float_workspace_buffer must be a torch\.Tensor\."),
]


@pytest.mark.parametrize("case", CTOR_REFUSALS, ids=[c[0] for c in CTOR_REFUSALS])
def test_constructor_refusals(case, device):
    _, kind, tensor_ws, kw, exc, match = case
    ws = _ws(device) if tensor_ws else (np.ones(64, np.uint8) if kind == "ragged" else [1] * 64)
    with pytest.raises(exc, match=match):
        CTORS[kind](ws, backend="triton", **kw)


# ---------------------------------------------------------------- page tables and masks at plan()

def _plan_args(b, device, what):
    args = dict(qo_indptr=b.qo_indptr, paged_kv_indptr=b.kv_indptr, paged_kv_indices=b.kv_indices,
                paged_kv_last_page_len=b.last_page_len)
    bits = 3 * 10 + 5 * 20  # the batch's sum(qo_len * kv_len)
    gen = torch.Generator().manual_seed(7)
    if what == "indptr_2d":
        args["qo_indptr"] = b.qo_indptr[None]
    elif what == "indptr_empty":
        args["paged_kv_indptr"] = torch.empty(0, dtype=I32, device=device)
    elif what == "indptr_start":
        args["qo_indptr"] = torch.tensor([1, 3, 8], dtype=I32, device=device)
    elif what == "indptr_decreasing":
        args["qo_indptr"] = torch.tensor([0, 5, 3], dtype=I32, device=device)
    elif what == "last_short":
        args["paged_kv_last_page_len"] = b.last_page_len[:1]
    elif what == "mask_float":
        args["custom_mask"] = (torch.rand(bits, generator=gen) + 0.5).to(device)
    elif what == "packed_int32":
        args["packed_custom_mask"] = torch.randint(1, 255, (17,), generator=gen, dtype=I32).to(device)
    elif what == "packed_size":
        args["packed_custom_mask"] = torch.randint(1, 255, (16,), generator=gen, dtype=torch.uint8).to(device)
    return args


PLAN_REFUSALS = [
    # (id, what, fragment): all ValueError
    ("indptr-2d", "indptr_2d", r"qo_indptr must be 1-D, got shape \(1, 3\)\."),
    ("indptr-empty", "indptr_empty",
     r"paged_kv_indptr has 0 elements; at least 1 are needed\."),
    ("indptr-start", "indptr_start", r"qo_indptr\[0\]=1; an indptr must start at 0\."),
    ("indptr-decreasing", "indptr_decreasing",
     r"qo_indptr decreases somewhere; an indptr must be non-decreasing\."),
    ("last-page-len-short", "last_short",
     r"paged_kv_last_page_len has 1 entries for a batch of 2 \(paged_kv_indptr has 3\)\."),
    ("custom-mask-float", "mask_float",
     r"custom_mask has dtype torch\.float32; it must be bool\."),
    ("packed-mask-int32", "packed_int32",
     r"packed_custom_mask has dtype torch\.int32; it must be uint8\."),
    ("packed-mask-size", "packed_size",  # segments of 30 and 100 bits: 4 + 13 bytes
     r"packed_custom_mask has 16 bytes; per-request segments padded to whole bytes need 17\."),
]


@pytest.mark.parametrize("case", PLAN_REFUSALS, ids=[c[0] for c in PLAN_REFUSALS])
def test_paged_plan_refusals(case, device):
    _, what, match = case
    b = _batch(device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton")
    with pytest.raises(ValueError, match="BatchPrefillWithPagedKVCacheWrapper.plan: " + match):
        w.plan(**_plan_args(b, device, what), num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, page_size=PS,
               q_data_type=F16)


# ---------------------------------------------------------------- run() of the paged prefill and decode wrappers

RUN_REFUSALS = [
    # (id, wrapper, what, exception, fragment); a meta tensor stands for another device (there is no second one here)
    ("paged-out-list", "paged", "out_list", ValueError, r"out must be a torch\.Tensor, got list\."),
    ("paged-out-meta", "paged", "out_meta", ValueError, r"out is on meta; expected "),
    ("paged-out-strided", "paged", "out_strided", ValueError,
     r"out must have a contiguous last dimension \(stride 4 received\)\."),
    ("paged-k-scale-meta", "paged", "k_scale_meta", ValueError,
     r"k_scale is on meta; a tensor scale must be on "),
    ("paged-cache-meta", "paged", "cache_meta", ValueError, r"k cache is on meta; expected "),
    ("paged-cache-strided", "paged", "cache_strided", ValueError,
     r"k must have a contiguous last dimension\."),
    ("decode-positional", "decode", "positional", NotImplementedError,
     r"run\(\) takes q, paged_kv_cache by position, then FlashInfer 0.7's three fp8 descales \(scale_q, scale_k, "
     r"scale_v\) for an fp8 query, and the rest by keyword; got 1 more by position\.$"),
    ("decode-cache-meta", "decode", "cache_meta", ValueError, r"k cache is on meta; expected "),
    ("decode-cache-strided", "decode", "cache_strided", ValueError,
     r"k must have a contiguous last dimension\."),
]


@pytest.mark.parametrize("case", RUN_REFUSALS, ids=[c[0] for c in RUN_REFUSALS])
def test_run_refusals(case, device):
    _, kind, what, exc, match = case
    b = _batch(device)
    if kind == "paged":
        w = _paged_plan(b, serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton"))
        q = b.q
    else:  # the bandwidth kernel's own run() checks (use_tensor_cores=False, an explicit backend)
        w = _decode_plan(b, serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), backend="triton"))
        q = _decode_q(b, device)
    cache, args, kw = b.cache, (), {}
    if what == "out_list":
        kw["out"] = q.tolist()
    elif what == "out_meta":
        kw["out"] = torch.empty(q.shape, dtype=q.dtype, device="meta")
    elif what == "out_strided":
        kw["out"] = torch.empty(q.shape[0], D, HQ, dtype=q.dtype, device=device).transpose(1, 2)
    elif what == "k_scale_meta":
        kw["k_scale"] = torch.ones(1, dtype=torch.float32, device="meta")
    elif what == "cache_meta":
        cache = torch.empty(cache.shape, dtype=cache.dtype, device="meta")
    elif what == "cache_strided":
        cache = _strided_cache(b)
    elif what == "positional":
        args = (1.0,)  # FlashInfer 0.7's positional descales
    entry = {"paged": "BatchPrefillWithPagedKVCacheWrapper", "decode": "BatchDecodeWithPagedKVCacheWrapper"}[kind]
    with pytest.raises(exc, match=entry + r"\.run: " + match):
        w.run(q, cache, *args, **kw)


# ---------------------------------------------------------------- single-request calls

SINGLE_REFUSALS = [
    # (id, entry point, (q shape, k shape, v shape), k/v device, exception, fragment)
    ("decode-k-2d", "decode", ((HQ, D), (20, D), (20, HKV, D)), None, ValueError,
     r"single_decode_with_kv_cache: k must be a 3-D tensor\."),
    ("decode-kv-shapes", "decode", ((HQ, D), (20, HKV, D), (21, HKV, D)), None, ValueError,
     r"single_decode_with_kv_cache: k has shape \(20, 2, 64\) but v has shape \(21, 2, 64\)\."),
    ("decode-head-dim", "decode", ((HQ, D), (20, HKV, 128), (20, HKV, 128)), None, ValueError,
     r"single_decode_with_kv_cache: q has head dim 64 but k has 128\."),
    ("prefill-kv-shapes", "prefill", ((5, HQ, D), (20, HKV, D), (21, HKV, D)), None, ValueError,
     r"single_prefill_with_kv_cache: k has shape \(20, 2, 64\) but v has shape \(21, 2, 64\)\."),
    ("prefill-head-dim", "prefill", ((5, HQ, D), (20, HKV, 128), (20, HKV, 128)), None, ValueError,  # :1393
     r"single_prefill_with_kv_cache: q has head dim 64 but k has 128\."),
    ("prefill-kv-meta", "prefill", ((5, HQ, D), (20, HKV, D), (20, HKV, D)), "meta", ValueError,
     r"single_prefill_with_kv_cache: k is on meta but the computation runs on "),
]


@pytest.mark.parametrize("case", SINGLE_REFUSALS, ids=[c[0] for c in SINGLE_REFUSALS])
def test_single_request_refusals(case, device):
    _, kind, (q_shape, k_shape, v_shape), kv_device, exc, match = case
    q = _rand(*q_shape, device=device)
    kv_device = kv_device or device
    k = _rand(*k_shape, device=device).to(kv_device) if kv_device != "meta" else \
        torch.empty(k_shape, dtype=F16, device="meta")
    v = _rand(*v_shape, device=device).to(kv_device) if kv_device != "meta" else \
        torch.empty(v_shape, dtype=F16, device="meta")
    fn = serveattn.single_decode_with_kv_cache if kind == "decode" else serveattn.single_prefill_with_kv_cache
    with pytest.raises(exc, match=match):
        fn(q, k, v, backend="triton")  # decode: the bandwidth kernel's path (no tensor cores, no RoPE)


# ---------------------------------------------------------------- use_cuda_graph=True (built on the CPU too)

def test_graph_decode_indptr_buffer_too_small(device):
    """The indptr buffer needs batch capacity + 1 entries (the capacity: last_page_len_buffer's)."""
    b = _batch(device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        _ws(device), use_cuda_graph=True, backend="triton",
        paged_kv_indptr_buffer=torch.arange(2, dtype=I32, device=device),
        paged_kv_indices_buffer=torch.arange(16, dtype=I32, device=device),
        paged_kv_last_page_len_buffer=torch.ones(2, dtype=I32, device=device))
    with pytest.raises(ValueError, match=r"BatchDecodeWithPagedKVCacheWrapper\.plan: the kv_indptr buffer holds 2 "
                                         r"entries; it needs at least 3 \(the batch capacity 2 \+ 1\)\.$"):
        _decode_plan(b, w)


GRAPH_PLAN_REFUSALS = [
    # (id, workspace, caller buffers, fragment)
    ("workspace-float32", "f32", {},
     r"under use_cuda_graph=True float_workspace_buffer must be a contiguous uint8 tensor of at least 64 bytes "
     r"\(got torch\.float32, 256 elements\)\."),
    ("workspace-32-bytes", "tiny", {},
     r"under use_cuda_graph=True float_workspace_buffer must be a contiguous uint8 tensor of at least 64 bytes "
     r"\(got torch\.uint8, 32 elements\)\."),
    ("qo-indptr-buf-int64", "ok", dict(qo_indptr_buf="int64"),
     r"the qo_indptr buffer must be a 1-D torch\.int32 tensor on "),
    ("indices-buf-2d", "ok", dict(paged_kv_indices_buf="2d"),
     r"the kv_indices buffer must be a 1-D torch\.int32 tensor on "),
]


@pytest.mark.parametrize("case", GRAPH_PLAN_REFUSALS, ids=[c[0] for c in GRAPH_PLAN_REFUSALS])
def test_graph_prefill_first_plan_refusals(case, device):
    _, ws_kind, bufs, match = case
    ws = {"f32": torch.empty(256, dtype=torch.float32, device=device), "tiny": _ws(device, 32),
          "ok": _ws(device)}[ws_kind]
    kw = {}
    for name, how in bufs.items():
        kw[name] = torch.arange(16, dtype=torch.int64, device=device) if how == "int64" else \
            torch.arange(64, dtype=I32, device=device).view(4, 16)
    b = _batch(device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True, backend="triton", **kw)
    with pytest.raises(ValueError, match=r"BatchPrefillWithPagedKVCacheWrapper\.plan: " + match):
        _paged_plan(b, w)


def test_graph_prefill_replan_beyond_the_captured_q(device):
    """After the first run() (the q a graph captures, 8 rows), a re-plan with more rows is refused."""
    b = _batch(device)
    w = _paged_plan(b, serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), use_cuda_graph=True,
                                                                      backend="triton"))
    w.run(b.q, b.cache)  # one interpreted launch: it fixes the captured q's rows
    more = torch.tensor([0, 4, 9], dtype=I32, device=device)
    with pytest.raises(ValueError, match=r"BatchPrefillWithPagedKVCacheWrapper\.plan: under use_cuda_graph=True the "
                                         r"re-plan has 9 query rows but the captured q holds 8\."):
        w.plan(more, b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, D, PS, q_data_type=F16)


# ---------------------------------------------------------------- forward() with RoPE on a plan that cannot take it

def test_forward_rope_on_an_fp8_prefill_plan(device):
    """An fp8 query (refused in forward() before run() is reached)."""
    b = _batch(device)
    cache = b.cache.to(E4M3)
    w = _paged_plan(b, serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton"),
                    q_data_type=E4M3, kv_data_type=E4M3)
    with pytest.raises(NotImplementedError, match=r"BatchPrefillWithPagedKVCacheWrapper\.forward: "
                                                   r"pos_encoding_mode='ROPE_LLAMA' is not served with an fp8 query "
                                                   r"or a tree; apply RoPE before quantizing q"):
        w.forward(b.q.to(E4M3), cache, pos_encoding_mode="ROPE_LLAMA")


def test_forward_rope_on_a_decode_tree_plan(device):
    """A tree (the decode wrapper's tensor-core route plans trees through the prefill wrapper)."""
    b = _batch(device)
    w = _decode_plan(b, serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), use_tensor_cores=True,
                                                                     backend="triton"),
                     tree_parents=[[-1, 0, 0], [-1, 0]])
    q = _rand(5, HQ, D, device=device)
    with pytest.raises(NotImplementedError, match=r"BatchDecodeWithPagedKVCacheWrapper\.forward: "
                                                   r"pos_encoding_mode='ROPE_LLAMA' is not served with an fp8 query "
                                                   r"or a tree"):
        w.forward(q, b.cache, pos_encoding_mode="ROPE_LLAMA")


# ---------------------------------------------------------------- sites with no public path

def test_graph_rows_cap_through_the_decode_wrappers_hook(device):
    """Only the decode wrapper sets a prefill wrapper's _graph_max_qo (to its chain's k, or 64 for
    trees) and it fixes the verify mode, so no public call plans more rows than the cap; set here as it sets it."""
    b = _batch(device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), use_cuda_graph=True, backend="triton")
    w._graph_max_qo = 4
    with pytest.raises(ValueError, match=r"under use_cuda_graph=True this wrapper serves at most 4 query rows per "
                                         r"request; the plan has 5\."):
        _paged_plan(b, w)

