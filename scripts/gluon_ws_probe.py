"""Warp-specialized paged attention forward in Gluon for sm_90: does a producer warp (TMA, page by page) with one
or two consumer warp groups reach FA3-class rates where our Triton kernel (and the non-specialized Gluon probe,
scripts/gluon_attention_probe.py) stop at ~370-400 TFLOP/s?

Layout of a program (128 query rows of one head, all keys of that head):
- producer (1 warp, few registers): Q once, then K(j+1) and V(j) per block, each block gathered as BLOCK_N / 16
  TMA copies of one page each (a 2-D view of the cache, [pages * page_size, kv_heads * head_dim]), completion on
  an mbarrier with the byte count; it waits for the consumers to free a stage before overwriting it.
- consumers: CONSUMERS=1: the default partition's 8 warps take all 128 rows in lock step; CONSUMERS=2: two
  4-warp groups (the default partition and a worker) take 64 rows each and run on their own, so one group's
  softmax can overlap the other's matrix products (what FA3 schedules by named barriers; here by the warp
  scheduler). Inside a group the FA3 in-warpgroup overlap of gluon_attention_probe.py: S(j+1) is issued before
  block j's softmax; PV(j) runs while the next S waits.

Non-causal MHA only, kv_len a multiple of BLOCK_N, no LSE: a feasibility probe, not a kernel. The producer also
fetches one dummy K block past the end (block 0 again) so the loop needs no peeled tail; it costs one q.K^T per
program.

    python scripts/gluon_ws_probe.py [--consumers 2]                                # compile for sm_90 here
    PYTHONPATH=$PWD python3 scripts/gluon_ws_probe.py --run [--seq 8192]           # on the H200
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
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from compile_probe import disassemble  # noqa: E402
from gluon_attention_probe import check_and_time, paged_problem  # noqa: E402


@gluon.jit
def _fetch_block(desc, smem, bar, kv_indices, block, kvh, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 PAGE_SIZE: gl.constexpr):
    """TMA of one key block (BLOCK_N / PAGE_SIZE pages, looked up in the table) into smem; completes on bar."""
    mbarrier.expect(bar, BLOCK_N * HEAD_DIM * 2)
    for i in gl.static_range(BLOCK_N // PAGE_SIZE):
        page = gl.load(kv_indices + block * (BLOCK_N // PAGE_SIZE) + i)
        tma.async_copy_global_to_shared(desc, [page * PAGE_SIZE, kvh * HEAD_DIM], bar,
                                        smem.slice(i * PAGE_SIZE, PAGE_SIZE))


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
             kv_indices, q_row0, head, kvh, num_blocks,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr,
             CONSUMERS: gl.constexpr):
    rows: gl.constexpr = q_smem.shape[1]
    mbarrier.expect(q_ready, CONSUMERS * rows * HEAD_DIM * 2)
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [q_row0 + c * rows, head * HEAD_DIM], q_ready, q_smem.index(c))
    _fetch_block(k_desc, k_smem.index(0), k_ready.index(0), kv_indices, 0, kvh, BLOCK_N, HEAD_DIM, PAGE_SIZE)
    # consumers need K(0), K(1), V(0), K(2), V(1), ...: issue in that order
    for j in range(num_blocks):
        nxt = j + 1
        st = nxt % STAGES
        mbarrier.wait(k_empty.index(st), ((nxt // STAGES) & 1) ^ 1)
        _fetch_block(k_desc, k_smem.index(st), k_ready.index(st), kv_indices, nxt % num_blocks, kvh,
                     BLOCK_N, HEAD_DIM, PAGE_SIZE)
        st = j % STAGES
        mbarrier.wait(v_empty.index(st), ((j // STAGES) & 1) ^ 1)
        _fetch_block(v_desc, v_smem.index(st), v_ready.index(st), kv_indices, j, kvh, BLOCK_N, HEAD_DIM, PAGE_SIZE)


@gluon.jit
def _consume(q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, O, o_row0, head,
             stride_ot, stride_oh, num_blocks, qk_scale,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    nw: gl.constexpr = gl.num_warps()
    rows: gl.constexpr = q_smem.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    mbarrier.wait(q_ready, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([rows, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    m_i = gl.full([rows], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([rows], gl.float32, gl.SliceLayout(1, s_layout))
    acc = warpgroup_mma_init(gl.zeros([rows, HEAD_DIM], gl.float32, o_layout))
    for j in range(num_blocks):
        st = j % STAGES
        ph = (j // STAGES) & 1
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S(j) ready (PV(j-1) may run): K(j) is free
        mbarrier.arrive(k_empty.index(st), count=1)
        nst = (j + 1) % STAGES
        mbarrier.wait(k_ready.index(nst), ((j + 1) // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_smem.index(nst).permute((1, 0)),
                               gl.zeros([rows, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)

        x = s * qk_scale
        m_new = gl.maximum(m_i, gl.max(x, 1))
        p = gl.exp2(x - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # PV(j-1) done: V(j-1) is free
        mbarrier.arrive(v_empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(st), ph)
        acc = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
        s = s_next

    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s))[0]
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = o_row0 + gl.arange(0, rows, layout=gl.SliceLayout(1, o_layout))
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_off = o_rows.to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
    gl.store(O + o_off[:, None] + o_d[None, :], out.to(gl.bfloat16))


@gluon.jit
def _consume_second(q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, O, o_row0, head,
                    stride_ot, stride_oh, num_blocks, qk_scale,
                    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    rows: gl.constexpr = q_smem.shape[1]
    _consume(q_smem.index(1), k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, O, o_row0 + rows, head,
             stride_ot, stride_oh, num_blocks, qk_scale, BLOCK_N, HEAD_DIM, STAGES)


@gluon.jit
def ws_attention_fwd(q_desc, k_desc, v_desc, O, kv_indices, num_blocks, qk_scale, stride_ot, stride_oh,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
                     STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr):
    tile = gl.program_id(0)
    head = gl.program_id(1)
    kvh = head  # MHA in the probe
    q_row0 = tile * BLOCK_M
    rows: gl.constexpr = BLOCK_M // CONSUMERS

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, rows, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consume, (q_smem.index(0), k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, O, q_row0, head,
                        stride_ot, stride_oh, num_blocks, qk_scale, BLOCK_N, HEAD_DIM, STAGES)),
            (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                        kv_indices, q_row0, head, kvh, num_blocks, BLOCK_N, HEAD_DIM, PAGE_SIZE, STAGES, CONSUMERS)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consume, (q_smem.index(0), k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, O, q_row0, head,
                        stride_ot, stride_oh, num_blocks, qk_scale, BLOCK_N, HEAD_DIM, STAGES)),
            (_consume_second, (q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, O, q_row0, head,
                               stride_ot, stride_oh, num_blocks, qk_scale, BLOCK_N, HEAD_DIM, STAGES)),
            (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                        kv_indices, q_row0, head, kvh, num_blocks, BLOCK_N, HEAD_DIM, PAGE_SIZE, STAGES, CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _constexprs(a):
    return dict(BLOCK_M=128, BLOCK_N=a.block_n, HEAD_DIM=a.head_dim, PAGE_SIZE=16, STAGES=a.stages,
                CONSUMERS=a.consumers, CONSUMER_REGS=a.consumer_regs, PRODUCER_REGS=a.producer_regs)


def _warps(a):
    return 8 if a.consumers == 1 else 4


def _layouts(a):
    rows = 128 // a.consumers
    q_layout = gl.NVMMASharedLayout.get_default_for([rows, a.head_dim], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([16, a.head_dim], gl.bfloat16)
    return rows, q_layout, kv_layout


def compile_probe(a):
    kernel = ws_attention_fwd
    constexprs = _constexprs(a)
    rows, q_layout, kv_layout = _layouts(a)
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "q_desc":
            sig[name] = f"tensordesc<bf16[{rows}, {a.head_dim}],{q_layout!r}>"
        elif name in ("k_desc", "v_desc"):
            sig[name] = f"tensordesc<bf16[16, {a.head_dim}],{kv_layout!r}>"
        elif name == "O":
            sig[name] = "*bf16"
        elif name == "kv_indices":
            sig[name] = "*i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if name in ("O", "kv_indices") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=_warps(a), maxnreg=a.maxnreg))


def run_on_gpu(a):
    """On a GPU: the kernel checked (and run twice: bitwise) and timed next to serveattn's paged prefill and cuDNN
    SDPA (gluon_attention_probe.check_and_time) on a non-causal MHA problem."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    problem = paged_problem(a.seq, a.heads, a.head_dim)
    q, k_cache, v_cache, table, scale = problem
    seq, heads, hd = q.shape
    pages, ps = k_cache.shape[:2]
    rows, q_layout, kv_layout = _layouts(a)
    q_desc = TensorDescriptor.from_tensor(q.view(seq, heads * hd), [rows, hd], q_layout)
    k_desc = TensorDescriptor.from_tensor(k_cache.view(pages * ps, heads * hd), [16, hd], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v_cache.view(pages * ps, heads * hd), [16, hd], kv_layout)

    def gluon_call(out):
        ws_attention_fwd[(seq // 128, heads)](
            q_desc, k_desc, v_desc, out, table, seq // a.block_n, scale * 1.4426950408889634,
            out.stride(0), out.stride(1), **_constexprs(a), num_warps=_warps(a), maxnreg=a.maxnreg)

    check_and_time("ws probe", gluon_call, problem, only=a.only, repeat=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2, choices=(1, 2))
    ap.add_argument("--consumer-regs", type=int, default=240)
    ap.add_argument("--producer-regs", type=int, default=24)
    ap.add_argument("--maxnreg", type=int, default=168)
    ap.add_argument("--dump", help="folder to write ttgir/ptx/sass into")
    ap.add_argument("--run", action="store_true", help="on a GPU: check against torch and time it (non-causal MHA)")
    ap.add_argument("--only", action="store_true", help="with --run: time the probe only (no peers)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    a = ap.parse_args()
    if a.run:
        run_on_gpu(a)
        return
    ck = compile_probe(a)
    ptx = ck.asm["ptx"]
    sass = disassemble(ck.asm["cubin"])
    counts = dict(wgmma=len(re.findall(r"wgmma\.mma_async", ptx)), tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                  setmaxnreg=re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx),
                  sass=len(re.findall(r"^\s+/\*[0-9a-f]+\*/", sass, re.M)), stl=len(re.findall(r" STL", sass)),
                  ldl=len(re.findall(r" LDL", sass)))
    print(f"block_n {a.block_n}, stages {a.stages}, consumers {a.consumers}: {counts}, shared {ck.metadata.shared} B, "
          f"warps {ck.metadata.num_warps}")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(a.dump, f"gluon_ws.{ext}"), "w") as f:
                f.write(ck.asm[ext])
        with open(os.path.join(a.dump, "gluon_ws.sass"), "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
