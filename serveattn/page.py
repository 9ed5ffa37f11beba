"""Paged KV cache utilities under FlashInfer's names: append tokens to the cache, and the index helpers.

Validation runs on the host before anything launches. Shapes, dtypes and devices are always checked;
checks that read index *values* (page-table consistency, positions inside owned pages) only run for
CPU tensors, because on a GPU they would synchronise the stream on every decode step.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple, Union

import torch

from . import backend as _backend
from . import policy

PagedCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _split_cache(entry: str, paged_kv_cache, kv_layout: str):
    """Validated (k, v) views `[pages, page_size, Hkv, D]` (NHD order) of either cache form."""
    policy.check_kv_layout(entry, kv_layout)
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2 or not all(isinstance(c, torch.Tensor) for c in paged_kv_cache):
            kinds = ", ".join(type(c).__name__ for c in paged_kv_cache)
            policy.refuse(entry, f"paged_kv_cache as a tuple must be (k_cache, v_cache), two tensors; got "
                                 f"{len(paged_kv_cache)} items ({kinds}).")
        k_cache, v_cache = policy.with_slot_axis(paged_kv_cache, kv_layout)  # page size 1: 3-D taken
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            policy.refuse(entry, f"paged_kv_cache tuple holds shapes {tuple(k_cache.shape)} and "
                                 f"{tuple(v_cache.shape)}; both must be the same 4-D shape "
                                 f"[num_pages, page_size, num_kv_heads, head_dim] ({kv_layout}).")
        policy.check_kv_pair(entry, k_cache, v_cache)
        policy.check_same_device(entry, k_cache.device, v_cache=v_cache)
        if k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr() and k_cache.stride() == v_cache.stride():
            policy.refuse(entry, "paged_kv_cache's k_cache and v_cache are the same memory, so appending would write "
                                 "V over K; give the cache's K and V as two tensors (or the 5-D cache).")
    elif isinstance(paged_kv_cache, torch.Tensor):
        paged_kv_cache = policy.with_slot_axis(paged_kv_cache, kv_layout)  # page size 1 without its slot axis
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            policy.refuse(entry, f"paged_kv_cache has shape {tuple(paged_kv_cache.shape)}; a single-tensor cache "
                                 f"is 5-D [num_pages, 2, page_size, num_kv_heads, head_dim] ({kv_layout}).")
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        policy.refuse(entry, f"paged_kv_cache must be a tensor or a (k_cache, v_cache) tuple, "
                             f"got {type(paged_kv_cache).__name__}.")
    dtype = k_cache.dtype
    if dtype not in policy.HALF_DTYPES + policy.FP8_DTYPES:
        policy.unsupported(entry, f"paged_kv_cache dtype {dtype} is not served; supported: float16, bfloat16, "
                                  f"float8_e4m3fn, float8_e5m2.")
    if k_cache.numel() and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        policy.refuse(entry, f"paged_kv_cache must have a contiguous head_dim (strides {k_cache.stride()} "
                             f"and {v_cache.stride()} received).")
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return k_cache, v_cache


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
                          positions: torch.Tensor, paged_kv_cache: PagedCache, kv_indices: torch.Tensor,
                          kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, kv_layout: str = "NHD",
                          *, k_scale=None, v_scale=None, backend: str = "auto") -> None:
    """Writes token t of append_key/append_value into the cache, in place, at request batch_indices[t],
    position positions[t]: page kv_indices[kv_indptr[b] + pos // page_size], slot pos % page_size. A token of
    request -1 is padding (get_batch_indices_positions' for an nnz past the appended tokens): it is not written.

    K/V of the cache's dtype are copied as they are. 16-bit (float16/bfloat16) K/V appended into an fp8
    cache are quantized with k_scale / v_scale (Python floats or one-element float32 tensors on the cache's
    device; the real value of a stored element is fp8 * scale, as in `run`): the stored value is
    x / scale computed in float32, saturated to the format's largest finite value (448 for float8_e4m3fn,
    57344 for float8_e5m2, also for +-inf), rounded to the nearest fp8 value with ties to even; NaN is
    stored as the canonical NaN 0x7F. Both backends store the same bits.
    """
    entry = "append_paged_kv_cache"
    k_cache, v_cache = _split_cache(entry, paged_kv_cache, kv_layout)
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if not isinstance(t, torch.Tensor):
            policy.refuse(entry, f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            policy.refuse(entry, f"{name} has shape {tuple(t.shape)}; expected [nnz, {num_kv_heads}, {head_dim}] "
                                 f"(num_kv_heads and head_dim of the cache).")
    policy.check_kv_pair(entry, append_key, append_value)
    quantize = append_key.dtype in policy.HALF_DTYPES and k_cache.dtype in policy.FP8_DTYPES
    if quantize:
        if k_scale is None or v_scale is None:
            missing = " and ".join(n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is None)
            policy.refuse(entry, f"append_key has dtype {append_key.dtype} but paged_kv_cache has {k_cache.dtype}; "
                                 f"quantizing 16-bit K/V into an fp8 cache needs both k_scale and v_scale "
                                 f"({missing} not given): the stored value is x / scale, the real value "
                                 f"fp8 * scale.")
    elif append_key.dtype != k_cache.dtype:
        policy.refuse(entry, f"append_key has dtype {append_key.dtype} but paged_kv_cache has {k_cache.dtype}; "
                             f"appended K/V must have the cache's dtype, or be float16/bfloat16 into an fp8 cache "
                             f"(quantized with k_scale and v_scale).")
    elif k_scale is not None or v_scale is not None:
        given = " and ".join(n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None)
        policy.refuse(entry, f"{given} given, but append_key and paged_kv_cache are both {k_cache.dtype}: "
                             f"the values are copied as they are and a scale would be ignored. k_scale/v_scale "
                             f"only apply when float16/bfloat16 K/V are quantized into an fp8 cache; drop them "
                             f"here (an fp8 cache's scales are given to run()).")
    nnz = append_key.shape[0]
    if append_value.shape[0] != nnz:
        policy.refuse(entry, f"append_value has {append_value.shape[0]} tokens but append_key has {nnz}.")
    policy.check_index(entry, "batch_indices", batch_indices)
    policy.check_index(entry, "positions", positions)
    policy.check_index(entry, "kv_indices", kv_indices)
    policy.check_index(entry, "kv_indptr", kv_indptr, min_len=1)
    policy.check_index(entry, "kv_last_page_len", kv_last_page_len)
    for name, t in (("batch_indices", batch_indices), ("positions", positions)):
        if t.numel() != nnz:
            policy.refuse(entry, f"{name} has {t.numel()} entries for {nnz} appended tokens.")
    batch = kv_indptr.numel() - 1
    if kv_last_page_len.numel() != batch:
        policy.refuse(entry, f"kv_last_page_len has {kv_last_page_len.numel()} entries for a batch of {batch} "
                             f"(kv_indptr has {kv_indptr.numel()}).")
    policy.check_same_device(entry, device, append_key=append_key, append_value=append_value,
                             batch_indices=batch_indices, positions=positions, kv_indices=kv_indices,
                             kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len)
    if quantize:
        k_scale = _check_scale(entry, "k_scale", k_scale, device)
        v_scale = _check_scale(entry, "v_scale", v_scale, device)
    if device.type == "cpu":
        _check_targets(entry, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len, num_pages,
                       page_size)
    chosen = _backend.resolve(entry, backend, device)
    if nnz == 0:
        return
    if chosen == "triton":
        from .kernels import page as page_kernels
        page_kernels.append(_unit_last_stride(append_key), _unit_last_stride(append_value), batch_indices,
                            positions, k_cache, v_cache, kv_indices, kv_indptr,
                            k_scale=k_scale if quantize else None, v_scale=v_scale if quantize else None)
    else:
        batch_of = batch_indices
        if device.type == "cpu" or not torch.cuda.is_current_stream_capturing():
            # request -1: padding, not written (a boolean index syncs a GPU stream, so not under capture, where
            # the torch route cannot skip padding: backend='triton' does)
            live = batch_indices >= 0
            append_key, append_value, positions, batch_of = (append_key[live], append_value[live], positions[live],
                                                             batch_indices[live])
        pos = positions.long()
        page = kv_indices.long()[kv_indptr.long()[batch_of.long()] + pos // page_size]
        slot = pos % page_size
        if quantize:
            append_key = _quantize_torch(append_key, k_scale, k_cache.dtype)
            append_value = _quantize_torch(append_value, v_scale, v_cache.dtype)
        k_cache[page, slot] = append_key
        v_cache[page, slot] = append_value


def _check_scale(entry, name, scale, device):
    """A quantization scale as a float32-exact Python float, or as a one-element float32 tensor on `device`.
    Values are checked for Python floats and CPU tensors; reading a GPU tensor would synchronise."""
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            policy.refuse(entry, f"{name} is a tensor of dtype {scale.dtype} and shape {tuple(scale.shape)}; "
                                 f"a tensor scale must be one float32 element (or pass a Python float).")
        policy.check_same_device(entry, device, **{name: scale})
        if scale.device.type == "cpu":
            value = float(scale.reshape(()))
            if not (math.isfinite(value) and value > 0):
                policy.refuse(entry, f"{name}={value!r}; a scale must be a positive finite float32 value.")
        return scale.reshape(())
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        policy.refuse(entry, f"{name} must be a Python float or a one-element float32 tensor, "
                             f"got {type(scale).__name__}.")
    try:  # the float32 the quotient is computed with, on both backends
        value = torch.tensor(float(scale), dtype=torch.float32).item()
    except OverflowError:
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        policy.refuse(entry, f"{name}={scale!r} is {value!r} in float32; a scale must be a positive finite "
                             f"float32 value.")
    return value


def _quantize_torch(x, scale, dtype):
    """x / scale in float32 (a true division: a tensor divisor on x's device, never a reciprocal),
    saturated, NaN made canonical, then torch's float32 -> fp8 conversion (round to nearest even)."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((), scale, dtype=torch.float32, device=x.device)
    fmax = torch.finfo(dtype).max
    q = (x.float() / scale).clamp_(-fmax, fmax)  # clamp keeps NaN
    return q.masked_fill_(torch.isnan(q), float("nan")).to(dtype)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_targets(entry, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len, num_pages, page_size):
    """Host-side value checks: the page table is well formed, every token lands in a page its request owns,
    and pages exist."""
    ip = kv_indptr.long()
    policy.check_indptr(entry, "kv_indptr", ip, total=kv_indices.numel())
    policy.check_last_page_len(entry, "kv_last_page_len", (ip[1:] - ip[:-1]).numpy(), kv_last_page_len.numpy(),
                               page_size)
    used = kv_indices[: int(ip[-1])].long()
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        bad = int(used.min()) if int(used.min()) < 0 else int(used.max())
        policy.refuse(entry, f"kv_indices holds page {bad} outside the cache's {num_pages} pages.")
    batch = ip.numel() - 1

    def numbered() -> str:  # the refusals' account of the batch (made only where one is raised)
        return "there are no requests" if batch == 0 else "the one request is 0" if batch == 1 else \
            f"requests are numbered 0..{batch - 1}"
    if batch_indices.numel() and int(batch_indices.min()) < -1:
        policy.refuse(entry, f"batch_indices holds {int(batch_indices.min())}; {numbered()}, and -1 marks padding.")
    live = batch_indices >= 0  # request -1: padding, not written (get_batch_indices_positions')
    if not bool(live.any()):
        return
    b, pos = batch_indices[live].long(), positions[live].long()
    if int(b.max()) >= batch:
        policy.refuse(entry, f"batch_indices holds {int(b.max())}; {numbered()}.")
    owned = (ip[1:] - ip[:-1])[b]
    outside = (pos < 0) | (pos // page_size >= owned)
    if bool(outside.any()):
        t = int(outside.nonzero()[0])  # among the live tokens; the message names its index in positions
        policy.refuse(entry, f"positions[{int(live.nonzero()[t])}]={int(pos[t])} for request {int(b[t])}, which "
                             f"owns {int(owned[t])} pages of {page_size} slots; a position must lie in "
                             f"0..pages*page_size-1.")
    # two tokens bound for one slot (a repeated position, or requests sharing a page) would race: which one the
    # cache keeps would depend on the launch, not the inputs
    slots = kv_indices.long()[ip[b] + pos // page_size] * page_size + pos % page_size
    order = torch.sort(slots, stable=True).indices
    same = slots[order[1:]] == slots[order[:-1]]
    if bool(same.any()):
        j = int(same.nonzero()[0])
        first, second = (int(live.nonzero()[int(order[j + k])]) for k in (0, 1))
        slot = int(slots[order[j]])
        policy.refuse(entry, f"appended tokens {first} and {second} both go to page {slot // page_size}, slot "
                             f"{slot % page_size}; each slot takes at most one token per call.")


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int,
                                batch_indices: Optional[torch.Tensor] = None,
                                positions: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each of the nnz appended tokens: its request, and its position in that request's KV sequence.

    Request b appends tokens append_indptr[b]..append_indptr[b+1]-1 as the last ones of its sequence of
    seq_lens[b] tokens (the length *after* the append), so token t sits at seq_lens[b] - append_indptr[b+1] + t.
    Tokens from append_indptr[-1] on (nnz padded, e.g. to a CUDA graph's size) get request -1 and position 0, as
    FlashInfer 0.7's does into new results (into a given `positions` it leaves those entries as they were; here
    they are 0 either way), and append_paged_kv_cache skips them (FlashInfer's append does not: ours is the safe
    side of its undefined case). Both results are int32 `[nnz]`, written into `batch_indices` /
    `positions` when given.
    """
    entry = "get_batch_indices_positions"
    policy.check_index(entry, "append_indptr", append_indptr, min_len=1)
    if isinstance(seq_lens, torch.Tensor) and seq_lens.dtype == torch.int64:
        seq_lens = seq_lens.int()  # lengths, not an index: int64 taken (FlashInfer's own example passes them)
    policy.check_index(entry, "seq_lens", seq_lens)
    batch = append_indptr.numel() - 1
    if seq_lens.numel() != batch:
        policy.refuse(entry, f"seq_lens has {seq_lens.numel()} entries for a batch of {batch} "
                             f"(append_indptr has {append_indptr.numel()}).")
    if not policy.is_int(nnz) or nnz < 0:
        policy.refuse(entry, f"nnz={nnz!r} must be an int >= 0.")
    device = append_indptr.device
    policy.check_same_device(entry, device, seq_lens=seq_lens)
    for name, out in (("batch_indices", batch_indices), ("positions", positions)):
        if out is not None:
            policy.check_tensor(entry, name, out, (nnz,), torch.int32, device)
            # the results are written after the inputs are read, the positions after the batch indices
            others = (("append_indptr", append_indptr), ("seq_lens", seq_lens)) + \
                ((("batch_indices", batch_indices),) if name == "positions" and batch_indices is not None else ())
            for other_name, other in others:
                if policy.overlaps(out, other):
                    policy.refuse(entry, f"{name} overlaps {other_name}; pass the results in memory of their own.")
    if device.type == "cpu":
        ip = append_indptr.long()
        policy.check_indptr(entry, "append_indptr", ip)
        if int(ip[-1]) > nnz:
            policy.refuse(entry, f"nnz={nnz} but append_indptr[-1]={int(ip[-1])}; nnz is the number of "
                                 f"appended tokens (or more: the rest is padding).")
        short = seq_lens.long() < ip[1:] - ip[:-1]
        if bool(short.any()):
            b = int(short.nonzero()[0])
            policy.refuse(entry, f"seq_lens[{b}]={int(seq_lens[b])} is smaller than the {int(ip[b + 1] - ip[b])} "
                                 f"tokens request {b} appends; seq_lens are lengths after the append.")
    if batch_indices is None:
        batch_indices = torch.empty(nnz, dtype=torch.int32, device=device)
    if positions is None:
        positions = torch.empty(nnz, dtype=torch.int32, device=device)
    if nnz == 0:
        return batch_indices, positions
    tokens = torch.arange(nnz, dtype=torch.int32, device=device)
    # The request owning token t is the number of request ends at or before t; searchsorted does not
    # sync, unlike repeat_interleave. Tokens past append_indptr[-1] (padding) find no end: request -1, position 0.
    owner = torch.searchsorted(append_indptr[1:], tokens, right=True)
    padding = owner >= batch
    owner.clamp_(max=max(batch - 1, 0))
    batch_indices.copy_(owner.masked_fill(padding, -1))
    positions.copy_((seq_lens[owner] - append_indptr[1:][owner] + tokens).masked_fill_(padding, 0)
                    if batch else torch.zeros_like(tokens))
    return batch_indices, positions


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV length of each request: page_size * (pages - 1) + last_page_len, and 0 for a request without
    pages (API.md). int32 `[batch]` on kv_indptr's device."""
    entry = "get_seq_lens"
    policy.check_index(entry, "kv_indptr", kv_indptr, min_len=1)
    policy.check_index(entry, "kv_last_page_len", kv_last_page_len)
    if not policy.is_int(page_size) or page_size < 1:
        policy.refuse(entry, f"page_size={page_size!r} must be a positive int.")
    batch = kv_indptr.numel() - 1
    if kv_last_page_len.numel() != batch:
        policy.refuse(entry, f"kv_last_page_len has {kv_last_page_len.numel()} entries for a batch of {batch} "
                             f"(kv_indptr has {kv_indptr.numel()}).")
    policy.check_same_device(entry, kv_indptr.device, kv_last_page_len=kv_last_page_len)
    if kv_indptr.is_cpu:  # a table on the host is checked (API.md); a device one would cost a sync
        ip = kv_indptr.long()  # (any start: only differences are read, so a slice of an indptr serves)
        if bool((ip[1:] < ip[:-1]).any()):
            policy.refuse(entry, "kv_indptr decreases somewhere; an indptr must be non-decreasing.")
        policy.check_last_page_len(entry, "kv_last_page_len", (ip[1:] - ip[:-1]).numpy(), kv_last_page_len.numpy(),
                                   page_size)
    pages = kv_indptr[1:] - kv_indptr[:-1]
    lens = (pages - 1) * page_size + kv_last_page_len
    return torch.where(pages > 0, lens, torch.zeros_like(lens)).to(torch.int32)
