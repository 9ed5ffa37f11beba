"""Compile-only probe (CPU, no device): can a Gluon decode kernel widen fp8 K/V tiles inside mma_v2's operand
registers, with the 16-bit operand's k-slot assignment (k_width=2), so that an fp8 cache and its dequantized
bf16 copy feed the same products (API.md's bitwise contract) without the shared-memory round trip of the
widened tile that limits the Triton decode kernel (docs/fp8.md, sessions 5 and 7)?

One 16-row group (GQA 4 padded to mma_v2's 16) against a 64-key block, head dim 128, 2 warps: S = q K^T with K^T
loaded from shared memory straight into the B-operand layout, then O = P V with V likewise. Prints, per cache
dtype, the shared loads, ldmatrix and conversions in the sm_90 PTX.

    python scripts/gluon_fp8_operand_probe.py
"""
import os
import re

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402


@gluon.jit
def block_products(Q, K, O, KV_FP8: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 2], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)  # bf16's k-slots
    io: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [2, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, io))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, io))
    smem = gl.allocate_shared_memory(K.dtype.element_ty, [64, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    smem.store(gl.load(K + r[:, None] * 128 + c[None, :]))  # one [keys, dim] tile, used as K and as V
    gl.thread_barrier()
    k_op = smem.permute((1, 0)).load(b_layout)  # K^T [dim, keys]: pairs along dim, contiguous bytes
    if KV_FP8:
        k_op = k_op.to(gl.bfloat16)  # widened in the operand's own registers
    qr = gl.arange(0, 16, layout=gl.SliceLayout(1, a_layout))
    qc = gl.arange(0, 128, layout=gl.SliceLayout(0, a_layout))
    s = mma_v2(gl.load(Q + qr[:, None] * 128 + qc[None, :]), k_op, gl.zeros([16, 64], gl.float32, mma))
    v_op = smem.load(b_layout)  # V [keys, dim]: pairs along keys, a row (128 bytes of fp8) apart
    if KV_FP8:
        v_op = v_op.to(gl.bfloat16)
    o = mma_v2(gl.convert_layout(s.to(gl.bfloat16), a_layout), v_op, gl.zeros([16, 128], gl.float32, mma))
    orow = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, 128, layout=gl.SliceLayout(0, mma))
    gl.store(O + orow[:, None] * 128 + ocol[None, :], o)


def main():
    for kv in ("bf16", "fp8e4nv"):
        src = GluonASTSource(block_products, {"Q": "*bf16", "K": f"*{kv}", "O": "*fp32", "KV_FP8": "constexpr"},
                             constexprs={(3,): kv != "bf16"})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2}).asm["ptx"]
        ops = {}
        for op in re.findall(r"\b(ld\.shared\.[\w.]+|ldmatrix[\w.:]+|cvt\.[\w.]+|mma\.sync)", ptx):
            ops[op] = ops.get(op, 0) + 1
        print(kv, "|", ", ".join(f"{k} {v}" for k, v in sorted(ops.items()) if not k.startswith("cvt.u")))


if __name__ == "__main__":
    main()
