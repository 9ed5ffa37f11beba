"""kernels/gather.py: an fp8 paged cache widened into ragged 16-bit rows, bitwise the dequantized cache's rows
(what lets an fp8 cache take the warp-specialized prefill kernel and stay bitwise its dequantized run)."""
import zlib

import numpy as np
import pytest
import torch

from serveattn import reference
from serveattn.kernels import gather
from serveattn.kernels.attention import kv_strides
from helpers import make_paged_batch


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2, None])  # None: a cache in q's dtype
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout, page_size, num_kv_heads", [("NHD", 16, 2), ("HND", 4, 3), ("NHD", 1, 2),
                                                           ("NHD", 64, 5)])  # 64 x 64 x 5: heads in two programs
def test_gathered_rows_are_the_dequantized_cache(fp8, dtype, layout, page_size, num_kv_heads, device):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fp8}{dtype}{layout}{page_size}{num_kv_heads}".encode()))
    qo_lens, kv_lens = [3, 0, 5, 2], [37, 0, 16, 1]  # a partial last page, an empty request, one key
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=num_kv_heads,
                         num_kv_heads=num_kv_heads, head_dim=64, page_size=page_size, dtype=torch.float32,
                         kv_layout=layout, tuple_cache=True, device=device)
    # fp8: spread over the format's range, subnormals included
    k8, v8 = ((t * 8).to(fp8 or dtype) for t in b.cache)
    ref_k, ref_v, ref_indptr = reference.gather_paged((k8.to(dtype), v8.to(dtype)), b.kv_indptr, b.kv_indices,
                                                     b.last_page_len, layout)
    tokens = int(ref_indptr[-1])
    pages = np.diff(b.kv_indptr.cpu().numpy())
    page_req = torch.from_numpy(np.repeat(np.arange(pages.size, dtype=np.int32), pages)).to(device)
    tok_indptr = ref_indptr.to(device=device, dtype=torch.int32)
    ko = torch.full((tokens, num_kv_heads, 64), float("nan"), dtype=dtype, device=device)
    vo = torch.full_like(ko, float("nan"))
    gather.gather_widen(k8, v8, ko, vo, page_req, b.kv_indptr, b.kv_indices, b.last_page_len, tok_indptr,
                        kv_strides(k8, layout, True), kv_strides(v8, layout, True), page_size, 64,
                        int(page_req.numel()), num_kv_heads)
    assert torch.equal(ko.view(torch.int16), ref_k.view(torch.int16))  # bitwise, NaN and -0 included
    assert torch.equal(vo.view(torch.int16), ref_v.view(torch.int16))


@pytest.mark.parametrize("cache_dtype, knob, known_pays, asks", [
    (torch.bfloat16, "1", False, False),  # a plan whose copy is known not to pay: decided without serves()
    (torch.bfloat16, "1", None, True),  # not known yet: serves() first, then the plan's numbers
    (torch.bfloat16, "1", True, True),
    (torch.bfloat16, "force", False, True),  # forced: copied whether it pays or not
    (torch.bfloat16, "0", None, False),  # off
    (torch.float16, "1", None, False),  # a 16-bit cache of another dtype than q: never copied
    (torch.float8_e4m3fn, "0", False, True),  # an fp8 cache has no other way onto the kernel: the knob is for 16-bit
])
def test_which_paged_calls_consider_the_copy(cache_dtype, knob, known_pays, asks, monkeypatch):
    """attention._launch_gathered's decisions before any copy (the copy itself needs CUDA: the GPU tests): which
    calls go on to ask the warp-specialized kernel whether it serves the copied rows."""
    from types import SimpleNamespace
    from serveattn.kernels import attention
    if attention.attention_ws is None:
        pytest.skip("no Gluon in this Triton")
    asked = []
    monkeypatch.setattr(attention.attention_ws, "serves", lambda *a, **k: asked.append(1) or False)
    monkeypatch.setenv("SERVEATTN_PREFILL_GATHER", knob)
    q = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    k = v = SimpleNamespace(dtype=cache_dtype)
    plan = SimpleNamespace(paged=True, gathered=None if known_pays is None else attention.Gathered(
        None, None, None, 0, known_pays))
    args = (None,) * 9
    assert attention._launch_gathered(q, k, v, None, None, plan, *args) is False
    assert bool(asked) is asks
