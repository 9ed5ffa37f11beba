"""Compiles the prefill or decode kernel for sm_90 on this (GPU-less) machine and summarises what Triton made
of it: which matrix instruction each dot became, shared-memory round trips, async copies, TMA, and the SASS
instruction mix (nvdisasm, shipped in triton's bin). Costs no device time.

    python scripts/compile_probe.py --q bf16 --kv fp8e4nv            # bf16 query over an fp8 cache
    python scripts/compile_probe.py --q fp8e4nv --kv fp8e4nv --dump /tmp/fp8   # writes ttgir/ptx/sass/json there
    python scripts/compile_probe.py --kernel decode --kv fp8e4nv --tiles 16,128,4,3

Pointers and strides carry tt.divisibility=16 as a real launch would (without it no load pipelines)."""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from serveattn.kernels.attention import prefill_kernel  # noqa: E402
from serveattn.kernels.decode import decode_kernel, item_call, merge_slots, tile_rows  # noqa: E402
from serveattn.kernels.sizes import next_pow2  # noqa: E402
from serveattn.kernels.common import LAUNCH_OPTIONS  # noqa: E402

FLOATS = {"qk_scale", "sm_scale", "soft_cap", "log2_theta", "rcp_scale", "v_scale"}
INT_PTRS = {"req_first_slot": "*i32", "req_num_slots": "*i32", "done_count": "*i32", "work": "*i32", "num_work_ptr": "*i32", "qo_indptr": "*i32", "kv_indptr": "*i32",
            "kv_indices": "*i32", "last_page_len": "*i32", "mask_ptr": "*u8", "mask_indptr": "*i32",
            "tree_mask": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "q_descale": "*fp32",
            "k_descale": "*fp32", "v_descale": "*fp32", "kv_tok_indptr": "*i32", "PART_O": "*fp32",
            "PART_LSE": "*fp32"}


def compile_prefill(q, kv, out, head_dim, group, block_m, block_n, warps, stages, paged, causal, page_size,
                    v_t=False, split_kv=False):
    fp8_qkv = q.startswith("fp8")
    constexprs = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size,
                      PAGED=paged, CAUSAL=causal, HAS_MASK=False, HAS_WINDOW=False, SOFT_CAP=False, ROPE=False,
                      RETURN_LSE=True, KV_SAME_STRIDES=True, K_SCALE_PTR=False, V_SCALE_PTR=False,
                      FP8_QKV=fp8_qkv, TREE=False, V_T=v_t, SPLIT_KV=split_kv,
                      OFF32=os.environ.get("SERVEATTN_PREFILL_KV_OFFSETS_32", "1") == "1"  # the launch's choice
                      and block_m >= int(os.environ.get("SERVEATTN_PREFILL_KV_OFFSETS_32_MIN_ROWS", "64")))
    return _compile(prefill_kernel, constexprs, q, kv, out, warps, stages)


def compile_decode(q, kv, out, head_dim, group, block_n, warps, stages, page_size, q_len=1, fused_merge=False):
    constexprs = dict(NUM_QO_HEADS=8 * group, GROUP=group, GROUP_PAD=tile_rows(q_len, group),
                      HEAD_DIM=head_dim, BLOCK_N=block_n, PAGE_SIZE=page_size, PAGED=True, HAS_WINDOW=False,
                      SOFT_CAP=False, RETURN_LSE=False, KV_SAME_STRIDES=True, K_SCALE_PTR=False, V_SCALE_PTR=False,
                      QLEN=q_len, FUSED_MERGE=fused_merge, MERGE_ROWS=next_pow2(q_len * group),
                      MERGE_SLOTS=merge_slots(next_pow2(q_len * group), head_dim) if fused_merge else 1,
                      OFF32=os.environ.get("SERVEATTN_KV_OFFSETS_32", "1") == "1",  # the launch's choice (fits_int32)
                      F16_SCORES=os.environ.get("SERVEATTN_DECODE_F16_SCORES", "0") == "1",
                      Q_HELD=os.environ.get("SERVEATTN_DECODE_Q_HELD", "0") == "1"  # the launch's choice
                      or (os.environ.get("SERVEATTN_DECODE_Q_HELD_FP8", "1") == "1" and kv.startswith("fp8")),
                      FOLD_CALL=fused_merge and os.environ.get("SERVEATTN_DECODE_FOLD_CALL", "1") == "1",
                      # an eager launch's (a CUDA graph's fixed grid loops over the work list: =0)
                      ONE_ITEM=os.environ.get("SERVEATTN_DECODE_ONE_ITEM", "1") == "1",
                      # the launch's choice where the loop stays (ONE_ITEM=0)
                      ITEM_CALL=item_call(fused_merge, 1 if kv.startswith("fp8") else 2, head_dim, q_len * group))
    return _compile(decode_kernel, constexprs, q, kv, out, warps, stages)


def _compile(kernel, constexprs, q, kv, out, warps, stages):
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in ("Q",):
            sig[name] = "*" + q
        elif name in ("K", "V", "VT"):
            sig[name] = "*" + kv
        elif name == "O":
            sig[name] = "*" + out
        elif name == "LSE":
            sig[name] = "*fp32"
        elif name in INT_PTRS:
            sig[name] = INT_PTRS[name]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        divisible = sig[name].startswith("*") or ("stride" in name and not name.endswith(("lh",)))
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name, value in constexprs.items():
        sig[name] = "constexpr"
    src = ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, **LAUNCH_OPTIONS))


def compile_prefill_ws(dtype, group, page_size, paged, causal, lse=True, head_dim=128):
    """The warp-specialized Hopper prefill kernel (Gluon: a tensordesc signature, warps and registers fixed by
    the kernel module). An fp8 dtype compiles fp8 attention (fp8 q and K/V, V read transposed, bf16 out)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from serveattn.kernels import attention_ws as ws
    kernel = ws.prefill_ws_kernel
    block_n = ws.BLOCK_N.value
    box = min(page_size, block_n) if paged else block_n
    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp8e4nv": gl.float8e4nv, "fp8e5": gl.float8e5}[dtype]
    fp8 = dtype.startswith("fp8")
    layout = gl.NVMMASharedLayout.get_default_for([box, head_dim], gl_dtype)
    vt_layout = gl.NVMMASharedLayout.get_default_for([head_dim, block_n], gl_dtype)
    q_box = [ws.BLOCK_M.value // 2 // group, group, head_dim]
    q_layout = gl.NVMMASharedLayout.get_default_for(q_box, gl_dtype)
    constexprs = dict(GROUP=group, PAGE_SIZE=page_size, BOX=box, PAGED=paged, CAUSAL=causal, RETURN_LSE=lse,
                      K_SCALE_PTR=False, V_SCALE_PTR=False, FP8=fp8, Q_TMA=True, KV_HEADS=8)
    # as a real launch specializes them: a stride of 1 is a constant, pointers and the q / out / lse row strides
    # are divisible by 16 (without that no store is vectorized)
    constexprs["stride_lh"] = 1
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in ("Q", "O", "LSE", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_lt"):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "q_desc":
            sig[name] = f"tensordesc<{dtype}[{q_box[0]}, {q_box[1]}, {q_box[2]}],{q_layout!r}>"
        elif name == "k_desc" or (name == "v_desc" and not fp8):
            sig[name] = f"tensordesc<{dtype}[{box}, {head_dim}],{layout!r}>"
        elif name == "v_desc":
            sig[name] = f"tensordesc<{dtype}[{head_dim}, {block_n}],{vt_layout!r}>"
        elif name == "Q":
            sig[name] = f"*{dtype}"
        elif name == "O":
            sig[name] = "*bf16" if fp8 else f"*{dtype}"
        elif name in ("LSE", "k_scale_ptr", "v_scale_ptr", "q_descale", "k_descale", "v_descale"):
            sig[name] = "*fp32"
        elif name in ("work", "num_work_ptr", "qo_indptr", "kv_indptr", "kv_indices", "last_page_len",
                      "kv_tok_indptr"):
            sig[name] = "*i32"
        elif name in ("qk_scale", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = GluonASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=ws.MAX_REGS, **LAUNCH_OPTIONS))


def summarise(ck):
    ttgir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
    count = lambda pat, text: len(re.findall(pat, text))  # noqa: E731
    print("dots: warp_group_dot", count(r"ttng\.warp_group_dot ", ttgir), "| tt.dot", count(r"tt\.dot ", ttgir))
    for m in re.finditer(r"#mma\d* = #ttg\.nvidia_mma<\{[^}]*\}>", ttgir):
        print("  ", m.group(0))
    print("local_alloc", count(r"ttg\.local_alloc", ttgir), "| local_load", count(r"ttg\.local_load", ttgir),
          "| async_copy", count(r"async_copy_global_to_local", ttgir), "| tma", count(r"async_tma", ttgir))
    print("ptx: wgmma", count(r"wgmma\.mma_async", ptx), "| mma.sync", count(r"mma\.sync", ptx),
          "| cp.async", count(r"cp\.async\.", ptx), "| ldmatrix", count(r"ldmatrix", ptx),
          "| stmatrix", count(r"stmatrix", ptx), "| shared mem", ck.metadata.shared, "B",
          "| regs", getattr(ck, "n_regs", None) or registers(ck.asm["cubin"]))
    for m in sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync\.aligned)\.[\w.]+", ptx))):
        print("  ", m)
    sass = disassemble(ck.asm["cubin"])
    ops = collections.Counter(op.split(".")[0] for op in re.findall(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M))
    print("sass:", sum(ops.values()), "instructions;", ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    return sass


def registers(cubin: bytes) -> str:
    """Registers a thread (cuobjdump -res-usage): a CPU compile leaves CompiledKernel.n_regs unset."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", usage)
    return found.group(1) if found else "?"


def disassemble(cubin: bytes) -> str:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=("prefill", "prefill-ws", "decode"), default="prefill")
    ap.add_argument("--q", default="bf16")
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--out", default="bf16")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tiles", default=None, help="block_m,block_n,warps,stages (default: 128,128,8,2 for "
                                                  "prefill, 16,128,4,3 for decode; decode ignores block_m)")
    ap.add_argument("--ragged", action="store_true")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--q-len", type=int, default=1, help="decode: draft rows per request (chain verify)")
    ap.add_argument("--fused-merge", action="store_true", help="decode: the split-KV merge inside the decode kernel")
    ap.add_argument("--vt", action="store_true", help="fp8 attention reading V from its transposed copy")
    ap.add_argument("--split-kv", action="store_true", help="prefill: the split-KV variant (6-int work items)")
    ap.add_argument("--dump", help="folder to write ttgir/ptx/llir/sass into")
    a = ap.parse_args()
    bm, bn, w, s = map(int, (a.tiles or ("128,128,8,2" if a.kernel == "prefill" else "16,128,4,3")).split(","))
    if a.kernel == "prefill-ws":
        ck = compile_prefill_ws(a.q, a.group, a.page_size, not a.ragged, True, head_dim=a.head_dim)
    elif a.kernel == "prefill":
        ck = compile_prefill(a.q, a.kv, a.out, a.head_dim, a.group, bm, bn, w, s, not a.ragged, True, a.page_size,
                             a.vt, a.split_kv)
    else:
        ck = compile_decode(a.q, a.kv, a.out, a.head_dim, a.group, bn, w, s, a.page_size, a.q_len, a.fused_merge)
    sass = summarise(ck)
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx", "llir"):
            with open(os.path.join(a.dump, f"{a.kernel}.{ext}"), "w") as f:
                f.write(ck.asm[ext])
        with open(os.path.join(a.dump, f"{a.kernel}.sass"), "w") as f:
            f.write(sass)
        with open(os.path.join(a.dump, f"{a.kernel}.json"), "w") as f:  # what bounds programs an SM
            json.dump({"shared": ck.metadata.shared,
                       "regs": int(getattr(ck, "n_regs", None) or registers(ck.asm["cubin"]))}, f)


if __name__ == "__main__":
    main()
