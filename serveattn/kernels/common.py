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

# Launch options of every floating-point kernel. Triton lets ptxas contract a mul and an add into one FMA
# wherever its scheduling makes that convenient, so two specializations of one kernel (an fp8 and a bf16
# cache, a tree and a chain mask) round the same softmax differently. Without fusion each mul/add rounds on
# its own and the result is a function of the source alone: an fp8 run equals, bitwise, the run on the
# dequantized cache (API.md), on the GPU as under the interpreter.
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)
# SERVEATTN_FP_FUSION=1 lets ptxas contract again: for measuring what the contract costs only (scripts/probe_prefill.py);
# with it an fp8 run may no longer be bitwise the run on the dequantized cache.
if os.environ.get("SERVEATTN_FP_FUSION", "0") == "1":
    LAUNCH_OPTIONS = dict(enable_fp_fusion=True)
# SERVEATTN_FP8_BOUNDARY=0 drops the operand boundary below: for measuring its cost only (scripts/probe_fp8.py);
# without it an fp8 run is no longer bitwise the run on the dequantized cache.
FP8_BOUNDARY: tl.constexpr = tl.constexpr(os.environ.get("SERVEATTN_FP8_BOUNDARY", "1") == "1")
# How _fp8_to_bf16 widens (all exact but 2): SERVEATTN_FAST_WIDEN=3 (the default) through fp16 and fp32 on the
# FMA pipe (_fp8_to_bf16_cvt_asm, 4 instructions a pair); 1 the integer path (_fp8_to_bf16_asm, ~8.4 a pair; the
# earlier default); 2 the integer path without its NaN/inf fix-up (measuring only: not exact for those);
# 0 Triton's conversion (also through fp16, but widening to fp32 on the quarter-rate conversion pipe, F2F).
_WIDEN = os.environ.get("SERVEATTN_FAST_WIDEN", "3")
FAST_WIDEN: tl.constexpr = tl.constexpr(_WIDEN in ("1", "2", "3"))
# The logit scale and the row max folded into one fma before exp2, the row max taken on the unscaled logits (so it
# needs a positive scale: sm_scale and float k_scale are checked; tensor scales and descales live on the device and
# are the caller's to keep positive, API.md), in prefill_kernel and the warp-specialized kernel alike (they stay
# bitwise equal); for fp8 attention P_SCALE rides in that fma's exponent. On since session 12 (H200, alternating
# processes: bf16 +2-3%, fp8 on the warp-specialized kernel +6-12%); SERVEATTN_SOFTMAX_FMA=0 measures without.
SOFTMAX_FMA: tl.constexpr = tl.constexpr(os.environ.get("SERVEATTN_SOFTMAX_FMA", "1") == "1")
# fp8 attention's transposed V copy stores the keys of each 32 in the order the accumulator layout of S holds them
# per lane (attention_ws._p_operand_permuted), so the warp-specialized kernel hands P to the tensor cores without
# lane shuffles; prefill_kernel reads the copy back in key order (vt_column). Outputs stay bitwise equal to
# prefill_kernel's (H200 GPU tests). On since session 13 (H200, alternating processes: fp8 prefill +4-5% at
# 1x4096..16x2048); SERVEATTN_FP8_KEY_ORDER=0 measures without.
FP8_KEY_ORDER: tl.constexpr = tl.constexpr(os.environ.get("SERVEATTN_FP8_KEY_ORDER", "1") == "1")


# Soft caps above this take tanh's series near 0 in the kernels (attention._attend): there the exp form's ~1e-7
# absolute error, times the cap, reaches ~3e-5 of a logit; below, the cheaper form alone (realistic caps: 30-50).
SERIES_CAP = 256.0


def soft_cap_mode(soft_cap: float) -> int:
    """The kernels' SOFT_CAP constexpr: 0 none, 1 the exp form, 2 with the series near 0 (caps above SERIES_CAP)."""
    return 0 if soft_cap <= 0 else (2 if soft_cap > SERIES_CAP else 1)


@triton.jit
def vt_column(n):
    """The column of key n in the transposed V copy: under FP8_KEY_ORDER, key bits (k4 k3 k2 k1 k0) of each 32
    go to column bits (k4 k2 k1 k3 k0); else the key itself."""
    if FP8_KEY_ORDER:
        return (n & ~0x1F) | (n & 0x10) | ((n & 0x6) << 1) | ((n & 0x8) >> 2) | (n & 1)
    else:
        return n


# SERVEATTN_FP8_ROWSUM_MMA (default 1): fp8 attention's row sum l as P x ones on the tensor cores, P * P_SCALE in
# f16 (one conversion a pair; l within 2^-12 a term of the fp32 sum, the LSE within 1e-4), in prefill_kernel and the
# warp-specialized kernel alike: the softmax then has no per-score add and no sum shuffles (WS fp8 loop 607 -> 576
# SASS instructions; kernel time -1.8..-3.5% at 1x4096, 1x8192, 16x2048: docs/fp8.md, session 21). 0: the fp32 sum
# on the CUDA cores (for A/B). (Summing the e4m3 P itself moved the LSE ~1.5%: measured in session 21, not kept.)
ROWSUM_MMA: tl.constexpr = tl.constexpr(os.environ.get("SERVEATTN_FP8_ROWSUM_MMA", "1") == "1")
ROWSUM_N: tl.constexpr = tl.constexpr(16)  # the ones tile's columns in prefill_kernel (tl.dot's smallest N)

# SERVEATTN_DECODE_K_OPERAND (on by default since session 33; =0 turns it off): the bandwidth decode kernel widens an
# fp8 K tile inside the mma operand's registers (widen_in_operand: Triton's exact conversions, which Triton applies
# after the shared-memory load of the fp8 tile, so K skips the bf16 round trip) and gives a 16-bit cache's q.K^T the
# same operand layout (with_8bit_origin on q: kWidth 4, the fp8 tile's), so both dtypes keep the same k-slots and
# bits. V keeps its round trip. H200, one process each way (session 33, docs/runs/2026-12-05T1542-h200-*): fp8-KV
# decode 1.15 -> 1.55x our bf16 at 64x8192 and 1.16 -> 1.52x at 128x4096, for bf16 decode at 4.34-4.39 TB/s instead
# of 4.41-4.44 (a 1% step back against cuDNN there). =0 is for deployments that never hold an fp8 cache. The
# bandwidth kernel's chain verify then takes other k-slots than prefill_kernel's, so it equals a path-shaped tree on
# the tensor-core route to rounding, not bitwise. scripts/probe_k_operand_widen.py: one shared trip fewer for fp8's
# K, more issue in both dtypes. Never under the interpreter (its inline asm does not run there).
_K_OPERAND = os.environ.get("SERVEATTN_DECODE_K_OPERAND", "1") == "1"
K_OPERAND: tl.constexpr = tl.constexpr(_K_OPERAND and not INTERPRET.value)

# SERVEATTN_EARLY_V=0: load an fp8 attention V tile where it is used (for measuring the early load only).
EARLY_V: tl.constexpr = tl.constexpr(os.environ.get("SERVEATTN_EARLY_V", "1") == "1")


@triton.jit
def mma(a, b, acc):
    """acc + a @ b on tensor cores (fp8 operands included); operands upcast to fp32 under the interpreter."""
    if INTERPRET:
        return tl.dot(as_float32(a), as_float32(b), acc)
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
    if x.dtype == dtype or (x.dtype.is_fp8() and dtype.is_fp8()):
        # fp8 attention keeps fp8 operands for the tensor cores, which take e4m3 and e5m2 mixed (an e5m2 tile
        # converted to an e4m3 query's encoding would saturate at 448 and lose its small values)
        return x
    elif x.dtype.is_fp8():
        if INTERPRET:
            bits = x.to(tl.uint8, bitcast=True).to(tl.uint32)
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
            # the sign as a bit (negating would turn -0 into +0 under the interpreter)
            value = (value.to(tl.uint32, bitcast=True) | ((bits >> 7) << 31)).to(tl.float32, bitcast=True)
            return to_dtype(value, dtype)
        elif FAST_WIDEN and dtype == tl.bfloat16:
            return _fp8_to_bf16(x)
        elif FP8_BOUNDARY:
            return _operand_boundary(x.to(dtype))
        else:
            return x.to(dtype)
    else:
        return x


@triton.jit
def widen_in_operand(x, dtype: tl.constexpr):
    """An fp8 tile in dtype by Triton's own conversions (exact: e4m3 / e5m2 -> f16 -> f32 -> bf16, the same 4
    instructions a pair as _fp8_to_bf16's), which, unlike inline asm, Triton moves past the shared-memory load into
    the dot operand's layout (kWidth 4): K_OPERAND."""
    if dtype == tl.bfloat16:
        return x.to(tl.float16).to(tl.float32).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def with_8bit_origin(x, byte):
    """x itself; `byte`, an 8-bit load, only joins x's backward slice, where Triton looks for the narrowest load to
    lay out a dot operand (AccelerateMatmul's computeOrigBitWidth): a 16-bit tile's dot then takes the fp8 tile's
    kWidth 4, hence its k-slots (K_OPERAND)."""
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h,r", [x, byte.to(tl.int32)], dtype=x.dtype,
                                     is_pure=True, pack=1)


def _fp8_to_bf16_asm(shift: int, mag: str, scale: str, carry: str, specials: bool = True) -> str:
    """PTX turning 4 fp8 bytes ($2) into 4 bf16 ($0, $1). Per pair: a holds the two bytes in the high byte of
    each 16-bit half; u = (a >> shift) & mag is each code's magnitude in bf16's bit positions, t = u | sign,
    multiplied by `scale`. u + carry sets a half's bit 15 exactly where the code's exponent (e4m3fn: exponent
    and mantissa) is all ones; prmt's sign-replicating selectors (0x9, 0xB) spread that bit over its half, and
    bf16's exponent 0x7F80 taken from it is OR-ed into the product: inf (zero mantissa) or NaN, signed."""
    pair = (f"shr.b32 u, a, {shift}; and.b32 u, u, {mag}; and.b32 t, a, 0x80008000; or.b32 t, t, u; "
            f"fma.rn.bf16x2 t, t, k, z; ")
    if specials:
        pair += f"add.u32 n, u, {carry}; prmt.b32 n, n, 0, 0xBB99; and.b32 n, n, 0x7F807F80; "
    else:  # measuring only (SERVEATTN_FAST_WIDEN=2): NaN/inf codes come out finite
        pair += "mov.b32 n, 0; "
    return (f"{{ .reg .b32 a, u, t, n, k, z; mov.b32 k, {scale}; mov.b32 z, 0x80008000; "
            f"prmt.b32 a, $2, 0, 0x1404; {pair}or.b32 $0, t, n; "
            f"prmt.b32 a, $2, 0, 0x3424; {pair}or.b32 $1, t, n; }}")


def _fp8_to_bf16_cvt_asm(encoding: str) -> str:
    """PTX turning 4 fp8 bytes ($2) into 4 bf16 ($0, $1) through fp16 and fp32, 4 SASS instructions a pair: one
    F2FP unpacks two codes into f16x2 (exact: every fp8 value is an f16 value, e4m3 subnormals normal in f16), two
    HADD2.F32 widen the halves (exact), and a PRMT keeps each fp32's high half: every fp8 value has at most 3
    significant bits, so the dropped low halves are zero and the truncation is exact; NaN stays NaN (a quiet fp32
    NaN's high half is a bf16 NaN), inf stays inf. F2FP is the only conversion; HADD2.F32 issues on the FMA pipe
    (ptxas lowers cvt.f32.f16 to it; sm_90 SASS checked with scripts/compile_probe.py)."""
    pair = ("cvt.rn.f16x2.{e}x2 h, {half}; mov.b32 {{a, b}}, h; cvt.f32.f16 f, a; cvt.f32.f16 g, b; "
            "prmt.b32 {out}, f, g, 0x7632; ")
    return ("{ .reg .b16 lo, hi, a, b; .reg .b32 h, f, g; mov.b32 {lo, hi}, $2; "
            + pair.format(e=encoding, half="lo", out="$0") + pair.format(e=encoding, half="hi", out="$1") + "}")


if _WIDEN == "3":
    E4M3_TO_BF16: tl.constexpr = tl.constexpr(_fp8_to_bf16_cvt_asm("e4m3"))
    E5M2_TO_BF16: tl.constexpr = tl.constexpr(_fp8_to_bf16_cvt_asm("e5m2"))
else:
    # e4m3fn s.eeee.mmm -> bf16 bits s.0000eeee.mmm0000 (magnitude at most 0x07F0, the NaN code), times 2^120.
    E4M3_TO_BF16: tl.constexpr = tl.constexpr(_fp8_to_bf16_asm(4, "0x07F007F0", "0x7B807B80", "0x78107810",
                                                               _WIDEN != "2"))
    # e5m2 s.eeeee.mm -> s.000eeeee.mm00000 (inf/NaN from 0x0F80), times 2^112.
    E5M2_TO_BF16: tl.constexpr = tl.constexpr(_fp8_to_bf16_asm(3, "0x0FE00FE0", "0x77807780", "0x70807080",
                                                               _WIDEN != "2"))


@triton.jit
def _fp8_to_bf16(x):
    """An fp8 tile in bf16, exactly (E4M3_TO_BF16 / E5M2_TO_BF16: SERVEATTN_FAST_WIDEN says which PTX).

    Triton's own conversion goes through fp16 and fp32 too, but widens f16 -> f32 with F2F, a conversion on the
    quarter-rate pipe, twice a pair: a decode reading fp8 at full bandwidth needs about 15 values a clock per SM.
    Opaque (is_pure=False) like `_operand_boundary`, so the dot that consumes the tile lays it out as it lays out
    a 16-bit load (the same k-slots, so the same bits as the dequantized cache)."""
    if x.dtype == tl.float8e4nv:
        asm: tl.constexpr = E4M3_TO_BF16
    else:
        asm: tl.constexpr = E5M2_TO_BF16
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                     is_pure=False, pack=4)


@triton.jit
def _operand_boundary(x):
    """x unchanged, behind an opaque move. Triton picks a tensor-core operand's register layout (mma v2's
    kWidth) from the narrowest load its value came from: a K/V tile widened from fp8 would get kWidth 4 where
    the same tile loaded as 16-bit gets 2, which permutes the products each mma sums and rounds the logits
    differently. The move (kept by is_pure=False) hides the fp8 load, so both take the 16-bit layout and an fp8
    cache gives, bitwise, the result of its dequantized copy."""
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [x], dtype=x.dtype, is_pure=False, pack=1)


@triton.jit
def to_float32(x):
    """A 16-bit tile in float32, exactly. Under the interpreter, whose bf16 -> fp32 conversion garbles
    subnormals, bf16 is widened from its bits."""
    if INTERPRET:
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        # numpy's matmul sums in an order that follows its operands' memory layout, and bf16's bit path above
        # leaves a row-major array: f16 gets one too (an operation with a splat), so tiles of equal values in
        # either dtype give one product (decode's F16_SCORES against the bf16 loop)
        return (x.to(tl.float32).to(tl.uint32, bitcast=True) | 0).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def to_fp8(x, dtype: tl.constexpr):
    """fp32 -> fp8 (`dtype` tl.float8e4nv or tl.float8e5) rounded to nearest, ties to even. Meant for x
    within the format's range or NaN (callers saturate first; on sm_89+ GPUs Triton converts with
    cvt.rn.satfinite, which saturates too). On a GPU the plain conversion; under the interpreter, whose fp8
    rounding is wrong (it rounds half up on one bit and lets a rounded-up mantissa spill into the
    exponent), the bits are built from x's bits, out-of-range values and +-inf saturating to the largest
    finite value and NaN giving a NaN (0x7F | sign)."""
    if INTERPRET:
        if dtype == tl.float8e4nv:
            mbits = 3  # e4m3fn: 3 mantissa bits, bias 7, largest finite 448 (fp32 bits 0x43E00000)
            bias = 7
            max_bits = 0x43E00000
        else:
            mbits = 2  # e5m2: 2 mantissa bits, bias 15, largest finite 57344 (fp32 bits 0x47600000)
            bias = 15
            max_bits = 0x47600000
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = tl.minimum(bits & 0x7FFFFFFF, max_bits)  # saturate (NaN is put back below)
        # |x| >= 2^(1-bias), fp8 normal: drop 23 - mbits mantissa bits with round-half-even; a carry
        # out of the mantissa moves into the exponent, which is then rebiased from 127 to `bias`.
        shift = 23 - mbits
        normal = ((a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift) - ((127 - bias) << mbits)
        # |x| < 2^(1-bias), fp8 subnormal: k = round-half-even(|x| / 2^(1-bias-mbits)) with
        # |x| = m * 2^(max(e, 1) - 150); k = 2^mbits is the smallest normal, which encodes as k too.
        e = a >> 23
        m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0).to(tl.uint32)
        sh = 151 - bias - mbits - tl.maximum(e.to(tl.int32), 1)  # >= 24 - mbits where it is used
        sh = tl.minimum(tl.maximum(sh, 1), 31).to(tl.uint32)  # no shift by >= 32 (m < 2^24 gives 0)
        sub = (m + ((tl.full(m.shape, 1, tl.uint32) << (sh - 1)) - 1) + ((m >> sh) & 1)) >> sh
        out = tl.where(a >= ((128 - bias) << 23), normal, sub) | sign
        out = tl.where(x == x, out, 0x7F | sign)
        return out.to(tl.uint8).to(dtype, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def narrow(x, dtype: tl.constexpr):
    """fp32 -> `dtype`, rounded to nearest even also under the interpreter (bf16 and fp8 there)."""
    if dtype.is_fp8():
        return to_fp8(x, dtype)
    else:
        return to_dtype(x, dtype)


@triton.jit
def as_float32(x):
    """Any tile (fp8, 16-bit, fp32) in float32, exactly, also under the interpreter."""
    if x.dtype.is_fp8():
        return widen(x, tl.float32)
    else:
        return to_float32(x)
