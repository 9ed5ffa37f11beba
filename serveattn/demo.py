"""`python -m serveattn demo`: a tiny random-weight transformer served with a paged KV cache.

Prompts of different lengths are prefilled, then decoded greedily; every attention call goes through
serveattn's FlashInfer-compatible API and is checked, per layer, against the float64 oracle.

`--kv-dtype fp8_e4m3` / `fp8_e5m2` serves from an fp8 cache: the bf16 K/V are quantized on append with one
scale per layer for K and one for V, amax(|K|) (resp. amax(|V|)) of the prompts' K/V over every request and
head, divided by the format's largest value (448 / 57344), computed at prefill and kept for decode (a later
value beyond the prompts' amax saturates). Attention reads the cache with those scales (`k_scale`/`v_scale`),
and is checked against the float64 oracle on the dequantized cache. The same prompts are then served from a
bf16 cache (same page tables), and the demo prints the error of the fp8 run's logits and attention outputs
against the bf16 run's, and whether the greedy tokens agree.

`--speculative` serves the same model (the target) with a draft model: the same architecture and weights plus
seeded Gaussian noise (`--draft-noise`, relative to each weight tensor's std), so the draft agrees with the
target often but not always. Non-speculative greedy decoding of the target runs first (the reference); then
each mode of `--spec-mode chain|tree|both` serves the prompts again, in rounds, until every request has
`--steps` + 1 tokens (a round may overshoot; the first steps + 1 are compared):

* chain: the draft proposes k = `--draft-len` tokens greedily; the target verifies them in one call of
  BatchDecodeWithPagedKVCacheWrapper planned with q_len_per_req=k + 1. The k + 1 rows per request are the
  last committed token, whose K/V the target has not computed yet (it was the previous round's output), and
  the k drafts, bottom-right causal: row j's logits judge draft j + 1, the last row gives a bonus token. The
  longest prefix of drafts equal to the target's argmax is accepted, plus the target's token after it.
* tree: the draft's top `--tree-width` tokens after the last committed token, each extended greedily to
  depth k (width x k nodes, e.g. parents [-1, 0, 1, 2, -1, 4, 5, 6]). The target verifies the last committed
  token (node 0, a child of the prefix) and every node in one call of BatchDecodeWithPagedKVCacheWrapper
  planned with tree_parents (its native tree mode: one ancestor bitmask word per node; TreeVerifyAttention).
  Nodes are appended to the KV in tree order, but their RoPE position is the
  prefix length + their depth. Greedy acceptance walks from the root into the child whose token is the
  target's argmax at its parent; then the target's token there is committed.

Rollback: only the page table changes (length, last_page_len, pages past the end back to the free list);
the slots of rejected tokens are overwritten by the next append. Tree compaction: the accepted nodes' K/V
are copied down to the positions right after the root; exact, since their RoPE already used those positions
and each attended only to the prefix and its ancestors. The draft keeps its own paged cache, rolled back to
the committed tokens it has computed; each round it first catches up on the ones it lacks (a prefill call
of 1 to k + 1 rows per request), and drafts a tree one branch at a time, rolling back after each.

Every attention call (prefill, the draft's steps, verify) is checked against the float64 oracle, with the
tree's mask for tree verify. The demo fails (nonzero exit) when a greedy speculative run's tokens differ from
non-speculative greedy decoding, unless the first difference is at a near-tie of the target's logits
(TIE_TOL, reported). It prints the acceptance rate: accepted draft tokens / k per request and round. With
`--temperature` > 0 (default 1) a sampled run per mode follows, accepting through chain_speculative_sampling /
tree_speculative_sampling (tokens sampled from softmax(logits / T); its acceptance is printed, nothing is
compared).
"""
from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

import serveattn
from serveattn import reference

REL_TOL = 2e-2  # relative-norm error a bf16 attention output must stay under
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Relative-norm error of the fp8 run's logits against the bf16 run's beyond which the demo fails: a sanity
# bound (a wrong scale or a broken quantizer gives O(1)), loose against the rounding of 3 (e4m3) or
# 2 (e5m2) mantissa bits, relative steps of 2^-4 / 2^-3 per element.
FP8_LOGITS_REL_TOL = {"fp8_e4m3": 0.1, "fp8_e5m2": 0.2}
# --speculative: a greedy token that differs from the non-speculative run's is tolerated only at a near-tie,
# where the two tokens' logits (in the non-speculative run) are within TIE_TOL x max(1, |largest logit|):
# a bf16 logit of magnitude 2..4 has a spacing of 2^-6, and verify rows and decode rows round differently.
TIE_TOL = 3e-2


@dataclass
class Config:
    vocab: int = 256
    hidden: int = 256
    layers: int = 2
    qo_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    page_size: int = 16
    prompt_lens: tuple = (5, 40)  # min, max


CPU_CONFIG = Config()
CUDA_CONFIG = Config(hidden=2048, layers=4, qo_heads=16, kv_heads=4, head_dim=128, ffn=4096,
                     prompt_lens=(16, 512))


def rms_norm(x, weight, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x, positions, theta=1e4):
    """Non-interleaved (rotate-half) RoPE on x [n, heads, D] at integer positions [n]; returns float32."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x.float().split(half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TinyLM:
    """Decoder-only transformer: RMSNorm, GQA attention with RoPE, SwiGLU MLP. Random, seeded weights."""

    def __init__(self, cfg: Config, device, dtype, seed: int):
        g = torch.Generator().manual_seed(seed)

        def w(*shape):  # scaled so activations stay O(1) through the layers
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(device, dtype)
        self.cfg, self.dtype = cfg, dtype
        qd, kvd = cfg.qo_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = torch.randn(cfg.vocab, cfg.hidden, generator=g).to(device, dtype)
        self.layers = [dict(wq=w(qd, cfg.hidden), wk=w(kvd, cfg.hidden), wv=w(kvd, cfg.hidden),
                            wo=w(cfg.hidden, qd), w_gate=w(cfg.ffn, cfg.hidden), w_up=w(cfg.ffn, cfg.hidden),
                            w_down=w(cfg.hidden, cfg.ffn),
                            norm1=torch.ones(cfg.hidden, device=device, dtype=dtype),
                            norm2=torch.ones(cfg.hidden, device=device, dtype=dtype))
                       for _ in range(cfg.layers)]
        self.final_norm = torch.ones(cfg.hidden, device=device, dtype=dtype)
        self.lm_head = w(cfg.vocab, cfg.hidden)

    def forward(self, tokens, positions, append_kv, attend):
        """tokens/positions [n]. append_kv(layer, k, v) writes the cache; attend(layer, q) reads it.
        Returns logits [n, vocab] and, per layer, the (q, out) pair handed to attention."""
        c, n = self.cfg, tokens.shape[0]
        x, records = self.embed[tokens], []
        for i, p in enumerate(self.layers):
            h = rms_norm(x, p["norm1"])
            q = rope((h @ p["wq"].T).view(n, c.qo_heads, c.head_dim), positions).to(torch.bfloat16)
            k = rope((h @ p["wk"].T).view(n, c.kv_heads, c.head_dim), positions).to(torch.bfloat16)
            v = (h @ p["wv"].T).view(n, c.kv_heads, c.head_dim).to(torch.bfloat16)
            append_kv(i, k, v)
            o = attend(i, q)
            records.append((q, o))
            x = x + o.reshape(n, -1).to(self.dtype) @ p["wo"].T
            h = rms_norm(x, p["norm2"])
            x = x + (F.silu(h @ p["w_gate"].T) * (h @ p["w_up"].T)) @ p["w_down"].T
        return rms_norm(x, self.final_norm) @ self.lm_head.T, records


class PagedKV:
    """One paged cache [num_pages, 2, page_size, Hkv, D] per layer; pages come from a shuffled free list.

    An fp8 cache also holds one K and one V scale per layer (Python floats, the real value is fp8 * scale),
    set from the first K/V appended (the prompts, at prefill): amax / the format's largest value."""

    def __init__(self, cfg: Config, batch: int, num_pages: int, device, gen: torch.Generator,
                 dtype: torch.dtype = torch.bfloat16):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.caches = [torch.zeros(num_pages, 2, cfg.page_size, cfg.kv_heads, cfg.head_dim,
                                   dtype=dtype, device=device) for _ in range(cfg.layers)]
        self.k_scales = [None] * cfg.layers
        self.v_scales = [None] * cfg.layers
        self.free = torch.randperm(num_pages, generator=gen).tolist()
        self.pages = [[] for _ in range(batch)]
        self.lens = [0] * batch

    def grow(self, new_tokens):
        """Reserves room for new_tokens[i] more tokens of request i (allocating pages as needed)."""
        for i, n in enumerate(new_tokens):
            self.lens[i] += n
            while len(self.pages[i]) * self.cfg.page_size < self.lens[i]:
                self.pages[i].append(self.free.pop())

    @property
    def fp8(self) -> bool:
        return self.dtype != torch.bfloat16

    def scales(self, layer, k, v):
        """(k_scale, v_scale) of a layer, set from k and v on the layer's first append."""
        if self.fp8 and self.k_scales[layer] is None:
            self.k_scales[layer], self.v_scales[layer] = fp8_scale(k, self.dtype), fp8_scale(v, self.dtype)
        return self.k_scales[layer], self.v_scales[layer]

    def truncate(self, i: int, n: int):
        """Rolls request i back to its first n tokens (speculative rollback): only the page table changes (the
        length, hence last_page_len, and pages wholly past the end go back to the free list); the cache
        slots of the dropped tokens keep their stale K/V until the next append overwrites them."""
        self.lens[i] = n
        keep = -(-n // self.cfg.page_size)
        while len(self.pages[i]) > keep:
            self.free.append(self.pages[i].pop())

    def move(self, i: int, src, dst):
        """Copies request i's K/V at token positions src to positions dst (same length, every layer); all of
        src is read before anything is written."""
        if not src:
            return
        ps = self.cfg.page_size
        pages = torch.tensor(self.pages[i], dtype=torch.long)
        s, d = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
        sp, so = pages[s // ps].to(self.device), (s % ps).to(self.device)
        dp, do = pages[d // ps].to(self.device), (d % ps).to(self.device)
        for cache in self.caches:  # [num_pages, 2, page_size, Hkv, D]
            cache[dp, :, do] = cache[sp, :, so]

    def table(self):
        """The CSR page table (indptr, indices, last_page_len), int32 on the cache's device."""
        counts = [len(p) for p in self.pages]
        indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        indices = torch.tensor([p for ps in self.pages for p in ps], dtype=torch.int32)
        last = torch.tensor([(n - 1) % self.cfg.page_size + 1 for n in self.lens], dtype=torch.int32)
        return indptr.to(self.device), indices.to(self.device), last.to(self.device)


def fp8_scale(x, dtype) -> float:
    """amax(|x|) / the fp8 format's largest value, as a float32-exact Python float (1.0 when x is all 0).
    One device-to-host read, once per layer at prefill."""
    amax = x.abs().max().float().item()
    scale = amax / torch.finfo(dtype).max if amax > 0 else 1.0
    return torch.tensor(scale, dtype=torch.float32).item()


class PagedAttention:
    def __init__(self, cfg: Config, backend: str, device, kv_dtype=torch.bfloat16):
        ws = torch.empty(128 * 1024 * 1024 if device.type == "cuda" else 1024 * 1024,
                         dtype=torch.uint8, device=device)
        self.cfg, self.kv_dtype = cfg, kv_dtype
        self.wrapper = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend=backend)

    def plan(self, qo_indptr, indptr, indices, last_page_len):  # once per step, shared by all layers
        c = self.cfg
        self.wrapper.plan(qo_indptr, indptr, indices, last_page_len, c.qo_heads, c.kv_heads, c.head_dim,
                          c.page_size, causal=True, q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype)

    def run(self, q, cache, k_scale=None, v_scale=None):  # one call per layer
        return self.wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale)


class DecodeAttention:
    """q_len_per_req query rows per request (1: decode; k > 1: chain verify, the last k KV positions,
    bottom-right causal among themselves) through BatchDecodeWithPagedKVCacheWrapper, on the route `auto`
    prefers."""

    def __init__(self, cfg: Config, backend: str, device, kv_dtype=torch.bfloat16, q_len_per_req: int = 1):
        ws = torch.empty(128 * 1024 * 1024 if device.type == "cuda" else 1024 * 1024,
                         dtype=torch.uint8, device=device)
        self.cfg, self.kv_dtype, self.q_len_per_req = cfg, kv_dtype, q_len_per_req
        tensor_cores = serveattn.decode.prefer_tensor_cores(cfg.qo_heads, cfg.kv_heads, q_len_per_req)
        self.wrapper = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend=backend,
                                                                    use_tensor_cores=tensor_cores)

    def plan(self, qo_indptr, indptr, indices, last_page_len):  # once per step, shared by all layers
        c = self.cfg
        self.wrapper.plan(indptr, indices, last_page_len, c.qo_heads, c.kv_heads, c.head_dim, c.page_size,
                          q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype, q_len_per_req=self.q_len_per_req)

    def run(self, q, cache, k_scale=None, v_scale=None):  # one call per layer
        return self.wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale)


def make_decode_attention(cfg: Config, backend: str, device, kv_dtype=torch.bfloat16):
    return DecodeAttention(cfg, backend, device, kv_dtype)


def serve_step(model, kv: PagedKV, attn, tokens_per_req, depths=None):
    """Appends tokens_per_req[i] to request i, runs the model, returns (next tokens, check info, logits).

    The tokens go to the next KV positions of each request, in order; their RoPE position is the same
    position unless depths is given (a tree draft: depths[i][t] is token t's depth below the first appended
    token, and its RoPE position is the first appended position + that depth)."""
    device, append_lens = kv.device, [len(t) for t in tokens_per_req]
    kv.grow(append_lens)
    indptr, indices, last = kv.table()
    qo_indptr = torch.tensor([0] + append_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    seq_lens = serveattn.get_seq_lens(indptr, last, kv.cfg.page_size)
    nnz = sum(append_lens)
    batch_indices, positions = serveattn.get_batch_indices_positions(qo_indptr, seq_lens, nnz)
    attn.plan(qo_indptr, indptr, indices, last)
    rope_positions = positions
    if depths is not None:
        rope_positions = torch.tensor([kv.lens[i] - n + d for i, n in enumerate(append_lens) for d in depths[i]],
                                      dtype=positions.dtype).to(device)

    def append_kv(layer, k, v):
        k_scale, v_scale = kv.scales(layer, k, v)  # None, None for a bf16 cache: K/V are copied
        serveattn.append_paged_kv_cache(k, v, batch_indices, positions, kv.caches[layer], indices, indptr,
                                        last, kv_layout="NHD", k_scale=k_scale, v_scale=v_scale)

    def attend(layer, q):
        return attn.run(q, kv.caches[layer], k_scale=kv.k_scales[layer], v_scale=kv.v_scales[layer])

    tokens = torch.tensor([t for ts in tokens_per_req for t in ts], dtype=torch.long, device=device)
    logits, records = model.forward(tokens, rope_positions, append_kv, attend)
    next_tokens = logits[qo_indptr[1:].long() - 1].argmax(-1).tolist()
    return next_tokens, (records, qo_indptr, indptr, indices, last, getattr(attn, "custom_mask", None)), logits


def check(kv: PagedKV, records, qo_indptr, indptr, indices, last, custom_mask=None):
    """(max abs error, max relative-norm error) of every layer's attention against the float64 oracle
    (on the dequantized cache, fp8 * scale, for an fp8 cache); bottom-right causal, or custom_mask."""
    max_abs = max_rel = 0.0
    for (q, out), cache, k_scale, v_scale in zip(records, kv.caches, kv.k_scales, kv.v_scales):
        ref, _ = reference.batch_paged(q, cache, qo_indptr, indptr, indices, last, kv_layout="NHD", causal=True,
                                       custom_mask=custom_mask,
                                       k_scale=1.0 if k_scale is None else k_scale,
                                       v_scale=1.0 if v_scale is None else v_scale)
        diff = out.double() - ref.to(out.device)
        max_abs = max(max_abs, diff.abs().max().item())
        max_rel = max(max_rel, (diff.norm() / ref.norm().clamp_min(1e-30)).item())
    return max_abs, max_rel


def sync_time(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---------------------------------------------------------------- speculative decoding (--speculative)

def noisy_copy(model: TinyLM, noise: float, seed: int) -> TinyLM:
    """The draft model: the same architecture and weights, each weight tensor plus seeded Gaussian noise of
    `noise` times that tensor's standard deviation (the norms, all ones, stay exact)."""
    g = torch.Generator().manual_seed(seed)

    def jitter(t):
        return (t.float() + noise * t.float().std() * torch.randn(t.shape, generator=g).to(t.device)).to(t.dtype)
    draft = copy.copy(model)
    draft.embed, draft.lm_head = jitter(model.embed), jitter(model.lm_head)
    draft.layers = [{name: jitter(t) for name, t in p.items()} for p in model.layers]
    return draft


class TreeVerifyAttention:
    """Tree verify: each request's rows are its verify tree's nodes in tree order (a parent before its
    children), the last len(tree) KV positions; a node sees the prefix, its ancestors and itself.

    Served by the decode wrapper's native tree mode (plan(tree_parents=...): one ancestor bitmask word per
    node, no dense mask on the device). The dense mask from tree_parents_to_mask is still built, for the
    float64 check only."""

    def __init__(self, cfg: Config, backend: str, device, kv_dtype=torch.bfloat16):
        ws = torch.empty(128 * 1024 * 1024 if device.type == "cuda" else 1024 * 1024,
                         dtype=torch.uint8, device=device)
        self.cfg, self.kv_dtype = cfg, kv_dtype
        self.wrapper = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend=backend)
        self.parents = None  # one parent array per request, set before each verify step
        self.custom_mask = None

    def plan(self, qo_indptr, indptr, indices, last_page_len):
        c = self.cfg
        kv_lens = serveattn.get_seq_lens(indptr, last_page_len, c.page_size).tolist()
        prefix_lens = [n - len(p) for n, p in zip(kv_lens, self.parents)]
        self.custom_mask, _, _ = serveattn.tree_parents_to_mask(self.parents, prefix_lens, device=indptr.device)
        self.wrapper.plan(indptr, indices, last_page_len, c.qo_heads, c.kv_heads, c.head_dim, c.page_size,
                          q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype, tree_parents=self.parents)

    def run(self, q, cache, k_scale=None, v_scale=None):
        return self.wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale)


def draft_tree_shape(width: int, depth: int):
    """The draft tree: the draft model's top-`width` tokens after the last committed token, each extended by
    a greedy (or, when sampling, sampled) chain to `depth` tokens. Nodes in branch order (branch b holds nodes
    b*depth .. b*depth + depth - 1), a parent before its children. Returns (parents, depths), the depth of a
    child of the root being 1."""
    parents, depths = [], []
    for b in range(width):
        for j in range(depth):
            parents.append(-1 if j == 0 else b * depth + j - 1)
            depths.append(j + 1)
    return parents, depths


@dataclass
class SpecStats:
    rounds: int = 0          # verify calls
    requests: int = 0        # request-rounds (one verify of one request)
    proposed: int = 0        # draft tokens on the longest draft path, summed over request-rounds (k each)
    accepted: int = 0        # draft tokens accepted
    nodes: int = 0           # draft tokens verified (k for a chain, the tree's size for a tree)
    side_paths: int = 0      # tree: accepted paths that leave the first branch (their K/V moved down)

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.proposed, 1)

    @property
    def tokens_per_verify(self) -> float:  # tokens committed per request per verify call (accepted + 1)
        return (self.accepted + self.requests) / max(self.requests, 1)


class Picker:
    """Greedy (temperature 0: argmax) or sampled (softmax(logits / temperature)) token choice, with the
    probabilities the speculative samplers need."""

    def __init__(self, temperature: float, seed: int):
        self.temperature = temperature
        self.gen = torch.Generator().manual_seed(seed) if temperature > 0 else None

    def probs(self, logits):
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def pick(self, logits, n: int = 1):
        """n distinct tokens per row [B, n] (the top n, or n sampled without replacement) and the rows'
        probabilities (None when greedy)."""
        if self.gen is None:  # argmax breaks ties as the non-speculative run does; topk may not
            top = logits.argmax(-1, keepdim=True) if n == 1 else logits.float().topk(n, dim=-1).indices
            return top, None
        probs = self.probs(logits)
        return torch.multinomial(probs.cpu(), n, replacement=False, generator=self.gen).to(logits.device), probs


def serve_speculative(target, draft, cfg: Config, prompts, steps, mode: str, k: int, width: int, backend: str,
                      device, num_pages: int, page_seed: int, failures, temperature: float = 0.0, seed: int = 0):
    """Speculative decoding until every request has steps + 1 tokens (a round may overshoot).

    Each round: the draft model proposes (chain: k tokens; tree: draft_tree_shape(width, k)), the target
    verifies all of them in one attention call per layer, the longest accepted path plus the target's next
    token is committed, and the KV caches are rolled back / compacted. Every attention call (prefill, draft,
    verify) is checked against the float64 oracle. Returns (generated tokens per request, SpecStats)."""
    batch = len(prompts)
    picker = Picker(temperature, seed + 17)
    sampled = temperature > 0
    label = f"{mode} " + (f"T={temperature:g} " if sampled else "greedy ")
    kv_t = PagedKV(cfg, batch, num_pages, device, torch.Generator().manual_seed(page_seed))
    kv_d = PagedKV(cfg, batch, num_pages, device, torch.Generator().manual_seed(page_seed + 1))
    prefill_attn = PagedAttention(cfg, backend, device)          # prompts; the draft's catch-up rows
    step_attn = make_decode_attention(cfg, backend, device)      # the draft's one-row steps
    tree_parents, tree_depths = draft_tree_shape(width, k)
    if mode == "chain":
        # rows per request: the last committed token (its K/V not yet in the target's cache) + k drafts
        verify_attn = DecodeAttention(cfg, backend, device, q_len_per_req=k + 1)
        verify_parents, verify_depths = None, None
    else:
        verify_attn = TreeVerifyAttention(cfg, backend, device)
        # node 0 is the last committed token (child of the prefix), draft node t is node t + 1
        verify_parents = [-1] + [p + 1 for p in tree_parents]
        verify_depths = [0] + tree_depths
        verify_children = [[c for c, p in enumerate(verify_parents) if p == v] for v in range(len(verify_parents))]
    errs = {"prefill": [], "draft": [], "verify": []}  # prefill: both models; draft: the draft's steps
    seconds = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}
    tokens = {"prefill": 0, "draft": 0, "verify": 0}
    stats = SpecStats()

    def step(phase, model, kv, attn, rows, depths=None):
        t0 = sync_time(device)
        _, info, logits = serve_step(model, kv, attn, rows, depths)
        seconds[phase] += sync_time(device) - t0
        tokens[phase] += sum(len(r) for r in rows)
        errs[phase].append(check(kv, *info))
        return logits, info[1]

    with torch.inference_mode():
        logits, qo = step("prefill", target, kv_t, prefill_attn, prompts)
        first, _ = picker.pick(logits[qo[1:].long() - 1])
        step("prefill", draft, kv_d, prefill_attn, prompts)
        generated = [[t] for t in first[:, 0].tolist()]
        seqs = [list(p) + g for p, g in zip(prompts, generated)]

        while min(len(g) for g in generated) < steps + 1:
            base = [len(s) for s in seqs]  # committed tokens; the target's cache holds all but the last
            # -- draft: catch up on the committed tokens its cache lacks (1 to k + 1 rows), then one row a step
            logits, qo = step("draft", draft, kv_d, prefill_attn, [s[n:] for s, n in zip(seqs, kv_d.lens)])
            root_logits = logits[qo[1:].long() - 1]
            if mode == "chain":
                tok, probs = picker.pick(root_logits)
                ids, draft_probs = [tok[:, 0]], [probs]
                for _ in range(k - 1):
                    logits, _ = step("draft", draft, kv_d, step_attn, [[t] for t in ids[-1].tolist()])
                    tok, probs = picker.pick(logits)
                    ids.append(tok[:, 0])
                    draft_probs.append(probs)
            else:
                roots, root_probs = picker.pick(root_logits, width)
                ids, draft_probs = [], []
                for b in range(width):  # one branch at a time; the draft's cache is rolled back after each
                    ids.append(roots[:, b])
                    draft_probs.append(root_probs)  # siblings: the shared row (sampled without replacement)
                    for _ in range(k - 1):
                        logits, _ = step("draft", draft, kv_d, step_attn, [[t] for t in ids[-1].tolist()])
                        tok, probs = picker.pick(logits)
                        ids.append(tok[:, 0])
                        draft_probs.append(probs)
                    for i in range(batch):
                        kv_d.truncate(i, base[i])
            ids = torch.stack(ids, dim=1)  # [B, nodes]
            draft_rows = ids.tolist()
            # -- target: verify every draft token in one call per layer
            rows = [[s[-1]] + d for s, d in zip(seqs, draft_rows)]
            if mode == "chain":
                logits, _ = step("verify", target, kv_t, verify_attn, rows)
            else:
                verify_attn.parents = [verify_parents] * batch
                logits, _ = step("verify", target, kv_t, verify_attn, rows, [verify_depths] * batch)
            logits = logits.view(batch, ids.shape[1] + 1, -1)  # row 0: after the last committed token
            # -- acceptance: paths[i] = accepted draft nodes (indices into ids), final[i] = the target's token
            if not sampled:
                target_tok = logits.argmax(-1).tolist()
                paths, final = [], []
                for i in range(batch):
                    if mode == "chain":
                        a = 0
                        while a < k and draft_rows[i][a] == target_tok[i][a]:
                            a += 1
                        paths.append(list(range(a)))
                        final.append(target_tok[i][a])
                    else:  # walk from the root: descend into the child holding the target's argmax
                        v, path = 0, []
                        while True:
                            nxt = [c for c in verify_children[v] if rows[i][c] == target_tok[i][v]]
                            if not nxt:
                                break
                            v = nxt[0]
                            path.append(v - 1)
                        paths.append(path)
                        final.append(target_tok[i][v])
            else:
                target_probs = picker.probs(logits)
                draft_probs = torch.stack(draft_probs, dim=1)
                if mode == "chain":
                    out, _, emitted = serveattn.chain_speculative_sampling(
                        draft_probs, ids, target_probs, generator=picker.gen, backend=backend)
                    paths = [list(range(e)) for e in emitted.tolist()]
                else:
                    out, _, emitted, nodes = serveattn.tree_speculative_sampling(
                        draft_probs, ids, target_probs,
                        torch.tensor([tree_parents] * batch, dtype=torch.int32, device=device),
                        generator=picker.gen, return_accepted_nodes=True)
                    paths = [n[:e] for n, e in zip(nodes.tolist(), emitted.tolist())]
                out = out.tolist()
                final = [out[i][len(paths[i])] for i in range(batch)]
                for i in range(batch):  # the sampler's emitted tokens are the path's tokens
                    if out[i][:len(paths[i])] != [draft_rows[i][t] for t in paths[i]]:
                        failures.append(f"{label}: request {i}: the sampler emitted {out[i]} for the accepted "
                                        f"nodes {paths[i]} of the draft {draft_rows[i]}")
            # -- commit, roll back, compact
            for i in range(batch):
                path, root = paths[i], base[i] - 1  # root: the KV position of the last committed token
                new = [draft_rows[i][t] for t in path] + [final[i]]
                if mode == "tree":
                    # The accepted nodes' K/V sit at root + 1 + node; RoPE used root + depth, the position
                    # they take now, so copying them down to root + 1 .. root + a is exact.
                    kv_t.move(i, [root + 1 + t for t in path], [root + 1 + j for j in range(len(path))])
                kv_t.truncate(i, root + 1 + len(path))
                if mode == "chain":  # the draft's cache holds base + k - 1 tokens: keep the accepted ones
                    kv_d.truncate(i, base[i] + min(len(path), k - 1))
                seqs[i] += new
                generated[i] += new
                stats.accepted += len(path)
                stats.side_paths += bool(path) and path[0] >= k
            stats.rounds += 1
            stats.requests += batch
            stats.proposed += batch * k
            stats.nodes += batch * ids.shape[1]

    backend_used = {"prefill": prefill_attn, "draft": step_attn, "verify": verify_attn}
    for phase, e in errs.items():
        max_abs, max_rel = max(x[0] for x in e), max(x[1] for x in e)
        print(f"{phase:8s} {tokens[phase]:6d} tokens  max|err| {max_abs:.3e}  rel err {max_rel:.3e}  "
              f"{tokens[phase] / max(seconds[phase], 1e-9):10.1f} tok/s  [{backend_used[phase].wrapper.backend}]"
              f"  {len(e)} calls")
        if not max_rel < REL_TOL:
            failures.append(f"speculative {label}{phase}: relative error {max_rel:.3e} >= {REL_TOL} "
                            f"(max abs error {max_abs:.3e})")
    print(f"{label}acceptance {stats.acceptance:.3f} ({stats.accepted}/{stats.proposed} draft tokens on the "
          f"longest path), {stats.tokens_per_verify:.2f} tokens per request per verify call, "
          f"{stats.rounds} verify calls of {stats.nodes // max(stats.requests, 1) + 1} rows per request"
          + (f"; {stats.side_paths} accepted paths through another branch than the first" if mode == "tree" else ""))
    return generated, stats


def baseline_logits(history, i: int, j: int):
    """The non-speculative run's logits that chose request i's generated token j."""
    logits, qo, _ = history[j]
    return logits[int(qo[i + 1]) - 1]


def compare_greedy(label: str, spec, base, history, failures) -> None:
    """spec's tokens must equal base's (the non-speculative greedy run) over base's length. A first difference
    at a near-tie of the baseline's logits (the two tokens' logits within TIE_TOL of the largest's magnitude:
    rounding, since verify rows and decode rows take different reduction orders) is reported, not failed."""
    n, same, ties = len(base[0]), 0, 0
    for i, (s, b) in enumerate(zip(spec, base)):
        s = s[:len(b)]
        if s == b:
            same += 1
            continue
        j = next(j for j, (x, y) in enumerate(zip(s, b)) if x != y)
        row = baseline_logits(history, i, j).float()
        margin = (row[b[j]] - row[s[j]]).item()
        if margin <= TIE_TOL * max(1.0, row.abs().max().item()):
            ties += 1
            print(f"  request {i}: first differs at generated token {j} at a near-tie of the target's logits "
                  f"(speculative {s[j]}, non-speculative {b[j]}, margin {margin:.2e})")
        else:
            failures.append(f"{label}: request {i} differs from non-speculative greedy decoding at generated "
                            f"token {j} (speculative {s[j]}, non-speculative {b[j]}, logit margin {margin:.3e})")
            print(f"  request {i}: speculative {s}\n  {'':10s} non-speculative {b}")
    print(f"{label}: greedy tokens equal non-speculative greedy decoding: {same}/{len(base)} requests identical "
          f"over {n} tokens" + (f" ({ties} differ after a near-tie)" if ties else ""))


def main_speculative(args, device, cfg: Config, steps: int, batch: int) -> int:
    gen = torch.Generator().manual_seed(args.seed)
    model_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = TinyLM(cfg, device, model_dtype, args.seed)
    draft = noisy_copy(target, args.draft_noise, args.seed + 1)
    prompt_lens = torch.randint(cfg.prompt_lens[0], cfg.prompt_lens[1] + 1, (batch,), generator=gen).tolist()
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    k, width = args.draft_len, args.tree_width
    # room for steps + 1 tokens, a round's overshoot (k + 1) and a verify's appended rows (1 + width * k)
    num_pages = sum(-(-(n + steps + 2 * k + 2 + width * k) // cfg.page_size) for n in prompt_lens) + 4
    modes = ["chain", "tree"] if args.spec_mode == "both" else [args.spec_mode]
    print(f"serveattn demo --speculative: device={device} backend={args.backend}")
    print(f"model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.qo_heads} q / {cfg.kv_heads} kv heads, "
          f"head_dim {cfg.head_dim}, vocab {cfg.vocab}; batch {batch}, prompt lengths {prompt_lens}, "
          f"page size {cfg.page_size}, {num_pages} pages per cache (shuffled)")
    print(f"draft: the target's weights + Gaussian noise of {args.draft_noise:g} x each tensor's std (seed "
          f"{args.seed + 1})")

    failures = []
    print("-- target, non-speculative greedy decoding (the reference for the speculative runs)")
    page_gen = torch.Generator().manual_seed(args.seed + 2)
    base_kv = PagedKV(cfg, batch, num_pages, device, page_gen)
    base, history = serve(target, cfg, prompts, steps, base_kv, args.backend, device, failures)
    runs = [(m, 0.0) for m in modes] + ([(m, args.temperature) for m in modes] if args.temperature > 0 else [])
    for mode, temperature in runs:
        if mode == "chain":
            print(f"-- speculative, chain: the draft proposes {k} tokens; verify rows per request = the last "
                  f"committed token + {k} drafts (decode wrapper, q_len_per_req={k + 1})")
        else:
            parents, _ = draft_tree_shape(width, k)
            print(f"-- speculative, tree: top-{width} draft tokens, each extended to depth {k}: {len(parents)} "
                  f"nodes, parents {parents}; verify rows per request = the last committed token + "
                  f"{len(parents)} nodes (decode wrapper, tree_parents)")
        if temperature > 0:
            print(f"   sampled at temperature {temperature:g} with "
                  f"{'chain' if mode == 'chain' else 'tree'}_speculative_sampling (no equality check)")
        spec, stats = serve_speculative(target, draft, cfg, prompts, steps, mode, k, width, args.backend, device,
                                        num_pages, args.seed + 3, failures, temperature, args.seed)
        if temperature == 0:
            compare_greedy(f"{mode} greedy", spec, base, history, failures)
        elif not all(len(g) >= steps + 1 for g in spec):
            failures.append(f"{mode} T={temperature:g}: a request generated fewer than {steps + 1} tokens")

    for i, g in enumerate(base):
        print(f"request {i}: prompt {prompt_lens[i]:4d} tokens -> generated {g}")
    print("\n".join(f"demo FAILED: {f}" for f in failures) if failures else "demo OK")
    return 1 if failures else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m serveattn demo", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=None, help="decode steps (default 8 on CPU, 32 on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="requests (default 4 on CPU, 8 on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES),
                   help="KV cache dtype (default bf16); an fp8 run is compared with a bf16 run of the same prompts")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", action="store_true",
                   help="serve with a noisy copy of the model as the draft (chain and/or tree verify), check the "
                        "greedy tokens against non-speculative greedy decoding, print the acceptance rate")
    s.add_argument("--spec-mode", default="both", choices=["chain", "tree", "both"], help="default both")
    s.add_argument("--draft-len", type=int, default=4,
                   help="k: draft tokens per round (chain), the depth of each tree branch (tree); default 4")
    s.add_argument("--tree-width", type=int, default=2,
                   help="tree mode: branches (the draft's top tokens at the root), default 2")
    s.add_argument("--draft-noise", type=float, default=0.05,
                   help="the draft's weight noise, relative to each weight tensor's std (default 0.05)")
    s.add_argument("--temperature", type=float, default=1.0,
                   help="after the greedy runs, a sampled run per mode through chain_/tree_speculative_sampling "
                        "at this temperature (default 1.0; 0 skips it)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was asked for but no CUDA device is available; use --device cpu")
    if args.speculative:
        if args.kv_dtype != "bf16":
            p.error("--speculative serves a bf16 KV cache; leave --kv-dtype at bf16")
        if args.draft_len < 1 or args.tree_width < 1:
            p.error(f"--draft-len ({args.draft_len}) and --tree-width ({args.tree_width}) must be >= 1")
        if args.tree_width * args.draft_len > 64:
            p.error(f"a tree of --tree-width x --draft-len = {args.tree_width * args.draft_len} nodes; at most 64")
        if args.draft_noise < 0 or args.temperature < 0:
            p.error("--draft-noise and --temperature must be >= 0")
    return args


def serve(model, cfg: Config, prompts, steps, kv: PagedKV, backend: str, device, failures, label=""):
    """Prefills the prompts, then decodes `steps` tokens greedily, checking every attention call against
    the float64 oracle. Returns the generated tokens per request and, per step, (logits, qo_indptr,
    attention outputs of every layer)."""
    batch = len(prompts)
    prefill_attn = PagedAttention(cfg, backend, device, kv.dtype)
    decode_attn = make_decode_attention(cfg, backend, device, kv.dtype)

    def report(phase, attn, n_tokens, seconds, errs):
        max_abs, max_rel = max(e[0] for e in errs), max(e[1] for e in errs)
        print(f"{phase:8s} {n_tokens:6d} tokens  max|err| {max_abs:.3e}  rel err {max_rel:.3e}  "
              f"{n_tokens / max(seconds, 1e-9):10.1f} tok/s  [{attn.wrapper.backend}]")
        if not max_rel < REL_TOL:
            failures.append(f"{label}{phase}: relative error {max_rel:.3e} >= {REL_TOL} (max abs error {max_abs:.3e})")

    history = []
    with torch.inference_mode():
        t0 = sync_time(device)
        next_tokens, info, logits = serve_step(model, kv, prefill_attn, prompts)
        report("prefill", prefill_attn, sum(len(p) for p in prompts), sync_time(device) - t0, [check(kv, *info)])
        history.append((logits, info[1], [out for _, out in info[0]]))

        generated, errs, decode_s = [[t] for t in next_tokens], [], 0.0
        bar = tqdm(range(steps), desc="decode", unit="step", leave=False)
        for _ in bar:
            t0 = sync_time(device)
            next_tokens, info, logits = serve_step(model, kv, decode_attn, [[t] for t in next_tokens])
            decode_s += sync_time(device) - t0
            errs.append(check(kv, *info))
            history.append((logits, info[1], [out for _, out in info[0]]))
            bar.set_postfix(rel_err=f"{errs[-1][1]:.2e}")
            for g, t in zip(generated, next_tokens):
                g.append(t)
        bar.close()
        if errs:
            report("decode", decode_attn, steps * batch, decode_s, errs)
    return generated, history


def compare_runs(gen_a, hist_a, gen_b, hist_b):
    """Error of run a against run b over the rows both computed from the same tokens: every prompt row, then
    a request's decode rows while its generated tokens agree. Returns (rows, logits (max abs, rel),
    attention (max abs, rel)), the relative error being ||a - b|| / ||b|| over all those rows."""
    sums = {"logits": [0.0, 0.0, 0.0], "attention": [0.0, 0.0, 0.0]}  # max abs, sum diff^2, sum ref^2
    rows = 0

    def add(name, a, b):
        d = a.double() - b.double()
        acc = sums[name]
        acc[0] = max(acc[0], d.abs().max().item()) if d.numel() else acc[0]
        acc[1] += d.pow(2).sum().item()
        acc[2] += b.double().pow(2).sum().item()

    for step, ((la, qo, outs_a), (lb, _, outs_b)) in enumerate(zip(hist_a, hist_b)):
        qo = qo.tolist()
        same = [i for i in range(len(gen_a)) if gen_a[i][:step] == gen_b[i][:step]]
        idx = torch.tensor([r for i in same for r in range(qo[i], qo[i + 1])], dtype=torch.long, device=la.device)
        rows += idx.numel()
        add("logits", la[idx], lb[idx])
        for oa, ob in zip(outs_a, outs_b):
            add("attention", oa[idx], ob[idx])
    return rows, *[(acc[0], math.sqrt(acc[1]) / max(math.sqrt(acc[2]), 1e-30)) for acc in sums.values()]


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    cfg = CUDA_CONFIG if on_cuda else CPU_CONFIG
    steps = args.steps if args.steps is not None else (32 if on_cuda else 8)
    batch = args.batch if args.batch is not None else (8 if on_cuda else 4)
    if args.speculative:
        return main_speculative(args, device, cfg, steps, batch)
    gen = torch.Generator().manual_seed(args.seed)
    kv_dtype = KV_DTYPES[args.kv_dtype]
    fp8 = kv_dtype != torch.bfloat16

    model = TinyLM(cfg, device, torch.bfloat16 if on_cuda else torch.float32, args.seed)
    prompt_lens = torch.randint(cfg.prompt_lens[0], cfg.prompt_lens[1] + 1, (batch,), generator=gen).tolist()
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    num_pages = sum(-(-(n + steps) // cfg.page_size) for n in prompt_lens) + 4
    page_state = gen.get_state()  # an fp8 run and its bf16 baseline get the same shuffled page tables
    kv = PagedKV(cfg, batch, num_pages, device, gen, kv_dtype)
    print(f"serveattn demo: device={device} backend={args.backend}" + (f" kv-dtype={args.kv_dtype}" if fp8 else ""))
    print(f"model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.qo_heads} q / {cfg.kv_heads} kv heads, "
          f"head_dim {cfg.head_dim}, vocab {cfg.vocab}; batch {batch}, prompt lengths {prompt_lens}, "
          f"page size {cfg.page_size}, {num_pages} pages (shuffled)")

    failures = []
    if fp8:
        print(f"-- {args.kv_dtype} KV cache (scales: amax of the prompts' K/V per layer / "
              f"{torch.finfo(kv_dtype).max:g}; attention checked on the dequantized cache)")
    generated, history = serve(model, cfg, prompts, steps, kv, args.backend, device, failures,
                               label=f"{args.kv_dtype} " if fp8 else "")
    if fp8:
        print("kv scales per layer: " + "; ".join(f"k {k:.3e} v {v:.3e}" for k, v in zip(kv.k_scales, kv.v_scales)))
        print("-- bf16 KV cache (baseline)")
        base_kv = PagedKV(cfg, batch, num_pages, device, torch.Generator().set_state(page_state))
        base_generated, base_history = serve(model, cfg, prompts, steps, base_kv, args.backend, device, failures,
                                             label="bf16 ")
        rows, (l_abs, l_rel), (a_abs, a_rel) = compare_runs(generated, history, base_generated, base_history)
        print(f"{args.kv_dtype} vs bf16 cache over {rows} rows computed from the same tokens:")
        print(f"  logits     max|err| {l_abs:.3e}  rel err {l_rel:.3e}")
        print(f"  attention  max|err| {a_abs:.3e}  rel err {a_rel:.3e}  (every layer's output)")
        agree = [g == b for g, b in zip(generated, base_generated)]
        print(f"  greedy tokens agree: {sum(agree)}/{batch} requests identical over {steps + 1} tokens")
        for i, (g, b) in enumerate(zip(generated, base_generated)):
            if g != b:
                j = next(j for j, (x, y) in enumerate(zip(g, b)) if x != y)
                print(f"  request {i}: first differs at generated token {j} ({args.kv_dtype} {g[j]}, bf16 {b[j]})")
        tol = FP8_LOGITS_REL_TOL[args.kv_dtype]
        if not l_rel < tol:
            failures.append(f"{args.kv_dtype} vs bf16 cache: logits relative error {l_rel:.3e} >= {tol}")

    for i, g in enumerate(generated):
        print(f"request {i}: prompt {prompt_lens[i]:4d} tokens -> generated {g}")
    print("\n".join(f"demo FAILED: {f}" for f in failures) if failures else "demo OK")
    return 1 if failures else 0
