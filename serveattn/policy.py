"""What serveattn serves, and the one sentence for what it does not.

Every public entry point asks this module before it compiles or launches anything. A wrong argument
raises ``ValueError``; a valid request this library does not serve raises ``NotImplementedError``.
Each message names the entry point, the argument, the value received and what is supported.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

HEAD_DIMS = (64, 128, 256)
HALF_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_LAYOUTS = ("NHD", "HND")
POS_ENCODINGS = ("NONE", "ROPE_LLAMA")
BACKENDS = ("auto", "triton", "torch", "fa2", "fa3")
# FlashInfer 0.7's other backend names (its wrappers' backend= values): refused as valid requests not served
FLASHINFER_ONLY_BACKENDS = ("cudnn", "trtllm-gen", "cute-dsl", "cute-dsl-prims", "cutlass", "cutile", "xqa",
                            "fmha_v2", "cake", "prims-ts")

_DTYPE_NAMES = {
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2, "e5m2": torch.float8_e5m2,
}


def cuda_properties(device: torch.device) -> Tuple[Tuple[int, int], int]:
    """(compute capability, SM count) of a CUDA device, read from the driver once per device (a properties call
    costs microseconds, and plan() and run() ask on every call)."""
    return _cuda_properties(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int) -> Tuple[Tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def refuse(entry: str, message: str) -> None:
    """A wrong argument: the caller must change it."""
    raise ValueError(f"{entry}: {message}")


def unsupported(entry: str, message: str) -> None:
    """A valid request that this library does not serve."""
    raise NotImplementedError(f"{entry}: {message}")


# FlashInfer's later keyword arguments (0.7.x: trtllm-gen / cuDNN inputs, attention sinks, scale-factor caches, ...),
# each with the value that leaves its call as it was before the argument existed. An engine that forwards every
# keyword passes these; the value is accepted, anything else is refused by name (extra_kwargs).
FLASHINFER_NOOPS = {
    "sinks": None, "kv_cache_sf": None, "skip_softmax_threshold_scale_factor": None, "use_fp16_softmax": None,
    "uses_spcompress": None, "o_scale": None, "window_right": 0, "is_causal": None, "block_tables": None,
    "seq_lens": None, "seq_lens_q": None, "uniform_q_len": None, "max_token_per_sequence": None,
    "max_sequence_kv": None, "prefix_len_ptr": None, "token_pos_in_items_ptr": None, "token_pos_in_items_len": 0,
    "max_item_len_ptr": None, "v_indptr": None, "o_indptr": None, "jit_kwargs": None, "variant_owns_mask": False,
}


# FlashInfer 0.7's decode plan(): the optional arguments after page_size that it still binds by position
# (deprecated there, in this order), as vLLM's FlashInfer backend passes them (15 of them, every decode step).
DECODE_PLAN_POSITIONS = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                         "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
                         "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req")


def keyword_signature(function) -> Tuple[Tuple[str, ...], dict]:
    """A plan()'s keyword-only parameter names and every parameter's default (for bind_positions: what the call
    gave by keyword is read from its locals by these names)."""
    parameters = inspect.signature(function).parameters.values()
    return (tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY),
            {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty})


def bind_positions(entry: str, names: Tuple[str, ...], first: int, values: tuple, keywords: dict,
                   defaults: dict) -> dict:
    """keywords with values bound to names[first:] in order (FlashInfer 0.7's deprecated positional arguments; the
    signature bound names[:first]). A name given both ways (its keyword off its default) and more values than
    names are refused, as FlashInfer refuses them."""
    if first + len(values) > len(names):
        refuse(entry, f"plan() takes at most {len(names)} optional arguments by position after page_size "
                      f"(FlashInfer 0.7's order: {', '.join(names)}); got {first + len(values)}.")
    bound = dict(keywords)
    for name, value in zip(names[first:], values):
        default = defaults.get(name)
        given = keywords.get(name, default)
        if given is not default and (isinstance(given, torch.Tensor) or given != default):
            refuse(entry, f"plan() got {name} by position and by keyword; pass it once.")
        bound[name] = value
    return bound


# FlashInfer wrappers' private state that engine code reaches into: vLLM's fast_plan_decode and SGLang's
# fast_decode_plan write these buffers and call the compiled module's plan under CUDA graphs
FLASHINFER_PRIVATE = frozenset({
    "_backend", "_batch_size", "_block_tables", "_cached_kv_data_type", "_cached_module", "_cached_o_data_type",
    "_cached_q_data_type", "_custom_mask_buf", "_fixed_batch_size", "_float_workspace_buffer", "_int_workspace_buffer",
    "_jit_module", "_kv_indptr_buf", "_kv_lens_arr_host", "_kv_lens_buffer", "_mask_indptr_buf", "_max_kv_len",
    "_o_indptr_buf", "_paged_kv_indices_buf", "_paged_kv_indptr_buf", "_paged_kv_last_page_len_buf",
    "_pin_memory_int_workspace_buffer", "_plan_info", "_qo_indptr_buf", "_v_indptr_buf"})


def extra_kwargs(entry: str, kwargs: dict, what: str = "argument(s)") -> None:
    """Keywords beyond an entry point's own: FlashInfer's later ones at their no-op value pass; any other is
    refused by name, before anything runs."""
    refused = [name for name, value in kwargs.items()
               if not (name in FLASHINFER_NOOPS and (value is None if FLASHINFER_NOOPS[name] is None else
                                                     type(value) is type(FLASHINFER_NOOPS[name]) and
                                                     value == FLASHINFER_NOOPS[name]))]
    if refused:
        unsupported(entry, f"{what} {', '.join(sorted(refused))} are not served"
                           f"{' at these values' if all(n in FLASHINFER_NOOPS for n in refused) else ''}.")


# ---------------------------------------------------------------- dtypes

def canonical_dtype(entry: str, name: str, value) -> torch.dtype:
    """Accepts a torch dtype or FlashInfer's string spelling of one."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.replace("torch.", "")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    refuse(entry, f"{name}={value!r} is not a dtype; pass a torch dtype such as torch.bfloat16 "
                  f"or its name ('float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2').")


def check_q_dtype(entry: str, dtype: torch.dtype, name: str = "q", kv_dtype: Optional[torch.dtype] = None) -> None:
    if dtype in HALF_DTYPES:
        return
    if dtype in FP8_DTYPES:
        if kv_dtype in FP8_DTYPES:
            return  # fp8 attention on tensor cores
        unsupported(entry, f"{name} dtype {dtype} (an fp8 query) is served with an fp8 KV cache only; the "
                           f"cache dtype is {kv_dtype}.")
    _unsupported_dtype(entry, name, dtype)


def check_kv_dtype(entry: str, kv_dtype: torch.dtype, q_dtype: torch.dtype, name: str = "kv") -> None:
    if kv_dtype in FP8_DTYPES:
        return  # an fp8 cache under a 16-bit query: dequantized on load, exactly
    if kv_dtype not in HALF_DTYPES:  # a KV cache may also be fp8: the sentence lists both
        _unsupported_dtype(entry, name, kv_dtype, HALF_DTYPES + FP8_DTYPES)
    if kv_dtype != q_dtype:
        unsupported(entry, f"{name} dtype {kv_dtype} differs from the query dtype {q_dtype}; "
                           f"a 16-bit KV cache must have the query's dtype.")


def _unsupported_dtype(entry: str, name: str, dtype: torch.dtype, served=None) -> None:
    text = str(dtype)
    if "fnuz" in text:
        why = "the AMD fnuz fp8 encodings are not served (use float8_e4m3fn or float8_e5m2)"
    elif dtype in (torch.int8, torch.uint8):
        why = "integer caches are not served"
    elif dtype == torch.float32:
        why = "float32 inputs are not served"
    else:
        why = "this dtype is not served"
    unsupported(entry, f"{name} dtype {dtype}: {why}; supported: {_names(served or HALF_DTYPES)}.")


def check_o_dtype(entry: str, o_dtype: torch.dtype) -> None:
    if o_dtype not in HALF_DTYPES:
        unsupported(entry, f"o_data_type={o_dtype} is not served; supported output dtypes are "
                           f"{_names(HALF_DTYPES)}.")


def slot_axis(t, kv_layout: str, dims: int):
    """FlashInfer's caches of page_size 1 may leave out the slot axis ([pages, (2,) Hkv, D], SGLang's token pools):
    a tensor of dims - 1 dimensions gets that axis of 1 back, where the layout puts it (FlashInfer's
    _expand_4d / _expand_5d); anything else as it is."""
    if isinstance(t, torch.Tensor) and t.dim() == dims - 1:
        return t.unsqueeze(-3 if kv_layout == "NHD" else -2)
    return t


def with_slot_axis(cache, kv_layout: str):
    """A paged cache (a (k, v) pair or one tensor) of page size 1 given without its slot axis, with it: 3-D pair
    members become 4-D and a 4-D [tokens, 2, ...] tensor 5-D (slot_axis); any other cache as it is."""
    if isinstance(cache, (tuple, list)):
        return tuple(slot_axis(t, kv_layout, 4) for t in cache)
    if isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.shape[1] == 2:
        return slot_axis(cache, kv_layout, 5)
    return cache


def check_kv_pair(entry: str, k: torch.Tensor, v: torch.Tensor) -> None:
    """K and V: two tensors of one dtype (their shapes are checked against the plan, or each other, after)."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            refuse(entry, f"{name} is a {type(t).__name__}; K and V must be tensors.")
    if k.dtype != v.dtype:
        refuse(entry, f"k has dtype {k.dtype} but v has dtype {v.dtype}; K and V must share one dtype.")


def check_same_pages(entry: str, k: torch.Tensor, v: torch.Tensor) -> None:
    """A (k_cache, v_cache) pair whose page shape the plan checked: one page table indexes both."""
    if k.shape[0] != v.shape[0]:
        refuse(entry, f"v cache has {v.shape[0]} pages but k cache has {k.shape[0]}; one page table indexes both.")


# ---------------------------------------------------------------- shapes and options

def check_heads(entry: str, num_qo_heads: int, num_kv_heads: int) -> None:
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
        if not is_int(value) or value < 1:
            refuse(entry, f"{name}={value!r} must be a positive int.")
    if num_qo_heads % num_kv_heads:
        refuse(entry, f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}.")


def check_head_dim(entry: str, head_dim: int, head_dim_vo: Optional[int] = None) -> None:
    if not is_int(head_dim):
        refuse(entry, f"head_dim={head_dim!r} ({type(head_dim).__name__}) must be a Python int.")
    if head_dim not in HEAD_DIMS:
        unsupported(entry, f"head_dim={head_dim} is not served; supported head dims are "
                           f"{', '.join(map(str, HEAD_DIMS))}.")
    if head_dim_vo is not None and head_dim_vo != head_dim:
        unsupported(entry, f"head_dim_vo={head_dim_vo} differs from head_dim_qk={head_dim}; "
                           f"only equal head dims are served.")


def check_kv_layout(entry: str, kv_layout: str) -> None:
    if kv_layout not in KV_LAYOUTS:
        refuse(entry, f"kv_layout={kv_layout!r} is not a layout; supported: 'NHD', 'HND'.")


def check_pos_encoding(entry: str, mode: str) -> None:
    if mode == "ALIBI":
        unsupported(entry, "pos_encoding_mode='ALIBI' is not served yet; supported: 'NONE', 'ROPE_LLAMA'.")
    if mode not in POS_ENCODINGS:
        refuse(entry, f"pos_encoding_mode={mode!r} is not a mode; supported: 'NONE', 'ROPE_LLAMA'.")


# The kernels take scales as float32: a positive scale must be a normal float32 (1e-300 would be 0, 1e39 inf), and
# so must the logit scale they make of it, sm_scale * k_scale * log2(e).
F32_TINY, F32_MAX = 2.0 ** -126, 3.4028234663852886e38
LOG2E = 1.4426950408889634


# A window of this many keys or more sees every key of any request served (kv_len < 2^30): plans keep it at this,
# so the kernels' int32 position arithmetic (position - window_left, positions negative where kv_len < qo_len)
# cannot wrap (2^31 - 1, a common "no window" value, wrapped and emptied rows).
WINDOW_CAP = 1 << 30


def window(window_left):
    """A plan's window_left: as given, but a window of WINDOW_CAP keys or more kept at WINDOW_CAP (the same keys)."""
    return WINDOW_CAP if is_int(window_left) and window_left > WINDOW_CAP else window_left


def is_int(value) -> bool:
    """A Python int that is not a bool (numpy integers, floats and tensors are refused by the checks that ask)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_f32(value) -> bool:
    """A Python int or float (not a bool) that float32 holds as a positive normal number."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and F32_TINY <= value <= F32_MAX


def check_scalars(entry: str, *, sm_scale=None, window_left=-1, logits_soft_cap=None,
                  rope_scale=None, rope_theta=None) -> None:
    if sm_scale is not None and not (positive_f32(sm_scale) and positive_f32(sm_scale * LOG2E)):
        refuse(entry, f"sm_scale={sm_scale!r} must be a positive finite float within float32's normal range.")
    if not is_int(window_left) or window_left < -1:
        refuse(entry, f"window_left={window_left!r} must be an int >= -1 (-1 disables the window).")
    if logits_soft_cap is not None and not (positive_f32(logits_soft_cap) or (
            isinstance(logits_soft_cap, (int, float)) and not isinstance(logits_soft_cap, bool) and
            logits_soft_cap == 0)):
        refuse(entry, f"logits_soft_cap={logits_soft_cap!r} must be a finite float >= 0 within float32's normal "
                      f"range (0 or None disables it).")
    if logits_soft_cap:  # the kernels scale logits by sm_scale / cap and the result by cap * log2(e)
        if not positive_f32(logits_soft_cap * LOG2E) or (
                sm_scale is not None and not positive_f32(sm_scale / logits_soft_cap)):
            refuse(entry, f"logits_soft_cap={logits_soft_cap!r} with sm_scale={sm_scale!r}: sm_scale / "
                          f"logits_soft_cap and logits_soft_cap * log2(e) must be positive finite float32 values "
                          f"in the normal range.")
    for name, value in (("rope_scale", rope_scale), ("rope_theta", rope_theta)):
        if value is not None and not positive_f32(value):
            refuse(entry, f"{name}={value!r} must be a positive finite float within float32's normal range.")


def split_args(entry: str, fixed_split_size, disable_split_kv, page_size=1) -> Tuple[Optional[int], bool]:
    """plan()'s (fixed_split_size, disable_split_kv) as (KV tokens per chunk or None for the library's choice,
    whether the plan is batch-invariant: either one set). fixed_split_size counts pages of a paged cache, as
    FlashInfer's planners do (they multiply the chunk by page_size), and tokens of ragged K/V (page_size 1); a
    page_size that is not a positive int is left to the page table's own refusal. -1 is FlashInfer's own "not
    fixed" (its plan() turns None into -1, and vLLM passes -1 outside its batch-invariant mode)."""
    if fixed_split_size is None or (fixed_split_size == -1 and type(fixed_split_size) is int):
        return None, bool(disable_split_kv)
    if not is_int(fixed_split_size) or fixed_split_size < 1:
        refuse(entry, f"fixed_split_size={fixed_split_size!r} must be a positive int (KV pages per chunk, or tokens "
                      f"for ragged K/V; a Python int, not numpy's), or -1 or None for the library's choice.")
    return fixed_split_size * (page_size if is_int(page_size) and page_size > 0 else 1), True


def check_graph_backend(entry: str, backend: str, use_cuda_graph: bool, device) -> None:
    """backend='torch' cannot be captured in a CUDA graph (its request loop runs on the host): refused on CUDA at
    construction. On the CPU (nothing to capture) its plans keep the re-plan rules of the other routes."""
    if use_cuda_graph and backend == "torch" and torch.device(device).type == "cuda":
        from .routing import torch_graph
        unsupported(entry, torch_graph())


def check_backend(entry: str, backend: str) -> None:
    """A name FlashInfer serves and this library does not is a valid request not served (NotImplementedError);
    any other name is a wrong argument (ValueError)."""
    if backend in BACKENDS:
        return
    supported = ", ".join(map(repr, BACKENDS))
    if backend in FLASHINFER_ONLY_BACKENDS:
        hint = " ('auto' takes torch's cuDNN attention where it was measured faster)" if backend == "cudnn" else ""
        unsupported(entry, f"backend={backend!r} is FlashInfer's and not served here; supported: {supported}{hint}.")
    refuse(entry, f"backend={backend!r} is not a backend; supported: {supported}.")


def decode_dtypes(entry: str, q_data_type, kv_data_type, o_data_type, fp8_query_refusal: str):
    """(q, kv, o) dtypes of a plan whose route takes no fp8 query (refused with fp8_query_refusal); kv and o
    default to q's dtype."""
    q_dtype = canonical_dtype(entry, "q_data_type", q_data_type)
    kv_dtype = canonical_dtype(entry, "kv_data_type", kv_data_type if kv_data_type is not None else q_dtype)
    o_dtype = canonical_dtype(entry, "o_data_type", o_data_type if o_data_type is not None else q_dtype)
    check_q_dtype(entry, q_dtype, "q_data_type", kv_dtype)
    if q_dtype in FP8_DTYPES:
        unsupported(entry, fp8_query_refusal)
    check_kv_dtype(entry, kv_dtype, q_dtype, "kv_data_type")
    check_o_dtype(entry, o_dtype)
    return q_dtype, kv_dtype, o_dtype


# ---------------------------------------------------------------- index tensors and page tables

def check_index(entry: str, name: str, t, min_len: int = 0) -> None:
    if not isinstance(t, torch.Tensor):
        refuse(entry, f"{name} must be an int32 torch.Tensor, got {type(t).__name__}.")
    if t.dtype != torch.int32:
        refuse(entry, f"{name} has dtype {t.dtype}; index tensors must be int32 (int64 is not cast).")
    if t.dim() != 1:
        refuse(entry, f"{name} must be 1-D, got shape {tuple(t.shape)}.")
    if t.numel() < min_len:
        refuse(entry, f"{name} has {t.numel()} elements; at least {min_len} are needed.")


def check_indptr(entry: str, name: str, indptr_host, total: Optional[int] = None) -> None:
    """indptr_host is a host copy (tensor or numpy); it must start at 0 and never decrease."""
    ip = np.asarray(indptr_host)
    if ip.size and int(ip[0]) != 0:
        refuse(entry, f"{name}[0]={int(ip[0])}; an indptr must start at 0.")
    if ip.size > 1 and bool((ip[1:] < ip[:-1]).any()):
        refuse(entry, f"{name} decreases somewhere; an indptr must be non-decreasing.")
    if total is not None and int(ip[-1]) > total:
        refuse(entry, f"{name}[-1]={int(ip[-1])} exceeds the {total} entries it indexes.")


def host_view(t: torch.Tensor) -> np.ndarray:
    """An index tensor as numpy in its own dtype: a view of a host tensor, one device-to-host copy of a CUDA one
    (detach/to cost a microsecond each even on a host tensor, several times per plan)."""
    return t.numpy() if t.is_cpu else t.detach().cpu().numpy()


def host_array(t: torch.Tensor) -> np.ndarray:
    """An int64 numpy copy of an index tensor (one device-to-host copy for CUDA tensors)."""
    return host_view(t).astype(np.int64)


# the page table's argument names in sentences: FlashInfer's prefill wrappers' spellings, and its decode wrapper's
PREFILL_TABLE_NAMES = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
DECODE_TABLE_NAMES = ("indptr", "indices", "last_page_len")


def page_table(entry: str, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
               page_size: int, names: Tuple[str, str, str] = PREFILL_TABLE_NAMES) -> Tuple[np.ndarray, np.ndarray]:
    """Validates a CSR page table on the host; returns (kv_len per request, the indptr), int64 numpy. `names`:
    the three arguments' names as the caller's entry point spells them.

    numpy, not torch, and few numpy calls (each costs about a microsecond on 256 entries): a cheap test of the
    whole table first, the sentence-producing checks only where it fails."""
    if not is_int(page_size) or page_size < 1:
        refuse(entry, f"page_size={page_size!r} must be a positive int.")
    indptr_name, indices_name, last_name = names
    check_index(entry, indptr_name, indptr, min_len=1)
    check_index(entry, indices_name, indices)
    check_index(entry, last_name, last_page_len)
    batch = indptr.numel() - 1
    if last_page_len.numel() != batch:
        refuse(entry, f"{last_name} has {last_page_len.numel()} entries for a batch of {batch} "
                      f"({indptr_name} has {indptr.numel()}).")
    ip = host_array(indptr)
    pages = ip[1:] - ip[:-1]  # int64 from int32: no overflow, so a decrease is a negative count
    fewest = int(np.minimum.reduce(pages)) if batch else 0
    if int(ip[0]) != 0 or fewest < 0 or int(ip[-1]) > indices.numel():
        check_indptr(entry, indptr_name, ip, total=indices.numel())  # raises the failing check's sentence
    last = host_view(last_page_len)
    if fewest > 0 and int(np.minimum.reduce(last)) >= 1 and int(np.maximum.reduce(last)) <= page_size:
        kv_lens = (pages - 1) * page_size + last  # every request owns pages (decode's common case)
    else:
        check_last_page_len(entry, last_name, pages, last, page_size)
        kv_lens = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    return kv_lens, ip


def check_seq_lens(entry: str, seq_lens, indptr, indices, last_page_len, page_size,
                   names: Tuple[str, str, str] = PREFILL_TABLE_NAMES) -> None:
    """FlashInfer's seq_lens (each request's KV length, which its trtllm-gen and cuDNN backends read): here the
    page metadata decides what a request attends to (API.md), so a seq_lens that is given must agree with it, or
    one of the caller's two descriptions of the batch is wrong and ignoring it would hide that. None passes."""
    if seq_lens is None:
        return
    dtypes = (torch.int32, torch.int64) + ((torch.uint32,) if hasattr(torch, "uint32") else ())
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype not in dtypes:
        got = (f"a {seq_lens.dim()}-D {seq_lens.dtype} tensor" if isinstance(seq_lens, torch.Tensor) else
               type(seq_lens).__name__)
        refuse(entry, f"seq_lens must be a 1-D int32 tensor of each request's KV length, or None; got {got}.")
    kv_lens, _ = page_table(entry, indptr, indices, last_page_len, page_size, names)
    given = seq_lens.detach().to("cpu").to(torch.int64).numpy()
    if given.size != kv_lens.size:
        refuse(entry, f"seq_lens has {given.size} entries for a batch of {kv_lens.size}.")
    differ = np.flatnonzero(given != kv_lens)
    if differ.size:
        i = int(differ[0])
        refuse(entry, f"seq_lens[{i}]={int(given[i])} but the page table gives request {i} {int(kv_lens[i])} keys; "
                      f"the page metadata decides what a request attends to, so the two must agree (or pass "
                      f"seq_lens=None).")


def check_last_page_len(entry: str, name: str, pages: np.ndarray, last: np.ndarray, page_size: int) -> None:
    """A request that owns pages fills 1..page_size slots of its last one (host arrays: pages per request, and
    the last page lengths)."""
    bad = (pages > 0) & ((last < 1) | (last > page_size))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        refuse(entry, f"{name}[{i}]={int(last[i])}; it must lie in 1..page_size={page_size} for a request that "
                      f"owns pages.")


_INT32_MAX = 2 ** 31 - 1  # np.iinfo(np.int32).max, which costs microseconds per call


def max_page(entry: str, used: np.ndarray, name: str = "paged_kv_indices") -> int:
    """The largest page index of a page table's used part (int32), -1 if it is empty; a negative index is refused.
    One reduction: viewed unsigned, a negative index is larger than any valid one."""
    if not used.size:
        return -1
    top = int(np.maximum.reduce(used.view(np.uint32)))
    if top > _INT32_MAX:
        refuse(entry, f"{name} holds a negative page index ({int(used.min())}).")
    return top


def paged_kv_lens(entry: str, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                  page_size: int, names: Tuple[str, str, str] = PREFILL_TABLE_NAMES) -> torch.Tensor:
    """Validates a CSR page table on the host (page_table); returns kv_len per request (CPU int64)."""
    kv_lens, _ = page_table(entry, indptr, indices, last_page_len, page_size, names)
    return torch.from_numpy(kv_lens)


def check_causal_lengths(entry: str, qo_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
    qo, kv = np.asarray(qo_lens), np.asarray(kv_lens)  # host tensors: numpy views, no copy
    bad = kv < qo
    if bad.any():
        i = int(bad.nonzero()[0][0])
        refuse(entry, f"causal=True with kv_len={int(kv[i])} < qo_len={int(qo[i])} for request {i}; "
                      f"bottom-right causal attention needs kv_len >= qo_len.")


# ---------------------------------------------------------------- tensors given at run time

def check_tensor(entry: str, name: str, t, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        refuse(entry, f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if tuple(t.shape) != tuple(shape):
        refuse(entry, f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}.")
    if t.dtype != dtype:
        refuse(entry, f"{name} has dtype {t.dtype}; expected {dtype}.")
    if t.device != device and t.device != torch.device(device):  # plans hold a torch.device: no new one per call
        refuse(entry, f"{name} is on {t.device}; expected {torch.device(device)}.")
    if t.numel() and t.stride(-1) != 1:
        refuse(entry, f"{name} must have a contiguous last dimension (stride {t.stride(-1)} received).")


def check_scales(entry: str, device: torch.device, sm_scale: Optional[float] = None, **scales) -> None:
    """k_scale / v_scale: a positive finite Python float, or a one-element float32 tensor on the device. A tensor's
    value must be positive and finite too (the kernels take the softmax row max on unscaled logits), but it stays
    on the device unread: checking it would cost a sync per call and cannot run under CUDA graphs. With the
    plan's sm_scale, a float k_scale's logit scale sm_scale * k_scale * log2(e) must be a normal float32 too."""
    ks = scales.get("k_scale")
    if sm_scale is not None and positive_f32(ks) and not positive_f32(sm_scale * ks * LOG2E):
        refuse(entry, f"k_scale={ks!r} makes the logit scale sm_scale * k_scale * log2(e) = "
                      f"{sm_scale * ks * LOG2E:.3g}, outside float32's normal range.")
    for name, s in scales.items():
        if s is None:
            continue
        if isinstance(s, torch.Tensor):
            if s.numel() != 1 or s.dtype != torch.float32:
                refuse(entry, f"{name} is a tensor of shape {tuple(s.shape)} and dtype {s.dtype}; a tensor scale "
                              f"must be one float32 element.")
            if s.device != torch.device(device):
                refuse(entry, f"{name} is on {s.device}; a tensor scale must be on {torch.device(device)}.")
        elif not positive_f32(s):
            refuse(entry, f"{name}={s!r} must be a positive finite float (a normal float32) or a one-element "
                          f"float32 tensor.")


def fold_q_scale(entry: str, q_scale, k_scale, descales_given: bool = False):
    """FlashInfer's q_scale (a float calibration scale of the query): it multiplies the logits' scale as k_scale
    does (sm_scale * q_scale * k_scale). Returns the k_scale that carries both (check_scales checks it)."""
    if q_scale is None:
        return k_scale
    if not positive_f32(q_scale):
        refuse(entry, f"q_scale={q_scale!r} must be a positive finite float (a normal float32); an fp8 query's "
                      f"descales are the tensors scale_q, scale_k, scale_v.")
    if descales_given:
        refuse(entry, "q_scale and scale_q/scale_k/scale_v were both given; the descales already dequantize q.")
    if k_scale is None:
        return float(q_scale)
    if isinstance(k_scale, torch.Tensor):
        unsupported(entry, "q_scale beside a tensor k_scale is not served; fold q_scale into k_scale.")
    return k_scale * q_scale if positive_f32(k_scale) else k_scale  # a bad k_scale: check_scales refuses it


_UNIT_DESCALES: dict = {}


def _indexed(device) -> torch.device:
    """`device` with its index: "cuda" is the current CUDA device, so it equals a tensor's cuda:N."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _unit_descale(device: torch.device) -> torch.Tensor:
    """A float32 one on `device`, made once (a fill launch per call otherwise); never written. Not kept when made
    during a CUDA graph capture (its memory would belong to that graph's pool)."""
    unit = _UNIT_DESCALES.get(device)
    if unit is None:
        unit = torch.ones(1, dtype=torch.float32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _UNIT_DESCALES[device] = unit
    return unit


def check_descales(entry: str, scale_q=None, scale_k=None, scale_v=None, k_scale=None, v_scale=None,
                   q_dtype: Optional[torch.dtype] = None, device=None, num_qo_heads: int = 0,
                   num_kv_heads: int = 0):
    """fp8-attention descales: float32 tensors on q's device of one element (of any shape, as k_scale) or one per
    head ([Hq], [Hkv], [Hkv]). Refused together with k_scale/v_scale (K and V would be scaled twice) and for a
    16-bit query. Their values must be positive and finite (quantization scales); like tensor k_scale/v_scale they
    are not read here.
    Returns (scale_q, scale_k, scale_v) for an fp8 query (None entries become ones), else None."""
    given = [n for n, s in (("scale_q", scale_q), ("scale_k", scale_k), ("scale_v", scale_v)) if s is not None]
    if given and (k_scale is not None or v_scale is not None):
        refuse(entry, f"{', '.join(given)} and k_scale/v_scale were both given; the descales already dequantize "
                      f"K and V, so the cache would be scaled twice.")
    if q_dtype not in FP8_DTYPES:
        if given:
            refuse(entry, f"{', '.join(given)} apply to an fp8 query; this query is {q_dtype}, and an fp8 KV cache "
                          f"under a 16-bit query takes k_scale/v_scale.")
        return None
    out, device = [], _indexed(device)
    for name, s, heads in (("scale_q", scale_q, num_qo_heads), ("scale_k", scale_k, num_kv_heads),
                           ("scale_v", scale_v, num_kv_heads)):
        if s is None:
            s = _unit_descale(device)
        elif not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or \
                not (s.numel() == 1 or s.dim() == 1 and s.numel() == heads):
            shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            refuse(entry, f"{name} has shape {shape}"
                          f"{' and dtype ' + str(s.dtype) if isinstance(s, torch.Tensor) else ''}; a descale is a "
                          f"float32 tensor of one element (per tensor) or of shape [{heads}] (per head).")
        elif s.device != device:
            refuse(entry, f"{name} is on {s.device}; a descale must be on {device}.")
        out.append(s.contiguous() if s.dim() == 1 else s.reshape(1))  # one element of another shape: a [1] view
    dq, dk, dv = out
    if dk.numel() != dv.numel():  # the kernels read scale_k and scale_v with one stride: both per head, then
        dk, dv = (d.expand(num_kv_heads).contiguous() if d.numel() == 1 else d for d in (dk, dv))
    return dq, dk, dv


def workspace_room(workspace: torch.Tensor) -> int:
    """The bytes of a float workspace that split-KV's float32 partial states may use: all of a contiguous buffer
    starting on a 16-byte boundary (torch.empty's always does), none of any other (a strided view, or a byte
    slice at an odd offset, which no float32 view can start at)."""
    if not workspace.is_contiguous() or workspace.data_ptr() % 16:
        return 0
    return workspace.numel() * workspace.element_size()


def split_state_bytes(rows: int, num_qo_heads: int, head_dim: int) -> int:
    """The float workspace bytes of split-KV's partial states: an fp32 output [head_dim] and LSE per row and head."""
    return 4 * rows * num_qo_heads * (head_dim + 1)


WORKSPACE_ROOM_HINT = ("a float workspace must be contiguous and start on a 16-byte boundary (a buffer from "
                       "torch.empty, or a slice of one at a multiple of 16 bytes)")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory extents intersect (one storage, overlapping byte ranges)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0 or \
            a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def extent(t):
        start = t.data_ptr()
        return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def check_same_device(entry: str, device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            refuse(entry, f"{name} is on {t.device} but the computation runs on {device}.")
