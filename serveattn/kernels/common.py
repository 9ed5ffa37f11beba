"""The one place that works around the Triton interpreter's numeric flaws (Triton 3.6).

Under TRITON_INTERPRET=1, `tl.dot` on bf16 operands returns garbage, float -> bf16 conversion truncates
instead of rounding to nearest even, and fp8 -> wider conversion flushes e5m2 subnormals and turns e4m3fn
NaN into 480. Kernels call `mma`, `to_dtype` and `widen` below instead of the `tl` operations; on a GPU
each compiles to the plain operation.
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


@triton.jit
def widen(x, dtype: tl.constexpr):
    """A loaded K/V tile in the compute dtype: fp8 is dequantized exactly (every fp8 value is a 16-bit
    value); a 16-bit tile is returned as it is. Under the interpreter fp8 is decoded from its bits."""
    if x.dtype.is_fp8():
        if INTERPRET:
            bits = x.to(tl.uint8, bitcast=True).to(tl.uint32)
            negative = (bits >> 7) != 0
            if x.dtype == tl.float8e4nv:  # e4m3fn: bias 7, 3 mantissa bits, one NaN pattern, no inf
                e = (bits >> 3) & 0xF
                m = bits & 0x7
                normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
                value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
                value = tl.where((e == 15) & (m == 7), float("nan"), value)
            else:  # e5m2: bias 15, 2 mantissa bits, inf and NaN as in IEEE
                e = (bits >> 2) & 0x1F
                m = bits & 0x3
                normal = (((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
                value = tl.where(e == 0, m.to(tl.float32) * 0.0000152587890625, normal)  # m * 2^-16
                value = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), value)
            value = tl.where(negative, -value, value)
            return to_dtype(value, dtype)
        else:
            return x.to(dtype)
    else:
        return x
