"""Speculative sampling under FlashInfer's names: `chain_speculative_sampling`, and a tree variant.

Random numbers. Each call draws its random numbers on the host side as int64 values in [0, 2^31) with
`torch.randint` (from `generator`, or a generator seeded from `seed`/`offset`, or torch's default one):
one acceptance uniform per draft position (u = (value >> 7) * 2^-24: its top 24 bits, exact in float32, so u < 1
and a draft token with q == p is always accepted; value * 2^-31 rounded the largest values to 1.0) and one more
for the final token. The Triton
kernel and the torch path consume the same numbers and return the same tokens, bitwise; the same seed
gives the same tokens on every call (`deterministic` is accepted for FlashInfer's sake: every path here is
deterministic).

Sampling a token from weights w (the residual or the target row) is by inverse CDF over integer weights:
w_j = floor(clamp(w_j, 0, 1) * 2^32) (entries below 2^-32 count as zero), total = sum w, and the token is
the first j whose prefix sum exceeds floor(total * u31 / 2^31). Integer prefix sums are exact, whatever
order an implementation adds in.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from . import backend as _backend
from . import policy

_TWO_POW_M24 = 2.0 ** -24
_TWO_POW_32 = 2.0 ** 32
_ID_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------- validation and random numbers

def _check_dense(entry: str, name: str, t: torch.Tensor) -> None:
    """Sparse, nested and meta tensors reach no kernel: torch's own error would name none of the arguments."""
    if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
        kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
        policy.unsupported(entry, f"{name} is a {kind} tensor on {t.device}; dense (strided) tensors holding data "
                                  f"are served.")


_PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_probs(entry: str, name: str, t, dims: int = 3) -> None:
    if not isinstance(t, torch.Tensor):
        policy.refuse(entry, f"{name} must be a float32 torch.Tensor, got {type(t).__name__}.")
    _check_dense(entry, name, t)
    if t.dim() != dims:
        policy.refuse(entry, f"{name} has shape {tuple(t.shape)}; expected a {dims}-D tensor "
                             f"[batch_size, num_tokens, vocab_size].")
    if t.dtype not in _PROB_DTYPES:  # the 16-bit and float64 ones are read as float32, as FlashInfer's .float()
        if t.dtype.is_floating_point:
            policy.unsupported(entry, f"{name} has dtype {t.dtype}; probabilities are served in float32, float16, "
                                      f"bfloat16 or float64 (read as float32).")
        policy.refuse(entry, f"{name} has dtype {t.dtype}; probabilities must be floating point.")


def _check_ids(entry: str, name: str, t, shape, vocab: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        policy.refuse(entry, f"{name} must be an int32 or int64 torch.Tensor, got {type(t).__name__}.")
    _check_dense(entry, name, t)
    if t.dtype not in _ID_DTYPES:
        policy.refuse(entry, f"{name} has dtype {t.dtype}; token ids must be int32 or int64.")
    if tuple(t.shape) != tuple(shape):
        policy.refuse(entry, f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}.")
    if t.device != device:
        policy.refuse(entry, f"{name} is on {t.device} but the probabilities are on {device}.")
    if t.numel():
        lo, hi = int(t.min()), int(t.max())  # one host synchronisation, so no kernel reads out of bounds
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            policy.refuse(entry, f"{name} holds token id {bad} outside the vocabulary 0..{vocab - 1}.")


def _check_counter(entry: str, name: str, t, batch: int, device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (batch,):
        desc = f"shape {tuple(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        policy.refuse(entry, f"{name} has {desc}; expected an int32 tensor of shape ({batch},).")
    _check_dense(entry, name, t)
    if t.device != device:
        policy.refuse(entry, f"{name} is on {t.device}; expected {device}.")


def _seed_value(entry: str, name: str, value, batch: int) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        integer = not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
        if integer and value.dim() == 1 and value.numel() == batch > 1:
            # FlashInfer's per-request form (one value per request, for CUDA graphs): valid, not served here
            policy.unsupported(entry, f"{name} holds {batch} per-request values; one {name} per call is served "
                                      f"(a Python int or a one-element integer tensor).")
        if value.numel() != 1 or not integer:
            policy.refuse(entry, f"{name} is a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; "
                                 f"expected a Python int or a one-element integer tensor.")
        value = int(value.item())
    elif not policy.is_int(value):
        policy.refuse(entry, f"{name}={value!r} must be a Python int or a one-element integer tensor.")
    if value < 0:
        policy.refuse(entry, f"{name}={value} is negative; expected an int >= 0.")
    return value


def _random_bits(entry: str, shape, device, generator, seed, offset) -> torch.Tensor:
    """int64 values in [0, 2^31) of `shape` on `device`."""
    seed = _seed_value(entry, "seed", seed, shape[0])
    offset = _seed_value(entry, "offset", offset, shape[0])
    if generator is not None and (seed is not None or offset is not None):
        given = " and ".join(n for n, v in (("seed", seed), ("offset", offset)) if v is not None)
        policy.refuse(entry, f"generator and {given} were both given; pass a generator, or a seed (and offset).")
    if offset is not None and seed is None:
        policy.refuse(entry, f"offset={offset} was given without a seed; pass seed as well (or a generator).")
    if generator is not None and not isinstance(generator, torch.Generator):
        policy.refuse(entry, f"generator must be a torch.Generator, got {type(generator).__name__}.")
    if seed is not None:
        generator = torch.Generator(device="cpu")
        # each (seed, offset) pair names a stream of its own (not FlashInfer's Philox stream: the numbers differ
        # from it); SeedSequence mixes the pair, so no two pairs meet (seed * c + offset did: (1, 0) and (0, c))
        state = np.random.SeedSequence([seed, offset or 0]).generate_state(1, np.uint64)[0]
        generator.manual_seed(int(state) % (1 << 63))
    if generator is None:
        return torch.randint(0, 1 << 31, tuple(shape), dtype=torch.int64, device=device)
    bits = torch.randint(0, 1 << 31, tuple(shape), dtype=torch.int64, generator=generator,
                         device=generator.device)
    return bits.to(device)


def _acceptance_uniform(bits: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) from draws in [0, 2^31): the top 24 bits, exact in float32 (as the Triton kernel computes it)."""
    return (bits >> 7).to(torch.float32) * _TWO_POW_M24


def _check_flag(entry: str, name: str, value) -> None:
    if not isinstance(value, bool):
        policy.refuse(entry, f"{name}={value!r} must be a bool.")


def _int_weights(w: torch.Tensor) -> torch.Tensor:
    """Probabilities (any leading dims) in 2^-32 fixed point, int64."""
    return (w.clamp(0.0, 1.0) * _TWO_POW_32).to(torch.int64)


def _sample_int(weights: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from int64 weights [B, V] with int64 bits [B] in [0, 2^31); returns int64 [B]."""
    total = weights.sum(dim=-1)
    threshold = (total >> 31) * bits + (((total & 0x7FFFFFFF) * bits) >> 31)
    count = (weights.cumsum(dim=-1) <= threshold[:, None]).sum(dim=-1)
    return count.clamp(max=weights.shape[-1] - 1)


def _final_token(p: torch.Tensor, q: Optional[torch.Tensor], bits: torch.Tensor) -> torch.Tensor:
    """Residual max(0, p - q) (the target p where q is None or the residual is all zero) sampled with bits."""
    w_p = _int_weights(p)
    if q is None:
        return _sample_int(w_p, bits)
    w_r = _int_weights(p - q)
    w = torch.where((w_r.sum(dim=-1) > 0)[:, None], w_r, w_p)
    return _sample_int(w, bits)


# ---------------------------------------------------------------- chain

def _accumulate(accepted, emitted, accepted_out, emitted_out):
    """FlashInfer's maybe_output_* counters: the counts are added in place and those tensors returned."""
    if accepted_out is not None:
        accepted = accepted_out.add_(accepted)
    if emitted_out is not None:
        emitted = emitted_out.add_(emitted)
    return accepted, emitted


def _check_draft_and_target(entry, draft_probs, draft_token_ids, target_probs, target_rows_why):
    """Shapes, dtypes and devices shared by both samplers; returns (B, n, V, device)."""
    _check_probs(entry, "draft_probs", draft_probs)
    _check_probs(entry, "target_probs", target_probs)
    B, n, V = draft_probs.shape
    device = draft_probs.device
    if V < 1:
        policy.refuse(entry, f"draft_probs has vocab_size {V}; at least 1 is needed.")
    if tuple(target_probs.shape) != (B, n + 1, V):
        policy.refuse(entry, f"target_probs has shape {tuple(target_probs.shape)}; expected {(B, n + 1, V)} "
                             f"({target_rows_why}).")
    if target_probs.device != device:
        policy.refuse(entry, f"target_probs is on {target_probs.device} but draft_probs is on {device}.")
    _check_ids(entry, "draft_token_ids", draft_token_ids, (B, n), V, device)
    return B, n, V, device


def _old_signature(entry, target_probs, third_after, kwargs) -> None:
    """FlashInfer 0.1's (draft_probs, draft_token_ids, uniform_samples, target_probs): refused by name, not read
    as today's order (its uniforms would land in target_probs)."""
    if "uniform_samples" in kwargs or (isinstance(target_probs, torch.Tensor) and target_probs.dim() == 2 and
                                       isinstance(third_after, torch.Tensor) and third_after.dim() == 3):
        policy.unsupported(entry, "uniform_samples (FlashInfer 0.1's argument, third by position there) is not "
                                  "served: pass (draft_probs, draft_token_ids, target_probs, ...) and the random "
                                  "numbers come from generator, or seed and offset.")
    if kwargs:
        policy.extra_kwargs(entry, kwargs)


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                               target_probs: torch.Tensor,
                               maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                               maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
                               deterministic: bool = True, generator: Optional[torch.Generator] = None,
                               seed=None, offset=None, backend: str = "auto", **unsupported_kwargs
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling of a chain of draft tokens per request (FlashInfer's semantics).

    draft_probs float32 [B, n, V]: the draft distribution token i was drawn from; draft_token_ids int32 or
    int64 [B, n]; target_probs float32 [B, n + 1, V] (row n is the target after the last draft token); float16,
    bfloat16 and float64 probabilities are read as float32 (FlashInfer's cast).

    For i = 0..n-1, draft token t_i is accepted when u_i * q_i(t_i) < p_i(t_i) (probability
    min(1, p/q)); at the first rejection the next token is sampled from normalize(max(0, p_i - q_i)) (from
    p_i if that residual is zero) and the walk stops; if all n are accepted, a bonus token is sampled from
    p_n. The emitted tokens are distributed exactly as the target's.

    Returns (output_token_ids int32 [B, n + 1]: the accepted draft tokens, then the sampled token, then -1;
    output_accepted_token_num int32 [B]: how many draft tokens pass the acceptance test considered one by
    one, ignoring that sampling stops at the first rejection (a draft/target alignment metric);
    output_emitted_draft_token_num int32 [B]: how many draft tokens were emitted, the bonus or residual
    token not included, so each request emits that + 1 tokens). When `maybe_output_*` tensors are given
    (int32 [B]) the counts are added to them in place and they are returned.
    """
    entry = "chain_speculative_sampling"
    _old_signature(entry, target_probs, maybe_output_accepted_token_num, unsupported_kwargs)
    B, n, V, device = _check_draft_and_target(entry, draft_probs, draft_token_ids, target_probs,
                                              "one more position than draft_probs")
    draft_probs, target_probs = draft_probs.float(), target_probs.float()  # FlashInfer's cast (float32: no copy)
    _check_counter(entry, "maybe_output_accepted_token_num", maybe_output_accepted_token_num, B, device)
    _check_counter(entry, "maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num, B, device)
    _check_flag(entry, "deterministic", deterministic)
    impl = _backend.resolve(entry, backend, device)
    bits = _random_bits(entry, (B, n + 1), device, generator, seed, offset)

    if impl == "triton":
        out, accepted, emitted = _chain_triton(draft_probs, draft_token_ids, target_probs, bits)
    else:
        out, accepted, emitted = _chain_torch(draft_probs, draft_token_ids, target_probs, bits)
    accepted, emitted = _accumulate(accepted, emitted, maybe_output_accepted_token_num,
                                    maybe_output_emitted_draft_token_num)
    return out, accepted, emitted


def _chain_torch(draft_probs, draft_token_ids, target_probs, bits):
    B, n, V = draft_probs.shape
    device = draft_probs.device
    out = torch.full((B, n + 1), -1, dtype=torch.int32, device=device)
    if B == 0:
        return out, torch.zeros(0, dtype=torch.int32, device=device), torch.zeros(0, dtype=torch.int32,
                                                                                  device=device)
    ids = draft_token_ids.long()
    q = draft_probs.gather(2, ids[:, :, None])[:, :, 0]
    p = target_probs[:, :n].gather(2, ids[:, :, None])[:, :, 0]
    u = _acceptance_uniform(bits[:, :n])
    ok = u * q < p
    accepted = ok.sum(dim=1).to(torch.int32)
    take = ok.to(torch.int32).cumprod(dim=1).bool()
    emitted = take.sum(dim=1)
    out[:, :n] = torch.where(take, ids, -1).to(torch.int32)
    rows = torch.arange(B, device=device)
    p_k = target_probs[rows, emitted]
    q_k = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, V)], dim=1)[rows, emitted]
    token = _final_token(p_k, q_k, bits[:, n])
    out[rows, emitted] = token.to(torch.int32)
    return out, accepted, emitted.to(torch.int32)


def _chain_triton(draft_probs, draft_token_ids, target_probs, bits):
    from .kernels.sampling import chain_speculative_sampling_kernel
    from .kernels.sizes import next_pow2

    B, n, V = draft_probs.shape
    device = draft_probs.device
    out = torch.full((B, n + 1), -1, dtype=torch.int32, device=device)
    accepted = torch.zeros(B, dtype=torch.int32, device=device)
    emitted = torch.zeros(B, dtype=torch.int32, device=device)
    if B == 0:
        return out, accepted, emitted
    block_v = min(4096, next_pow2(V))
    chain_speculative_sampling_kernel[(B,)](
        draft_probs.contiguous(), draft_token_ids.contiguous(), target_probs.contiguous(), bits.contiguous(),
        out, accepted, emitted, n, V, BLOCK_V=block_v)
    return out, accepted, emitted


# ---------------------------------------------------------------- tree

def tree_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                              target_probs: torch.Tensor, tree_parents: torch.Tensor,
                              maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                              maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
                              deterministic: bool = True, generator: Optional[torch.Generator] = None,
                              seed=None, offset=None, backend: str = "auto", return_accepted_nodes: bool = False):
    """Speculative sampling of a tree of draft tokens per request (multi-draft rejection sampling).

    The convention. Each request has T draft nodes 0..T-1 (padding is not supported: every request has T).
      * tree_parents int32 or int64 [B, T]: the parent node of node t, -1 for a child of the root (the last
        committed token); a parent precedes its children (parents[t] < t).
      * draft_token_ids [B, T]: the token of node t.
      * draft_probs float32 [B, T, V]: the draft distribution node t's token was drawn from, i.e. the
        draft model's distribution at t's parent. Siblings are assumed drawn from it *without
        replacement* in index order (the k-th sibling from that distribution with the earlier siblings'
        tokens removed and renormalised); passing either the shared row or the already-renormalised row
        per sibling gives the same distribution (the earlier siblings' tokens are zeroed either way). A
        sibling repeating a rejected sibling's token is rejected (after the exclusion both its q and the
        residual p at that token are zero).
      * target_probs float32 [B, T + 1, V]: row 0 is the target distribution at the root, row t + 1 the
        target distribution after node t.

    The walk starts at the root with p = target row of the current node. The current node's children are
    tried in index order: child c with token x is accepted when u_c * q(x) < p(x), where q is c's draft row
    with the tokens of earlier rejected siblings zeroed and renormalised; on acceptance x is emitted and the
    walk descends to c (p = target row of c). On rejection p becomes normalize(max(0, p - q)) (unchanged if
    that is zero) and the next sibling is tried. When a node has no child left (all rejected, or a leaf),
    one token is sampled from p, emitted, and the walk stops. The emitted tokens are then distributed
    exactly as the target's. A chain (parents [-1, 0, 1, ...]) gives chain_speculative_sampling's tokens
    for the same random numbers.

    Random numbers: T + 1 per request, number t for node t's acceptance test, number T for the final token.

    Returns (output_token_ids int32 [B, T + 1]: the accepted path's tokens, then the sampled token, then -1;
    accepted int32 [B]: the nodes t whose token passes the plain test u_t * draft[t, x_t] <
    target[parent(t) + 1, x_t] considered one by one (the alignment metric of the chain case); emitted int32
    [B]: the accepted path's length, the final token not included). With return_accepted_nodes=True a
    fourth tensor, int32 [B, T], lists the accepted path's node indices padded with -1 (the KV entries to
    keep). `maybe_output_*` are added to in place and returned, as in the chain case. Torch path only: any
    backend resolves to it.
    """
    entry = "tree_speculative_sampling"
    B, T, V, device = _check_draft_and_target(entry, draft_probs, draft_token_ids, target_probs,
                                              "the root's row, then one row per draft node")
    draft_probs, target_probs = draft_probs.float(), target_probs.float()
    if not isinstance(tree_parents, torch.Tensor) or tree_parents.dtype not in _ID_DTYPES:
        desc = tree_parents.dtype if isinstance(tree_parents, torch.Tensor) else type(tree_parents).__name__
        policy.refuse(entry, f"tree_parents has type {desc}; expected an int32 or int64 tensor of shape {(B, T)}.")
    _check_dense(entry, "tree_parents", tree_parents)
    if tuple(tree_parents.shape) != (B, T):
        policy.refuse(entry, f"tree_parents has shape {tuple(tree_parents.shape)}; expected {(B, T)}.")
    if tree_parents.device != device:
        policy.refuse(entry, f"tree_parents is on {tree_parents.device} but the probabilities are on {device}.")
    parents = tree_parents.long()
    if T:
        node = torch.arange(T, device=device)
        bad = (parents < -1) | (parents >= node)
        if bool(bad.any()):
            b, t = (int(x) for x in bad.nonzero()[0])
            earlier = f"an earlier node (0..{t - 1})" if t else "nothing else for node 0, which has no earlier node"
            policy.refuse(entry, f"tree_parents[{b}, {t}]={int(parents[b, t])}; a parent must be -1 (the root) "
                                 f"or {earlier}.")
    _check_counter(entry, "maybe_output_accepted_token_num", maybe_output_accepted_token_num, B, device)
    _check_counter(entry, "maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num, B, device)
    _check_flag(entry, "deterministic", deterministic)
    _check_flag(entry, "return_accepted_nodes", return_accepted_nodes)
    _backend.resolve(entry, backend, device)  # validates the name; the torch path serves every backend
    bits = _random_bits(entry, (B, T + 1), device, generator, seed, offset)

    out, accepted, emitted, nodes = _tree_torch(draft_probs, draft_token_ids.long(), target_probs, parents, bits)
    accepted, emitted = _accumulate(accepted, emitted, maybe_output_accepted_token_num,
                                    maybe_output_emitted_draft_token_num)
    if return_accepted_nodes:
        return out, accepted, emitted, nodes
    return out, accepted, emitted


def _tree_torch(draft_probs, ids, target_probs, parents, bits):
    B, T, V = draft_probs.shape
    device = draft_probs.device
    out = torch.full((B, T + 1), -1, dtype=torch.int32, device=device)
    nodes = torch.full((B, T), -1, dtype=torch.int32, device=device)
    if B == 0:
        z = torch.zeros(0, dtype=torch.int32, device=device)
        return out, z, z, nodes
    rows = torch.arange(B, device=device)
    u_all = _acceptance_uniform(bits[:, :T])

    # The alignment metric: every node's plain test against its parent's target row.
    if T:
        q_x = draft_probs.gather(2, ids[:, :, None])[:, :, 0]
        p_x = target_probs.gather(1, (parents + 1)[:, :, None].expand(B, T, V)).gather(2, ids[:, :, None])[:, :, 0]
        accepted = (u_all * q_x < p_x).sum(dim=1).to(torch.int32)
    else:
        accepted = torch.zeros(B, dtype=torch.int32, device=device)

    # first_child[b, v + 1]: the lowest-index child of node v (v = -1 is the root); next_sib[b, t]: the
    # next sibling of t in index order; -1 for none.
    big = T + 1
    idx = torch.arange(T, device=device)
    owners = torch.arange(-1, T, device=device)
    is_child = parents[:, None, :] == owners[None, :, None]  # [B, T + 1, T]
    first_child = torch.where(is_child, idx, big).min(dim=2).values if T else torch.full((B, 1), big, device=device)
    first_child = torch.where(first_child == big, -1, first_child)
    if T:
        later_sib = (parents[:, :, None] == parents[:, None, :]) & (idx[None, None, :] > idx[None, :, None])
        next_sib = torch.where(later_sib, idx, big).min(dim=2).values
        next_sib = torch.where(next_sib == big, -1, next_sib)

    cand = first_child[:, 0].clone()  # the node to test next
    emitted = torch.zeros(B, dtype=torch.long, device=device)
    p_cur = target_probs[:, 0].clone()  # the current target (residual) row
    z_p = torch.ones(B, dtype=torch.float32, device=device)  # its normaliser
    excluded = torch.zeros(B, V, dtype=torch.bool, device=device)  # earlier rejected siblings' tokens

    for _ in range(T):  # each step tests one node per live request; no node is tested twice
        active = cand >= 0
        if not bool(active.any()):
            break
        c = cand.clamp(min=0)
        tok = ids[rows, c]
        q = draft_probs[rows, c].masked_fill(excluded, 0.0)
        z_q = torch.where(excluded.any(dim=1), q.sum(dim=1), torch.ones_like(z_p))
        z_q = torch.where(z_q > 0, z_q, torch.ones_like(z_q))  # all draft mass excluded: q = 0, p/q = inf
        q_tok = q[rows, tok] / z_q
        p_tok = p_cur[rows, tok] / z_p
        ok = (u_all[rows, c] * q_tok < p_tok) & active
        rej = ~ok & active
        # accepted: emit x and descend to c
        out[rows[ok], emitted[ok]] = tok[ok].to(torch.int32)
        nodes[rows[ok], emitted[ok]] = c[ok].to(torch.int32)
        emitted = emitted + ok.long()
        # rejected: p <- max(0, p - q) (kept unnormalised, z_p its sum; unchanged if it is zero), x excluded
        residual = (p_cur / z_p[:, None] - q / z_q[:, None]).clamp(0.0, 1.0)
        keep_old = _int_weights(residual).sum(dim=1) == 0
        new_p = torch.where(keep_old[:, None], p_cur / z_p[:, None], residual)
        new_z = torch.where(keep_old, torch.ones_like(z_p), residual.sum(dim=1))
        p_cur = torch.where(ok[:, None], target_probs[rows, c + 1], torch.where(rej[:, None], new_p, p_cur))
        z_p = torch.where(ok, torch.ones_like(z_p), torch.where(rej, new_z, z_p))
        excluded = excluded & ~ok[:, None]
        excluded[rows[rej], tok[rej]] = True
        next_c = torch.where(ok, first_child[rows, c + 1], next_sib[rows, c])
        cand = torch.where(active, next_c, cand)
    # the final token: from p (the residual after rejections, or the target row of a leaf: a bonus token);
    # with no rejection or a single one this is the chain sampler's draw.
    token = _sample_int(_int_weights(p_cur), bits[:, T])
    out[rows, emitted] = token.to(torch.int32)
    return out, accepted, emitted.to(torch.int32), nodes
