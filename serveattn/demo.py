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
"""
from __future__ import annotations

import argparse
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
    """One query row per request through BatchDecodeWithPagedKVCacheWrapper, on the route `auto` prefers."""

    def __init__(self, cfg: Config, backend: str, device, kv_dtype=torch.bfloat16):
        ws = torch.empty(128 * 1024 * 1024 if device.type == "cuda" else 1024 * 1024,
                         dtype=torch.uint8, device=device)
        self.cfg, self.kv_dtype = cfg, kv_dtype
        tensor_cores = serveattn.decode.prefer_tensor_cores(cfg.qo_heads, cfg.kv_heads)
        self.wrapper = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend=backend,
                                                                    use_tensor_cores=tensor_cores)

    def plan(self, qo_indptr, indptr, indices, last_page_len):  # once per step, shared by all layers
        c = self.cfg
        self.wrapper.plan(indptr, indices, last_page_len, c.qo_heads, c.kv_heads, c.head_dim, c.page_size,
                          q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype)

    def run(self, q, cache, k_scale=None, v_scale=None):  # one call per layer
        return self.wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale)


def make_decode_attention(cfg: Config, backend: str, device, kv_dtype=torch.bfloat16):
    return DecodeAttention(cfg, backend, device, kv_dtype)


def serve_step(model, kv: PagedKV, attn, tokens_per_req):
    """Appends tokens_per_req[i] to request i, runs the model, returns (next tokens, check info, logits)."""
    device, append_lens = kv.device, [len(t) for t in tokens_per_req]
    kv.grow(append_lens)
    indptr, indices, last = kv.table()
    qo_indptr = torch.tensor([0] + append_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    seq_lens = serveattn.get_seq_lens(indptr, last, kv.cfg.page_size)
    nnz = sum(append_lens)
    batch_indices, positions = serveattn.get_batch_indices_positions(qo_indptr, seq_lens, nnz)
    attn.plan(qo_indptr, indptr, indices, last)

    def append_kv(layer, k, v):
        k_scale, v_scale = kv.scales(layer, k, v)  # None, None for a bf16 cache: K/V are copied
        serveattn.append_paged_kv_cache(k, v, batch_indices, positions, kv.caches[layer], indices, indptr,
                                        last, kv_layout="NHD", k_scale=k_scale, v_scale=v_scale)

    def attend(layer, q):
        return attn.run(q, kv.caches[layer], k_scale=kv.k_scales[layer], v_scale=kv.v_scales[layer])

    tokens = torch.tensor([t for ts in tokens_per_req for t in ts], dtype=torch.long, device=device)
    logits, records = model.forward(tokens, positions, append_kv, attend)
    next_tokens = logits[qo_indptr[1:].long() - 1].argmax(-1).tolist()
    return next_tokens, (records, qo_indptr, indptr, indices, last), logits


def check(kv: PagedKV, records, qo_indptr, indptr, indices, last):
    """(max abs error, max relative-norm error) of every layer's attention against the float64 oracle
    (on the dequantized cache, fp8 * scale, for an fp8 cache)."""
    max_abs = max_rel = 0.0
    for (q, out), cache, k_scale, v_scale in zip(records, kv.caches, kv.k_scales, kv.v_scales):
        ref, _ = reference.batch_paged(q, cache, qo_indptr, indptr, indices, last, kv_layout="NHD", causal=True,
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m serveattn demo", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=None, help="decode steps (default 8 on CPU, 32 on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="requests (default 4 on CPU, 8 on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES),
                   help="KV cache dtype (default bf16); an fp8 run is compared with a bf16 run of the same prompts")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was asked for but no CUDA device is available; use --device cpu")
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
