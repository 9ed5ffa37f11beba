"""The dtype/scale refusals of API.md swept over every public entry point, before anything launches.

The entry points come from `serveattn.__all__`: a new export fails `test_every_export_is_swept` until it
is placed in one of the tables below.
"""
import pytest
import torch

import serveattn
from serveattn import torch_impl
from serveattn.kernels import attention as attention_kernel
from serveattn.kernels import decode as decode_kernel

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
I32 = torch.int32
HQ, HKV, D, PS = 4, 2, 64, 16


def _tensor(shape, dtype, device):
    x = torch.randn(shape) * 2
    if dtype in (torch.int8, torch.uint8):
        return torch.randint(0, 100, shape, dtype=dtype, device=device)
    return x.to(dtype).to(device)


def _paged(kv_dtype, v_dtype, device, batch=2, kv_len=20):
    pages = -(-kv_len // PS)
    k = _tensor((batch * pages, PS, HKV, D), kv_dtype, device)
    v = _tensor((batch * pages, PS, HKV, D), v_dtype, device)
    # a fixed contiguous table on purpose: every call here is refused on its dtypes before the table is read
    table = (torch.arange(batch + 1, dtype=I32, device=device) * pages,
             torch.arange(batch * pages, dtype=I32, device=device),
             torch.full((batch,), kv_len - (pages - 1) * PS, dtype=I32, device=device))
    return (k, v), table


def _ws(device):
    return torch.empty(1 << 20, dtype=torch.uint8, device=device)


# Each adapter calls one entry point with the given dtypes and extra run keywords; it returns nothing.
def _batch_prefill_paged(device, q_dtype, kv_dtype, v_dtype, o_dtype, run_kw):
    cache, table = _paged(kv_dtype, v_dtype, device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton")
    w.plan(torch.tensor([0, 3, 6], dtype=I32), *table, HQ, HKV, D, PS, causal=True, q_data_type=q_dtype,
           kv_data_type=kv_dtype, o_data_type=o_dtype)
    w.run(_tensor((6, HQ, D), q_dtype, device), cache, **run_kw)


def _batch_prefill_ragged(device, q_dtype, kv_dtype, v_dtype, o_dtype, run_kw):
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
    w.plan(torch.tensor([0, 3, 6], dtype=I32), torch.tensor([0, 20, 40], dtype=I32), HQ, HKV, D, causal=True,
           q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=o_dtype)
    w.run(_tensor((6, HQ, D), q_dtype, device), _tensor((40, HKV, D), kv_dtype, device),
          _tensor((40, HKV, D), v_dtype, device), **run_kw)


def _batch_decode(device, q_dtype, kv_dtype, v_dtype, o_dtype, run_kw, tensor_cores=False, graph=False):
    cache, table = _paged(kv_dtype, v_dtype, device)
    if graph:
        w = serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            _ws(device), torch.empty(3, dtype=I32, device=device), torch.empty(8, dtype=I32, device=device),
            torch.empty(2, dtype=I32, device=device), use_tensor_cores=tensor_cores)
    else:
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), use_tensor_cores=tensor_cores,
                                                         backend="triton")
    w.plan(*table, HQ, HKV, D, PS, q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=o_dtype)
    w.run(_tensor((2, HQ, D), q_dtype, device), cache, **run_kw)


def _cascade(device, q_dtype, kv_dtype, v_dtype, o_dtype, run_kw):
    cache, (indptr, indices, last) = _paged(kv_dtype, v_dtype, device)
    w = serveattn.MultiLevelCascadeAttentionWrapper(2, _ws(device), backend="triton")
    w.plan([torch.tensor([0, 6], dtype=I32, device=device), torch.tensor([0, 3, 6], dtype=I32, device=device)],
           [indptr[:2], indptr], [indices[:2], indices], [last[:1], last], HQ, HKV, D, PS, causal=True,
           q_data_type=q_dtype, kv_data_type=kv_dtype)
    w.run(_tensor((6, HQ, D), q_dtype, device), cache, **run_kw)


def _single_prefill(device, q_dtype, kv_dtype, v_dtype, o_dtype, run_kw, return_lse=False):
    fn = serveattn.single_prefill_with_kv_cache_return_lse if return_lse else serveattn.single_prefill_with_kv_cache
    kw = dict(run_kw)
    if o_dtype is not None:
        kw["o_dtype"] = o_dtype
    fn(_tensor((5, HQ, D), q_dtype, device), _tensor((20, HKV, D), kv_dtype, device),
       _tensor((20, HKV, D), v_dtype, device), causal=True, backend="triton", **kw)


def _single_decode(device, q_dtype, kv_dtype, v_dtype, o_dtype, run_kw):
    serveattn.single_decode_with_kv_cache(_tensor((HQ, D), q_dtype, device), _tensor((20, HKV, D), kv_dtype, device),
                                          _tensor((20, HKV, D), v_dtype, device), backend="triton", **run_kw)


ATTENTION = {
    "BatchPrefillWithPagedKVCacheWrapper": _batch_prefill_paged,
    "BatchPrefillWithRaggedKVCacheWrapper": _batch_prefill_ragged,
    "BatchDecodeWithPagedKVCacheWrapper": _batch_decode,
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper": lambda *a: _batch_decode(*a, tensor_cores=True, graph=True),
    "MultiLevelCascadeAttentionWrapper": _cascade,
    "single_prefill_with_kv_cache": _single_prefill,
    "single_prefill_with_kv_cache_return_lse": lambda *a: _single_prefill(*a, return_lse=True),
    "single_decode_with_kv_cache": _single_decode,
}
# Entry points that take no output dtype or no fp8-query descales (FlashInfer's signatures) skip those rows.
NO_O_DTYPE = {"MultiLevelCascadeAttentionWrapper", "single_decode_with_kv_cache"}
NO_DESCALES = {"MultiLevelCascadeAttentionWrapper", "single_decode_with_kv_cache"}
FP8_QUERY_ON_BANDWIDTH_ROUTE = {"BatchDecodeWithPagedKVCacheWrapper"}  # refused at plan: tensor cores only

DESCALE = {"scale_q": 1}  # any value: the descales are refused before they are read


def _descale(device):
    return torch.ones(1, device=device)


CASES = [
    # (id, q dtype, k dtype, v dtype, o dtype, run keywords, exception, sentence)
    ("fnuz-query", torch.float8_e4m3fnuz, torch.float8_e4m3fnuz, torch.float8_e4m3fnuz, None, {},
     NotImplementedError, "fnuz fp8 encodings are not served"),
    ("fnuz-cache", F16, torch.float8_e5m2fnuz, torch.float8_e5m2fnuz, None, {}, NotImplementedError,
     "fnuz fp8 encodings are not served"),
    ("int8-cache", F16, torch.int8, torch.int8, None, {}, NotImplementedError, "integer caches are not served"),
    ("uint8-cache", BF16, torch.uint8, torch.uint8, None, {}, NotImplementedError, "integer caches are not served"),
    ("float32-inputs", F32, F32, F32, None, {}, NotImplementedError, "float32 inputs are not served"),
    ("float32-cache", F16, F32, F32, None, {}, NotImplementedError, "float32 inputs are not served"),
    ("kv-mismatch", F16, F16, BF16, None, {}, ValueError, "K and V must share one dtype"),
    ("fp8-kv-mismatch", BF16, E4M3, E5M2, None, {}, ValueError, "K and V must share one dtype"),
    ("fp8-query-16bit-cache", E4M3, F16, F16, None, {}, NotImplementedError, "an fp8 query"),
    ("fp8-output", F16, F16, F16, E4M3, {}, NotImplementedError, "float8_e4m3fn is not served; supported output"),
    ("16bit-cache-other-dtype", F16, BF16, BF16, None, {}, NotImplementedError, "differs from the query dtype"),
    ("descales-16bit-query", BF16, E4M3, E4M3, None, "descale", ValueError, "apply to an fp8 query"),
    ("descales-with-k_scale", BF16, E4M3, E4M3, None, "descale+k_scale", ValueError, "scaled twice"),
    ("descale-wrong-shape", E4M3, E4M3, E4M3, None, "descale-shape", ValueError,
     "scale_q has shape \\(3,\\) and dtype torch.float32; a descale is a float32 tensor of one element \\(per "
     "tensor\\) or of shape \\["),
    ("descale-wrong-device", E4M3, E4M3, E4M3, None, "descale-device", ValueError, "a descale must be on"),
]


def _run_kw(spec, device):
    if spec == "descale":
        return {"scale_q": _descale(device), "scale_k": _descale(device), "scale_v": _descale(device)}
    if spec == "descale+k_scale":
        return {"scale_k": _descale(device), "k_scale": 0.5}
    if spec == "descale-shape":
        return {"scale_q": torch.ones(3, device=device)}
    if spec == "descale-device":
        return {"scale_k": torch.ones(1, device="meta")}
    return dict(spec)


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch (or torch-path compute) during a refused call fails the test."""
    def boom(*args, **kwargs):
        raise AssertionError("a kernel was launched before the refusal")
    for module, name in ((attention_kernel, "launch"), (decode_kernel, "launch"), (torch_impl, "prefill")):
        monkeypatch.setattr(module, name, boom)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("entry", sorted(ATTENTION))
def test_attention_refusals(entry, case, device, no_launch):
    _, q_dtype, k_dtype, v_dtype, o_dtype, run_spec, exc, sentence = case
    if o_dtype is not None and entry in NO_O_DTYPE:
        pytest.skip(f"{entry} takes no output dtype")
    if isinstance(run_spec, str) and entry in NO_DESCALES:
        pytest.skip(f"{entry} takes no fp8-query descales")
    if q_dtype in (E4M3, E5M2) and k_dtype in (E4M3, E5M2) and entry in FP8_QUERY_ON_BANDWIDTH_ROUTE:
        exc, sentence = NotImplementedError, "an fp8 query is served on the tensor-core route only"
    with pytest.raises(exc, match=sentence):
        ATTENTION[entry](device, q_dtype, k_dtype, v_dtype, o_dtype, _run_kw(run_spec, device))


def _append(device, dtype):
    cache = _tensor((4, 2, PS, HKV, D), dtype, device)
    x = _tensor((3, HKV, D), dtype, device)
    serveattn.append_paged_kv_cache(x, x, torch.zeros(3, dtype=I32, device=device),
                                    torch.arange(3, dtype=I32, device=device), cache,
                                    torch.arange(2, dtype=I32, device=device), torch.tensor([0, 2], dtype=I32,
                                                                                            device=device),
                                    torch.tensor([3], dtype=I32, device=device), backend="triton")


def _merge(name, device, dtype):
    v, s = _tensor((3, HQ, D), dtype, device), torch.zeros(3, HQ, device=device)
    if name == "merge_states":
        serveattn.merge_states(v[:, None], s[:, None], backend="triton")
    elif name == "merge_state":
        serveattn.merge_state(v, s, v, s, backend="triton")
    else:
        serveattn.merge_state_in_place(v, s, v, s, backend="triton")


CACHE_WRITERS = {"append_paged_kv_cache": _append}
STATE_MERGERS = {name: (lambda device, dtype, name=name: _merge(name, device, dtype))
                 for name in ("merge_state", "merge_state_in_place", "merge_states")}
INDEX_HELPERS = {
    "get_batch_indices_positions": lambda device: serveattn.get_batch_indices_positions(
        torch.tensor([0, 2], dtype=torch.int64, device=device), torch.tensor([2], dtype=I32, device=device), 2),
    "get_seq_lens": lambda device: serveattn.get_seq_lens(
        torch.tensor([0, 1], dtype=torch.int64, device=device), torch.tensor([3], dtype=I32, device=device), 16),
    "segment_packbits": lambda device: serveattn.segment_packbits(
        torch.ones(4, dtype=torch.bool, device=device), torch.tensor([0, 4], dtype=torch.int64, device=device)),
    "packbits": lambda device: serveattn.packbits(torch.ones(4, dtype=torch.bool, device=device),
                                                  bitorder="middle"),
}


@pytest.mark.parametrize("dtype,sentence", [
    (torch.float8_e4m3fnuz, "not served"), (torch.int8, "not served"), (torch.uint8, "not served"),
    (F32, "not served")])
def test_cache_writer_refusals(dtype, sentence, device):
    for name, call in CACHE_WRITERS.items():
        with pytest.raises(NotImplementedError, match=sentence):
            call(device, dtype)


@pytest.mark.parametrize("dtype", [torch.int8, E4M3, torch.float8_e5m2fnuz])
def test_state_merger_refusals(dtype, device):
    for name, call in STATE_MERGERS.items():
        with pytest.raises(NotImplementedError, match="dtype"):
            call(device, dtype)


def test_index_helper_refusals(device):
    for name, call in INDEX_HELPERS.items():
        with pytest.raises(ValueError, match="int32|bit order"):
            call(device)


def _probs(device, dtype, n=2, vocab=8):
    return torch.softmax(torch.randn(3, n, vocab), -1).to(dtype).to(device)


SAMPLERS = {
    "chain_speculative_sampling": lambda device, dtype: serveattn.chain_speculative_sampling(
        _probs(device, dtype), torch.zeros(3, 2, dtype=I32, device=device), _probs(device, dtype, n=3)),
    "tree_speculative_sampling": lambda device, dtype: serveattn.tree_speculative_sampling(
        _probs(device, dtype), torch.zeros(3, 2, dtype=I32, device=device), _probs(device, dtype, n=3),
        torch.tensor([[-1, 0]] * 3, dtype=I32, device=device)),
}
MASK_BUILDERS = {"tree_parents_to_mask": (lambda: serveattn.tree_parents_to_mask([[-1, 5]], [4]),
                                          r"^tree_parents_to_mask: parents_list\[0\]\[1\]=5; a parent must be -1 "
                                          r"\(the root\) or an earlier node \(0\.\.0\)\.")}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_sampler_refusals(dtype, device):
    """16-bit and float64 probabilities are read as float32 (FlashInfer's cast); fp8 ones are refused."""
    for name, call in SAMPLERS.items():
        with pytest.raises(NotImplementedError, match="served in float32, float16, bfloat16 or float64"):
            call(device, dtype)


def test_mask_builder_refusals():
    for name, (call, match) in MASK_BUILDERS.items():
        with pytest.raises(ValueError, match=match):
            call()


def test_every_export_is_swept():
    swept = set(ATTENTION) | set(CACHE_WRITERS) | set(STATE_MERGERS) | set(INDEX_HELPERS) | set(SAMPLERS) | \
        set(MASK_BUILDERS)
    assert swept == set(serveattn.__all__), "a public entry point is missing from the refusal sweep"
