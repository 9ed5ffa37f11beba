"""Can Triton 3.6's Gluon express FA3's in-warpgroup overlap for our paged prefill? Compile-only probe (no GPU
needed): a paged-KV attention forward written in Gluon for sm_90, compiled here, with a summary of what came out.

Why (docs/performance.md, session 5): in `tl.dot` Triton 3.6 waits for every wgmma whose result is not a
loop-carried accumulator right after issuing it, so the next block's q.K^T cannot run during this block's
softmax. Gluon exposes `warpgroup_mma(..., is_async=True)` and `warpgroup_mma_wait(num_outstanding=N)`, so the
order can be written out:

    top of block j:   wait until only PV(j-1) may be in flight   -> S(j) is ready
                      cp.async K(j+2) into S(j)'s freed K buffer
                      wait for K(j+1)'s copy; issue S(j+1) = Q K(j+1)^T     (async)
                      softmax of S(j) in registers (overlaps S(j+1) on the tensor cores)
                      wait until only S(j+1) may be in flight  -> PV(j-1) is done
                      cp.async V(j+1) into PV(j-1)'s freed V buffer; rescale O
                      wait for V(j)'s copy; issue PV(j) = P(j) V(j)          (async, P from registers)

K/V are gathered page by page with cp.async (a page of 16 keys is smaller than a TMA box could be for a
128-key block without a gather). Not run, not tested: no causal mask, no GQA row packing, no tail handling
(kv_len a multiple of BLOCK_N, at least 2 blocks), no LSE; its numbers are unknown. What it answers now: does
this compile, with how many registers and spills, and are the waits where we put them?

    python scripts/gluon_attention_probe.py [--block-m 128 --block-n 64 --warps 8] [--dump DIR]
    PYTHONPATH=$PWD python3 scripts/gluon_attention_probe.py --run [--seq 8192]     # on the H200
"""
import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(__file__))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from compile_probe import disassemble  # noqa: E402


@gluon.jit
def _gather_kv(smem, CACHE, kv_indices, page_base, n0, kv_len, kvh, stride_p, stride_s, stride_h,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, layout: gl.constexpr):
    """cp.async of keys n0 .. n0 + BLOCK_N of KV head kvh (page by page through the table) into smem; keys past
    kv_len (the blocks the pipeline reaches beyond the end) are zero-filled, their pages never looked up."""
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ok = n < kv_len
    page = gl.load(kv_indices + page_base + n // PAGE_SIZE, mask=ok, other=0)
    row = page.to(gl.int64) * stride_p + (n % PAGE_SIZE).to(gl.int64) * stride_s + kvh.to(gl.int64) * stride_h
    cp.async_copy_global_to_shared(smem, CACHE + row[:, None] + d[None, :], mask=ok[:, None])
    cp.commit_group()


@gluon.jit
def paged_attention_fwd(Q, K, V, O, kv_indices, num_blocks, qk_scale,  # num_blocks = kv_len / BLOCK_N
                        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_ot, stride_oh,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                        PAGE_SIZE: gl.constexpr, num_warps: gl.constexpr):
    tile = gl.program_id(0)
    head = gl.program_id(1)  # one query head per program here (no GQA packing in the probe)
    kvh = head
    page_base = 0
    kv_len = num_blocks * BLOCK_N

    # registers: S [BLOCK_M, BLOCK_N] and O [BLOCK_M, HEAD_DIM] in wgmma accumulator layouts, P as the A operand
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
    kv_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], q_shared)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], kv_shared)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], kv_shared)

    rows = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    q_row = rows.to(gl.int64) * stride_qt + head.to(gl.int64) * stride_qh
    cp.async_copy_global_to_shared(q_smem, Q + q_row[:, None] + d[None, :])
    _gather_kv(k_smem.index(0), K, kv_indices, page_base, 0, kv_len, kvh, stride_kp, stride_ks, stride_kh,
               BLOCK_N, HEAD_DIM, PAGE_SIZE, load_layout)  # group: Q + K(0)
    _gather_kv(k_smem.index(1), K, kv_indices, page_base, BLOCK_N, kv_len, kvh, stride_kp, stride_ks, stride_kh,
               BLOCK_N, HEAD_DIM, PAGE_SIZE, load_layout)  # group: K(1)
    _gather_kv(v_smem.index(0), V, kv_indices, page_base, 0, kv_len, kvh, stride_kp, stride_ks, stride_kh,
               BLOCK_N, HEAD_DIM, PAGE_SIZE, load_layout)  # group: V(0)
    cp.wait_group(2)  # Q and K(0) landed
    gl.thread_barrier()
    fence_async_shared()
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)),
                      gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    # O is loop-carried as an in-flight wgmma accumulator (like S): initialised as one
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    for j in range(num_blocks):
        buf = j % 2
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S(j) ready; PV(j-1) may still run
        _gather_kv(k_smem.index(buf), K, kv_indices, page_base, (j + 2) * BLOCK_N, kv_len, kvh,
                   stride_kp, stride_ks, stride_kh, BLOCK_N, HEAD_DIM, PAGE_SIZE, load_layout)  # K(j+2)
        cp.wait_group(2)  # K(j+1) landed (V(j) and K(j+2) may be in flight)
        gl.thread_barrier()
        fence_async_shared()
        s_next = warpgroup_mma(q_smem, k_smem.index(1 - buf).permute((1, 0)),
                               gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)

        # softmax of block j while S(j+1) runs
        x = s * qk_scale
        m_new = gl.maximum(m_i, gl.max(x, 1))
        p = gl.exp2(x - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # PV(j-1) done (S(j+1) may run)
        _gather_kv(v_smem.index(1 - buf), V, kv_indices, page_base, (j + 1) * BLOCK_N, kv_len, kvh,
                   stride_kp, stride_ks, stride_kh, BLOCK_N, HEAD_DIM, PAGE_SIZE, load_layout)  # V(j+1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        cp.wait_group(2)  # V(j) landed (K(j+2) and V(j+1) may be in flight)
        gl.thread_barrier()
        fence_async_shared()
        acc = warpgroup_mma(p_op, v_smem.index(buf), acc, is_async=True)
        s = s_next

    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s))[0]
    cp.wait_group(0)
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_row = o_rows.to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
    gl.store(O + o_row[:, None] + o_d[None, :], out.to(gl.bfloat16))


def compile_probe(block_m: int, block_n: int, head_dim: int, page_size: int, num_warps: int):
    kernel = paged_attention_fwd
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
                      num_warps=num_warps)
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("Q", "K", "V", "O"):
            sig[name] = "*bf16"
        elif name == "kv_indices":
            sig[name] = "*i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def paged_problem(seq: int, heads: int, head_dim: int, page_size: int = 16):
    """A non-causal MHA problem on a shuffled page table (CUDA): q, k_cache, v_cache, table, scale."""
    import torch
    torch.manual_seed(0)
    pages = seq // page_size
    k_cache = torch.randn(pages, page_size, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(pages, device="cuda").to(torch.int32)
    q = torch.randn(seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, table, head_dim ** -0.5


def check_and_time(label: str, call, problem, only: bool = False, repeat: bool = False):
    """call(out) runs a probe kernel into out. Checks it against a float32 torch reference (every element
    written, relative error; repeat: a second run bitwise equal), then times it next to serveattn's paged
    prefill and cuDNN SDPA on the same problem (only: the probe alone; do_bench medians)."""
    import torch
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import serveattn

    q, k_cache, v_cache, table, scale = problem
    seq, heads, hd = q.shape
    ps = k_cache.shape[1]
    out = torch.full_like(q, float("nan"))
    call(out)
    torch.cuda.synchronize()
    k = k_cache[table.long()].reshape(seq, heads, hd).transpose(0, 1).float()
    v = v_cache[table.long()].reshape(seq, heads, hd).transpose(0, 1).float()
    ref = (torch.softmax(q.transpose(0, 1).float() @ k.transpose(1, 2) * scale, -1) @ v).transpose(0, 1)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"{label}: every element written {not torch.isnan(out).any().item()}, relative error {err:.2e}")
    if repeat:
        again = torch.full_like(q, float("nan"))
        call(again)
        torch.cuda.synchronize()
        print(f"{label}: second run bitwise equal {torch.equal(again, out)}")

    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="triton")
    i32 = dict(dtype=torch.int32, device="cpu")
    w.plan(torch.tensor([0, seq], **i32), torch.tensor([0, seq // ps], **i32), table.cpu(), torch.tensor([ps], **i32),
           heads, heads, hd, ps, causal=False, q_data_type=torch.bfloat16)
    qb, kb, vb = q.transpose(0, 1)[None], k.to(torch.bfloat16)[None], v.to(torch.bfloat16)[None]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb)

    flops = 4 * seq * seq * heads * hd
    peers = [(label, lambda: call(out))]
    if not only:
        peers += [("serveattn paged prefill", lambda: w.run(q, (k_cache, v_cache))), ("cuDNN SDPA (contiguous)", cudnn)]
    for name, fn in peers:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        print(f"{name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")


def run_on_gpu(a):
    """On a GPU: the probe kernel checked and timed (check_and_time) on a non-causal MHA problem."""
    problem = paged_problem(a.seq, a.heads, a.head_dim)
    q, k_cache, v_cache, table, scale = problem
    seq, heads, hd = q.shape
    ps = k_cache.shape[1]

    def gluon_call(out):
        paged_attention_fwd[(seq // a.block_m, heads)](
            q, k_cache, v_cache, out, table, seq // a.block_n, scale * 1.4426950408889634,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1),
            BLOCK_M=a.block_m, BLOCK_N=a.block_n, HEAD_DIM=hd, PAGE_SIZE=ps, num_warps=a.warps)

    check_and_time("gluon probe", gluon_call, problem)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--dump", help="folder to write ttgir/ptx/sass into")
    ap.add_argument("--run", action="store_true", help="on a GPU: check against torch and time it (non-causal MHA)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    a = ap.parse_args()
    if a.run:
        run_on_gpu(a)
        return
    ck = compile_probe(a.block_m, a.block_n, a.head_dim, 16, a.warps)
    ptx = ck.asm["ptx"]
    sass = disassemble(ck.asm["cubin"])
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    counts = dict(wgmma=len(re.findall(r"wgmma\.mma_async", ptx)), cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
                  sass=len(re.findall(r"^\s+/\*[0-9a-f]+\*/", sass, re.M)), stl=len(re.findall(r" STL", sass)),
                  ldl=len(re.findall(r" LDL", sass)))
    print(f"tiles {a.block_m} x {a.block_n}, head dim {a.head_dim}, {a.warps} warps: wgmma {counts['wgmma']}, "
          f"wgmma.wait_group {waits}, cp.async {counts['cp_async']}, shared {ck.metadata.shared} B, "
          f"SASS {counts['sass']} instructions, spills STL {counts['stl']} / LDL {counts['ldl']}")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(a.dump, f"gluon_attention.{ext}"), "w") as f:
                f.write(ck.asm[ext])
        with open(os.path.join(a.dump, "gluon_attention.sass"), "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
