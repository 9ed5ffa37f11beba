#!/usr/bin/env python
"""Seeded differential fuzzer: serveattn's public API against the float64 oracle (serveattn/reference.py).

Each case draws one configuration from its seed (same seed and family: same case, on any machine), runs it
through the public entry points on backend="triton" (the Triton kernels; on CPU through Triton's interpreter)
and, where cheap, "auto", and checks what ../shared/API.md promises:

- out close to the float64 reference per request (tests/helpers.tolerance), rows with no visible key 0 / -inf;
- every element of a NaN-poisoned out / lse written;
- base-2 LSE close to the reference's;
- a second run bitwise equal to the first; a re-plan to another batch and back gives the first bits again;
- an fp8 KV cache bitwise equal to the same call on cache.to(q.dtype) with the same scales;
- one request planned alone bitwise equal to its rows in the batch (prefill; decode with a fixed or no split), and
  so with a batch-invariant plan (disable_split_kv=True under backend="auto") whatever the tiles;
- one plan under a random mix of kinds of call (lse or not, no / float / tensor scales, other cache tensors or
  strides, a caller's out) bitwise equal to a fresh plan's call of each kind;
- forward()'s per-call settings, then run() with the plan's own bits;
- use_cuda_graph=True planning (no capture): re-plans within the fixed buffers, and back;
- wrappers recycled from four other seeds' plans (one case in four);
- refusals only for what the contract does not serve (any other refusal is reported as a failure).

Families: prefill (paged / ragged / single), decode (batch incl. chains and trees / single), cascade (multi-level
cascade and merge_state(s)), append (append_paged_kv_cache, get_seq_lens, get_batch_indices_positions).
On CPU the GPU-only host paths (fast launch, replays, the Gluon kernel, page gathering, cuDNN) are not reached,
and fp8 query attention (scale_q / scale_k / scale_v) is not drawn.

--device cuda: the case's inputs (q, caches, index tensors, masks, scale tensors, caller out / lse, workspaces) on the
GPU, the interpreter off: the compiled kernels through the fast launch path and direct launcher
(serveattn/kernels/launch.py), plan replays (kernels/replay.py), the warp-specialized Gluon prefill, fp8 page
gathering, and backend="auto"'s real routes (Triton, cuDNN, torch; recorded as route=). A plan's index tensors lie on
the GPU or on the host (drawn per case, index_on=). The float64 reference always runs on CPU copies. Tensors are drawn
on the CPU from the seed, then moved, so a GPU failure replays on CPU with the same seed (and --scale).
--scale N multiplies the drawn lengths and token budgets (bigger shapes on the GPU; the seed still fixes the case).

Usage (CPU):  TRITON_INTERPRET=1 python scripts/fuzz.py --family all --seeds 200 --start 0 --time-limit 3000
Usage (GPU):  python3 scripts/fuzz.py --device cuda --family all --seeds 100000 --time-limit 240  (gpu_run.sh fuzz)
Each failure prints a one-line reproducer: python scripts/fuzz.py --family F --start SEED --seeds 1 -v (with
--device cuda / --scale N where the run had them; without --device cuda the same case replays on the CPU).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field



def device_arg(argv) -> str:
    """--device from the command line, read before triton is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu")
    return pre.parse_known_args(argv)[0].device


import torch  # noqa: E402  (torch does not import triton)

# Triton's interpreter, set before triton is imported, for CPU tensors only: as a script, --device cpu; imported (by
# tests/test_fuzz.py), as tests/conftest.py does, on a machine without a GPU
if (device_arg(sys.argv[1:]).startswith("cpu") if __name__ == "__main__" else not torch.cuda.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's serveattn, not an installed one
sys.path.insert(0, os.path.join(ROOT, "tests"))

import serveattn  # noqa: E402
from serveattn import reference  # noqa: E402
from serveattn.kernels import attention as attention_kernel, decode as decode_kernel  # noqa: E402
from helpers import make_paged_batch, rel_err, tolerance  # noqa: E402

FAMILIES = ("prefill", "decode", "cascade", "append")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
I32 = torch.int32
LSE_ATOL = 2e-2  # tests/helpers.check_lse's bound (base 2)

# The case being run: where its inputs live and where its plans' index tensors live (the device or the host), set
# by use_device; --scale, set by main.
DEVICE = torch.device("cpu")
INDEX_DEVICE = torch.device("cpu")
SCALE = 1


def on_device(x, device=None):
    """x on device (default: the case's DEVICE). x was made on the CPU from the case's generator, so a seed draws the
    same values on any device; a view stays a view (of its base, moved). Tuples and lists map; None passes."""
    device = DEVICE if device is None else device
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return type(x)(on_device(t, device) for t in x)
    if x.device == device:
        return x
    if x._base is None:
        return x.to(device)
    return x._base.to(device).as_strided(x.shape, x.stride(), x.storage_offset())


def on_index_device(x):
    """A plan's index tensor (indptr, indices, last_page_len): on the device or the host, as the case drew."""
    return on_device(x, INDEX_DEVICE)


def on_cpu(x):
    """CPU copies of the tensors in x (nested tuples, lists, dicts): what the float64 reference reads."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(on_cpu(t) for t in x)
    if isinstance(x, dict):
        return {k: on_cpu(v) for k, v in x.items()}
    return x


class CpuOracle:
    """serveattn.reference called on CPU copies of its arguments: the float64 oracle never runs on the device (its
    functions are looked up per call, so a test may monkeypatch serveattn.reference)."""

    def __getattr__(self, name):
        fn = getattr(reference, name)
        return lambda *args, **kwargs: fn(*on_cpu(args), **on_cpu(kwargs))


oracle = CpuOracle()


def scaled(n: int) -> int:
    """A length bound or token budget under --scale."""
    return n * SCALE


class Mismatch(Exception):
    """A check failed: a silent wrong answer (or a crash) the fuzzer found."""


@dataclass
class Case:
    family: str
    seed: int
    config: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    refusals: list = field(default_factory=list)  # (expected?, sentence)
    seconds: float = 0.0
    device: str = "cpu"
    scale: int = 1

    def repro(self) -> str:
        where = (f" --device {self.device}" if self.device != "cpu" else "") + \
            (f" --scale {self.scale}" if self.scale != 1 else "")
        return f"python scripts/fuzz.py --family {self.family} --start {self.seed} --seeds 1{where} -v"


# ---------------------------------------------------------------- checks

def short(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def check_close(case, what, out, ref_out, ref_lse, row_splits, dtype, tol_dtype=None):
    """out against the reference: written everywhere, per request within tolerance, empty rows exactly 0.
    tol_dtype: the dtype whose rounding bounds the error (the looser of q's and out's), default dtype."""
    if out.dtype != dtype:
        raise Mismatch(f"{what}: out has dtype {out.dtype}, expected {dtype}")
    o = out.double().cpu()
    if torch.isnan(o).any():
        rows = torch.isnan(o).flatten(1).any(1).nonzero().flatten().tolist()
        raise Mismatch(f"{what}: out holds NaN (unwritten?) in rows {rows[:8]}")
    empty = torch.isinf(ref_lse.cpu())  # [rows, Hq]: rows/heads that see no key must come out exactly 0
    if empty.any() and o[empty].abs().max().item() != 0.0:
        raise Mismatch(f"{what}: a row with no visible key is not 0 (max |out| {o[empty].abs().max().item():.3g})")
    tol = tolerance(tol_dtype or dtype)
    err = rel_err(o, ref_out)
    if not err < tol:
        raise Mismatch(f"{what}: rel_err {err:.3g} >= {tol} over the batch")
    for i, (a, b) in enumerate(zip(row_splits[:-1], row_splits[1:])):
        ref_i = ref_out[a:b]
        if b > a and ref_i.norm().item() > 0:
            e = rel_err(o[a:b], ref_i)
            if not e < tol:
                raise Mismatch(f"{what}: request {i} (rows {a}:{b}) rel_err {e:.3g} >= {tol}")


def check_lse(what, lse, ref_lse, rel=0.0):
    """rel: a bound relative to |lse| on top of LSE_ATOL, for RoPE only: the rotated q and k are rounded to the
    16-bit dtype before their product (as in FlashInfer), an error that grows with the logits."""
    got = lse.double().cpu()
    if lse.dtype != torch.float32:
        raise Mismatch(f"{what}: lse has dtype {lse.dtype}")
    if torch.isnan(got).any():
        raise Mismatch(f"{what}: lse holds NaN (unwritten?)")
    ninf = torch.isinf(ref_lse.cpu()) & (ref_lse.cpu() < 0)
    if not torch.equal(torch.isinf(got) & (got < 0), ninf) or torch.isinf(got[~ninf]).any():
        raise Mismatch(f"{what}: lse is -inf in {int((torch.isinf(got)).sum())} places, the reference in "
                       f"{int(ninf.sum())}")
    if (~ninf).any():
        ref = ref_lse.cpu()[~ninf]
        d = ((got[~ninf] - ref).abs() - rel * ref.abs()).max().item()
        if not d < LSE_ATOL:
            raise Mismatch(f"{what}: lse off by {d:.3g} (base 2)")


def bits(t):
    """t's bits as integers of its element size (torch.equal on floats calls NaN unequal, and -0 equal to 0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def same_bits(what, a, b):
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        if x is None or y is None:
            raise Mismatch(f"{what}: one call returned an lse, the other none")
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(bits(x), bits(y)):
            nan_same = x.shape == y.shape and torch.equal(torch.isnan(x.float()), torch.isnan(y.float()))
            diff = (x.float() - y.float()).abs().nan_to_num(0).max().item() if x.shape == y.shape else "shape"
            raise Mismatch(f"{what}: not bitwise equal (max diff {diff}, NaN pattern same: {nan_same})")


def poisoned(shape, dtype):
    return on_device(torch.full(shape, float("nan"), dtype=dtype))


def workspace():
    return on_device(torch.empty(1 << 20, dtype=torch.uint8))


def batch_on_device(b):
    """A PagedBatch made on the CPU (and checked against the reference there) moved for the API: q and the cache to
    the device, the index tensors where the case keeps a plan's index tensors."""
    b.q, b.cache = on_device(b.q), on_device(b.cache)
    b.qo_indptr, b.kv_indptr = on_index_device(b.qo_indptr), on_index_device(b.kv_indptr)
    b.kv_indices, b.last_page_len = on_index_device(b.kv_indices), on_index_device(b.last_page_len)
    return b


def as_tuple(r):
    return r if isinstance(r, tuple) else (r, None)


# ---------------------------------------------------------------- drawing

def draw_heads(rng):
    if rng.random() < 0.15:  # MQA
        return rng.choice([2, 4, 8]), 1
    hkv = rng.choice([1, 2])
    return hkv * rng.choice([1, 2, 4]), hkv


def draw_head_dim(rng):
    r = rng.random()
    return 64 if r < 0.9 else 128 if r < 0.97 else 256


@contextlib.contextmanager
def env_switch(name: str, value):
    """The environment variable `name` set to `value` inside the block (None: left as it is), then restored."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def draw_kv_len(rng, page_size, hi):
    """Lengths that stress the page table: 0, 1, exact page multiples and one either side, or any."""
    r = rng.random()
    if r < 0.08:
        return 0
    if r < 0.16:
        return 1
    if r < 0.45:
        m = rng.randint(1, max(1, hi // page_size))
        return max(0, min(hi, m * page_size + rng.choice([-1, 0, 1])))
    return rng.randint(1, hi)


def draw_scales(rng, fp8):
    """(k_scale, v_scale): None, floats, or one-element float32 tensors (fp8 caches nearly always scaled)."""
    r = rng.random()
    if r < (0.1 if fp8 else 0.55):
        return None, None
    ks, vs = round(rng.uniform(0.05, 2.0), 4), round(rng.uniform(0.1, 3.0), 4)
    if rng.random() < 0.3:
        return on_device(torch.tensor([ks], dtype=torch.float32)), on_device(torch.tensor([vs], dtype=torch.float32))
    return ks, vs


def scale_value(s):
    return 1.0 if s is None else float(s.item()) if isinstance(s, torch.Tensor) else float(s)


def fp8_cache(cache, kv_dtype):
    """A random 16-bit cache turned into an fp8 one (spread over the format, not only near 1)."""
    if isinstance(cache, tuple):
        return tuple((c.float() * 4).to(kv_dtype) for c in cache)
    if cache.is_contiguous():
        return (cache.float() * 4).to(kv_dtype)
    # a view into a larger buffer: keep it a view (of an fp8 buffer)
    base = cache._base if cache._base is not None else cache
    big = (base.float() * 4).to(kv_dtype)
    return big.as_strided(cache.shape, cache.stride(), cache.storage_offset())


def widened(cache, dtype):
    if isinstance(cache, tuple):
        return tuple(c.to(dtype) for c in cache)
    if cache.is_contiguous():
        return cache.to(dtype)
    base = cache._base
    return base.to(dtype).as_strided(cache.shape, cache.stride(), cache.storage_offset())


def draw_lengths(rng, batch, page_size, causal, q_hi, kv_hi, budget=200):
    """qo / kv lengths per request; kv >= qo under causal; empty requests likely; total tokens <= budget."""
    while True:
        qo, kv = [], []
        for _ in range(batch):
            q = 0 if (batch > 1 and rng.random() < 0.15) else rng.choice([1, 1, rng.randint(1, q_hi)])
            k = draw_kv_len(rng, page_size, kv_hi)
            if causal:
                k = max(k, q)
            qo.append(q)
            kv.append(k)
        if sum(qo) + sum(kv) <= budget:
            return qo, kv


def mask_blocks(gen, qo, kv, p):
    blocks = [torch.rand(q * k, generator=gen) < p for q, k in zip(qo, kv)]
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)


def mask_indptr(qo, kv):
    ip = [0]
    for q, k in zip(qo, kv):
        ip.append(ip[-1] + q * k)
    return torch.tensor(ip, dtype=I32)


def ragged_from_paged(b, layout, view):
    """The batch's K/V as ragged tensors (NHD [tokens, H, D] or HND [H, tokens, D]); view: strided ones."""
    k, v, kv_indptr = oracle.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, layout)
    k, v, kv_indptr = on_device(k), on_device(v), on_index_device(kv_indptr)
    if view:  # K and V interleaved in one buffer: k = kv[:, 0], strides not the dense ones
        both = torch.stack([k, v], 1)
        k, v = both[:, 0], both[:, 1]
    if layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if not view:
            k, v = k.contiguous(), v.contiguous()
    return k, v, kv_indptr



def strided(x, junk):
    """x's values in a non-contiguous view (every other element of a larger buffer)."""
    return torch.stack([x, torch.full_like(x, junk)], -1)[..., 0]


def q_view(q, num_kv_heads):
    """q as the query part of a fused [tokens, Hq + 2 Hkv, D] QKV projection (a serving engine's usual q)."""
    fused = torch.randn(q.shape[0], q.shape[1] + 2 * num_kv_heads, q.shape[2]).to(q.dtype)
    fused[:, :q.shape[1]] = q
    return fused[:, :q.shape[1]]


def poisoned_view(shape, dtype, view):
    """A NaN-filled caller buffer, or (view) the same shape inside a larger one (row stride past the heads)."""
    if not view:
        return poisoned(shape, dtype)
    big = poisoned((shape[0], shape[1] + 3) + tuple(shape[2:]), dtype)
    return big[:, :shape[1]]


def perturb_batch(rng, b, config, prefix=""):
    """What a server may hand the planner besides tidy tensors: the query a view of a fused QKV tensor,
    kv_indices longer than kv_indptr[-1] (a preallocated buffer), index tensors that are strided views, and
    requests without pages whose last_page_len is not 0 (API.md: such a request has kv_len 0)."""
    draws = dict(q_view=rng.random() < 0.2, idx_tail=rng.random() < 0.2, idx_views=rng.random() < 0.15,
                 empty_last=rng.random() < 0.2)
    config[prefix + "perturb"] = [k for k, v in draws.items() if v]
    if draws["q_view"]:
        b.q = q_view(b.q, 1)
    if draws["idx_tail"]:
        b.kv_indices = torch.cat([b.kv_indices, torch.tensor([2 ** 30, -7, 5], dtype=I32)])
    if draws["empty_last"]:
        pages = (b.kv_indptr[1:] - b.kv_indptr[:-1])
        b.last_page_len = torch.where(pages == 0, torch.randint(0, b.page_size + 1, pages.shape, dtype=I32),
                                      b.last_page_len)
    if draws["idx_views"]:
        b.qo_indptr, b.kv_indptr = strided(b.qo_indptr, 99), strided(b.kv_indptr, -99)
        b.kv_indices, b.last_page_len = strided(b.kv_indices, 2 ** 30), strided(b.last_page_len, 1000)
    return b

# ---------------------------------------------------------------- refusals

EXPECTED_REFUSALS = (
    # the contract's refusals that a drawn configuration may legitimately hit (README "Refused with a sentence")
    "is served on the tensor-core route only",  # RoPE on the bandwidth decode kernel
)


def refused(case, exc, expected_why=None):
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    expected = expected_why is not None or any(s in msg for s in EXPECTED_REFUSALS)
    case.refusals.append((expected, f"{type(exc).__name__}: {msg[:160]}"))
    if not expected:
        raise Mismatch(f"unexpected refusal of a served combination: {type(exc).__name__}: {msg}")


def guarded(case, fn, expected_why=None):
    """fn(), or None where it was refused with a sentence (recorded; unexpected refusals fail the case)."""
    try:
        return fn()
    except (ValueError, NotImplementedError) as exc:
        refused(case, exc, expected_why)
        return None



# ---------------------------------------------------------------- one plan, many kinds of call

def draw_call_kinds(rng, n, paged, fp8):
    """Kinds of run() call (lse or not, scales none / float / tensor, the cache as given or as other tensors with
    other strides, a caller's out or not), in a random order: the plan keeps launch state per kind (launch memo,
    replays, cache views), which must never leak from one kind into another."""
    kinds = []
    for _ in range(n):
        kinds.append(dict(lse=rng.random() < 0.5, scales=rng.choice(["none", "none", "float", "tensor"] if not fp8
                                                                      else ["float", "tensor"]),
                          other_cache=rng.random() < 0.4, out=rng.random() < 0.3,
                          ks=round(rng.uniform(0.2, 2.0), 3), vs=round(rng.uniform(0.2, 2.0), 3)))
    return kinds


def restride(t):
    """t's values with other strides: a dense tensor becomes a view into rows padded past the head dim, a view
    becomes dense."""
    if not t.is_contiguous():
        return t.contiguous()
    padded = t.new_zeros(t.shape[:-1] + (t.shape[-1] + 8,))
    padded[..., :t.shape[-1]] = t
    return padded[..., :t.shape[-1]]


def kind_args(kind, kv, paged, out_shape, out_dtype):
    """(kv, kwargs) of one call kind; kv: the paged cache, or the ragged (k, v) pair."""
    kw = dict(return_lse=kind["lse"])
    if kind["scales"] == "float":
        kw.update(k_scale=kind["ks"], v_scale=kind["vs"])
    elif kind["scales"] == "tensor":
        kw.update(k_scale=on_device(torch.tensor([kind["ks"]])), v_scale=on_device(torch.tensor([kind["vs"]])))
    if kind["out"]:
        kw["out"] = poisoned(out_shape, out_dtype)
    if kind["other_cache"]:  # the same values in other tensors, of other strides where the form allows
        if not paged:
            kv = tuple(restride(t) for t in kv)
        elif isinstance(kv, tuple):
            kv = torch.stack(kv, 1)  # a pair becomes one 5-D tensor
        else:
            kv = tuple(t.contiguous() for t in kv.unbind(1))  # a 5-D tensor becomes a dense pair
    return kv, kw


def call_mix(case, rng, what, shared_run, fresh_run, kv, paged, fp8, out_shape, out_dtype):
    """shared_run(kv, **kw) on one plan against fresh_run(kv, **kw) on a new plan each time: bitwise equal."""
    kinds = draw_call_kinds(rng, rng.randint(2, 5), paged, fp8)
    case.config["call_mix"] = [(k["lse"], k["scales"], k["other_cache"], k["out"]) for k in kinds]
    for i, kind in enumerate(kinds):
        kv_i, kw = kind_args(kind, kv, paged, out_shape, out_dtype)
        got = as_tuple(shared_run(kv_i, **kw))
        kw.pop("out", None)
        want = as_tuple(fresh_run(kv_i, **kw))
        same_bits(f"{what}: call {i} of a mixed sequence {kinds[i]} vs a fresh plan", got, want)

# ---------------------------------------------------------------- prefill

@dataclass
class PrefillDraw:
    api: str
    dtype: torch.dtype
    kv_dtype: torch.dtype
    hq: int
    hkv: int
    head_dim: int
    page_size: int
    layout: str
    form: str
    mask_mode: str
    opts: dict
    k_scale: object
    v_scale: object
    return_lse: bool
    single_lse_fn: bool  # single prefill through single_prefill_with_kv_cache_return_lse
    o_dtype: object  # None: q's dtype
    lse_base: str  # FlashInfer's later run() keywords (paged / ragged): "log2" or "ln"
    lse_layout: str  # "NH" or "HN"
    hot: bool = False  # q scaled 16x (large logits)
    perturbed: dict = field(default_factory=dict)  # what perturb_batch did to each batch

    @property
    def causal(self):
        return self.mask_mode == "causal"


def rope_moderate(rng, k_scale, opts, kv_dtype):
    """Under RoPE the kernels round the rotated q and k to 16 bits before their product (as FlashInfer does): an
    error that grows with the logits, past tests/helpers' tolerances once they reach ~8 (a 4x-spread fp8 cache
    at k_scale ~2, or sm_scale 0.4 at head dim 256; seeds 76 and 20604 of the first runs). RoPE cases keep
    the logits moderate: no sm_scale above 1/sqrt(D), and an fp8 cache's k_scale at most 0.3."""
    opts = {k: v for k, v in opts.items() if k != "sm_scale"}
    if kv_dtype in FP8:
        k_scale = round(rng.uniform(0.05, 0.3), 4)
    return k_scale, opts


def draw_logit_options(rng, p_window, p_soft_cap, p_sm_scale, max_window=20) -> dict:
    """window_left / logits_soft_cap / sm_scale, each with its own probability (0: never drawn, no draw spent)."""
    opts = {}
    if p_window and rng.random() < p_window:
        opts["window_left"] = rng.randint(0, max_window)
    if rng.random() < p_soft_cap:
        opts["logits_soft_cap"] = round(rng.uniform(1.0, 30.0), 3)
    if rng.random() < p_sm_scale:
        opts["sm_scale"] = round(rng.uniform(0.03, 0.4), 4)
    return opts


def draw_prefill(rng) -> PrefillDraw:
    api = rng.choice(["paged", "paged", "ragged", "single"])
    dtype = rng.choice([torch.float16, torch.bfloat16])
    r = rng.random()
    kv_dtype = dtype if r < 0.75 else FP8[0] if r < 0.875 else FP8[1]
    hq, hkv = draw_heads(rng)
    opts = draw_logit_options(rng, 0.3, 0.3, 0.35)
    if rng.random() < 0.08:
        opts.update(pos_encoding_mode="ROPE_LLAMA", rope_theta=rng.choice([1e4, 500.0]),
                    rope_scale=rng.choice([1.0, 2.0]))
    k_scale, v_scale = draw_scales(rng, kv_dtype in FP8)
    if "pos_encoding_mode" in opts:
        k_scale, opts = rope_moderate(rng, k_scale, opts, kv_dtype)
    return PrefillDraw(
        api=api, dtype=dtype, kv_dtype=kv_dtype, hq=hq, hkv=hkv, head_dim=draw_head_dim(rng),
        page_size=rng.choice([1, 3, 16, 32]) if api == "paged" else 1, layout=rng.choice(["NHD", "HND"]),
        form=rng.choice(["5d", "tuple", "view"]) if api == "paged" else rng.choice(["dense", "view"]),
        mask_mode=rng.choices(["none", "causal", "custom", "packed"], [30, 40, 18, 12])[0], opts=opts,
        k_scale=k_scale, v_scale=v_scale, return_lse=rng.random() < 0.75, single_lse_fn=rng.random() < 0.5,
        o_dtype=None if rng.random() < 0.85 else rng.choice([torch.float16, torch.bfloat16]),
        lse_base=rng.choice(["log2"] * 6 + ["ln"]) if api != "single" else "log2",
        lse_layout=rng.choice(["NH"] * 6 + ["HN"]) if api != "single" else "NH",
        hot="pos_encoding_mode" not in opts and rng.random() < 0.1)


def prefill_batch(d: PrefillDraw, rng, gen, qo, kv):
    """A paged batch (ragged / single runs read its K/V gathered) and its custom mask, if any."""
    b = make_paged_batch(gen, qo_lens=qo, kv_lens=kv, num_qo_heads=d.hq, num_kv_heads=d.hkv, head_dim=d.head_dim,
                         page_size=d.page_size, dtype=d.dtype, kv_layout=d.layout, tuple_cache=d.form == "tuple",
                         non_contiguous=d.form == "view")
    if d.kv_dtype in FP8:
        b.cache = fp8_cache(b.cache, d.kv_dtype)
    if d.hot:
        b.q = (b.q.float() * 16).to(d.dtype)  # logits ~16x: peaked rows, LSEs in the hundreds
    perturb_batch(rng, b, d.perturbed)
    mask = mask_blocks(gen, qo, kv, rng.choice([0.2, 0.6, 0.95])) if d.mask_mode in ("custom", "packed") else None
    return batch_on_device(b), mask  # the mask stays on the CPU for the reference; plans take a device copy


def rope_rel(opts, dtype):
    """check_lse's rel for a RoPE run: the rounding of a rotated 16-bit element (half an ulp), else 0."""
    return {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype] if opts.get("pos_encoding_mode") else 0.0


def prefill_reference(d: PrefillDraw, b, mask):
    return oracle.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                 kv_layout=d.layout, causal=d.causal, custom_mask=mask,
                                 k_scale=scale_value(d.k_scale), v_scale=scale_value(d.v_scale), **d.opts)


def prefill_plan_kwargs(d: PrefillDraw, qo, kv, mask, kv_dtype):
    kw = dict(d.opts, causal=d.causal, q_data_type=d.dtype, kv_data_type=kv_dtype, o_data_type=d.o_dtype)
    if d.mask_mode == "custom":
        kw["custom_mask"] = on_device(mask)
    elif d.mask_mode == "packed":
        kw["packed_custom_mask"], _ = serveattn.segment_packbits(on_device(mask), on_device(mask_indptr(qo, kv)),
                                                                 bitorder="little")
    return kw


class PrefillRunner:
    """One entry point planned for one batch: call(kv, out, lse) -> (out, lse). kv: the paged cache, or (k, v)."""

    def __init__(self, case, d: PrefillDraw, backend, b, mask, qo, kv, kv_dtype, plan_extra=None):
        """plan_extra: more plan() arguments (a batch-invariant plan's disable_split_kv)."""
        self.d, self.b, self.backend = d, b, backend
        self.wrapper = None
        self.ok = True
        ws = workspace()
        if d.api == "single":
            self.kv = ragged_from_paged(b, d.layout, d.form == "view")[:2]
            self.single_kw = dict(d.opts, causal=d.causal, kv_layout=d.layout, backend=backend, o_dtype=d.o_dtype)
            if d.mask_mode == "custom":
                self.single_kw["custom_mask"] = on_device(mask.reshape(qo[0], kv[0]))
            elif d.mask_mode == "packed":
                self.single_kw["packed_custom_mask"] = serveattn.packbits(on_device(mask), bitorder="little")
            return
        kw = dict(prefill_plan_kwargs(d, qo, kv, mask, kv_dtype), **(plan_extra or {}))
        if d.api == "ragged":
            k, v, ip = ragged_from_paged(b, d.layout, d.form == "view")
            self.kv = (k, v)
            self.wrapper = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout=d.layout, backend=backend)
            planned = guarded(case, lambda: self.wrapper.plan(b.qo_indptr, ip.to(I32), d.hq, d.hkv, d.head_dim,
                                                              **kw) or True)
        else:
            self.kv = b.cache
            self.wrapper = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=d.layout, backend=backend)
            planned = guarded(case, lambda: self.wrapper.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                                              d.hq, d.hkv, d.head_dim, d.page_size, **kw) or True)
        self.ok = planned is not None
        if self.ok and backend == "auto":
            case.config["route"] = self.wrapper.backend  # where "auto" sent the plan (on a GPU: triton, cudnn, torch)

    def __call__(self, kv=None, out=None, lse=None):
        d, b = self.d, self.b
        kv = self.kv if kv is None else kv
        scales = dict(k_scale=d.k_scale, v_scale=d.v_scale)
        if d.api == "single":
            if d.return_lse and d.single_lse_fn:
                return serveattn.single_prefill_with_kv_cache_return_lse(b.q, *kv, **scales, **self.single_kw)
            return as_tuple(serveattn.single_prefill_with_kv_cache(b.q, *kv, **scales, return_lse=d.return_lse,
                                                                   **self.single_kw))
        args = kv if d.api == "ragged" else (kv,)
        if not d.return_lse or (d.lse_base, d.lse_layout) == ("log2", "NH"):
            return as_tuple(self.wrapper.run(b.q, *args, **scales, out=out, lse=lse, return_lse=d.return_lse))
        # FlashInfer's lse_base / lse_layout: turned back into base 2 [rows, heads] for the checks
        hn = d.lse_layout == "HN"
        given = None if lse is None else poisoned(lse.t().shape, torch.float32) if hn else lse
        out, got = self.wrapper.run(b.q, *args, **scales, out=out, lse=given, return_lse=True,
                                    lse_base=d.lse_base, lse_layout=d.lse_layout)
        if given is not None and got is not given:
            raise Mismatch(f"lse_base={d.lse_base} lse_layout={d.lse_layout}: run() did not return the caller's lse")
        nh = got.t() if hn else got
        nh = nh / math.log(2.0) if d.lse_base == "ln" else nh.clone()
        if lse is not None:
            lse.copy_(nh)
            return out, lse
        return out, nh


def prefill_case(case: Case, rng: random.Random, gen: torch.Generator):
    d = draw_prefill(rng)
    batch = 1 if d.api == "single" else rng.randint(1, 5)
    long = rng.random() < 0.2  # requests of several query tiles (the interpreter's tiles are at most 64 rows)
    q_hi, kv_hi = (scaled(70), scaled(160)) if long else (scaled(12), scaled(48))
    budget = max(40, scaled(480 if long else 240) // (d.hq * d.head_dim // 64))
    len_page = d.page_size if d.api == "paged" else rng.choice([3, 16])
    qo, kv = draw_lengths(rng, batch, len_page, d.causal, q_hi, kv_hi, budget)
    caller_bufs = d.api != "single" and rng.random() < 0.4
    replan = d.api != "single" and rng.random() < 0.35
    case.config.update(api=d.api, dtype=str(d.dtype)[6:], kv=str(d.kv_dtype)[6:], heads=(d.hq, d.hkv), d=d.head_dim,
                       page=d.page_size, layout=d.layout, form=d.form, mask=d.mask_mode, qo=qo, kv_lens=kv,
                       k_scale=None if d.k_scale is None else scale_value(d.k_scale),
                       v_scale=None if d.v_scale is None else scale_value(d.v_scale),
                       scale_tensor=isinstance(d.k_scale, torch.Tensor), lse=d.return_lse, bufs=caller_bufs,
                       replan=replan, o=None if d.o_dtype is None else str(d.o_dtype)[6:],
                       lse_form=(d.lse_base, d.lse_layout), long=long, hot=d.hot, **d.opts)
    if d.api == "paged" and rng.random() < 0.15:
        return prefill_graph(case, rng, gen, d, q_hi, kv_hi, budget)
    b, mask = prefill_batch(d, rng, gen, qo, kv)
    case.config.update(d.perturbed)
    out_dtype = d.o_dtype or d.dtype
    tol_dtype = torch.bfloat16 if torch.bfloat16 in (d.dtype, out_dtype) else torch.float16
    ref_out, ref_lse = prefill_reference(d, b, mask)
    splits = b.qo_indptr.tolist()
    for backend in ("triton", "auto"):
        what = f"{d.api}/{backend}"
        run = PrefillRunner(case, d, backend, b, mask, qo, kv, d.kv_dtype)
        if not run.ok:
            continue
        view = rng.random() < 0.3
        out_buf = poisoned_view(b.q.shape, out_dtype, view) if caller_bufs else None
        lse_buf = poisoned_view(b.q.shape[:2], torch.float32, view) if caller_bufs and d.return_lse else None
        res = guarded(case, lambda: run(None, out_buf, lse_buf))
        if res is None:
            continue
        out, lse = res
        if out_buf is not None and (out is not out_buf or (lse_buf is not None and lse is not lse_buf)):
            raise Mismatch(f"{what}: run() did not return the caller's out / lse")
        check_close(case, what, out, ref_out, ref_lse, splits, out_dtype, tol_dtype)
        if d.return_lse:
            check_lse(what, lse, ref_lse, rope_rel(d.opts, d.dtype))
        if backend == "auto":
            continue  # the torch path; bitwise promises below are the kernels'
        same_bits(f"{what}: second run", (out, lse), run())
        if d.api == "paged" and rng.random() < 0.1:  # README: accepted, computed in float32 as without it
            case.config["fp16_qk_reduction"] = True
            w16 = serveattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), d.layout,
                                                                backend=backend)
            w16.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, d.hq, d.hkv, d.head_dim, d.page_size,
                     use_fp16_qk_reduction=True, **prefill_plan_kwargs(d, qo, kv, mask, d.kv_dtype))
            # both in base 2, [rows, heads]: (out, lse) may have come back as ln / HN, turned back with a rounding
            plain = run.wrapper.run(b.q, run.kv, k_scale=d.k_scale, v_scale=d.v_scale, return_lse=d.return_lse)
            same_bits(f"{what}: use_fp16_qk_reduction=True", as_tuple(plain),
                      as_tuple(w16.run(b.q, run.kv, k_scale=d.k_scale, v_scale=d.v_scale, return_lse=d.return_lse)))
        if d.kv_dtype in FP8:  # the defining test of an fp8 cache: bitwise its dequantized copy, same scales
            wide = PrefillRunner(case, d, backend, b, mask, qo, kv, d.dtype)
            wide_kv = widened(run.kv, d.dtype) if d.api == "paged" else tuple(t.to(d.dtype) for t in run.kv)
            same_bits(f"{what}: fp8 cache vs cache.to({str(d.dtype)[6:]})", (out, lse), wide(wide_kv))
        if d.api != "single" and rng.random() < 0.2:
            prefill_forward(case, rng, d, run, b, mask, qo, kv, (out, lse), what)
        if d.api != "single" and len(qo) > 1 and rng.random() < 0.5:
            prefill_alone(case, rng, d, b, mask, qo, kv, (out, lse), what, run.wrapper)
        if d.api != "single" and rng.random() < 0.6:
            ragged = d.api == "ragged"

            def fresh(kv_, **kw):
                return PrefillRunner(case, d, backend, b, mask, qo, kv, d.kv_dtype).wrapper.run(
                    b.q, *(kv_ if ragged else (kv_,)), **kw)
            call_mix(case, rng, what, lambda kv_, **kw: run.wrapper.run(b.q, *(kv_ if ragged else (kv_,)), **kw),
                     fresh, run.kv, not ragged, d.kv_dtype in FP8, b.q.shape, d.o_dtype or d.dtype)
        if replan:
            prefill_replan(case, d, rng, gen, run, budget, (out, lse), what, qo, kv, b, mask, q_hi, kv_hi)


def draw_forward_settings(rng):
    """FlashInfer's deprecated forward() arguments (defaults included: they all apply to the call)."""
    return draw_logit_options(rng, 0.5, 0.5, 0.5)


def prefill_forward(case, rng, d: PrefillDraw, run, b, mask, qo, kv, first, what):
    """forward() with other settings than the plan's: the reference under those settings; then run() again gives
    the plan's first bits (forward's settings hold for its call only)."""
    settings = draw_forward_settings(rng)
    causal = rng.random() < 0.5 and all(k >= q for q, k in zip(qo, kv))
    case.config["forward"] = dict(settings, causal=causal)
    args = run.kv if d.api == "ragged" else (run.kv,)
    kw = dict(k_scale=d.k_scale, v_scale=d.v_scale) if d.api == "paged" else {}
    if d.api == "ragged" and (d.k_scale is not None or d.v_scale is not None):
        return  # FlashInfer's ragged forward() takes no scales
    out, lse = run.wrapper.forward(b.q, *args, causal=causal, return_lse=True, **settings, **kw)
    ref_out, ref_lse = oracle.batch_paged(
        b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, kv_layout=d.layout,
        causal=causal, custom_mask=mask, k_scale=scale_value(d.k_scale), v_scale=scale_value(d.v_scale),
        window_left=settings.get("window_left", -1), logits_soft_cap=settings.get("logits_soft_cap"),
        sm_scale=settings.get("sm_scale"))
    out_dtype = d.o_dtype or d.dtype
    check_close(case, f"{what}: forward({settings}, causal={causal})", out, ref_out, ref_lse,
                b.qo_indptr.tolist(), out_dtype, torch.bfloat16 if torch.bfloat16 in (d.dtype, out_dtype)
                else torch.float16)
    check_lse(f"{what}: forward()", lse, ref_lse)
    same_bits(f"{what}: run() after forward()", first, run())


def tiles_of(wrapper):
    """The tile configuration a planned wrapper launches with (prefill, or decode on either route), and its split-KV
    chunk (None: unsplit): a request alone may be split where the batch fills the GPU unsplit (README, split-KV)."""
    plan = wrapper._prefill._plan if getattr(wrapper, "_prefill", None) is not None else wrapper._plan
    chunk = plan.chunk if hasattr(plan, "chunk") else plan.split_chunk
    return (plan.tiles.block_m, plan.tiles.block_n, plan.tiles.num_warps, chunk)


def same_alone(case, what, tiles_batch, tiles_alone, alone, in_batch, tol_dtype):
    """Bitwise where both plans launch the same tiles and split-KV chunk (tiles_of); a default plan splits by the
    batch's size, so there a request alone is close, not bitwise. The prefill kernel's BLOCK_M follows the batch's
    longest request, and under the interpreter tl.dot is a float32 numpy matmul (OpenBLAS), whose rows depend on the
    matrix's row count: there a request alone may differ in the last bit from its rows in the batch (decode seed
    1601700), an artifact of the interpreter that only a GPU run can settle; then close, not bitwise."""
    if tiles_batch == tiles_alone:
        return same_bits(what, alone, in_batch)
    case.config["alone_tiles"] = (tiles_batch, tiles_alone)
    e = rel_err(alone[0], in_batch[0].double())
    if not e < tolerance(tol_dtype):
        raise Mismatch(f"{what} (tiles {tiles_batch} vs {tiles_alone}): rel_err {e:.3g}")
    if alone[1] is not None and (alone[1] - in_batch[1]).abs().nan_to_num(0).max().item() >= LSE_ATOL:
        raise Mismatch(f"{what} (tiles {tiles_batch} vs {tiles_alone}): lse differs")


def prefill_alone(case, rng, d: PrefillDraw, b, mask, qo, kv, batch_result, what, batch_wrapper):
    """README: a request planned alone gives, bitwise, its rows of the batch's run where both plans launch the same
    tiles and split-KV chunk (same_alone), and under a batch-invariant plan always."""
    i = rng.choice([j for j, n in enumerate(qo) if n] or [0])
    case.config["alone"] = i
    q0, q1 = int(b.qo_indptr[i]), int(b.qo_indptr[i + 1])
    p0, p1 = int(b.kv_indptr[i]), int(b.kv_indptr[i + 1])
    m0 = sum(a * c for a, c in zip(qo[:i], kv[:i]))
    one = make_paged_batch(torch.Generator().manual_seed(0), qo_lens=[0], kv_lens=[0], num_qo_heads=d.hq,
                           num_kv_heads=d.hkv, head_dim=d.head_dim, page_size=d.page_size, dtype=d.dtype)
    one.q, one.cache = b.q[q0:q1], b.cache
    one.qo_indptr = on_index_device(torch.tensor([0, q1 - q0], dtype=I32))
    one.kv_indptr = on_index_device(torch.tensor([0, p1 - p0], dtype=I32))
    one.kv_indices = b.kv_indices[p0:p1].clone()
    one.last_page_len = b.last_page_len[i:i + 1].clone()
    one_mask = None if mask is None else mask[m0:m0 + qo[i] * kv[i]]
    alone = PrefillRunner(case, d, "triton", one, one_mask, [qo[i]], [kv[i]], d.kv_dtype)
    out, lse = alone()
    want_out, want_lse = batch_result
    out_dtype = d.o_dtype or d.dtype
    same_alone(case, f"{what}: request {i} planned alone vs its rows in the batch", tiles_of(batch_wrapper),
               tiles_of(alone.wrapper), (out, lse), (want_out[q0:q1], None if want_lse is None else want_lse[q0:q1]),
               torch.bfloat16 if torch.bfloat16 in (d.dtype, out_dtype) else torch.float16)
    # batch-invariant plans (vLLM's mode passes disable_split_kv=True; auto must not route by the batch either):
    # bitwise, whatever the tiles above. No random draw here: a seed keeps its case.
    invariant = dict(disable_split_kv=True)
    batch_run = PrefillRunner(case, d, "auto", b, mask, qo, kv, d.kv_dtype, plan_extra=invariant)
    alone_run = PrefillRunner(case, d, "auto", one, one_mask, [qo[i]], [kv[i]], d.kv_dtype, plan_extra=invariant)
    if batch_run.ok and alone_run.ok:
        got_out, got_lse = batch_run()
        same_bits(f"{what}: batch-invariant plan, request {i} alone vs its rows in the batch", alone_run(),
                  (got_out[q0:q1], None if got_lse is None else got_lse[q0:q1]))


def prefill_replan(case, d, rng, gen, run, budget, first, what, qo, kv, b, mask, q_hi, kv_hi):
    """The same wrapper re-planned for another batch (checked), then planned back: the first bits again."""
    qo2, kv2 = draw_lengths(rng, rng.randint(1, 5), d.page_size if d.api == "paged" else 16, d.causal, q_hi, kv_hi,
                            budget)
    case.config["replan_to"] = (qo2, kv2)
    b2, mask2 = prefill_batch(d, rng, gen, qo2, kv2)
    case.config["replan_perturb"] = d.perturbed["perturb"]
    w = run.wrapper

    def plan(bb, m, q_lens, k_lens):
        kw = prefill_plan_kwargs(d, q_lens, k_lens, m, d.kv_dtype)
        if d.api == "paged":
            w.plan(bb.qo_indptr, bb.kv_indptr, bb.kv_indices, bb.last_page_len, d.hq, d.hkv, d.head_dim,
                   d.page_size, **kw)
            return bb.cache
        k, v, ip = ragged_from_paged(bb, d.layout, d.form == "view")
        w.plan(bb.qo_indptr, ip.to(I32), d.hq, d.hkv, d.head_dim, **kw)
        return (k, v)

    kv2_args = plan(b2, mask2, qo2, kv2)
    scales = dict(k_scale=d.k_scale, v_scale=d.v_scale)
    args = kv2_args if d.api == "ragged" else (kv2_args,)
    out2, lse2 = w.run(b2.q, *args, **scales, return_lse=True)
    r2_out, r2_lse = prefill_reference(d, b2, mask2)
    out_dtype = d.o_dtype or d.dtype
    check_close(case, f"{what}: re-planned", out2, r2_out, r2_lse, b2.qo_indptr.tolist(), out_dtype,
                torch.bfloat16 if torch.bfloat16 in (d.dtype, out_dtype) else torch.float16)
    check_lse(f"{what}: re-planned", lse2, r2_lse, rope_rel(d.opts, d.dtype))
    plan(b, mask, qo, kv)
    same_bits(f"{what}: planned back to the first batch", first, run())



# ---------------------------------------------------------------- use_cuda_graph=True (no capture on CPU)

def graph_sequence(case, what, plan_a, run_a, ref_a, plan_b, run_b, ref_b, out_dtype, tol_dtype, rope_rel_):
    """Fixed-buffer planning: plan A, run; re-plan B within the buffers, run; plan A again: A's first bits.
    plan_x() -> bool (False: refused, recorded); run_x() -> (out, lse, row splits)."""
    if not plan_a():
        return
    out_a, lse_a, splits_a = run_a()
    check_close(case, f"{what}: graph A", out_a, ref_a[0], ref_a[1], splits_a, out_dtype, tol_dtype)
    check_lse(f"{what}: graph A", lse_a, ref_a[1], rope_rel_)
    if not plan_b():
        return
    out_b, lse_b, splits_b = run_b()
    check_close(case, f"{what}: graph re-plan B", out_b, ref_b[0], ref_b[1], splits_b, out_dtype, tol_dtype)
    check_lse(f"{what}: graph re-plan B", lse_b, ref_b[1], rope_rel_)
    if not plan_a():
        return
    again = run_a()
    same_bits(f"{what}: graph A planned again", (out_a, lse_a), again[:2])


def prefill_graph(case, rng, gen, d: PrefillDraw, q_hi, kv_hi, budget):
    """The paged wrapper with use_cuda_graph=True: buffers sized for both batches, the larger query first (the
    captured q holds the first run's rows)."""
    batches = []
    for _ in range(2):
        qo, kv = draw_lengths(rng, rng.randint(1, 5), d.page_size, d.causal, q_hi, kv_hi, budget)
        b, mask = prefill_batch(d, rng, gen, qo, kv)
        batches.append((sum(qo), qo, kv, b, mask))
    batches.sort(key=lambda t: -t[0])
    case.config["graph"] = [(qo, kv) for _, qo, kv, _, _ in batches]
    n_req = max(len(t[1]) for t in batches)
    n_idx = max(int(t[3].kv_indices.numel()) for t in batches)
    mask_bytes = max(sum((q * k + 7) // 8 for q, k in zip(t[1], t[2])) for t in batches)
    i32 = dict(dtype=I32)
    bufs = dict(qo_indptr_buf=torch.empty(n_req + 1, **i32), paged_kv_indptr_buf=torch.empty(n_req + 1, **i32),
                paged_kv_indices_buf=torch.empty(n_idx + 2, **i32),
                paged_kv_last_page_len_buf=torch.empty(n_req, **i32))
    if d.mask_mode in ("custom", "packed"):
        bufs.update(custom_mask_buf=torch.empty(mask_bytes + 1, dtype=torch.uint8),
                    mask_indptr_buf=torch.empty(n_req + 1, **i32))
    bufs = {name: on_device(buf) for name, buf in bufs.items()}  # a graph's buffers live on the device
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), d.layout,
                                                      use_cuda_graph=True, backend="triton", **bufs)
    out_dtype = d.o_dtype or d.dtype

    def planner(t):
        _, qo, kv, b, mask = t
        kw = prefill_plan_kwargs(d, qo, kv, mask, d.kv_dtype)
        return lambda: guarded(case, lambda: w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, d.hq,
                                                    d.hkv, d.head_dim, d.page_size, **kw) or True) is not None

    def runner(t):
        b = t[3]

        def run():
            out = poisoned(b.q.shape, out_dtype)
            lse = poisoned(b.q.shape[:2], torch.float32)
            w.run(b.q, b.cache, k_scale=d.k_scale, v_scale=d.v_scale, out=out, lse=lse, return_lse=True)
            return out, lse, b.qo_indptr.tolist()
        return run

    refs = [prefill_reference(d, t[3], t[4]) for t in batches]
    graph_sequence(case, "paged/triton graph", planner(batches[0]), runner(batches[0]), refs[0], planner(batches[1]),
                   runner(batches[1]), refs[1], out_dtype,
                   torch.bfloat16 if torch.bfloat16 in (d.dtype, out_dtype) else torch.float16,
                   rope_rel(d.opts, d.dtype))

# ---------------------------------------------------------------- decode

def tree_mask(trees, kv_lens):
    """The dense custom mask of tree verify, built here from the parent arrays (not by the library): a node sees
    the whole prefix, its ancestors and itself."""
    blocks = []
    for parents, kv in zip(trees, kv_lens):
        n = len(parents)
        m = torch.zeros(n, kv, dtype=torch.bool)
        m[:, :kv - n] = True
        for t, par in enumerate(parents):
            if par >= 0:
                m[t, kv - n:] = m[par, kv - n:]
            m[t, kv - n + t] = True
        blocks.append(m.reshape(-1))
    return torch.cat(blocks)


def decode_case(case: Case, rng: random.Random, gen: torch.Generator):
    api = "single" if rng.random() < 0.2 else "batch"
    dtype = rng.choice([torch.float16, torch.bfloat16])
    r = rng.random()
    kv_dtype = dtype if r < 0.75 else FP8[0] if r < 0.875 else FP8[1]
    hq, hkv = draw_heads(rng)
    head_dim = draw_head_dim(rng)
    page_size = rng.choice([1, 3, 16, 32]) if api == "batch" else 1
    layout = rng.choice(["NHD", "HND"])
    form = rng.choice(["5d", "tuple", "view"]) if api == "batch" else rng.choice(["dense", "view"])
    use_tc = rng.random() < 0.4
    q_len = 1 if api == "single" or rng.random() < 0.65 else rng.randint(2, 4)
    split = rng.choice(["default", "disable", "fixed"])
    split_kw = {"disable": {"disable_split_kv": True}, "default": {},
                # fixed_split_size counts pages: about 1-64 keys a chunk, as before it did (the same draws)
                "fixed": {"fixed_split_size": max(1, rng.choice([1, 5, 16, 32, 64]) // page_size)}}[split] \
        if api == "batch" else {}
    opts = draw_logit_options(rng, 0.3, 0.3, 0.35, max_window=30)
    rope = rng.random() < (0.08 if use_tc else 0.03)  # on the bandwidth kernel: a refusal the README lists
    if rope:
        opts.update(pos_encoding_mode="ROPE_LLAMA", rope_theta=rng.choice([1e4, 500.0]),
                    rope_scale=rng.choice([1.0, 2.0]))
    o_dtype = None if api == "single" or rng.random() < 0.8 else rng.choice([torch.float16, torch.bfloat16])
    k_scale, v_scale = draw_scales(rng, kv_dtype in FP8)
    if rope:
        k_scale, opts = rope_moderate(rng, k_scale, opts, kv_dtype)
    return_lse = rng.random() < 0.75
    caller_bufs = api == "batch" and rng.random() < 0.4
    replan = api == "batch" and rng.random() < 0.35
    batch = 1 if api == "single" else rng.randint(1, 5)
    budget = max(60, scaled(320) // (hq * head_dim // 64))
    # tree verify (README: served on the tensor-core route); a window has no position for a tree node: not drawn
    tree = api == "batch" and q_len == 1 and not rope and "window_left" not in opts and rng.random() < 0.2
    hot = not rope and rng.random() < 0.1

    long = rng.random() < 0.15  # many split chunks
    kv_hi = scaled(400 if long else 80)
    # SERVEATTN_DECODE_MIN_CHUNK lowered at plan time, so that plan()'s own splits (a full GPU's ragged split
    # included) happen at these lengths; drawn from a generator of its own: every earlier seed draws as before
    side = random.Random(f"decode-min-chunk-{case.seed}")
    min_chunk = side.choice([16, 64]) if split == "default" and api == "batch" and side.random() < 0.5 else None
    # and, eager plans only, SERVEATTN_DECODE_PROGRAMS_PER_SM at half the batch's programs: on the interpreter's 2
    # SMs the batch then fills "the GPU" and a request longer than the mean is cut (_ragged_chunk)
    per_sm = max(1, batch * hkv // 2) if min_chunk is not None and side.random() < 0.6 else None
    if per_sm is not None:  # lengths past the kernel's key block, where a cut can fall
        kv_hi, budget = scaled(400), max(budget, scaled(900))
    graph_plans = []  # set when the case takes the CUDA-graph path (the grid's size is fixed at capture)
    budget = budget * 3 if long else budget

    def lengths(n):
        while True:
            kv = [max(q_len, draw_kv_len(rng, page_size, kv_hi)) if q_len > 1 else draw_kv_len(rng, page_size, kv_hi)
                  for _ in range(n)]
            if sum(kv) <= budget:
                return kv
    kv = lengths(batch)
    out_dtype = o_dtype or dtype
    tol_dtype = torch.bfloat16 if torch.bfloat16 in (dtype, out_dtype) else torch.float16
    case.config.update(api=api, dtype=str(dtype)[6:], kv=str(kv_dtype)[6:], heads=(hq, hkv), d=head_dim,
                       page=page_size, layout=layout, form=form, tc=use_tc, q_len=q_len, split=split_kw,
                       kv_lens=kv, o=None if o_dtype is None else str(o_dtype)[6:],
                       k_scale=None if k_scale is None else scale_value(k_scale),
                       v_scale=None if v_scale is None else scale_value(v_scale),
                       scale_tensor=isinstance(k_scale, torch.Tensor), lse=return_lse, bufs=caller_bufs,
                       replan=replan, tree=tree, hot=hot, **opts)
    if min_chunk is not None:
        case.config.update(min_chunk=min_chunk, programs_per_sm=per_sm)
    rope_refusal = "RoPE on the bandwidth decode kernel (README: 'no')" if rope and not use_tc else None

    def make(kv_lens):
        trees = None
        qo_lens = [q_len] * len(kv_lens)
        if tree:  # node t hangs off the prefix (-1) or an earlier node; the nodes are the last KV positions
            trees = [[rng.randint(-1, t - 1) for t in range(rng.randint(1, 6))] for _ in kv_lens]
            qo_lens = [len(t) for t in trees]
            kv_lens[:] = [max(k, n) for k, n in zip(kv_lens, qo_lens)]
            case.config["replan_trees" if "trees" in case.config else "trees"] = trees
        b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=hq, num_kv_heads=hkv,
                             head_dim=head_dim, page_size=page_size, dtype=dtype, kv_layout=layout,
                             tuple_cache=form == "tuple", non_contiguous=form == "view")
        b.trees = trees
        if kv_dtype in FP8:
            b.cache = fp8_cache(b.cache, kv_dtype)
        if hot:
            b.q = (b.q.float() * 16).to(dtype)  # logits ~16x: peaked rows, LSEs in the hundreds
        perturb_batch(rng, b, case.config, "replan_" if "perturb" in case.config else "")
        ref = oracle.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                    kv_layout=layout, causal=q_len > 1, k_scale=scale_value(k_scale),
                                    v_scale=scale_value(v_scale),
                                    custom_mask=tree_mask(trees, kv_lens) if tree else None, **opts)
        return batch_on_device(b), ref

    def planned(backend, b, plan_kv_dtype, wrapper=None):
        w = wrapper or serveattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), layout,
                                                                    use_tensor_cores=use_tc, backend=backend)
        kw = dict(opts, q_data_type=dtype, kv_data_type=plan_kv_dtype, o_data_type=o_dtype, **split_kw)
        if q_len > 1:
            kw["q_len_per_req"] = q_len
        if b.trees is not None:
            kw["tree_parents"] = b.trees
        with env_switch("SERVEATTN_DECODE_MIN_CHUNK", min_chunk), \
                env_switch("SERVEATTN_DECODE_PROGRAMS_PER_SM", None if graph_plans else per_sm):
            ok = guarded(case, lambda: w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, head_dim,
                                              page_size, **kw) or True,
                         rope_refusal if backend == "triton" else None)
        if ok and backend == "auto":
            case.config["route"] = w.backend  # where "auto" sent the plan (on a GPU: triton, cudnn, torch)
        return w if ok else None

    def single(backend, b, kv_pair):
        k, v = kv_pair
        return as_tuple(serveattn.single_decode_with_kv_cache(
            b.q[0], k, v, kv_layout=layout, use_tensor_cores=use_tc, k_scale=k_scale, v_scale=v_scale,
            return_lse=return_lse, backend=backend, **opts))

    if api == "batch" and rng.random() < 0.15:  # use_cuda_graph=True: fixed buffers, a persistent grid
        graph_plans.append(True)
        first, second = (make(kv), make(lengths(rng.randint(1, 5))))
        first, second = sorted([first, second], key=lambda t: -t[0].q.shape[0])  # the captured q: the larger
        case.config["graph"] = [t[0].kv_indptr.numel() - 1 for t in (first, second)]
        cap = max(t[0].kv_indptr.numel() - 1 for t in (first, second))
        n_idx = max(t[0].kv_indices.numel() for t in (first, second))
        graph_bufs = on_device((torch.empty(cap + 1, dtype=I32), torch.empty(n_idx + 2, dtype=I32),
                                torch.empty(cap, dtype=I32)))  # a graph's buffers live on the device
        if rng.random() < 0.3:  # FlashInfer's class for it (its backend: auto, the torch path on CPU)
            case.config["graph_class"] = True
            w = serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                workspace(), *graph_bufs, kv_layout=layout, use_tensor_cores=use_tc)
        else:
            w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
                workspace(), layout, use_cuda_graph=True, use_tensor_cores=use_tc,
                paged_kv_indptr_buffer=graph_bufs[0], paged_kv_indices_buffer=graph_bufs[1],
                paged_kv_last_page_len_buffer=graph_bufs[2], backend="triton")

        def planner(b):
            return lambda: planned("triton", b, kv_dtype, w) is not None

        def runner(b):
            def run():
                out, lse = poisoned(b.q.shape, out_dtype), poisoned(b.q.shape[:2], torch.float32)
                w.run(b.q, b.cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=True)
                return out, lse, b.qo_indptr.tolist()
            return run
        return graph_sequence(case, "decode/triton graph", planner(first[0]), runner(first[0]), first[1],
                              planner(second[0]), runner(second[0]), second[1], out_dtype, tol_dtype,
                              rope_rel(opts, dtype))
    b, (ref_out, ref_lse) = make(kv)
    splits = b.qo_indptr.tolist()
    for backend in ("triton", "auto"):
        what = f"decode-{api}/{backend}"
        if api == "single":
            kv_pair = ragged_from_paged(b, layout, form == "view")[:2]
            res = guarded(case, lambda: single(backend, b, kv_pair), rope_refusal if backend == "triton" else None)
            if res is None:
                continue
            out, lse = res
            out, lse = out[None], (lse[None] if lse is not None else None)
        else:
            w = planned(backend, b, kv_dtype)
            if w is None:
                continue
            view = rng.random() < 0.3
            out_buf = poisoned_view(b.q.shape, out_dtype, view) if caller_bufs else None
            lse_buf = poisoned_view(b.q.shape[:2], torch.float32, view) if caller_bufs and return_lse else None
            out, lse = as_tuple(w.run(b.q, b.cache, k_scale=k_scale, v_scale=v_scale, out=out_buf, lse=lse_buf,
                                      return_lse=return_lse))
            if out_buf is not None and (out is not out_buf or (lse_buf is not None and lse is not lse_buf)):
                raise Mismatch(f"{what}: run() did not return the caller's out / lse")
        check_close(case, what, out, ref_out, ref_lse, splits, out_dtype, tol_dtype)
        if return_lse:
            check_lse(what, lse, ref_lse, rope_rel(opts, dtype))
        if backend == "auto":
            continue
        if api == "single":
            again = single(backend, b, kv_pair)
            same_bits(f"{what}: second run", (out[0], None if lse is None else lse[0]), again)
            if kv_dtype in FP8:
                wide = single(backend, b, tuple(t.to(dtype) for t in kv_pair))
                same_bits(f"{what}: fp8 cache vs cache.to({str(dtype)[6:]})", (out[0], lse[0] if return_lse
                                                                               else None), wide)
            continue
        same_bits(f"{what}: second run", (out, lse), as_tuple(w.run(b.q, b.cache, k_scale=k_scale, v_scale=v_scale,
                                                                    return_lse=return_lse)))
        if kv_dtype in FP8:
            ww = planned(backend, b, dtype)
            wide = as_tuple(ww.run(b.q, widened(b.cache, dtype), k_scale=k_scale, v_scale=v_scale,
                                   return_lse=return_lse))
            same_bits(f"{what}: fp8 cache vs cache.to({str(dtype)[6:]})", (out, lse), wide)
        if len(kv) > 1 and (split_kw or use_tc) and rng.random() < 0.5:
            # fixed or no KV split: a request's rows do not depend on the batch (what vLLM passes fixed_split_size /
            # disable_split_kv for); on the tensor-core route by default, bitwise where both plans split alike
            # (same_alone)
            i = rng.randrange(len(kv))
            case.config["alone"] = i
            p0, p1 = int(b.kv_indptr[i]), int(b.kv_indptr[i + 1])
            one = make_paged_batch(torch.Generator().manual_seed(0), qo_lens=[0], kv_lens=[0], num_qo_heads=hq,
                                   num_kv_heads=hkv, head_dim=head_dim, page_size=page_size, dtype=dtype)
            rows = slice(int(b.qo_indptr[i]), int(b.qo_indptr[i + 1]))
            one.q, one.cache = b.q[rows], b.cache
            one.kv_indptr = on_index_device(torch.tensor([0, p1 - p0], dtype=I32))
            one.kv_indices, one.last_page_len = b.kv_indices[p0:p1].clone(), b.last_page_len[i:i + 1].clone()
            one.trees = None if b.trees is None else b.trees[i:i + 1]
            w_one = planned(backend, one, kv_dtype)
            alone = as_tuple(w_one.run(one.q, b.cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse))
            same_alone(case, f"{what}: request {i} planned alone vs its rows in the batch", tiles_of(w),
                       tiles_of(w_one), alone, (out[rows], None if lse is None else lse[rows]), tol_dtype)
        if rng.random() < 0.4:
            call_mix(case, rng, what, lambda kv_, **kw: w.run(b.q, kv_, **kw),
                     lambda kv_, **kw: planned(backend, b, kv_dtype).run(b.q, kv_, **kw), b.cache, True,
                     kv_dtype in FP8, b.q.shape, out_dtype)
        if replan:
            kv2 = lengths(rng.randint(1, 5))
            case.config["replan_to"] = kv2
            b2, (r2_out, r2_lse) = make(kv2)
            planned(backend, b2, kv_dtype, w)
            out2, lse2 = w.run(b2.q, b2.cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)
            check_close(case, f"{what}: re-planned", out2, r2_out, r2_lse, b2.qo_indptr.tolist(), out_dtype,
                        tol_dtype)
            check_lse(f"{what}: re-planned", lse2, r2_lse, rope_rel(opts, dtype))
            planned(backend, b, kv_dtype, w)
            same_bits(f"{what}: planned back to the first batch", (out, lse),
                      as_tuple(w.run(b.q, b.cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)))


# ---------------------------------------------------------------- cascade and merge

def cascade_case(case: Case, rng: random.Random, gen: torch.Generator):
    if rng.random() < 0.35:
        return merge_case(case, rng, gen)
    dtype = rng.choice([torch.float16, torch.bfloat16])
    r = rng.random()
    kv_dtype = dtype if r < 0.8 else FP8[0] if r < 0.9 else FP8[1]
    hq, hkv = draw_heads(rng)
    head_dim = draw_head_dim(rng)
    page_size = rng.choice([1, 3, 16, 32])
    layout = rng.choice(["NHD", "HND"])
    form = rng.choice(["5d", "tuple", "view"])
    causal = rng.random() < 0.5
    num_levels = rng.choice([1, 2, 2, 3])
    # per-logit options compose over levels; a window (positions) does not, and is not drawn here
    opts = draw_logit_options(rng, 0, 0.3, 0.35)
    k_scale, v_scale = draw_scales(rng, kv_dtype in FP8)
    return_lse = rng.random() < 0.75
    caller_bufs = rng.random() < 0.4
    budget = max(60, scaled(300) // (hq * head_dim // 64))

    def structure(batch):
        """qo lens, per-level groups (consecutive requests sharing a segment) and segment lengths."""
        while True:
            qo = [0 if (batch > 1 and rng.random() < 0.15) else rng.randint(1, scaled(8)) for _ in range(batch)]
            groups, lens = [], []
            for lv in range(num_levels):
                if lv == num_levels - 1:
                    g = [1] * batch
                else:
                    g, left = [], batch
                    while left:
                        g.append(rng.randint(1, left))
                        left -= g[-1]
                groups.append(g)
                seg = [draw_kv_len(rng, page_size, scaled(40)) for _ in g]
                if lv == num_levels - 1 and causal:
                    seg = [max(s, q) for s, q in zip(seg, qo)]  # causal applies to the last level
                lens.append(seg)
            if sum(qo) + sum(map(sum, lens)) <= budget:
                return qo, groups, lens
    qo, groups, lens = structure(rng.randint(1, 5))
    replan = rng.random() < 0.35
    case.config.update(api="cascade", dtype=str(dtype)[6:], kv=str(kv_dtype)[6:], heads=(hq, hkv), d=head_dim,
                       page=page_size, layout=layout, form=form, causal=causal, qo=qo, groups=groups, seg_lens=lens,
                       k_scale=None if k_scale is None else scale_value(k_scale),
                       v_scale=None if v_scale is None else scale_value(v_scale), lse=return_lse, bufs=caller_bufs,
                       replan=replan, **opts)

    def build(qo, groups, lens):
        """(q, cache, per-level plan arrays, reference out and lse, row splits) of one cascade."""
        segments = [k for seg in lens for k in seg]
        b = make_paged_batch(gen, qo_lens=[0] * len(segments), kv_lens=segments, num_qo_heads=hq, num_kv_heads=hkv,
                             head_dim=head_dim, page_size=page_size, dtype=dtype, kv_layout=layout,
                             tuple_cache=form == "tuple", non_contiguous=form == "view")
        if kv_dtype in FP8:
            b.cache = fp8_cache(b.cache, kv_dtype)
        q = torch.randn(sum(qo), hq, head_dim, generator=gen).to(dtype)
        if rng.random() < 0.2:
            q = q_view(q, hkv)
        views = rng.random() < 0.15  # the levels' index tensors as strided views
        arrays = {"qo": [], "indptr": [], "indices": [], "last": []}
        owner, first = [], 0  # owner[l][r]: the global segment request r reads at level l
        for g, seg in zip(groups, lens):
            a, z = first, first + len(seg)
            rows, req = [0], 0
            for n in g:
                rows.append(rows[-1] + sum(qo[req:req + n]))
                req += n
            level = (torch.tensor(rows, dtype=I32), b.kv_indptr[a:z + 1] - b.kv_indptr[a],
                     b.kv_indices[int(b.kv_indptr[a]):int(b.kv_indptr[z])].clone(), b.last_page_len[a:z].clone())
            for name, t in zip(("qo", "indptr", "indices", "last"), level):
                arrays[name].append(strided(t, -5) if views else t)
            owner.append([first + j for j, n in enumerate(g) for _ in range(n)])
            first = z
        # the reference: each request's attention over its segments concatenated in level order
        k_all, v_all, seg_ip = oracle.gather_paged(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, layout)
        outs, lses, row = [], [], 0
        for r, n in enumerate(qo):
            segs = [owner[lv][r] for lv in range(num_levels)]
            k = torch.cat([k_all[int(seg_ip[j]):int(seg_ip[j + 1])] for j in segs])
            v = torch.cat([v_all[int(seg_ip[j]):int(seg_ip[j + 1])] for j in segs])
            o, s_ = oracle.attention(q[row:row + n], k, v, causal=causal, k_scale=scale_value(k_scale),
                                        v_scale=scale_value(v_scale), **opts)
            outs.append(o)
            lses.append(s_)
            row += n
        ref_out = torch.cat(outs) if outs else torch.zeros(0, hq, head_dim, dtype=torch.float64)
        ref_lse = torch.cat(lses) if lses else torch.zeros(0, hq, dtype=torch.float64)
        splits = [0]
        for n in qo:
            splits.append(splits[-1] + n)
        q, b.cache = on_device(q), on_device(b.cache)
        arrays = {name: on_index_device(levels) for name, levels in arrays.items()}
        return q, b, arrays, ref_out, ref_lse, splits

    def planned(backend, plan_kv_dtype, arrays, w=None):
        w = w or serveattn.MultiLevelCascadeAttentionWrapper(num_levels, workspace(),
                                                             layout, backend=backend)
        ok = guarded(case, lambda: w.plan(arrays["qo"], arrays["indptr"], arrays["indices"], arrays["last"], hq, hkv,
                                          head_dim, page_size, causal=causal, q_data_type=dtype,
                                          kv_data_type=plan_kv_dtype, **opts) or True)
        if ok and backend == "auto":
            case.config["route"] = w.backend  # where "auto" sent the plan (on a GPU: triton, cudnn, torch)
        return w if ok else None

    q, b, arrays, ref_out, ref_lse, splits = build(qo, groups, lens)
    for backend in ("triton", "auto"):
        what = f"cascade{num_levels}/{backend}"
        w = planned(backend, kv_dtype, arrays)
        if w is None:
            continue
        view = rng.random() < 0.3
        out_buf = poisoned_view(q.shape, dtype, view) if caller_bufs else None
        lse_buf = poisoned_view(q.shape[:2], torch.float32, view) if caller_bufs and return_lse else None
        out, lse = as_tuple(w.run(q, b.cache, k_scale=k_scale, v_scale=v_scale, out=out_buf, lse=lse_buf,
                                  return_lse=return_lse))
        if out_buf is not None and (out is not out_buf or (lse_buf is not None and lse is not lse_buf)):
            raise Mismatch(f"{what}: run() did not return the caller's out / lse")
        check_close(case, what, out, ref_out, ref_lse, splits, dtype)
        if return_lse:
            check_lse(what, lse, ref_lse)
        if backend == "auto":
            continue
        same_bits(f"{what}: second run", (out, lse),
                  as_tuple(w.run(q, b.cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)))
        if kv_dtype in FP8:
            wide = planned(backend, dtype, arrays).run(q, widened(b.cache, dtype), k_scale=k_scale, v_scale=v_scale,
                                                       return_lse=return_lse)
            same_bits(f"{what}: fp8 cache vs cache.to({str(dtype)[6:]})", (out, lse), as_tuple(wide))
        if replan:  # the same wrapper on another cascade (its intermediates reused or grown), then back
            qo2, groups2, lens2 = structure(rng.randint(1, 5))
            case.config["replan_to"] = (qo2, groups2, lens2)
            q2, b2, arrays2, r2_out, r2_lse, splits2 = build(qo2, groups2, lens2)
            planned(backend, kv_dtype, arrays2, w)
            out2, lse2 = w.run(q2, b2.cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)
            check_close(case, f"{what}: re-planned", out2, r2_out, r2_lse, splits2, dtype)
            check_lse(f"{what}: re-planned", lse2, r2_lse)
            planned(backend, kv_dtype, arrays, w)
            same_bits(f"{what}: planned back", (out, lse),
                      as_tuple(w.run(q, b.cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)))


def merge_case(case: Case, rng: random.Random, gen: torch.Generator):
    """merge_state / merge_state_in_place / merge_states on random states with empty (-inf) ones."""
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    rows, num_states, heads = rng.randint(0, 9), rng.randint(0, 5), rng.randint(1, 5)
    head_dim = rng.choice([64, 64, 128, 96])
    spread = rng.choice([1.0, 6.0, 60.0])  # LSE gaps up to ~100: exp2 under- and overflow without a shift
    garbage = rng.choice(["finite", "finite", "finite", "nan"])  # what an empty state's v holds
    strided = rng.random() < 0.3
    case.config.update(api="merge", dtype=str(dtype)[6:], rows=rows, states=num_states, heads=heads, d=head_dim,
                       spread=spread, garbage=garbage, strided=strided)
    v = torch.randn(rows, num_states, heads, head_dim, generator=gen)
    s = torch.randn(rows, num_states, heads, generator=gen) * spread
    empty = torch.rand(rows, num_states, heads, generator=gen) < rng.choice([0.0, 0.3, 0.7])
    if rows:
        empty[0] = True  # a row whose every state is empty
    s[empty] = float("-inf")
    v[empty] = float("nan") if garbage == "nan" else 3e4
    v = v.to(dtype)
    if strided:  # views: v with head_dim stride 2, s with a state stride past its rows
        v = torch.stack([v, torch.zeros_like(v)], -1)[..., 0]
        s = torch.cat([s, torch.zeros_like(s)], 1)[:, :num_states]
    ref_v, ref_s = oracle.merge_states(v, s)
    v, s = on_device(v), on_device(s)
    tol = 1e-5 if dtype == torch.float32 else tolerance(dtype)

    def check(what, got_v, got_s, want_v, want_s):
        if got_v.dtype != dtype or got_s.dtype != torch.float32:
            raise Mismatch(f"{what}: dtypes {got_v.dtype}, {got_s.dtype}")
        got_v, got_s = got_v.cpu(), got_s.cpu()  # next to the CPU reference
        if torch.isnan(got_v).any() or torch.isnan(got_s).any():
            raise Mismatch(f"{what}: NaN in the merged state")
        none = torch.isinf(want_s)
        if not torch.equal(torch.isinf(got_s), none):
            raise Mismatch(f"{what}: -inf LSE not exactly where every state is empty")
        if none.any() and got_v[none].abs().max().item() != 0:
            raise Mismatch(f"{what}: an all-empty row is not 0")
        if (~none).any():
            d = (got_s[~none].double() - want_s[~none]).abs().max().item()
            if not d < 1e-5 * max(1.0, spread / 6):
                raise Mismatch(f"{what}: merged LSE off by {d:.3g}")
        e = rel_err(got_v, want_v)
        if not e < tol:
            raise Mismatch(f"{what}: rel_err {e:.3g} >= {tol}")

    for backend in ("triton", "auto"):
        mv, ms = serveattn.merge_states(v, s, backend=backend)
        check(f"merge_states/{backend}", mv, ms, ref_v, ref_s)
        same_bits(f"merge_states/{backend}: second run", (mv, ms), serveattn.merge_states(v, s, backend=backend))
        if num_states != 2:
            continue
        ref2_v, ref2_s = ref_v, ref_s
        tv, ts = serveattn.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1], backend=backend)
        check(f"merge_state/{backend}", tv, ts, ref2_v, ref2_s)
        iv, is_ = v[:, 0].clone(), s[:, 0].clone()
        keep = on_device(torch.rand(rows, generator=gen) < 0.6)
        serveattn.merge_state_in_place(iv, is_, v[:, 1], s[:, 1], backend=backend,
                                       mask=keep.to(torch.uint8) if rng.random() < 0.5 else keep)
        same_bits(f"merge_state_in_place/{backend}: merged rows", (iv[keep], is_[keep]), (tv[keep], ts[keep]))
        if not torch.equal(bits(iv[~keep]), bits(v[:, 0][~keep])) or not torch.equal(is_[~keep], s[:, 0][~keep]):
            raise Mismatch(f"merge_state_in_place/{backend}: a masked-out row changed")


# ---------------------------------------------------------------- append

def append_case(case: Case, rng: random.Random, gen: torch.Generator):
    cache_dtype = rng.choice([torch.float16, torch.bfloat16, FP8[0], FP8[1]])
    quantize = cache_dtype in FP8 and rng.random() < 0.7
    src_dtype = rng.choice([torch.float16, torch.bfloat16]) if quantize else cache_dtype
    heads, head_dim = rng.choice([1, 2, 4]), draw_head_dim(rng)
    page_size = rng.choice([1, 3, 16, 32])
    layout = rng.choice(["NHD", "HND"])
    form = rng.choice(["5d", "tuple", "5d_view", "tuple_view"])
    batch = rng.randint(1, 5)
    old = [draw_kv_len(rng, page_size, scaled(40)) for _ in range(batch)]
    new = [rng.choice([0, 1, rng.randint(0, scaled(20))]) for _ in range(batch)]
    magnitude = rng.choice([1.0, 1.0, 100.0, 1e5])  # 1e5: past both formats' largest value (saturation)
    specials = quantize and rng.random() < 0.2  # inf / NaN in the appended K/V
    scales = None
    if quantize:
        ks, vs = round(rng.uniform(0.01, 4.0), 5), round(rng.uniform(0.01, 4.0), 5)
        scales = on_device((torch.tensor([ks]), torch.tensor([vs]))) if rng.random() < 0.3 else (ks, vs)
    case.config.update(api="append", cache=str(cache_dtype)[6:], src=str(src_dtype)[6:], heads=heads, d=head_dim,
                       page=page_size, layout=layout, form=form, old=old, new=new, magnitude=magnitude,
                       specials=specials, scales=None if scales is None else tuple(map(scale_value, scales)))
    lens = [o + n for o, n in zip(old, new)]
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 3
    kv_indices = on_device(torch.randperm(num_pages, generator=gen)[: sum(pages)].to(I32))
    kv_indptr = on_device(torch.tensor([0] + [sum(pages[:i + 1]) for i in range(batch)], dtype=I32))
    last = on_device(torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)], dtype=I32))
    append_indptr = on_device(torch.tensor([0] + [sum(new[:i + 1]) for i in range(batch)], dtype=I32))
    nnz = sum(new)
    seq_lens = serveattn.get_seq_lens(kv_indptr, last, page_size)
    if seq_lens.tolist() != lens:
        raise Mismatch(f"get_seq_lens gave {seq_lens.tolist()}, expected {lens}")
    batch_indices, positions = serveattn.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    want_bi = [i for i, n in enumerate(new) for _ in range(n)]
    want_pos = [o + j for o, n in zip(old, new) for j in range(n)]
    if batch_indices.tolist() != want_bi or positions.tolist() != want_pos:
        raise Mismatch("get_batch_indices_positions: wrong targets")
    order = on_device(torch.randperm(nnz, generator=gen))  # tokens need not arrive grouped by request
    batch_indices, positions = batch_indices[order].contiguous(), positions[order].contiguous()
    key = torch.randn(nnz, heads, head_dim, generator=gen) * magnitude
    value = torch.randn(nnz, heads, head_dim, generator=gen) * magnitude
    if specials and nnz:
        key.view(-1)[0], value.view(-1)[-1] = float("inf"), float("nan")
        key.view(-1)[-1] = float("-inf")
    key, value = key.to(src_dtype), value.to(src_dtype)
    if not quantize and cache_dtype in FP8:
        key, value = (key.float() * 4).to(cache_dtype), (value.float() * 4).to(cache_dtype)
    key, value = on_device(key), on_device(value)
    inner = (page_size, heads) if layout == "NHD" else (heads, page_size)
    view = form.endswith("_view")
    lo = 1 if view else 0

    def fresh_cache():
        g = torch.Generator().manual_seed(case.seed)
        kv_axis = (2,) if form.startswith("5d") else ()
        bufs = [(torch.randn(num_pages + 4 * lo, *kv_axis, *inner, head_dim + 16 * lo, generator=g) * 2).to(cache_dtype)
                for _ in range(1 if kv_axis else 2)]
        bufs = on_device(bufs)  # the views below are of the moved buffers, as a server's cache would be
        views = [bb[lo:lo + num_pages, ..., 8 * lo:8 * lo + head_dim] for bb in bufs]
        return (views[0] if kv_axis else tuple(views)), bufs

    cache0, _ = fresh_cache()
    if quantize:
        k_store = oracle.quantize_fp8(key, scales[0], cache_dtype)
        v_store = oracle.quantize_fp8(value, scales[1], cache_dtype)
    else:
        k_store, v_store = key, value
    want = oracle.append_paged_kv_cache(k_store, v_store, batch_indices, positions, cache0, kv_indices, kv_indptr,
                                           last, layout)
    want = want if isinstance(want, tuple) else (want,)
    for backend in ("triton", "torch", "auto"):
        cache, bufs = fresh_cache()
        before = [bb.clone() for bb in bufs]
        kw = dict(k_scale=scales[0], v_scale=scales[1]) if quantize else {}
        serveattn.append_paged_kv_cache(key, value, batch_indices, positions, cache, kv_indices, kv_indptr, last,
                                        layout, backend=backend, **kw)
        got = cache if isinstance(cache, tuple) else (cache,)
        for g_, w_ in zip(got, want):
            g_ = g_.cpu()  # next to the CPU reference
            if not torch.equal(bits(g_.contiguous()), bits(w_.contiguous())):
                bad = (bits(g_.contiguous()) != bits(w_.contiguous())).sum().item()
                raise Mismatch(f"append/{backend}: {bad} bytes differ from the reference")
        if view:  # nothing outside the view written
            for bb, b0 in zip(bufs, before):
                outside = torch.ones(bb.shape, dtype=torch.bool)
                outside[lo:lo + num_pages, ..., 8 * lo:8 * lo + head_dim] = False
                if not torch.equal(bits(bb.cpu())[outside], bits(b0.cpu())[outside]):
                    raise Mismatch(f"append/{backend}: wrote outside the cache view")


# ---------------------------------------------------------------- driver

CASES = {"prefill": prefill_case, "decode": decode_case, "cascade": cascade_case, "append": append_case}


def family_of(family: str, seed: int) -> str:
    return FAMILIES[seed % len(FAMILIES)] if family == "all" else family


WRAPPERS = ("BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
            "BatchDecodeWithPagedKVCacheWrapper", "MultiLevelCascadeAttentionWrapper")


class Recycler:
    """Wrappers that have served other plans before: while recording, every wrapper the fuzzer builds (through
    serveattn.<name>) is kept; while reusing, a build with the same class and settings gets one of the kept
    ones instead (each once), so the case's plan()s re-plan wrappers that held other heads, dtypes, masks, windows,
    routes and batches. CUDA-graph wrappers are never recycled (their first plan fixes them)."""

    def __init__(self):
        self.kept, self.mode, self.saved = collections.defaultdict(list), None, {}

    def __enter__(self):
        for name in WRAPPERS:
            cls = self.saved[name] = getattr(serveattn, name)
            setattr(serveattn, name, self._factory(name, cls))
        return self

    def __exit__(self, *exc):
        for name, cls in self.saved.items():
            setattr(serveattn, name, cls)

    def _factory(self, name, cls):
        def build(*args, **kwargs):
            if kwargs.get("use_cuda_graph") or any(a is True for a in args[2:3]):
                return cls(*args, **kwargs)
            settings = [a for a in args if not isinstance(a, torch.Tensor)]
            key = (name, repr(settings), repr(sorted(kwargs.items())))
            if self.mode == "reuse" and self.kept[key]:
                return self.kept[key].pop()
            w = cls(*args, **kwargs)
            if self.mode == "record":
                self.kept[key].append(w)
            return w
        return build


def run_case(family: str, seed: int, recycle=None, device="cpu") -> Case:
    """One case: the configuration follows from (family, seed) alone (and --scale), whatever the device. recycle (by
    default drawn from the seed, one case in four): first run four other seeds of the family, keeping their wrappers,
    then this case on them."""
    if recycle is None:
        recycle = random.Random(f"recycle:{family}:{seed}").random() < 0.25
    if not recycle:
        return _run_one(family, seed, device)
    with Recycler() as recycler:
        recycler.mode = "record"
        warm = [_run_one(family, seed + 1000003 * i, device) for i in (1, 2, 3, 4)]
        recycler.mode = "reuse"
        case = _run_one(family, seed, device)
    case.config["recycled_after"] = [w.seed for w in warm]
    for w in warm:  # a warm-up seed's own failure is reported here too
        case.failures += [f"(warm-up seed {w.seed}) {f}" for f in w.failures]
        case.refusals += w.refusals
    return case


def use_device(device, family: str, seed: int) -> str:
    """Sets DEVICE and INDEX_DEVICE for one case: a plan's index tensors on the device or on the host (FlashInfer
    takes both), drawn from a stream of its own so that the case's draws do not depend on the device."""
    global DEVICE, INDEX_DEVICE
    DEVICE = torch.device(device)
    on_host = random.Random(f"index:{family}:{seed}").random() < 0.5
    INDEX_DEVICE = torch.device("cpu") if on_host else DEVICE
    return "host" if on_host else "device"


# switches under measurement, each set for half the cases of its families, drawn from a generator of its own (every
# earlier seed draws as before): (config key, module, attribute, value drawn, families, draw); read at a plan's first
# run. prefill_off32_all: int32 K/V offsets at every prefill_kernel tile (the default takes them at 64 rows and more)
MEASURING = (
    ("f16_scores", decode_kernel, "F16_SCORES", True, ("decode",), "f16-scores:{seed}"),  # fp8 decode's q.K^T in f16
    # q's operand held in registers over the KV loop (K_OPERAND only: a GPU draw; the interpreter runs without it)
    ("q_held", decode_kernel, "Q_HELD", True, ("decode",), "q-held:{seed}"),
    # the fused fold inlined into the decode kernel (FOLD_CALL off; its default calls it: a GPU draw, the interpreter
    # runs both alike)
    ("fold_inline", decode_kernel, "FOLD_CALL", False, ("decode",), "fold-inline:{seed}"),
    # eager decode grids through the strided loop over the work list (ONE_ITEM off; CUDA graphs always loop)
    ("one_item_off", decode_kernel, "ONE_ITEM", False, ("decode",), "one-item:{seed}"),
    # the strided loop's items inlined, not called (ITEM_CALL off; the loop runs under graphs or with ONE_ITEM off)
    ("item_call_off", decode_kernel, "ITEM_CALL", False, ("decode",), "item-call:{seed}"),
    ("prefill_off32_all", attention_kernel, "PREFILL_OFF32_MIN_ROWS", 0, FAMILIES, "prefill-off32:{family}:{seed}"),
)


@contextlib.contextmanager
def measuring_switches(case: Case, family: str, seed: int):
    """MEASURING's draws for one case, set inside the block (recorded in its config where drawn), then restored."""
    kept = [(module, attr, getattr(module, attr)) for _, module, attr, _, _, _ in MEASURING]
    try:
        for key, module, attr, value, families, draw in MEASURING:
            if family in families and random.Random(draw.format(family=family, seed=seed)).random() < 0.5:
                case.config[key] = True
                setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in kept:
            setattr(module, attr, value)


def _run_one(family: str, seed: int, device="cpu") -> Case:
    case = Case(family, seed, device=str(device), scale=SCALE)
    case.config["index_on"] = use_device(device, family, seed)
    rng = random.Random(f"{family}:{seed}")
    gen = torch.Generator().manual_seed(seed * 4 + FAMILIES.index(family))  # CPU draws: the same on any device
    t0 = time.time()
    with measuring_switches(case, family, seed):
        try:
            CASES[family](case, rng, gen)
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()  # an asynchronous kernel fault belongs to this case, not the next
        except Mismatch as exc:
            case.failures.append(str(exc))
        except (ValueError, NotImplementedError) as exc:  # raised outside guarded(): a call the case expected to pass
            case.failures.append(f"unexpected refusal: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        except Exception as exc:  # a crash: never the contract's answer
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            case.failures.append(f"crash: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''} "
                                 f"at {os.path.basename(tb.filename)}:{tb.lineno}")
    case.seconds = time.time() - t0
    return case


def sticky_cuda_error(failure: str) -> bool:
    """A fault that leaves the CUDA context unusable (every later call fails with it)."""
    return any(s in failure for s in ("illegal memory access", "unspecified launch failure", "device-side assert",
                                      "misaligned address", "illegal instruction"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=50, help="how many seeds")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--family", choices=FAMILIES + ("all",), default="all",
                    help="'all' rotates the families over the seeds (seed %% 4)")
    ap.add_argument("--time-limit", type=float, default=None, help="stop starting cases after this many seconds")
    ap.add_argument("--device", default="cpu",
                    help="where the inputs live: cpu (Triton's interpreter) or cuda (the compiled kernels)")
    ap.add_argument("--scale", type=int, default=1, help="multiply the drawn lengths and token budgets")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case's configuration")
    args = ap.parse_args(argv)
    global SCALE
    SCALE = args.scale
    t0 = time.time()
    ran, failed = collections.Counter(), []
    refusals = collections.Counter()
    for seed in range(args.start, args.start + args.seeds):
        if args.time_limit is not None and time.time() - t0 > args.time_limit:
            print(f"time limit reached after {sum(ran.values())} cases")
            break
        fam = family_of(args.family, seed)
        case = run_case(fam, seed, device=args.device)
        ran[fam] += 1
        for expected, msg in case.refusals:
            refusals[("expected" if expected else "UNEXPECTED", msg[:120])] += 1
        if case.failures:
            failed.append(case)
            print(f"FAIL {fam} seed={seed} ({case.seconds:.1f}s): {case.failures[0]} | repro: {case.repro()} | "
                  f"config: {short(case.config)}", flush=True)
            if args.device.startswith("cuda") and any(sticky_cuda_error(f) for f in case.failures):
                print("a CUDA error the process cannot recover from: stopping (later cases would all fail)")
                break
        elif args.verbose:
            print(f"ok   {fam} seed={seed} ({case.seconds:.1f}s): {short(case.config)}", flush=True)
        if sum(ran.values()) % 100 == 0:
            print(f"... {sum(ran.values())} cases, {len(failed)} failed, {time.time() - t0:.0f}s", flush=True)
    total = sum(ran.values())
    print(f"\n{total} cases ({', '.join(f'{k} {v}' for k, v in sorted(ran.items()))}) on {args.device} "
          f"(scale {args.scale}) in {time.time() - t0:.0f}s; {len(failed)} failed")
    for (kind, msg), n in sorted(refusals.items()):
        print(f"  refusal ({kind}) x{n}: {msg}")
    for case in failed:
        print(f"  FAIL {case.family} seed={case.seed}: {case.failures[0]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
