"""Random batches for attention tests: shuffled page tables, partial last pages, empty requests."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

import serveattn


@dataclass
class PagedBatch:
    q: torch.Tensor
    cache: object  # 5-D tensor or (k, v) tuple
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_lens: list
    kv_lens: list
    page_size: int
    kv_layout: str


def random_lengths(gen, batch, max_qo, max_kv, causal, allow_empty=True):
    """qo/kv lengths with at least one empty request when allowed, and kv >= qo under causal."""
    qo, kv = [], []
    for i in range(batch):
        q = int(torch.randint(1, max_qo + 1, (1,), generator=gen))
        k = int(torch.randint(0, max_kv + 1, (1,), generator=gen))
        if causal:
            k = max(k, q)
        qo.append(q)
        kv.append(k)
    if allow_empty and batch > 1:
        qo[1] = 0  # a request with no query rows
        if not causal:
            kv[-1] = 0  # a request with no keys: rows must come out 0 / -inf
    return qo, kv


def make_paged_batch(gen, *, qo_lens, kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                     kv_layout="NHD", tuple_cache=False, device="cpu", spare_pages=3,
                     non_contiguous=False) -> PagedBatch:
    pages_per_req = [math.ceil(k / page_size) for k in kv_lens]
    num_pages = sum(pages_per_req) + spare_pages
    perm = torch.randperm(num_pages, generator=gen)  # shuffled, non-contiguous pages
    indices, indptr, last = [], [0], []
    used = 0
    for n, k in zip(pages_per_req, kv_lens):
        indices += perm[used:used + n].tolist()
        used += n
        indptr.append(indptr[-1] + n)
        last.append(k - (n - 1) * page_size if n else 0)
    total_q = sum(qo_lens)
    q = torch.randn(total_q, num_qo_heads, head_dim, generator=gen).to(dtype).to(device)
    shape = (num_pages, page_size, num_kv_heads, head_dim) if kv_layout == "NHD" else \
        (num_pages, num_kv_heads, page_size, head_dim)
    if tuple_cache:
        k = torch.randn(*shape, generator=gen).to(dtype).to(device)
        v = torch.randn(*shape, generator=gen).to(dtype).to(device)
        cache = (k, v)
    else:
        full = (num_pages, 2) + shape[1:]
        if non_contiguous:  # a view into a larger buffer: strides that are not the dense ones
            big = torch.randn(num_pages, 3, *shape[1:], generator=gen).to(dtype).to(device)
            cache = big[:, 1:]
        else:
            cache = torch.randn(*full, generator=gen).to(dtype).to(device)
    i32 = dict(dtype=torch.int32, device=device)
    qo_indptr = torch.tensor([0] + list(torch.cumsum(torch.tensor(qo_lens), 0).tolist()), **i32) \
        if qo_lens else torch.zeros(1, **i32)
    return PagedBatch(q, cache, qo_indptr, torch.tensor(indptr, **i32), torch.tensor(indices, **i32),
                      torch.tensor(last, **i32), qo_lens, kv_lens, page_size, kv_layout)


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float64 (NaN if out holds NaN)."""
    out = out.double().cpu()
    ref = ref.double().cpu()
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom else 1.0)


def tolerance(dtype):
    """Relative-norm tolerances for 16-bit operands (METHOD.md: bf16 1e-3..1e-2)."""
    return {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def check_lse(lse, ref_lse):
    """-inf exactly where the reference has -inf; elsewhere close (base 2)."""
    lse = lse.double().cpu()
    ref_lse = ref_lse.double().cpu()
    assert not torch.isnan(lse).any(), "lse holds NaN (an element was not written?)"
    ninf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ninf)
    if (~ninf).any():
        assert (lse[~ninf] - ref_lse[~ninf]).abs().max().item() < 2e-2


def nan_like(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def run_under_switch(monkeypatch, name: str, values, planned, q, cache, device):
    """{value: (out, lse, wrapper)}: for each value of the environment switch `name` (read at plan time), the
    wrapper planned(value) returns (planned under it) run on q and the cache into poisoned out and lse."""
    results = {}
    for value in values:
        monkeypatch.setenv(name, value)
        w = planned(value)
        out, lse = nan_like(q.shape, q.dtype, device), nan_like(q.shape[:2], torch.float32, device)
        w.run(q, cache, out=out, lse=lse, return_lse=True)
        results[value] = out, lse, w
    return results


def fp8_decode_runs(monkeypatch, module, settings, b, enc, heads, head_dim, q_len, device, plan_kw=None,
                    k_scale=0.37, v_scale=2.5) -> dict:
    """{(setting index, kv dtype): (out, lse)}: under each setting (a dict of module attributes to set, e.g.
    decode's measuring switches), the batch b's fp8 cache (encoding enc) and its bf16 copy, each planned by a fresh
    decode wrapper (heads: (query heads, KV heads), page size 16, bf16 query, q_len rows a request) and run into
    poisoned out and lse: the fp8 contract's pairs, side by side."""
    ws = torch.empty(256 << 20 if device == "cuda" else 1 << 22, dtype=torch.uint8, device=device)
    results = {}
    for i, setting in enumerate(settings):
        for name, value in setting.items():
            monkeypatch.setattr(module, name, value)
        for cache, kv_dtype in ((b.cache, enc), (b.cache.to(torch.bfloat16), torch.bfloat16)):
            w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
            w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, *heads, head_dim, 16, q_data_type=torch.bfloat16,
                   kv_data_type=kv_dtype, q_len_per_req=q_len, **(plan_kw or {}))
            out, lse = nan_like(b.q.shape, torch.bfloat16, device), nan_like(b.q.shape[:2], torch.float32, device)
            w.run(b.q, cache, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
            results[i, kv_dtype] = out, lse
    if device == "cuda":
        torch.cuda.synchronize()
    return results


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_module(name: str):
    """scripts/<name>.py loaded as a module (the scripts are not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_for_sm90(dump, *args: str, **env: str) -> None:
    """scripts/compile_probe.py with args (its ttgir/ptx/llir/sass written into the folder dump) in a fresh process:
    the suite runs under TRITON_INTERPRET=1, which neither Gluon nor a real compile takes; env: switches to set (the
    caller's SERVEATTN_ switches are dropped: a test compiles the defaults and what it names, whatever a probe set)."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("SERVEATTN_")}
    environ.update(PYTHONPATH=ROOT, **env)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "compile_probe.py"), *args, "--dump", str(dump)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
