"""The warp-specialized Hopper prefill kernel on a machine without a GPU: it compiles for sm_90 (Gluon is not
interpreted, so this is what CPU CI can hold it to), and calls it does not serve go to prefill_kernel."""
import os
import re
import subprocess
import sys

import pytest
import torch

from serveattn.kernels import attention_ws as ws
from serveattn.kernels.common import ROWSUM_MMA
from helpers import ROOT, compile_for_sm90


@pytest.mark.parametrize("dtype, head_dim, softmax_fma", [("bf16", 128, "0"), ("bf16", 64, "0"), ("fp8e4nv", 128, "0"),
                                                        ("bf16", 128, "1"), ("fp8e4nv", 128, "1")])
def test_compiles_for_sm90_with_the_designed_schedule(dtype, head_dim, softmax_fma, tmp_path):
    """Compiled in a fresh process (the suite runs under TRITON_INTERPRET=1, which Gluon does not take), also with
    SERVEATTN_SOFTMAX_FMA=1 (scale and row max in one fma, as prefill_kernel under the same switch)."""
    compile_for_sm90(tmp_path, "--kernel", "prefill-ws", "--q", dtype, "--head-dim", str(head_dim),
                     SERVEATTN_SOFTMAX_FMA=softmax_fma)
    ptx = (tmp_path / "prefill-ws.ptx").read_text()
    # two consumer groups, each: S(0) before the loop, S(j+1) and P.V(j) in it, the last P.V after it (head_dim / 16
    # and BLOCK_N / 16 k-steps)
    k_step = 32 if dtype.startswith("fp8") else 16  # a wgmma reads 32 bytes of each row
    # fp8 (common.ROWSUM_MMA): each P.V has a row-sum twin, P in f16 times ones (BLOCK_N / 16 k-steps)
    row_sum = 2 * ws.BLOCK_N.value // 16 if dtype.startswith("fp8") and ROWSUM_MMA.value else 0
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 2 * (2 * head_dim // k_step + 2 * ws.BLOCK_N.value // k_step
                                                             + row_sum)
    assert "cp.async.bulk.tensor" in ptx  # the producer's TMA
    # P.V(j) (and its row-sum twin) stays in flight over softmax(j+1)
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+%d;" % (2 if row_sum else 1), ptx)
    assert str(ws.PRODUCER_REGS.value) in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)
    assert (len(re.findall(r"fma\.rn\.f32", ptx)) > 0) == (softmax_fma == "1")  # fp contraction is off otherwise
    # fp8 at head dim 128 branches around the accumulator's rescale when both of a thread's row maxima stayed
    assert ("SKIP_RESCALE" in ptx) == (dtype.startswith("fp8") and head_dim == 128)


def test_fp8_key_order_hands_p_over_without_lane_shuffles(tmp_path):
    """SERVEATTN_FP8_KEY_ORDER (on by default): fp8 P goes to the second product in the key
    order the accumulator of S holds per lane (V^T written alike), so the layout change to the A operand moves
    no value between lanes: the compiled kernel keeps only the row reductions' shuffles (sm_90 SASS, session 12:
    SHFL 96 -> 32, PRMT 584 -> 519, 6840 -> 6600 instructions)."""
    shuffles = {}
    for key_order in ("0", "1"):
        out = tmp_path / key_order
        compile_for_sm90(out, "--kernel", "prefill-ws", "--q", "fp8e4nv", "--kv", "fp8e4nv", "--vt",
                         SERVEATTN_FP8_KEY_ORDER=key_order)
        ptx = (out / "prefill-ws.ptx").read_text()
        shuffles[key_order] = len(re.findall(r"shfl\.sync", ptx))
    assert shuffles["1"] < shuffles["0"], shuffles


def test_measuring_switches_compile(tmp_path):
    """The measuring switch SERVEATTN_PREFILL_WS_TRACE (%clock64 stamps into the LSE buffer, scripts/probe_ws_trace.py)
    keeps compiling, beside the default epilogue (the output through shared memory: 16-byte stores, 8 a thread,
    instead of 32 of 4 bytes)."""
    compile_for_sm90(tmp_path, "--kernel", "prefill-ws", "--q", "bf16", SERVEATTN_PREFILL_WS_TRACE="1")
    ptx = (tmp_path / "prefill-ws.ptx").read_text()
    assert "%clock64" in ptx
    # two consumer groups, 8 stores each of 16-byte pieces of whole rows
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 2 * 8


def test_not_served_off_the_gpu():
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    assert ws.serves(q, q, q, plan=None, descales=None) is False


@pytest.mark.parametrize("layout", ["NHD", "HND", "interleaved-NHD", "interleaved-HND", "strided"])
def test_tma_view_addresses_every_key(layout):
    """The producer's 2-D view: row page * page_rows + head_rows * h + slot, column head_cols * h is the element
    offset of (page, slot, head) for every cache form the wrappers accept (host arithmetic, no GPU needed)."""
    pages, ps, heads, d = 6, 16, 4, 128
    if layout == "NHD":
        k = torch.zeros(pages, ps, heads, d, dtype=torch.bfloat16)
        strides = (k.stride(0), k.stride(1), k.stride(2))
    elif layout == "HND":
        k = torch.zeros(pages, heads, ps, d, dtype=torch.bfloat16)
        strides = (k.stride(0), k.stride(2), k.stride(1))
    elif layout == "interleaved-NHD":
        k = torch.zeros(pages, 2, ps, heads, d, dtype=torch.bfloat16)[:, 1]
        strides = (k.stride(0), k.stride(1), k.stride(2))
    elif layout == "interleaved-HND":
        k = torch.zeros(pages, 2, heads, ps, d, dtype=torch.bfloat16)[:, 0]
        strides = (k.stride(0), k.stride(2), k.stride(1))
    else:
        k = torch.zeros(pages, 3, ps, heads, d, dtype=torch.bfloat16)[:, 1:][:, 0]
        strides = (k.stride(0), k.stride(1), k.stride(2))
    slot_stride, page_rows, head_rows, head_cols = ws._row_map(k, strides, heads, d)
    desc, rows = ws._descriptor(k, slot_stride, ps, d)
    assert desc.block_shape == [ps, d] and desc.strides == [slot_stride, 1]
    for p in range(pages):
        for s in range(ps):
            for h in range(heads):
                row, col = p * page_rows + head_rows * h + s, head_cols * h
                assert row < rows and col + d <= slot_stride
                assert row * slot_stride + col == p * strides[0] + s * strides[1] + h * strides[2]


def test_tma_view_declines_what_it_cannot_address():
    k = torch.zeros(4, 16, 4, 128, dtype=torch.bfloat16)
    assert ws._row_map(k, (k.stride(0), k.stride(1), 100), 4, 128) is None  # heads overlap within a slot row
    assert ws._row_map(k, (1000, k.stride(1), k.stride(2)), 4, 128) is None  # pages not a whole number of rows
    assert ws._row_map(k.transpose(2, 3), (k.stride(0), k.stride(1), k.stride(2)), 4, 128) is None  # d strided
    # 16-byte alignment in bytes: a slot stride of 520 elements suits bf16 (1040 B), not fp8 (520 B)
    wide = torch.zeros(4, 16, 520, dtype=torch.bfloat16)
    assert ws._row_map(wide, (wide.stride(0), 520, 128), 4, 128) is not None
    narrow = torch.zeros(4, 16, 520, dtype=torch.float8_e4m3fn)
    assert ws._row_map(narrow, (narrow.stride(0), 520, 128), 4, 128) is None

def test_a_triton_without_gluon_still_serves_prefill():
    """serveattn imports and prefills (prefill_kernel) where Triton has no Gluon Hopper API (before 3.6)."""
    code = """
import builtins
real = builtins.__import__
def without_gluon(name, globals=None, *args, **kwargs):
    # serveattn's own imports only: Triton's runtime imports its Gluon modules too
    if name.startswith("triton.experimental.gluon") and (globals or {}).get("__name__", "").startswith("serveattn"):
        raise ImportError("no gluon here")
    return real(name, globals, *args, **kwargs)
builtins.__import__ = without_gluon
import torch, serveattn
from serveattn.kernels import attention
assert attention.attention_ws is None
q, k, v = (torch.randn(5, 2, 64, dtype=torch.float16, device=DEVICE) for _ in range(3))
out = serveattn.single_prefill_with_kv_cache(q, k, v, causal=True, backend="triton")
assert out.shape == q.shape and not torch.isnan(out).any()
print("ok")
"""
    # on a GPU machine the real kernel (prefill_kernel) on the GPU, else the interpreter
    gpu = torch.cuda.is_available()
    env = dict(os.environ, TRITON_INTERPRET="0" if gpu else "1", PYTHONPATH=ROOT)
    code = code.replace("DEVICE", repr("cuda" if gpu else "cpu"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_fp8_attention_takes_the_kernel_where_it_serves(monkeypatch):
    """fp8 attention takes the warp-specialized kernel unless SERVEATTN_PREFILL_WS_FP8=0, and only where it will
    serve: V^T made (more than one 128-row query tile), TMA-friendly pages, head dim 64 or 128, sm_90."""
    monkeypatch.setattr(ws, "_capability", lambda device: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("SERVEATTN_PREFILL_WS_FP8", "0")
    assert not ws.takes_fp8(cuda, 128, 16, 4096)
    monkeypatch.delenv("SERVEATTN_PREFILL_WS_FP8")  # the default
    assert ws.takes_fp8(cuda, 128, 16, 4096) and ws.takes_fp8(cuda, 64, None, 4096)
    assert not ws.takes_fp8(cuda, 128, 16, 128)  # one query tile: no V^T
    assert not ws.takes_fp8(cuda, 128, 16, None)  # CUDA graphs: no V^T
    assert not ws.takes_fp8(cuda, 128, 12, 4096) and not ws.takes_fp8(cuda, 128, 4, 4096)  # pages
    assert not ws.takes_fp8(cuda, 256, 16, 4096)
    assert not ws.takes_fp8(torch.device("cpu"), 128, 16, 4096)
    monkeypatch.setattr(ws, "_capability", lambda device: (8, 0))
    assert not ws.takes_fp8(cuda, 128, 16, 4096)


def test_tma_descriptor_validates_once_and_equals_the_dataclass():
    """_tma_descriptor skips TensorDescriptor's checks after a (dtype, strides, block shape) passed them once: the
    result equals the dataclass built the usual way, and a misaligned base or an empty shape is still checked."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    t = torch.randn(64, 8, 128, dtype=torch.bfloat16)
    shape, strides, block = [64 * 8, 128], [128, 1], [16, 128]
    def fields(desc):  # the base by identity (tensors do not compare as one bool)
        return {k: (id(v) if k == "base" else v) for k, v in vars(desc).items()}

    later = t[8:]
    first = ws._tma_descriptor(t, shape, strides, block)
    again = ws._tma_descriptor(later, [56 * 8, 128], strides, block)
    assert (t.dtype, tuple(strides), tuple(block)) in ws._VALIDATED
    layout = ws._smem_layout((16, 128), t.dtype)
    assert fields(first) == fields(TensorDescriptor(t, shape, strides, block, layout))
    assert fields(again) == fields(TensorDescriptor(later, [56 * 8, 128], strides, block, layout))
    assert type(again) is TensorDescriptor
    flat = t.view(-1)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        ws._tma_descriptor(flat[1:], [100, 128], strides, block)  # 2-byte offset: checked again, refused
    with pytest.raises(AssertionError, match="shape must be positive"):
        ws._tma_descriptor(t, [0, 128], strides, block)


def test_measuring_knockouts_are_off_unless_named(monkeypatch):
    """SERVEATTN_PREFILL_WS_KNOCKOUT (scripts/probe_knockouts.sh) gives wrong results by design: unset, every switch
    is off; each name turns on its own switch only."""
    import importlib
    names = {"softmax": "KNOCK_SOFTMAX", "exp": "KNOCK_EXP", "rowstats": "KNOCK_ROWSTATS", "pv": "KNOCK_PV",
             "kv": "KNOCK_KV"}
    try:
        for value, on in [(None, set()), ("", set()), ("exp,kv", {"exp", "kv"}), ("pv", {"pv"})]:
            if value is None:
                monkeypatch.delenv("SERVEATTN_PREFILL_WS_KNOCKOUT", raising=False)
            else:
                monkeypatch.setenv("SERVEATTN_PREFILL_WS_KNOCKOUT", value)
            mod = importlib.reload(ws)
            assert {n for n, attr in names.items() if getattr(mod, attr).value} == on
    finally:
        monkeypatch.undo()
        importlib.reload(ws)
