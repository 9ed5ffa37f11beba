"""Prototype (measuring only, not served): decode with each warp on its own keys, to test whether fp8 decode's
floor (~0.29 ms at 64x8192 with the cache in the L2, docs/performance.md session 40) is the decode kernel's
structure. serveattn's decode kernel spreads one 64-key block over its 2 warps, so every block's softmax and its
P operand cross warps (shared memory and a barrier a block). Here the keys of a step are a [W, BLOCK_N] tile and
q.K^T / P.V are batched dots over W, whose warps Triton places on the batch axis: each warp runs its own online
softmax over its own blocks, and the W states merge once at the end.

Simplest form: one program a (request, KV head), no split-KV, an fp16 query (--q-dtype bfloat16 for bf16: fp8 K/V
widen to the query's dtype through serveattn's `widen`, as the decode kernel's), NHD pages [pages, 2, page,
kv_heads, head_dim].

    python scripts/proto_decode3d.py --check                 # CPU interpreter: against a float64 reference
    python scripts/proto_decode3d.py --compile 2,64,3        # sm_90 compile on this CPU: shared memory, SASS mix
    python scripts/proto_decode3d.py --bench [--pool-pages 256] [--variants "2,64,3;4,32,3"]   # GPU: vs serveattn

Its swapped-products form (K.q^T and V^T.P^T, a group of 4 on the 8-column side) was measured in session 41 and
removed (not faster; code at 7825e58).
"""
import argparse
import os
import sys

if "--check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from serveattn.kernels.common import widen  # noqa: E402  (serveattn's exact fp8 widening, as the decode kernel's)

HQ, HKV, D, PS = 32, 8, 128, 16


@triton.jit
def decode3d_kernel(Q, K, V, O, kv_indptr, kv_indices, kv_lens, qk_scale_log2,
                    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_ob, stride_oh,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                    W: tl.constexpr, PAGE_SIZE: tl.constexpr):
    req = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    q_rows = h * GROUP + rows
    q = tl.load(Q + req * stride_qb + q_rows[:, None] * stride_qh + d[None, :], mask=rows[:, None] < GROUP,
                other=0.0)
    q3 = tl.broadcast_to(q[None, :, :], (W, GROUP_PAD, HEAD_DIM))
    w = tl.arange(0, W)
    n = tl.arange(0, BLOCK_N)
    kv_len = tl.load(kv_lens + req)
    first_page = tl.load(kv_indptr + req)
    m_i = tl.full((W, GROUP_PAD), float("-inf"), tl.float32)
    l_i = tl.zeros((W, GROUP_PAD), tl.float32)
    acc = tl.zeros((W, GROUP_PAD, HEAD_DIM), tl.float32)
    for start in range(0, kv_len, W * BLOCK_N):
        tok = start + w[:, None] * BLOCK_N + n[None, :]  # [W, BLOCK_N]: warp w's keys of this step
        valid = tok < kv_len
        page = tl.load(kv_indices + first_page + tok // PAGE_SIZE, mask=valid, other=0)
        off = page * stride_kp + (tok % PAGE_SIZE) * stride_ks + h * stride_kh
        k = widen(tl.load(K + off[:, :, None] + d[None, None, :], mask=valid[:, :, None], other=0.0),
                  Q.dtype.element_ty)
        s = tl.dot(q3, tl.trans(k, 0, 2, 1)) * qk_scale_log2  # [W, GROUP_PAD, BLOCK_N]
        s = tl.where(valid[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a warp with no key yet: alpha 1, p 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        v = widen(tl.load(V + off[:, :, None] + d[None, None, :], mask=valid[:, :, None], other=0.0),
                  Q.dtype.element_ty)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(Q.dtype.element_ty), v)
        m_i = m_new
    m = tl.max(m_i, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    scale = tl.exp2(m_i - m_use[None, :])
    l_sum = tl.sum(l_i * scale, 0)
    o = tl.sum(acc * scale[:, :, None], 0) / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(O + req * stride_ob + q_rows[:, None] * stride_oh + d[None, :], o.to(O.dtype.element_ty),
             mask=rows[:, None] < GROUP)


def launch(q, cache, kv_indptr, kv_indices, kv_lens, out, sm_scale, w, block_n, stages):
    k, v = cache[:, 0], cache[:, 1]
    group = q.shape[1] // k.shape[2]
    decode3d_kernel[(q.shape[0], k.shape[2])](
        q, k, v, out, kv_indptr, kv_indices, kv_lens, sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=q.shape[2], BLOCK_N=block_n, W=w,
        PAGE_SIZE=k.shape[1], num_warps=w, num_stages=stages)


def inputs(batch, kv, pool_pages, cache_dtype, device, seed=0, kv_heads=HKV, head_dim=D, q_dtype=torch.float16):
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = (kv + PS - 1) // PS
    num_pages = pool_pages or batch * pages
    cache = (torch.randn(num_pages, 2, PS, kv_heads, head_dim, device=device, generator=gen) * 2).to(cache_dtype)
    cpu = torch.Generator().manual_seed(seed + 1)
    indices = (torch.randint(num_pages, (batch * pages,), generator=cpu) if pool_pages else
               torch.randperm(batch * pages, generator=cpu)).to(torch.int32).to(device)
    indptr = (torch.arange(batch + 1, dtype=torch.int32) * pages).to(device)
    lens = torch.full((batch,), kv, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ if kv_heads == HKV else kv_heads * 4, head_dim, device=device, generator=gen,
                    dtype=q_dtype)
    return q, cache, indptr, indices, lens


def reference(q, cache, indptr, indices, lens, sm_scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.shape[3]
    for r in range(q.shape[0]):
        pages = indices[indptr[r]:indptr[r + 1]].long()
        kv = cache[pages].double()
        k = kv[:, 0].reshape(-1, cache.shape[3], cache.shape[4])[:int(lens[r])]
        v = kv[:, 1].reshape(-1, cache.shape[3], cache.shape[4])[:int(lens[r])]
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[r].double(), k) * sm_scale
        out[r] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
    return out


def check():
    torch.manual_seed(0)
    for (batch, kv, w, block_n, dtype) in ((2, 37, 2, 16, torch.float16), (3, 100, 4, 16, torch.float8_e4m3fn),
                                          (1, 16, 2, 32, torch.float16), (2, 64, 2, 16, torch.float8_e4m3fn)):
        q, cache, indptr, indices, lens = inputs(batch, kv, 0, dtype, "cpu", kv_heads=2, head_dim=32)
        out = torch.full_like(q, float("nan"))
        launch(q, cache, indptr, indices, lens, out, 32 ** -0.5, w, block_n, 1)
        ref = reference(q, cache, indptr, indices, lens, 32 ** -0.5)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"batch {batch} kv {kv} W {w} block {block_n} {dtype}: rel err {err:.2e}, all written "
              f"{not out.isnan().any().item()}")
        assert err < 2e-3 and not out.isnan().any()


def compile_sm90(variant):
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    w, block_n, stages = map(int, variant.split(","))
    kern = decode3d_kernel
    consts = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_N=block_n, W=w, PAGE_SIZE=16)
    sig, attrs = {}, {}
    ptrs = {"Q": "*fp16", "K": "*fp8e4nv", "V": "*fp8e4nv", "O": "*fp16", "kv_indptr": "*i32",
            "kv_indices": "*i32", "kv_lens": "*i32"}
    for i, name in enumerate(kern.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=w, num_stages=stages))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True).stdout
    ops = [line.split()[1].split(".")[0] for line in sass.splitlines() if line.strip().startswith("/*") and
           len(line.split()) > 1]
    print(f"W {w} block {block_n} stages {stages}: shared {compiled.metadata.shared} B, {len(ops)} SASS lines, "
          f"HMMA {sum(o == 'HMMA' for o in ops)}, BAR {sum(o == 'BAR' for o in ops)}, "
          f"LDGSTS {sum(o == 'LDGSTS' for o in ops)}, STS {sum(o == 'STS' for o in ops)}, "
          f"LDS {sum(o == 'LDS' for o in ops)}, LDSM {sum(o == 'LDSM' for o in ops)}")


def bench(args):
    import serveattn
    for case in args.cases.split(","):
        batch, kv = map(int, case.split("x"))
        q_dtype = getattr(torch, args.q_dtype)
        for cache_dtype in (torch.float8_e4m3fn, q_dtype):
            q, cache, indptr, indices, lens = inputs(batch, kv, args.pool_pages, cache_dtype, "cuda", q_dtype=q_dtype)
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            wr = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
            last = torch.full((batch,), PS, dtype=torch.int32)
            wr.plan(indptr.cpu(), indices.cpu(), last, HQ, HKV, D, PS, q_data_type=q_dtype,
                    kv_data_type=cache_dtype)
            ref_out = torch.empty_like(q)
            ms = {"serveattn": triton.testing.do_bench(lambda: wr.run(q, cache, out=ref_out), warmup=25, rep=100,
                                                       return_mode="median")}
            for variant in args.variants.split(";"):
                w, block_n, stages = map(int, variant.split(","))
                out = torch.full_like(q, float("nan"))
                call = lambda: launch(q, cache, indptr, indices, lens, out, D ** -0.5, w, block_n, stages)  # noqa
                try:
                    ms[variant] = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile or fit
                    print(f"  {variant}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    continue
                err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
                ms[variant + " err"] = err
            line = ", ".join(f"{k} {v:.4f}" + ("" if "err" in k else " ms") for k, v in ms.items())
            print(f"{case} pool {args.pool_pages} {str(cache_dtype).split('.')[-1]} cache, {args.q_dtype} q: {line}",
                  flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--compile", default="")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--cases", default="64x8192,8x4096")
    ap.add_argument("--pool-pages", type=int, default=0)
    ap.add_argument("--q-dtype", default="float16", choices=("float16", "bfloat16"),
                    help="the query's dtype (and the 16-bit cache's); fp8 K/V widen to it as serveattn's kernels do")
    ap.add_argument("--variants", default="2,64,3;2,64,4;4,32,3;4,64,3;2,32,4")
    a = ap.parse_args()
    if a.check:
        check()
    for v in filter(None, a.compile.split(";")):
        compile_sm90(v)
    if a.bench:
        bench(a)
