"""The one place that works around the Triton interpreter's numeric flaws (Triton 3.6).

Under TRITON_INTERPRET=1, `tl.dot` on bf16 operands returns garbage and float -> bf16 conversion
truncates instead of rounding to nearest even. Kernels call `mma` and `to_dtype` below instead of
`tl.dot` / `.to()` for those cases; on a GPU both compile to the plain operation.
"""
import os

import triton
import triton.language as tl

INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def mma(a, b, acc):
    """acc + a @ b on tensor cores; operands upcast to fp32 under the interpreter."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """fp32 -> dtype with round-to-nearest-even, also under the interpreter."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            # NaN/inf keep their pattern: the rounding above only matters for finite values.
            x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    return x.to(dtype)
