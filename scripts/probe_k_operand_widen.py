"""Compile-only probe (CPU, no device): fp8 K widened inside mma_v2's operand registers, in Triton, with the bf16
cache's dot made to take the same k-slots.

Triton picks a dot operand's register layout (kWidth) from the narrowest load in the backward slice of either
operand (AccelerateMatmul's computeOrigBitWidth): 4 for an fp8 tile, 2 for a 16-bit one, and the two lay the
products out differently inside each mma (docs/fp8.md: different bits). An identity inline asm that also reads an
8-bit load puts that load in q's slice, so the bf16 dot takes kWidth 4 too; the fp8 tile, widened by Triton's own
conversions (through f16 and f32, exact), is then converted in the operand's registers after ldmatrix, with no
bf16 shared-memory round trip. V stays on the round trip (kWidth 2 for both), as the decode kernel has it.

One block of the decode loop (16 rows, 64 keys, head dim 128, 2 warps, 3 stages) per variant: mode 0 is today's
(K and V through common.widen), mode 1 the above. Prints each dot's kWidth, the shared buffers and the hot loop's
SASS mix.

    python scripts/probe_k_operand_widen.py
"""
import os
import re
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from compile_probe import disassemble  # noqa: E402  (scripts/, beside this file)
from sass_loops import loops  # noqa: E402
from serveattn.kernels.common import widen, widen_in_operand, with_8bit_origin  # noqa: E402


@triton.jit
def block_loop(Q, K, V, O, N, FP8: tl.constexpr, MODE: tl.constexpr):
    r = tl.arange(0, 16)
    d = tl.arange(0, 128)
    n = tl.arange(0, 64)
    q = tl.load(Q + r[:, None] * 128 + d[None, :])
    if MODE == 1 and not FP8:
        q = with_8bit_origin(q, tl.load(Q.to(tl.pointer_type(tl.int8)) + r[:, None] * 128 + d[None, :]))
    acc = tl.zeros([16, 128], tl.float32)
    m = tl.full([16], -1e30, tl.float32)
    for n0 in range(0, N, 64):
        k = tl.load(K + (n0 + n)[:, None] * 128 + d[None, :])
        v = tl.load(V + (n0 + n)[:, None] * 128 + d[None, :])
        if FP8:
            k = widen_in_operand(k, tl.bfloat16) if MODE == 1 else widen(k, tl.bfloat16)
            v = widen(v, tl.bfloat16)
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        acc = acc * tl.exp2(m - m_new)[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m = m_new
    tl.store(O + r[:, None] * 128 + d[None, :], acc)


def main():
    for kv, mode in (("bf16", 0), ("fp8e4nv", 0), ("bf16", 1), ("fp8e4nv", 1)):
        signature = {"Q": "*bf16", "K": f"*{kv}", "V": f"*{kv}", "O": "*fp32", "N": "i32", "FP8": "constexpr",
                     "MODE": "constexpr"}
        src = ASTSource(block_loop, signature=signature, constexprs={(5,): kv != "bf16", (6,): mode},
                        attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "num_stages": 3})
        ttgir = ck.asm["ttgir"]
        with tempfile.NamedTemporaryFile("w", suffix=".sass") as sass:  # sass_loops reads a file
            sass.write(disassemble(ck.asm["cubin"]))
            sass.flush()
            body = max(loops(sass.name), key=lambda loop: len(loop[2]))[2]
        mix = {}
        for text in body:
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
            mix[op] = mix.get(op, 0) + 1
        widths = re.findall(r"tt.dot .*?kWidth = (\d+)", ttgir)
        buffers = re.findall(r"local_alloc.*?!ttg.memdesc<([0-9x]+x\w+)", ttgir)
        print(f"{kv} mode {mode}: dot kWidth {widths}, shared buffers {buffers}, {ck.metadata.shared} B")
        print(f"    loop {len(body)} instructions: "
              + ", ".join(f"{op} {k}" for op, k in sorted(mix.items(), key=lambda item: -item[1])[:12]))


if __name__ == "__main__":
    main()
