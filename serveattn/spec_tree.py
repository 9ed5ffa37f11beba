"""Attention masks for tree drafts (speculative decoding): parent arrays -> FlashInfer's custom mask."""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch

from . import policy
from .quantization import segment_packbits

MAX_TREE_NODES = 64  # one int64 ancestor word per draft token


def _as_list(entry: str, name: str, value) -> list:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            policy.refuse(entry, f"{name} is a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; "
                                 f"expected a 1-D integer tensor or a sequence of ints.")
        return [int(x) for x in value.tolist()]
    if isinstance(value, np.ndarray):
        return _as_list(entry, name, torch.from_numpy(value))
    try:
        items = list(value)
    except TypeError:
        policy.refuse(entry, f"{name} has type {type(value).__name__}; expected a sequence of ints.")
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            policy.refuse(entry, f"{name} holds {x!r}; expected ints.")
    return [int(x) for x in items]


def _ancestors(entry: str, i: int, parents, name: str = "parents_list") -> np.ndarray:
    """bool [T, T]: row t marks node t's ancestors and t itself; parents validated (`name`: the caller's
    argument, in the sentences)."""
    parents = _as_list(entry, f"{name}[{i}]", parents)
    T = len(parents)
    anc = np.zeros((T, T), dtype=bool)
    for t, par in enumerate(parents):
        if par < -1 or par >= t:
            policy.refuse(entry, f"{name}[{i}][{t}]={par}; a parent must be -1 (the root) or an "
                                 f"earlier node (0..{t - 1}).")
        if par >= 0:
            anc[t] = anc[par]
        anc[t, t] = True
    return anc


def _parent_arrays(entry: str, parents_list, name: str = "parents_list") -> list:
    if isinstance(parents_list, torch.Tensor) and parents_list.dim() == 2:
        parents_list = list(parents_list)
    try:
        return list(parents_list)
    except TypeError:
        policy.refuse(entry, f"{name} has type {type(parents_list).__name__}; expected a sequence of "
                             f"parent arrays, one per request.")


def tree_ancestor_bits(entry: str, parents_list, max_nodes: int = MAX_TREE_NODES, name: str = "parents_list"):
    """(sizes int64 [batch], bits int64 [sum(sizes)]) of a batch of tree drafts: bit j of node t's word is set
    when draft token j is t or one of its ancestors (bit 63 is the sign bit; kernels shift arithmetically and
    test bit 0, so it reads back right). The kernels' native tree mode takes these instead of a dense mask.
    name: the caller's argument (the decode wrapper's tree_parents), in the sentences."""
    parents_list = _parent_arrays(entry, parents_list, name)
    sizes, words = [], []
    weights = (np.ones(max_nodes, dtype=np.uint64) << np.arange(max_nodes, dtype=np.uint64))
    for i, parents in enumerate(parents_list):
        anc = _ancestors(entry, i, parents, name)
        if len(anc) > max_nodes:
            policy.unsupported(entry, f"tree {i} has {len(anc)} draft tokens; the native tree mode serves at "
                                      f"most {max_nodes} per request (use a custom mask with the prefill "
                                      f"wrappers beyond that).")
        sizes.append(len(anc))
        words.append((anc * weights[: len(anc)]).sum(axis=1, dtype=np.uint64))
    bits = np.concatenate(words) if words else np.zeros(0, dtype=np.uint64)
    return np.asarray(sizes, dtype=np.int64), bits.view(np.int64)


def tree_parents_to_mask(parents_list: Sequence, prefix_lens, device="cpu"
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Custom attention masks for a batch of tree drafts.

    parents_list[i]: request i's parent array (ints or a 1-D integer tensor) of its T_i draft tokens;
    parents[t] is -1 for a child of the root (the last committed token) or an earlier node (< t).
    prefix_lens[i] >= 0: the KV entries before the draft tokens. The draft tokens are the last
    qo_len_i = T_i positions of request i's kv_len_i = prefix_lens[i] + T_i keys (FlashInfer's layout).

    Draft token r sees the whole prefix, its ancestors and itself. Returns
      custom_mask bool [sum_i T_i * kv_len_i]: one row-major [qo_len_i, kv_len_i] block per request,
        flattened and concatenated (the `custom_mask` of the prefill wrappers' plan);
      packed_custom_mask uint8: the same bits packed with segment_packbits(..., bitorder="little"), each
        request's segment padded to whole bytes;
      mask_indptr int32 [batch + 1]: where each request's block starts in custom_mask (in elements).
    A chain (parents [-1, 0, 1, ...]) gives the bottom-right causal mask.
    """
    entry = "tree_parents_to_mask"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        policy.refuse(entry, f"device={device!r} is not a torch device.")
    if device.type == "cuda" and not torch.cuda.is_available():
        policy.refuse(entry, f"device={str(device)!r} but CUDA is not available here.")
    parents_list = _parent_arrays(entry, parents_list)
    prefix = _as_list(entry, "prefix_lens", prefix_lens)
    if len(prefix) != len(parents_list):
        policy.refuse(entry, f"prefix_lens has {len(prefix)} entries for {len(parents_list)} parent arrays.")
    blocks, sizes = [], []
    for i, (parents, pre) in enumerate(zip(parents_list, prefix)):
        if pre < 0:
            policy.refuse(entry, f"prefix_lens[{i}]={pre}; a prefix length must be >= 0.")
        anc = _ancestors(entry, i, parents)
        block = np.concatenate([np.ones((len(anc), pre), dtype=bool), anc], axis=1)
        blocks.append(block.reshape(-1))
        sizes.append(block.size)
    flat = np.concatenate(blocks) if blocks else np.zeros(0, dtype=bool)
    custom_mask = torch.from_numpy(flat).to(device)
    mask_indptr = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    if sizes:
        mask_indptr[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32)
    mask_indptr = mask_indptr.to(device)
    packed, _ = segment_packbits(custom_mask, mask_indptr, bitorder="little")
    return custom_mask, packed, mask_indptr
