"""fp8 KV caches under a 16-bit query: every route equals, bitwise, the same call on cache.to(q.dtype)."""
import itertools
import re
import zlib

import pytest
import torch
import triton
import triton.language as tl

import serveattn
from serveattn.kernels.common import widen
from serveattn import reference
from helpers import compile_for_sm90, fp8_decode_runs, make_paged_batch, rel_err, script_module

ENCODINGS = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.37, 2.5
ROUTES = ["single_prefill", "ragged", "paged", "decode", "decode_tc", "single_decode", "cascade"]


def _cases():
    cycle = itertools.cycle(itertools.product([torch.float16, torch.bfloat16], ["NHD", "HND"]))
    for route, enc, head_dim in itertools.product(ROUTES, ENCODINGS, [64, 128, 256]):
        q_dtype, layout = next(cycle)
        yield pytest.param(route, enc, head_dim, q_dtype, layout,
                           id=f"{route}-{str(enc)[6:]}-d{head_dim}-{str(q_dtype)[6:]}-{layout}")


def _fp8_batch(gen, enc, q_dtype, head_dim, layout, qo_lens, kv_lens, device):
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=head_dim,
                         page_size=16, dtype=torch.float32, kv_layout=layout, device=device)
    b.q = b.q.to(q_dtype)
    b.cache = (b.cache * 4).to(enc)  # spread over the format's range, not only near 1
    return b


def _run_route(route, b, cache, kv_dtype, q_dtype, head_dim, layout, k_scale, v_scale, device):
    """(out, lse) of one route on `cache` (fp8 or its 16-bit copy), with the given scales."""
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=device)
    kw = dict(k_scale=k_scale, v_scale=v_scale)
    if route == "paged":
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, layout, backend="triton")
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, head_dim, 16, causal=True,
               q_data_type=q_dtype, kv_data_type=kv_dtype)
        return w.run(b.q, cache, return_lse=True, **kw)
    if route in ("decode", "decode_tc"):
        q = b.q[b.qo_indptr[1:].long() - 1]  # one row per request
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=route == "decode_tc",
                                                         backend="triton")
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, head_dim, 16, q_data_type=q_dtype,
               kv_data_type=kv_dtype, fixed_split_size=2)
        return w.run(q, cache, return_lse=True, **kw)
    if route == "cascade":
        # level 0: the first request's pages shared by every query row; level 1: each request's own pages
        total = int(b.qo_indptr[-1])
        n0 = int(b.kv_indptr[1])
        w = serveattn.MultiLevelCascadeAttentionWrapper(2, ws, layout, backend="triton")
        i32 = dict(dtype=torch.int32, device=device)
        w.plan([torch.tensor([0, total], **i32), b.qo_indptr],
               [torch.tensor([0, n0], **i32), b.kv_indptr],
               [b.kv_indices[:n0], b.kv_indices],
               [b.last_page_len[:1], b.last_page_len], 8, 2, head_dim, 16, causal=True, q_data_type=q_dtype,
               kv_data_type=kv_dtype)
        return w.run(b.q, cache, return_lse=True, **kw)
    k, v, kv_indptr = reference.gather_paged(cache, b.kv_indptr, b.kv_indices, b.last_page_len, layout)
    if layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    if route == "ragged":
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, layout, backend="triton")
        w.plan(b.qo_indptr, kv_indptr.to(torch.int32).to(device), 8, 2, head_dim, causal=True, q_data_type=q_dtype,
               kv_data_type=kv_dtype)
        return w.run(b.q, k, v, return_lse=True, **kw)
    # single request: the first one
    q0, q1 = int(b.qo_indptr[0]), int(b.qo_indptr[1])
    n = int(kv_indptr[1])
    ks, vs = (k[:, :n], v[:, :n]) if layout == "HND" else (k[:n], v[:n])
    if route == "single_prefill":
        return serveattn.single_prefill_with_kv_cache(b.q[q0:q1], ks, vs, causal=True, kv_layout=layout,
                                                      backend="triton", return_lse=True, **kw)
    return serveattn.single_decode_with_kv_cache(b.q[q1 - 1], ks, vs, kv_layout=layout, backend="triton",
                                                 return_lse=True, **kw)


@pytest.mark.parametrize("route,enc,head_dim,q_dtype,layout", list(_cases()))
def test_fp8_cache_equals_dequantized_cache_bitwise(route, enc, head_dim, q_dtype, layout, device):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{route}{enc}{head_dim}".encode()))
    b = _fp8_batch(gen, enc, q_dtype, head_dim, layout, qo_lens=[5, 0, 3, 7], kv_lens=[40, 0, 77, 7],
                   device=device)  # request 1 empty
    wide = b.cache.to(q_dtype)  # exact: every fp8 value is a 16-bit value
    out8, lse8 = _run_route(route, b, b.cache, enc, q_dtype, head_dim, layout, K_SCALE, V_SCALE, device)
    out16, lse16 = _run_route(route, b, wide, q_dtype, q_dtype, head_dim, layout, K_SCALE, V_SCALE, device)
    assert torch.equal(out8, out16) and torch.equal(lse8, lse16)
    # A/B: a kernel that dropped either fold would not pass the equality above
    no_k, _ = _run_route(route, b, wide, q_dtype, q_dtype, head_dim, layout, 1.0, V_SCALE, device)
    no_v, _ = _run_route(route, b, wide, q_dtype, q_dtype, head_dim, layout, K_SCALE, 1.0, device)
    assert not torch.equal(out8, no_k) and not torch.equal(out8, no_v)


@pytest.mark.parametrize("enc", ENCODINGS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_len", [1, 3], ids=["decode", "chain3"])
def test_f16_scores_keep_the_dequantized_bits(enc, q_len, device, monkeypatch):
    """SERVEATTN_DECODE_F16_SCORES (kernels/decode.F16_SCORES, measuring): a bf16 query tile that f16 holds exactly
    takes q.K^T in f16 over the fp8 K tile; the result stays, bit for bit, the run on the dequantized cache and the
    run without the switch, every row written. Tiles whose query holds a value f16 cannot (a bf16 bit below f16's
    2^-24, 70000, a row of 2^-30) take the bf16 product; chains and split requests included."""
    from serveattn.kernels import decode as decode_kernel
    gen = torch.Generator().manual_seed(zlib.crc32(f"f16-scores-{enc}-{q_len}".encode()))
    kv_lens = [90, 0 if q_len == 1 else 3, 200, 33, 129, 64]  # an empty request where decode allows it
    b = _fp8_batch(gen, enc, torch.bfloat16, 64, "NHD", [q_len] * len(kv_lens), kv_lens, device)
    b.q = torch.where(b.q.abs() < 2.0 ** -8, 2.0 ** -8, b.q)  # no draw below f16's precision: only planted ones
    q = b.q.view(len(kv_lens), q_len, 8, 64)
    q[2, -1, 1, 5] = (1 + 2.0 ** -7) * 2.0 ** -20  # a bf16 bit at 2^-27, below f16's 2^-24: inexact
    q[3, 0, 6, 60] = 70000.0  # past f16's range
    q[4, :, 3] = 2.0 ** -30  # far below: inexact
    q[5, 0, 0, 0] = 2.0 ** -17  # from 2^-17 up every bf16 value is an f16 value: request 5 stays exact
    # (request, KV head) tiles f16 holds: both kinds present, the planted ones where planted
    exact = (q.to(torch.float16).to(torch.bfloat16) == q).view(len(kv_lens), q_len, 2, 4, 64).permute(0, 2, 1, 3, 4)
    exact = exact.flatten(2).all(2)
    assert not exact[2, 0] and not exact[3, 1] and not exact[4, 0] and exact[5].all() and exact[0].all()
    results = fp8_decode_runs(monkeypatch, decode_kernel, [{"F16_SCORES": False}, {"F16_SCORES": True}], b, enc,
                              (8, 2), 64, q_len, device, dict(fixed_split_size=4), K_SCALE, V_SCALE)
    out, lse = results[1, enc]
    assert not out.isnan().any() and not lse.isnan().any()
    for other in (results[0, enc], results[1, torch.bfloat16]):
        assert torch.equal(out, other[0]) and torch.equal(lse, other[1])
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   causal=True, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 1e-2


def test_fp8_paged_prefill_against_reference(device):
    gen = torch.Generator().manual_seed(12)
    b = _fp8_batch(gen, torch.float8_e4m3fn, torch.bfloat16, 128, "NHD", [6, 9], [50, 90], device)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    out = w.run(b.q, b.cache, k_scale=K_SCALE, v_scale=V_SCALE)
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   causal=True, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 1e-2


def test_cache_dtype_must_match_the_plan(device):
    gen = torch.Generator().manual_seed(13)
    b = _fp8_batch(gen, torch.float8_e5m2, torch.float16, 64, "NHD", [1, 1], [20, 30], device)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend="triton")
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 64, 16, q_data_type=torch.float16,
           kv_data_type=torch.float8_e5m2)
    with pytest.raises(ValueError, match="k cache has dtype torch.float16 but the plan declared torch.float8_e5m2"):
        w.run(b.q[:2], b.cache.to(torch.float16))
    with pytest.raises(ValueError, match="k cache has dtype torch.float8_e4m3fn but the plan declared"):
        w.run(b.q[:2], b.cache.view(torch.uint8).view(torch.float8_e4m3fn))


def test_append_into_fp8_cache_is_exact(device):
    gen = torch.Generator().manual_seed(14)
    for enc in ENCODINGS:
        cache = (torch.randn(6, 2, 4, 2, 64, generator=gen) * 3).to(enc).to(device)
        k = (torch.randn(5, 2, 64, generator=gen) * 3).to(enc).to(device)
        v = (torch.randn(5, 2, 64, generator=gen) * 3).to(enc).to(device)
        indptr = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
        indices = torch.tensor([4, 1, 0, 5, 3], dtype=torch.int32, device=device)
        last = torch.tensor([3, 1], dtype=torch.int32, device=device)
        batch_indices = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32, device=device)
        positions = torch.tensor([5, 6, 6, 7, 8], dtype=torch.int32, device=device)
        want = reference.append_paged_kv_cache(k, v, batch_indices, positions, cache, indices, indptr, last)
        for backend in ("torch", "triton"):
            got = cache.clone()
            serveattn.append_paged_kv_cache(k, v, batch_indices, positions, got, indices, indptr, last,
                                            backend=backend)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (enc, backend)


@pytest.mark.parametrize("route", ["paged", "decode", "decode_tc", "single_prefill", "single_decode"])
def test_tensor_scales_are_read_in_the_kernel(route, device):
    """One-element float32 device tensors serve as k_scale / v_scale (graph-safe: no host read)."""
    gen = torch.Generator().manual_seed(15)
    b = _fp8_batch(gen, torch.float8_e4m3fn, torch.bfloat16, 64, "NHD", [4, 6], [30, 50], device)
    ks = torch.tensor([K_SCALE], dtype=torch.float32, device=device)
    vs = torch.tensor([V_SCALE], dtype=torch.float32, device=device)
    out_t, lse_t = _run_route(route, b, b.cache, torch.float8_e4m3fn, torch.bfloat16, 64, "NHD", ks, vs, device)
    out_f, lse_f = _run_route(route, b, b.cache, torch.float8_e4m3fn, torch.bfloat16, 64, "NHD", K_SCALE, V_SCALE,
                              device)
    assert rel_err(out_t, out_f.double()) < 1e-2
    assert (lse_t - lse_f).abs().max().item() < 1e-3
    wide_t, _ = _run_route(route, b, b.cache.to(torch.bfloat16), torch.bfloat16, torch.bfloat16, 64, "NHD", ks, vs,
                           device)
    assert torch.equal(out_t, wide_t)


@triton.jit
def _widen_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, widen(tl.load(X + i), Y.dtype.element_ty))


@pytest.mark.parametrize("enc", ENCODINGS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_widen_every_fp8_code(enc, dtype, device):
    """kernels/common.widen, the one place fp8 K/V is dequantized (bit-level on the GPU for bf16), gives what
    torch's conversion gives for all 256 codes of each encoding: zeros' signs, subnormals, NaN, e5m2 inf."""
    codes = torch.arange(256, dtype=torch.uint8, device=device).repeat(4).view(enc)  # 1024: a 2-D-sized tile
    out = torch.full(codes.shape, float("nan"), dtype=dtype, device=device)
    _widen_kernel[(1,)](codes, out, N=codes.numel())
    want = codes.to(dtype)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))  # bitwise: signed zeros too


@pytest.mark.parametrize("enc", ENCODINGS, ids=["e4m3", "e5m2"])
def test_widening_through_fp16_and_fp32_is_exact_for_every_code(enc):
    """The arithmetic SERVEATTN_FAST_WIDEN=3's PTX relies on (common._fp8_to_bf16_cvt_asm), on the host: fp8 -> f16
    -> f32 exactly, then the f32's high half is the code's bf16 for all 256 codes (its low half is zero: fp8 values
    have at most 3 significant bits), NaN staying NaN. The GPU test above runs the PTX itself."""
    codes = torch.arange(256, dtype=torch.uint8).view(enc)
    f32 = codes.to(torch.float16).to(torch.float32)
    high = (f32.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    want = codes.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(high.isnan(), nan)
    assert torch.equal(high[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert bool(((f32.view(torch.int32) & 0xFFFF)[~nan] == 0).all())


def _decode_sass(tmp_path, widen_mode: str, kv: str, k_operand: str = "0") -> tuple:
    out = tmp_path / f"{kv}-{widen_mode}-k{k_operand}"
    compile_for_sm90(out, "--kernel", "decode", "--kv", kv, "--tiles", "16,64,2,6", SERVEATTN_FAST_WIDEN=widen_mode,
                     SERVEATTN_DECODE_K_OPERAND=k_operand)
    return (out / "decode.sass").read_text(), (out / "decode.ptx").read_text()


@pytest.mark.parametrize("kv", ["fp8e4nv", "fp8e5"])
def test_decode_widening_compiles_to_the_fma_pipe(kv, tmp_path):
    """sm_90 SASS of fp8 decode (CPU): the default widening (SERVEATTN_FAST_WIDEN=3) has no F2F (the quarter-rate
    f16 -> f32 conversion Triton's own path takes) and fewer instructions than the integer path (=1), and the
    product reads its operands as that path's (the same mma.sync and ldmatrix: the same k-slots, so the fp8 run
    stays bitwise its dequantized run). K_OPERAND=0, where the switch widens both K and V; under K_OPERAND=1 K is
    widened by Triton's conversions in its operand, still without F2F."""
    sass3, ptx3 = _decode_sass(tmp_path, "3", kv)
    sass1, ptx1 = _decode_sass(tmp_path, "1", kv)
    ops = lambda sass, op: len(re.findall(r"\s%s[.\s]" % op, sass))  # noqa: E731
    assert ops(sass3, "F2F") == 0 and ops(sass3, "HADD2") > 0 and ops(sass3, "F2FP") > 0
    assert sass3.count(";") < sass1.count(";") * 0.85
    for instr in ("mma.sync", "ldmatrix"):
        assert ptx3.count(instr) == ptx1.count(instr) > 0
    default, _ = _decode_sass(tmp_path, "3", kv, "1")
    assert ops(default, "F2F") == 0


def _decode_ir(tmp_path, kv: str, k_operand: str, **switches: str) -> tuple:
    out = tmp_path / f"{kv}-k{k_operand}-{'-'.join(switches)}"
    compile_for_sm90(out, "--kernel", "decode", "--kv", kv, "--tiles", "16,64,2,6",
                     SERVEATTN_DECODE_K_OPERAND=k_operand, **switches)
    return (out / "decode.ttgir").read_text(), (out / "decode.ptx").read_text()


def _dots(ttgir: str) -> list:
    """The tt.dot lines of a ttgir dump, SSA names and locations dropped: operand types and layouts."""
    return [re.sub(r"%[\w]+|loc\([^)]*\)", "", line).strip() for line in ttgir.splitlines() if "tt.dot " in line]


def test_k_in_operand_gives_both_dtypes_one_layout(tmp_path):
    """SERVEATTN_DECODE_K_OPERAND=1 (the default, common.K_OPERAND), sm_90 on this CPU: the fp8 K tile is widened
    in q.K^T's operand registers (one bf16 shared buffer fewer: no round trip for K), and the bf16 cache's q.K^T
    takes the very same operand layouts (kWidth 4 both), so the k-slots, hence the bits, stay the dequantized
    run's; P.V is untouched (kWidth 2, V still through its round trip)."""
    dots = lambda ttgir: re.sub(r"%[\w]+|loc\([^)]*\)", "", "\n".join(  # noqa: E731
        line for line in ttgir.splitlines() if "tt.dot " in line))
    buffers = lambda ttgir: len(re.findall(r"local_alloc.*x128xbf16", ttgir))  # noqa: E731
    # Q_HELD_FP8 (on by default) gives fp8's q an operand layout of its own origin: compared without it
    fp8, fp8_ptx = _decode_ir(tmp_path, "fp8e4nv", "1", SERVEATTN_DECODE_Q_HELD_FP8="0")
    bf16, bf16_ptx = _decode_ir(tmp_path, "bf16", "1", SERVEATTN_DECODE_Q_HELD_FP8="0")
    fp8_off, _ = _decode_ir(tmp_path, "fp8e4nv", "0", SERVEATTN_DECODE_Q_HELD_FP8="0")
    assert dots(fp8) == dots(bf16)
    widths = re.findall(r"kWidth = (\d)", dots(fp8))
    assert widths and widths == ["4", "4", "2", "2"] * (len(widths) // 4)
    assert buffers(fp8) == buffers(fp8_off) - len(widths) // 4  # one bf16 buffer fewer a KV loop
    assert fp8_ptx.count("mma.sync") == bf16_ptx.count("mma.sync") > 0


def _kv_loop(ttgir: str) -> list:
    """The lines of a decode ttgir's KV loop: the scf.for carrying the [rows, head_dim] fp32 accumulator."""
    lines = ttgir.splitlines()
    start = next(i for i, line in enumerate(lines) if "scf.for" in line and "iter_args" in line and
                 re.search(r"-> \(.*tensor<\d+x128xf32, #mma>", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next(i for i in range(start + 1, len(lines))
               if lines[i].strip().startswith("}") and len(lines[i]) - len(lines[i].lstrip()) == indent)
    return lines[start:end]


@pytest.mark.parametrize("kv,tiles", [("fp8e4nv", "16,64,2,6"), ("bf16", "16,64,2,4")], ids=["e4m3", "bf16"])
def test_q_held_keeps_q_out_of_the_kv_loop(kv, tiles, tmp_path):
    """SERVEATTN_DECODE_Q_HELD=1 (kernels/decode.Q_HELD; fp8 caches by default, Q_HELD_FP8), sm_90 on this CPU:
    without it the KV loop
    reloads q's kWidth-4 operand from shared memory every block (and ptxas shuffles it into the mma's register
    quads); with it no shared -> register load of q is left in the loop, the loop's dots keep the very operand
    layouts (the same k-slots: the same bits), nothing spills and the kernel has fewer instructions."""
    ir = {}
    for held in ("0", "1"):
        out = tmp_path / f"{kv}-held{held}"
        compile_for_sm90(out, "--kernel", "decode", "--kv", kv, "--tiles", tiles, SERVEATTN_DECODE_Q_HELD=held,
                         SERVEATTN_DECODE_Q_HELD_FP8=held)
        ir[held] = ((out / "decode.ttgir").read_text(), (out / "decode.sass").read_text())
    q_loads = lambda ttgir: [line for line in _kv_loop(ttgir)  # noqa: E731
                             if "local_load" in line and "16x128x" in line and "opIdx = 0" in line]
    loop_dots = lambda ttgir: _dots("\n".join(_kv_loop(ttgir)))  # noqa: E731
    assert q_loads(ir["0"][0]) and not q_loads(ir["1"][0])
    assert loop_dots(ir["0"][0]) == loop_dots(ir["1"][0]) and len(loop_dots(ir["1"][0])) == 2
    assert not re.search(r"\s(LDL|STL)[.\s]", ir["1"][1])
    # the KV loop's SASS (the smallest loop holding a block's exp2s): the 8-byte loads of q and their shuffles gone
    hot, sass_loops = {}, script_module("sass_loops")
    for held, (_, sass) in ir.items():
        path = tmp_path / f"{held}.sass"
        path.write_text(sass)
        bodies = [body for _, _, body in sass_loops.loops(str(path)) if sum("MUFU.EX2" in t for t in body) >= 8]
        hot[held] = min(bodies, key=len)
    moves = lambda body: sum(t.split()[0] == "IMAD.MOV.U32" for t in body)  # noqa: E731
    assert len(hot["1"]) < len(hot["0"]) * 0.95 and moves(hot["1"]) < moves(hot["0"]) // 2


@pytest.mark.parametrize("kv,tiles", [("fp8e4nv", "16,64,2,6"), ("bf16", "16,64,2,4")], ids=["e4m3", "bf16"])
def test_fold_call_keeps_the_fused_kv_loop_short(kv, tiles, tmp_path):
    """FOLD_CALL (kernels/decode, on by default), sm_90 on this CPU: the decode kernel with the fused fold calls the
    fold as a function of its own (a .func in the PTX) instead of inlining it, and where the kernel loops over the
    work list (a CUDA graph's fixed grid: ONE_ITEM off) the KV loop that it runs for every block comes out shorter
    than with the fold inlined (whose values squeezed its registers), unspilled."""
    hot, sass_loops = {}, script_module("sass_loops")
    for call in ("0", "1"):
        out = tmp_path / f"{kv}-call{call}"
        compile_for_sm90(out, "--kernel", "decode", "--kv", kv, "--tiles", tiles, "--group", "4", "--fused-merge",
                         SERVEATTN_DECODE_FOLD_CALL=call, SERVEATTN_DECODE_ONE_ITEM="0")
        ptx = (out / "decode.ptx").read_text()
        assert (re.search(r"^\.func .*_merge_request", ptx, re.M) is not None) == (call == "1")
        bodies = [body for _, _, body in sass_loops.loops(str(out / "decode.sass"))
                  if sum("MUFU.EX2" in t for t in body) >= 8]
        hot[call] = min(bodies, key=len)
        assert not any(t.split()[0].startswith(("LDL", "STL")) for t in hot[call])
    assert len(hot["1"]) < len(hot["0"]) * 0.99


def test_one_item_grid_keeps_the_fused_kv_loop_short(tmp_path):
    """ONE_ITEM (kernels/decode, eager launches), sm_90 on this CPU: without the loop over the work list nothing
    is live across the called fold, and bf16 group 4's fused-fold kernel (the split plans of one to 32 requests)
    runs a KV loop as short as the plain kernel's (761 instructions a block against 780), not the looping kernel's
    (829, with 44 register moves to its 27), unspilled. Where the loop stays (a CUDA graph's fixed grid), ITEM_CALL
    runs each item in a called function: 781."""
    hot, sass_loops = {}, script_module("sass_loops")
    for name, one_item, item_call, fused in (("loop", "0", "0", True), ("call", "0", "1", True),
                                             ("one", "1", "0", True), ("plain", "0", "0", False)):
        out = tmp_path / name
        compile_for_sm90(out, "--kernel", "decode", "--kv", "bf16", "--tiles", "16,64,2,4", "--group", "4",
                         *(("--fused-merge",) if fused else ()), SERVEATTN_DECODE_ONE_ITEM=one_item,
                         SERVEATTN_DECODE_ITEM_CALL=item_call)
        bodies = [body for _, _, body in sass_loops.loops(str(out / "decode.sass"))
                  if sum("MUFU.EX2" in t for t in body) >= 8]
        hot[name] = min(bodies, key=len)
        assert not any(t.split()[0].startswith(("LDL", "STL")) for t in hot[name])
    moves = lambda body: sum(t.split()[0] == "MOV" for t in body)  # noqa: E731
    assert len(hot["one"]) <= len(hot["plain"]) < len(hot["loop"]) * 0.96
    assert len(hot["call"]) < len(hot["loop"]) * 0.96
    assert moves(hot["one"]) < moves(hot["loop"]) and moves(hot["call"]) < moves(hot["loop"])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_tiles_keep_the_bitwise_contract(head_dim, monkeypatch):
    """An fp8 cache may pipeline differently from its dequantized copy, but never tile it differently: BLOCK_N
    fixes where the online softmax rescales and the warps fix the order of its row sums, so a tuning that
    changed either for fp8 caches alone would break the bitwise contract on the GPU. Tiles are chosen on the
    host, so this runs without one."""
    from serveattn import prefill
    from serveattn.decode import decode_tiles
    gpu = torch.device("cuda", 0)
    for enc in ENCODINGS:
        for wide in (torch.bfloat16, torch.float16):
            a, b = decode_tiles(head_dim, gpu, enc), decode_tiles(head_dim, gpu, wide)
            assert (a.block_m, a.block_n, a.num_warps) == (b.block_m, b.block_n, b.num_warps)
    # prefill: only an fp8 query (fp8 attention, no bitwise contract) asks for fp8 tiles; a 16-bit query over an
    # fp8 cache gets the 16-bit query's tiles
    asked = []
    real = prefill.choose_tiles

    def spy(*args, fp8=False, **kwargs):
        asked.append(fp8)
        return real(*args, fp8=fp8, **kwargs)
    monkeypatch.setattr(prefill, "choose_tiles", spy)
    b = make_paged_batch(torch.Generator().manual_seed(5), qo_lens=[3], kv_lens=[20], num_qo_heads=4, num_kv_heads=2,
                         head_dim=head_dim, page_size=16, dtype=torch.float32, device="cpu")
    for q_dtype, kv_dtype in ((torch.bfloat16, ENCODINGS[0]), (torch.float16, ENCODINGS[1]), (ENCODINGS[0],) * 2):
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="torch")
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, head_dim, 16, q_data_type=q_dtype,
               kv_data_type=kv_dtype)
    assert asked == [False, False, True]
