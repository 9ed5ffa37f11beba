"""backend='auto' (serveattn/routing.py): every decline reason and its producer, warn-once, re-resolution at every
plan(), the first route holding under CUDA graphs, explicit backends honoured, unknown names refused, and the same
numbers (within the route's tolerance) whichever route auto picks.

On the CPU the capability and routing functions take plain requests with any architecture; the wrappers are run
with ``routing.device_info`` reporting a Hopper (the kernels still run on CPU tensors, through the interpreter),
and torch's own cuDNN check stubbed where the cuDNN route must look capable."""
import dataclasses
import logging
import pathlib
import re
import sys

import pytest
import torch

import serveattn
from serveattn import prefill, reference, routing, vendor
from helpers import check_lse, make_paged_batch, rel_err, tolerance

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16, F16, E4M3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
I32 = torch.int32
# The sm 9.0 table as routing's logic is tested against: with a tensor-core threshold for group 4 (1.939 KV-head
# programs per SM, the first crossover run's value), so both decode routes and every reason are reachable even
# while the measured table (now: the bandwidth kernel for every group) has none.
H200 = dataclasses.replace(
    routing.table_for((9, 0)),
    decode_tc_min_programs_per_sm={**routing.table_for((9, 0)).decode_tc_min_programs_per_sm,
                                   ("bfloat16", 128, 4): 1.939})
MIN_ROWS = H200.cudnn_min_rows[("bfloat16", 128, 4, True)]  # the measured crossover, whatever it is
G4_CAUSAL = ("bfloat16", 128, 4, True)


def _rows(n):
    """A prefill request of n query and n key rows (the default GQA 32/8, bf16, causal)."""
    return pf(min_qo_len=n, max_qo_len=n, min_kv_len=n, max_kv_len=n)
#: Tests that run the kernels on CPU tensors (through the interpreter) under a faked GPU; on a CUDA machine the
#: same ground is covered by tests/test_routing_gpu.py.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="kernels on CPU tensors: the interpreter only")

# A prefill request the sm 9.0 table sends to cuDNN (its group-4 causal crossover's length, whatever it is), and a
# decode request (bandwidth kernel below the crossover).
PF = routing.Request(kind="prefill", device_type="cuda", arch=(9, 0), num_sms=132, q_dtype=BF16, kv_dtype=BF16,
                     o_dtype=BF16, head_dim=128, num_qo_heads=32, num_kv_heads=8, causal=True, batch=2,
                     min_qo_len=MIN_ROWS, max_qo_len=MIN_ROWS, min_kv_len=MIN_ROWS, max_kv_len=MIN_ROWS)
DEC = dataclasses.replace(PF, kind="decode", paged=True, causal=False, batch=1, min_qo_len=1, max_qo_len=1)


def pf(**kw):
    return dataclasses.replace(PF, **kw)


def dec(**kw):
    return dataclasses.replace(DEC, **kw)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(routing, "_warned", set())
    monkeypatch.setattr(routing, "_cudnn_failed", set())
    monkeypatch.setitem(routing.TABLES, (9, 0), H200)


@pytest.fixture
def fake_gpu(monkeypatch):
    """routing sees a GPU of the given architecture and SM count; torch's cuDNN check says yes."""
    def install(arch=(9, 0), sms=132, cudnn_ok=True):
        monkeypatch.setattr(routing, "device_info", lambda device: routing.DeviceInfo("cuda", arch, sms))
        if cudnn_ok:
            monkeypatch.setattr(vendor, "torch_declines", lambda req, device: None)
    return install


def _table(monkeypatch, **fields):
    """The sm 9.0 table with other thresholds (tiny shapes for the interpreter)."""
    monkeypatch.setitem(routing.TABLES, (9, 0), dataclasses.replace(H200, **fields))
    return routing.TABLES[(9, 0)]


def _prefill_reason(req):
    return routing.cudnn_declines(req) or routing.cudnn_slower(req)


def _decode_reason(req):
    return routing.choose_decode("t", "auto", req, "cuda:0").reason


def _cudnn_failed_at_run(monkeypatch, fake_gpu):
    if torch.cuda.is_available():
        pytest.skip("cuDNN fails at run() only on CPU tensors; tests/test_routing_gpu.py covers the route")
    fake_gpu(sms=2)
    _table(monkeypatch, cudnn_min_rows={("bfloat16", 64, 2, True): 8})
    q, k, v, indptr = _ragged([8, 8], BF16)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16)
    assert w.backend == "cudnn"
    w.run(q, k, v)  # the cuDNN op has no CPU kernel: it raises, and the plan falls back to our kernel
    assert w.backend == "triton"
    return w.backend_fallback_reason


def _cudnn_failed_before(monkeypatch, fake_gpu):
    _cudnn_failed_at_run(monkeypatch, fake_gpu)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    _, _, _, indptr = _ragged([8, 8], BF16)
    w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16)
    assert w.backend == "triton"
    return w.backend_fallback_reason


# producer name -> (what triggers it, the producer's arguments)
TRIGGERS = {
    "triton_needs_cuda": (lambda mp, fg: routing.triton_declines(pf(device_type="cpu")), ()),
    "triton_needs_sm80": (lambda mp, fg: routing.triton_declines(pf(arch=(7, 5))), ()),
    "unmeasured_arch": (lambda mp, fg: routing.cudnn_slower(pf(arch=(8, 9))), ("cudnn",)),
    "cudnn_needs_cuda": (lambda mp, fg: routing.cudnn_declines(pf(device_type="cpu")), ()),
    "cudnn_needs_arch": (lambda mp, fg: routing.cudnn_declines(pf(arch=(7, 5))), ()),
    "cudnn_not_prefill": (lambda mp, fg: routing.cudnn_declines(dec()), ()),
    "cudnn_paged": (lambda mp, fg: routing.cudnn_declines(pf(paged=True)), ()),
    "cudnn_mask": (lambda mp, fg: routing.cudnn_declines(pf(custom_mask=True)), ()),
    "cudnn_window": (lambda mp, fg: routing.cudnn_declines(pf(window_left=64)), ()),
    "cudnn_soft_cap": (lambda mp, fg: routing.cudnn_declines(pf(soft_cap=30.0)), ()),
    "cudnn_rope": (lambda mp, fg: routing.cudnn_declines(pf(rope=True)), ()),
    "cudnn_dtype": (lambda mp, fg: routing.cudnn_declines(pf(kv_dtype=E4M3)), ()),
    "cudnn_head_dim": (lambda mp, fg: routing.cudnn_declines(pf(head_dim=256)), ()),
    "cudnn_cuda_graph": (lambda mp, fg: routing.cudnn_declines(pf(use_cuda_graph=True)), ()),
    "cudnn_unequal_lengths": (lambda mp, fg: routing.cudnn_declines(pf(min_qo_len=100)), ()),
    "cudnn_causal_offset": (lambda mp, fg: routing.cudnn_declines(pf(min_qo_len=100, max_qo_len=100)), ()),
    "cudnn_short": (lambda mp, fg: routing.cudnn_declines(pf(min_kv_len=1, max_kv_len=1, causal=False)), ()),
    "cudnn_unavailable": (lambda mp, fg: (mp.setattr(vendor, "available", lambda: False),
                                          vendor.torch_declines(PF, "cpu"))[1], ()),
    "cudnn_torch_declines": (lambda mp, fg: (mp.setattr(vendor, "available", lambda: True),
                                             vendor.torch_declines(PF, "cpu"))[1], ()),
    "cudnn_disabled_env": (lambda mp, fg: (mp.setenv("SERVEATTN_CUDNN", "0"), routing.cudnn_slower(PF))[1], ()),
    "cudnn_unmeasured": (lambda mp, fg: _prefill_reason(pf(q_dtype=F16, kv_dtype=F16, o_dtype=F16)),
                         (H200.prefill_table,)),
    "cudnn_below_crossover": (lambda mp, fg: _prefill_reason(_rows(MIN_ROWS - 1)), (MIN_ROWS, H200.prefill_table)),
    "cudnn_above_crossover": (lambda mp, fg: (_table(mp, cudnn_max_rows={G4_CAUSAL: MIN_ROWS + 16}),
                                              _prefill_reason(_rows(MIN_ROWS + 16)))[1],
                              (MIN_ROWS + 16, H200.prefill_table)),
    "cudnn_failed_at_run": (lambda mp, fg: _cudnn_failed_at_run(mp, fg), ()),
    "cudnn_failed_before": (lambda mp, fg: _cudnn_failed_before(mp, fg), ()),
    "cudnn_batch_invariant": (lambda mp, fg: routing.cudnn_declines(pf(batch_invariant=True)), ()),
    "crossover_batch_invariant": (lambda mp, fg: _decode_reason(dec(batch=64, batch_invariant=True)),
                                  ("tensor-core",)),
    "bandwidth_rows": (lambda mp, fg: routing.bandwidth_declines(dec(q_len_per_req=17)), ()),  # 17 x group 4 > 32
    "bandwidth_tree": (lambda mp, fg: routing.bandwidth_declines(dec(tree=True)), ()),
    "bandwidth_rope": (lambda mp, fg: routing.bandwidth_declines(dec(rope=True)), ()),
    "bandwidth_fp8_query": (lambda mp, fg: routing.bandwidth_declines(dec(q_dtype=E4M3, kv_dtype=E4M3)), ()),
    "bandwidth_mask": (lambda mp, fg: routing.bandwidth_declines(dec(custom_mask=True)), ()),
    "bandwidth_above_crossover": (lambda mp, fg: _decode_reason(dec(batch=32)), (256 / 132, H200.decode_table)),
    "tensor_core_below_crossover": (lambda mp, fg: _decode_reason(dec(batch=31)), (256 / 132, H200.decode_table)),
    "tensor_core_unmeasured": (lambda mp, fg: _decode_reason(dec(batch=64, head_dim=64)), (H200.decode_table,)),
    "tensor_core_hint_overruled": (lambda mp, fg: _decode_reason(dec(batch=1, use_tensor_cores=True)),
                                   (H200.decode_table,)),
}


def test_every_producer_has_a_trigger():
    assert set(TRIGGERS) == set(routing.PRODUCERS), "a decline reason without a test, or a test without a producer"


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_decline_reason_and_its_producer(name, monkeypatch, fake_gpu):
    trigger, args = TRIGGERS[name]
    expected = routing.PRODUCERS[name](*args)
    got = trigger(monkeypatch, fake_gpu)
    assert got is not None and expected in got, (name, got)
    assert expected.split(":")[0] in ("triton", "cudnn", "bandwidth", "tensor-core"), expected


def test_reasons_name_the_threshold_not_the_observed_value():
    a, b = _prefill_reason(_rows(MIN_ROWS - 1)), _prefill_reason(_rows(MIN_ROWS // 2 + 3))
    assert a == b and str(MIN_ROWS) in a and str(MIN_ROWS - 1) not in a and str(MIN_ROWS // 2 + 3) not in b
    c, d = _decode_reason(dec(batch=3)), _decode_reason(dec(batch=17))
    assert c == d and "1.94" in c and "17" not in d
    e, f = _decode_reason(dec(batch=40)), _decode_reason(dec(batch=200))
    assert e == f and "1.94" in e and "200" not in f


# ---------------------------------------------------------------- choices on plain requests

def test_prefill_choices(monkeypatch):
    gate = vendor.torch_declines
    monkeypatch.setattr(vendor, "torch_declines", lambda req, device: None if device == "cuda:0" else gate(req, device))

    def choose(req):
        return routing.choose_prefill("t", "auto", req, "cuda:0")

    assert choose(PF) == routing.Decision("cudnn")
    assert choose(pf(batch_invariant=True)) == routing.Decision("triton", reasons=(routing.cudnn_batch_invariant(),))
    assert choose(pf(min_qo_len=MIN_ROWS, max_qo_len=MIN_ROWS, min_kv_len=MIN_ROWS,
                     max_kv_len=MIN_ROWS)).backend == "cudnn"
    for req, reason in ((pf(paged=True), routing.cudnn_paged()),
                        (pf(min_qo_len=MIN_ROWS - 1, max_qo_len=MIN_ROWS - 1, min_kv_len=MIN_ROWS - 1,
                            max_kv_len=MIN_ROWS - 1), routing.cudnn_below_crossover(MIN_ROWS, H200.prefill_table)),
                        (pf(num_qo_heads=16), routing.cudnn_unmeasured(H200.prefill_table)),  # group 2
                        (pf(head_dim=64), routing.cudnn_unmeasured(H200.prefill_table)),
                        (pf(arch=(10, 0)), routing.unmeasured_arch("cudnn"))):
        d = choose(req)
        assert d.backend == "triton" and d.reason == reason
    assert choose(pf(arch=(7, 5))) == routing.Decision("torch", reasons=(routing.triton_needs_sm80(),))
    # under CUDA graphs there is no route on such a GPU: the torch route cannot be captured
    with pytest.raises(NotImplementedError, match=r"^t: under use_cuda_graph=True backend='auto' has no route .*"
                                                  r"compute capability 8\.0.*use_cuda_graph=False\.$"):
        choose(pf(arch=(7, 5), use_cuda_graph=True))
    with pytest.raises(NotImplementedError, match="has no route for this plan"):
        routing.choose_decode("t", "auto", dec(arch=(7, 5), use_cuda_graph=True), "cuda:0")
    assert choose(pf(device_type="cpu", use_cuda_graph=True)).backend == "torch"  # nothing to capture on the CPU
    assert choose(pf(device_type="cpu")) == routing.Decision("torch", reasons=(routing.triton_needs_cuda(),))
    # torch's own check is asked last, on the device: on a CPU build it is never capable
    d = routing.choose_prefill("t", "auto", PF, "cpu")
    assert d.backend == "triton" and d.reason in (routing.cudnn_unavailable(), routing.cudnn_torch_declines())


def test_decode_choices():
    def choose(req, backend="auto"):
        return routing.choose_decode("t", backend, req, "cuda:0")

    table = H200.decode_table
    assert choose(dec(batch=31)) == routing.Decision("triton", "bandwidth",
                                                     (routing.tensor_core_below_crossover(256 / 132, table),))
    assert choose(dec(batch=32)) == routing.Decision("triton", "tensor-core",
                                                     (routing.bandwidth_above_crossover(256 / 132, table),))
    # use_tensor_cores=True is a hint: where the table measured the bandwidth kernel faster, it holds
    assert choose(dec(batch=1, use_tensor_cores=True)) == routing.Decision(
        "triton", "bandwidth", (routing.tensor_core_hint_overruled(table),))
    assert choose(dec(batch=32, use_tensor_cores=True)).kernel == "tensor-core"
    # unmeasured (head dim 64 is not in the table): the hint is taken
    assert choose(dec(batch=1, head_dim=64, use_tensor_cores=True)) == routing.Decision("triton", "tensor-core")
    # e4m3 and e5m2 caches (groups 1, 4, 8, head dim 128): measured by bench crossover, the bandwidth kernel at every
    # size, in their own table
    fp8_table = H200.decode_table + "-fp8"
    assert H200.decode_table_for("float8_e4m3fn") == fp8_table
    for kv_dtype in (E4M3, torch.float8_e5m2):
        for batch, qo_heads in ((1, 8), (256, 32), (1, 64)):
            assert choose(dec(batch=batch, kv_dtype=kv_dtype, num_qo_heads=qo_heads, use_tensor_cores=True)) == \
                routing.Decision("triton", "bandwidth", (routing.tensor_core_hint_overruled(fp8_table),))
    # ... other groups were not measured: the hint is taken
    assert choose(dec(batch=1, kv_dtype=E4M3, num_qo_heads=16, use_tensor_cores=True)) == routing.Decision(
        "triton", "tensor-core")
    # a chain whose k x group rows fit the bandwidth kernel's tile is its request like any decode
    assert choose(dec(batch=1, q_len_per_req=8)) == routing.Decision(
        "triton", "bandwidth", (routing.tensor_core_below_crossover(256 / 132, table),))
    for req, reason in ((dec(q_len_per_req=17), routing.bandwidth_rows()), (dec(tree=True), routing.bandwidth_tree()),
                        (dec(rope=True), routing.bandwidth_rope()),
                        (dec(q_dtype=E4M3, kv_dtype=E4M3), routing.bandwidth_fp8_query())):
        assert choose(req) == routing.Decision("triton", "tensor-core", (reason,))
    # unmeasured: the bandwidth kernel holds, however large the batch
    assert choose(dec(batch=256, num_qo_heads=16)) == routing.Decision(  # group 2
        "triton", "bandwidth", (routing.tensor_core_unmeasured(table),))
    assert choose(dec(batch=256, kv_dtype=E4M3)).kernel == "bandwidth"
    assert choose(dec(batch=256, arch=(8, 0))) == routing.Decision(
        "triton", "bandwidth", (routing.unmeasured_arch("tensor-core"),))
    assert choose(dec(device_type="cpu")).backend == "torch"
    # fixed_split_size / disable_split_kv given: use_tensor_cores is taken literally, whatever the batch
    for batch in (1, 31, 32, 256):
        for tc in (False, True):
            declined = "bandwidth" if tc else "tensor-core"
            assert choose(dec(batch=batch, use_tensor_cores=tc, batch_invariant=True)) == routing.Decision(
                "triton", "tensor-core" if tc else "bandwidth", (routing.crossover_batch_invariant(declined),))


def test_explicit_decode_backend_takes_use_tensor_cores_literally(device):
    for name in ("triton", "fa2", "fa3"):
        d = routing.choose_decode("t", name, dec(batch=256), device)  # CPU: the interpreter runs the kernels
        assert d == routing.Decision("triton", "bandwidth")
        assert routing.choose_decode("t", name, dec(batch=1, use_tensor_cores=True), device).kernel == "tensor-core"
        assert routing.choose_decode("t", name, dec(q_len_per_req=3), device).kernel == "bandwidth"  # 12 rows
        assert routing.choose_decode("t", name, dec(q_len_per_req=17), device).kernel == "tensor-core"  # 68 rows > 32
        with pytest.raises(NotImplementedError, match="ROPE_LLAMA' is served on the tensor-core route only"):
            routing.choose_decode("t", name, dec(rope=True), device)
    assert routing.choose_decode("t", "torch", dec(batch=256), device) == routing.Decision("torch")
    assert routing.choose_prefill("t", "fa3", PF, device) == routing.Decision("triton")
    assert routing.choose_prefill("t", "torch", PF, device) == routing.Decision("torch")


def test_forced_route_refuses_when_incapable(device):
    with routing.forced(prefill="cudnn"), pytest.raises(NotImplementedError, match="forced route 'cudnn'.*paged"):
        routing.choose_prefill("t", "auto", pf(paged=True), device)
    with routing.forced(decode="bandwidth"), pytest.raises(NotImplementedError, match="at most 32 rows"):
        routing.choose_decode("t", "auto", dec(q_len_per_req=17), device)
    with routing.forced(decode="tensor-core"):
        assert routing.choose_decode("t", "auto", dec(batch=1), device).kernel == "tensor-core"
    assert routing._FORCED == {"prefill": None, "decode": None}


# ---------------------------------------------------------------- names

@pytest.mark.parametrize("name", ["cudnn", "trtllm-gen", "flashinfer", "FA2", "", "cuda", None])
def test_unknown_backend_names_are_refused(name, device):
    """FlashInfer's other backends are valid requests not served (NotImplementedError); other names are wrong
    arguments (ValueError)."""
    ws = torch.empty(1 << 16, dtype=torch.uint8, device=device)
    exc, what = (NotImplementedError, "is FlashInfer's and not served here") if name in ("cudnn", "trtllm-gen") else \
        (ValueError, "is not a backend")
    for cls in (serveattn.BatchPrefillWithRaggedKVCacheWrapper, serveattn.BatchPrefillWithPagedKVCacheWrapper,
                serveattn.BatchDecodeWithPagedKVCacheWrapper):
        with pytest.raises(exc, match=f"{what}; supported: 'auto', 'triton', 'torch', 'fa2', 'fa3'"):
            cls(ws, backend=name)
    with pytest.raises(exc, match=what):
        routing.choose_prefill("t", name, PF, device)
    with pytest.raises(exc, match=what):
        routing.choose_decode("t", name, DEC, device)
    if name == "cudnn":
        with pytest.raises(exc, match=r"\('auto' takes torch's cuDNN attention where it was measured faster\)\.$"):
            serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, backend=name)


def test_aliases_are_logged_once_and_run_triton(device, caplog):
    from serveattn import backend as backends
    backends._logged_aliases.discard("fa3")
    q, k, v, indptr = _ragged([5, 7], F16, device)
    with caplog.at_level(logging.INFO, logger="serveattn"):
        for _ in range(2):
            w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8,
                                                                           device=device), backend="fa3")
            w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=F16)
            assert w.backend == "triton" and w.backend_fallback_reason is None
    assert sum("alias of 'triton'" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------- warn once

def test_warn_once_per_device_and_reason(caplog):
    below = _rows(MIN_ROWS // 4)
    with caplog.at_level(logging.WARNING, logger="serveattn"):
        for _ in range(3):
            routing.choose_prefill("t", "auto", below, "cuda:0")
        routing.choose_prefill("t", "auto", _rows(MIN_ROWS - 1), "cuda:0")  # another length, the same rule: no warning
        routing.choose_prefill("t", "auto", below, "cuda:1")  # another device
        routing.choose_prefill("t", "auto", pf(paged=True), "cuda:0")  # another reason
        routing.choose_prefill("t", "auto", PF, "cpu")  # torch's gate declines on the CPU: another reason
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    below_reason = routing.cudnn_below_crossover(MIN_ROWS, H200.prefill_table)
    assert sum(below_reason in m and "cuda:0" in m for m in msgs) == 1
    assert sum(below_reason in m and "cuda:1" in m for m in msgs) == 1
    assert sum(routing.cudnn_paged() in m for m in msgs) == 1
    assert len(msgs) == 4


def test_cudnn_serves_only_inside_its_measured_range(monkeypatch):
    """cuDNN takes a request whose length is in [cudnn_min_rows, cudnn_max_rows) (no upper end where the table
    has none); at or above the upper end our kernel, with the rule's sentence."""
    _table(monkeypatch, cudnn_min_rows={G4_CAUSAL: 512}, cudnn_max_rows={G4_CAUSAL: 4096})
    table = routing.TABLES[(9, 0)]
    assert routing.cudnn_slower(_rows(512)) is None and routing.cudnn_slower(_rows(4095)) is None
    for n in (4096, 8192):
        assert routing.cudnn_slower(_rows(n)) == routing.cudnn_above_crossover(4096, table.prefill_table)
    assert "from 4096 query rows per request on our kernel is faster" in routing.cudnn_above_crossover(4096, "t")
    _table(monkeypatch, cudnn_min_rows={G4_CAUSAL: 512}, cudnn_max_rows={})
    assert routing.cudnn_slower(_rows(1 << 20)) is None


def test_explicit_backends_do_not_warn(caplog, device):
    with caplog.at_level(logging.WARNING, logger="serveattn"):
        routing.choose_prefill("t", "triton", pf(paged=True), device)
        routing.choose_decode("t", "torch", dec(batch=64), device)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


# ---------------------------------------------------------------- the wrappers

def _ragged(lens, dtype, device="cpu", hq=4, hkv=2, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(n, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype).to(device)
    indptr = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=I32, device=device)
    return q, k, v, indptr


def test_cpu_auto_runs_torch_and_says_why(device):
    if device != "cpu":
        pytest.skip("the CPU's own choice")
    q, k, v, indptr = _ragged([5, 7], F16)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=F16)
    assert w.backend == "torch" and w.backend_fallback_reason == routing.triton_needs_cuda()
    d = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    b = make_paged_batch(torch.Generator().manual_seed(1), qo_lens=[1, 1], kv_lens=[9, 30], num_qo_heads=4,
                         num_kv_heads=2, head_dim=64, page_size=16, dtype=F16)
    d.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, q_data_type=F16)
    assert d.backend == "torch" and d.backend_fallback_reason == routing.triton_needs_cuda()


def test_prefill_wrapper_reresolves_at_every_plan(monkeypatch, fake_gpu):
    fake_gpu(sms=2)
    _table(monkeypatch, cudnn_min_rows={("bfloat16", 64, 2, True): 8})
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws)
    steps = [([8, 8], "cudnn", None), ([8, 12], "triton", routing.cudnn_unequal_lengths()),
             ([4, 4], "triton", routing.cudnn_below_crossover(8, routing.TABLES[(9, 0)].prefill_table)),
             ([9, 9, 9], "cudnn", None)]
    for lens, backend, reason in steps:
        _, _, _, indptr = _ragged(lens, BF16)
        w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16)
        assert (w.backend, w.backend_fallback_reason) == (backend, reason), lens
    # fixed_split_size / disable_split_kv: never cuDNN (its choice follows the batch), and the tiles do not follow it
    for lens in ([8, 8], [9, 9, 9], [1, 40]):
        _, _, _, indptr = _ragged(lens, BF16)
        for split in (dict(fixed_split_size=256), dict(disable_split_kv=True)):
            w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16, **split)
            assert (w.backend, w.backend_fallback_reason) == ("triton", routing.cudnn_batch_invariant()), lens
            assert w._plan.tiles == prefill.choose_tiles(64, 2, None, w.device, paged=False)
    # -1 / False (what vLLM passes outside its batch-invariant mode) are FlashInfer's "not set": auto routes as ever
    _, _, _, indptr = _ragged([8, 8], BF16)
    w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16, fixed_split_size=-1, disable_split_kv=False)
    assert (w.backend, w.backend_fallback_reason) == ("cudnn", None)
    # the paged wrapper never takes cuDNN, and says why
    b = make_paged_batch(torch.Generator().manual_seed(0), qo_lens=[8, 8], kv_lens=[8, 8], num_qo_heads=4,
                         num_kv_heads=2, head_dim=64, page_size=4, dtype=BF16)
    p = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws)
    p.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 4, causal=True, q_data_type=BF16)
    assert p.backend == "triton" and p.backend_fallback_reason == routing.cudnn_paged()


@cpu_only
def test_cudnn_failure_at_run_falls_back_with_the_same_numbers(monkeypatch, fake_gpu):
    """The cuDNN op has no CPU kernel: run() on a plan routed to cuDNN falls back to our kernel and is exact."""
    reason = _cudnn_failed_at_run(monkeypatch, fake_gpu)
    assert reason == routing.cudnn_failed_at_run()
    q, k, v, indptr = _ragged([8, 8], BF16)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_ragged(q, k, v, indptr, indptr, causal=True)
    assert rel_err(out, ref) < tolerance(BF16)
    check_lse(lse, ref_lse)
    explicit = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8),
                                                              backend="triton")
    explicit.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16)
    assert torch.equal(out, explicit.run(q, k, v))  # the fallback is our kernel, bit for bit


@cpu_only
def test_cudnn_failure_is_remembered_per_shape(monkeypatch, fake_gpu, caplog):
    """A serving loop re-plans every step: after cuDNN raised once, plans of that shape stay on our kernel (one
    warning, no retry); another shape still takes cuDNN."""
    with caplog.at_level("WARNING", logger=routing.log.name):
        _cudnn_failed_at_run(monkeypatch, fake_gpu)
        failures = [r for r in caplog.records if routing.cudnn_failed_at_run() in r.getMessage()]
        assert len(failures) == 1
        q, k, v, indptr = _ragged([8, 8], BF16)
        for _ in range(3):
            w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
            w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16)
            assert (w.backend, w.backend_fallback_reason) == ("triton", routing.cudnn_failed_before())
            w.run(q, k, v)
        assert len([r for r in caplog.records if "cudnn: cuDNN raised" in r.getMessage()]) == 2  # + failed_before once
    _, _, _, other = _ragged([12, 12], BF16)
    w.plan(other, other, 4, 2, 64, causal=True, q_data_type=BF16)
    assert w.backend == "cudnn"


def _decode_batch(batch, seed=3, kv_max=300):
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [int(x) for x in torch.randint(1, kv_max, (batch,), generator=gen)]
    return make_paged_batch(gen, qo_lens=[1] * batch, kv_lens=kv_lens, num_qo_heads=8, num_kv_heads=2,
                            head_dim=128, page_size=16, dtype=BF16)


def _decode_ref(b):
    return reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)


@cpu_only
def test_decode_wrapper_reresolves_and_numbers_agree_whichever_route(fake_gpu):
    """2 fake SMs, 2 KV heads: batch 1 is 1 KV-head program per SM (bandwidth), batch 2 is 2 (tensor cores)."""
    fake_gpu(sms=2)
    ws = torch.empty(1 << 22, dtype=torch.uint8)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws)
    table = routing.TABLES[(9, 0)].decode_table
    for batch, kernel, reason in ((1, "bandwidth", routing.tensor_core_below_crossover(256 / 132, table)),
                                  (2, "tensor-core", routing.bandwidth_above_crossover(256 / 132, table)),
                                  (1, "bandwidth", routing.tensor_core_below_crossover(256 / 132, table))):
        b = _decode_batch(batch, seed=batch)
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
        assert (w.backend, w._decision.kernel, w.backend_fallback_reason) == ("triton", kernel, reason)
        out, lse = w.run(b.q, b.cache, return_lse=True)
        ref, ref_lse = _decode_ref(b)
        assert rel_err(out, ref) < tolerance(BF16)
        check_lse(lse, ref_lse)
        # auto's pick is that route, bit for bit; the other routes agree within their tolerance
        for tc, backend in ((kernel == "tensor-core", "triton"), (kernel != "tensor-core", "triton"),
                            (False, "torch")):
            e = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws.clone(), use_tensor_cores=tc, backend=backend)
            e.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
            o = e.run(b.q, b.cache)
            if backend == "triton" and tc == (kernel == "tensor-core"):
                assert torch.equal(o, out)
            assert rel_err(o, ref) < tolerance(BF16)


@cpu_only
def test_graph_auto_wrapper_held_on_the_bandwidth_kernel_refuses_rope(fake_gpu):
    """Under use_cuda_graph=True auto holds its first plan's route; held on the bandwidth kernel, a RoPE plan (which
    that kernel does not apply) is refused, never run without RoPE."""
    fake_gpu()
    gen = torch.Generator().manual_seed(8)
    b = make_paged_batch(gen, qo_lens=[1] * 3, kv_lens=[300, 77, 150], num_qo_heads=32, num_kv_heads=8,
                         head_dim=128, page_size=16, dtype=BF16)
    i32 = dict(dtype=torch.int32)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 22, dtype=torch.uint8), use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty(5, **i32),
        paged_kv_indices_buffer=torch.empty(64, **i32), paged_kv_last_page_len_buffer=torch.empty(4, **i32))
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, q_data_type=BF16)
    assert w._decision.kernel == routing.BANDWIDTH
    with pytest.raises(NotImplementedError, match="pos_encoding_mode='ROPE_LLAMA' is served on the tensor-core "
                                                  "route only, and this wrapper's route is the bandwidth kernel"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, q_data_type=BF16,
               pos_encoding_mode="ROPE_LLAMA")


@cpu_only
def test_single_decode_auto_takes_an_fp8_query_to_the_tensor_core_route(fake_gpu, monkeypatch):
    """Under auto an fp8 query (which the bandwidth kernel does not serve) goes to the tensor-core route whatever
    use_tensor_cores says, as the batch wrapper's does; backend='triton' takes the flag literally and refuses."""
    from serveattn import decode as decode_mod
    fake_gpu(sms=2)
    monkeypatch.setattr(decode_mod.backends, "resolve", lambda entry, backend, device: "triton")
    prefill = decode_mod._single_prefill
    monkeypatch.setattr(decode_mod, "_single_prefill", lambda *a: prefill(*a[:13], "triton", *a[14:]))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(8, 64, generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn(40, 2, 64, generator=gen).to(torch.float8_e4m3fn)
    out = serveattn.single_decode_with_kv_cache(q, k, k, use_tensor_cores=False)
    ref, _ = reference.attention(q.to(torch.float32)[None], k.to(torch.float32), k.to(torch.float32))
    assert rel_err(out, ref[0]) < 2e-2
    with pytest.raises(NotImplementedError, match="an fp8 query is served on the tensor-core route only; pass "
                                                  "use_tensor_cores=True"):
        serveattn.single_decode_with_kv_cache(q, k, k, use_tensor_cores=False, backend="triton")


@cpu_only
def test_single_decode_use_tensor_cores_true_is_a_hint_under_auto(fake_gpu, monkeypatch):
    """single_decode_with_kv_cache asks the same table as the batch wrapper (one request) under auto."""
    from serveattn import decode as decode_mod
    fake_gpu(sms=2)
    monkeypatch.setattr(decode_mod.backends, "resolve", lambda entry, backend, device: "triton")
    taken = []
    bandwidth, prefill = decode_mod._single_decode_bandwidth, decode_mod._single_prefill
    monkeypatch.setattr(decode_mod, "_single_decode_bandwidth",
                        lambda *a, **k: taken.append("bandwidth") or bandwidth(*a, **k))
    # the prefill family on CPU tensors: its kernel through the interpreter (auto would take torch there);
    # _single_prefill's 14th argument is the backend
    monkeypatch.setattr(decode_mod, "_single_prefill",
                        lambda *a: taken.append("tensor-core") or prefill(*a[:13], "triton", *a[14:]))
    gen = torch.Generator().manual_seed(3)
    for head_dim, kw, route in ((128, {}, "bandwidth"),  # measured (bf16, 128, group 4): the table's kernel
                                (64, {}, "tensor-core"),  # unmeasured: the hint is taken
                                (128, dict(backend="triton"), "tensor-core")):  # explicit: literal
        q = torch.randn(8, head_dim, generator=gen).to(BF16)
        k = torch.randn(40, 2, head_dim, generator=gen).to(BF16)
        v = torch.randn(40, 2, head_dim, generator=gen).to(BF16)
        out = serveattn.single_decode_with_kv_cache(q, k, v, use_tensor_cores=True, **kw)
        assert taken[-1] == route, (head_dim, kw, taken)
        ref, _ = reference.attention(q[None], k, v)
        assert rel_err(out, ref[0]) < tolerance(BF16)


@cpu_only
def test_decode_use_tensor_cores_true_is_a_hint_and_explicit_triton_is_literal(fake_gpu):
    fake_gpu(sms=2)
    b = _decode_batch(1)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), use_tensor_cores=True)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
    assert w._decision.kernel == "bandwidth" and "speed hint" in w.backend_fallback_reason
    t = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), use_tensor_cores=True,
                                                     backend="triton")
    t.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
    assert t._decision == routing.Decision("triton", "tensor-core") and t.backend_fallback_reason is None
    b = _decode_batch(4)
    e = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), backend="triton")
    e.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
    assert e._decision == routing.Decision("triton", "bandwidth") and e._prefill is None


@cpu_only
def test_decode_rope_under_auto_runs_on_tensor_cores(fake_gpu):
    fake_gpu(sms=2)
    b = _decode_batch(1)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8))
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16, pos_encoding_mode="ROPE_LLAMA")
    assert w._decision.kernel == "tensor-core" and w.backend_fallback_reason == routing.bandwidth_rope()
    ref, _ = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                   pos_encoding_mode="ROPE_LLAMA")
    assert rel_err(w.run(b.q, b.cache), ref) < tolerance(BF16)


def _graph_decode(batch_capacity=2, pages=64):
    i32 = dict(dtype=I32)
    return serveattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 22, dtype=torch.uint8), use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(batch_capacity + 1, **i32),
        paged_kv_indices_buffer=torch.empty(pages, **i32), paged_kv_last_page_len_buffer=torch.empty(batch_capacity,
                                                                                                      **i32))


@cpu_only
@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_cuda_graph_holds_the_first_route(first, then, fake_gpu):
    fake_gpu(sms=2)
    w = _graph_decode()
    b = _decode_batch(first, seed=first)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
    held = w._decision
    assert held.kernel == ("tensor-core" if first == 2 else "bandwidth")
    b = _decode_batch(then, seed=10 + then)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
    assert w._decision == held and w.backend_fallback_reason == held.reason  # not re-resolved
    out = w.run(b.q, b.cache)
    assert rel_err(out, _decode_ref(b)[0]) < tolerance(BF16)
    # without CUDA graphs the same two plans re-resolve
    e = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8))
    e.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
    assert e._decision.kernel != held.kernel


def test_prefill_under_cuda_graph_never_takes_cudnn(monkeypatch, fake_gpu):
    fake_gpu(sms=2)
    _table(monkeypatch, cudnn_min_rows={("bfloat16", 64, 2, True): 8})
    _, _, _, indptr = _ragged([8, 8], BF16)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), use_cuda_graph=True,
                                                       qo_indptr_buf=torch.empty(3, dtype=I32),
                                                       kv_indptr_buf=torch.empty(3, dtype=I32))
    w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16)
    assert w.backend == "triton" and w.backend_fallback_reason == routing.cudnn_cuda_graph()
    assert w._held == routing.Decision("triton", reasons=(routing.cudnn_cuda_graph(),))


def test_unmeasured_architecture_gets_safe_defaults(fake_gpu, monkeypatch):
    fake_gpu(arch=(8, 9), sms=2)
    _, _, _, indptr = _ragged([8, 8], BF16)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(indptr, indptr, 4, 2, 64, causal=True, q_data_type=BF16)
    assert w.backend == "triton" and "no crossover table for this GPU architecture (measured: sm 9.0)" in \
        w.backend_fallback_reason
    b = _decode_batch(2)
    d = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8))
    d.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 8, 2, 128, 16, q_data_type=BF16)
    assert d._decision.kernel == "bandwidth" and d.backend_fallback_reason == routing.unmeasured_arch("tensor-core")


@cpu_only
def test_single_prefill_takes_cudnn_where_the_table_says(monkeypatch, fake_gpu):
    fake_gpu(sms=2)
    _table(monkeypatch, cudnn_min_rows={("bfloat16", 64, 2, True): 8})
    q, k, v, _ = _ragged([8], BF16)
    calls = []

    def fake_cudnn(q, k, v, out, lse, return_lse, plan, kv_layout, k_scale=None, v_scale=None):
        calls.append((plan.backend, plan.batch, plan.causal))
        return torch.zeros_like(q)

    monkeypatch.setattr(vendor, "prefill", fake_cudnn)
    serveattn.single_prefill_with_kv_cache(q, k, v, causal=True)
    serveattn.single_prefill_with_kv_cache(q[:4], k, v, causal=True)  # kv_len != qo_len under causal: our kernel
    assert calls == [("cudnn", 1, True)]


# ---------------------------------------------------------------- docs and the README

def test_tables_name_their_docs_tables():
    doc = (ROOT / "docs" / "routing.md").read_text()
    source = (ROOT / "serveattn" / "routing.py").read_text()
    for arch, table in routing.TABLES.items():
        assert f"<!-- crossover:{table.name}:begin -->" in doc and f"<!-- crossover:{table.name}:end -->" in doc
        for name in (table.prefill_table, table.decode_table):
            short = name.split("table ")[1]
            assert f"#### Table {short}" in doc, short
            assert f"docs/routing.md, table {short}" in source, short
        for key, value in list(table.cudnn_min_rows.items()) + list(table.cudnn_max_rows.items()):
            assert f"{key!r}: {value!r}" in doc
    assert "<!-- crossover:append -->" in doc


def test_support_matrix_is_current_and_the_check_catches_drift(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import support_matrix
    finally:
        sys.path.pop(0)
    assert support_matrix.main(["--check"]) == 0
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    row = re.search(r"\| paged KV cache \|[^\n]*\n", text).group(0)
    readme.write_text(text.replace(row, row.replace("| no |", "| yes |")))
    assert support_matrix.main(["--check", "--readme", str(readme)]) == 1
    assert support_matrix.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == text
    assert "| paged KV cache | yes | yes | yes | no |" in text


# ---------------------------------------------------------------- the cuDNN route's plumbing, emulated

def _emulated_cudnn(qb, kb, vb, want_lse, causal, scale):
    """What torch's cuDNN op returns, computed in float64 on the CPU: the output in q's memory layout
    ([B, S, H, D] storage viewed as [B, H, S, D]), the natural-log LSE as [B, H, S, 1]; is_causal top-left."""
    b, hq, s, d = qb.shape
    group = hq // kb.shape[1]
    k64 = kb.double().repeat_interleave(group, 1)
    v64 = vb.double().repeat_interleave(group, 1)
    logits = torch.einsum("bhqd,bhkd->bhqk", qb.double(), k64) * scale
    if causal:
        keep = torch.ones(s, kb.shape[2], dtype=torch.bool).tril()
        logits = logits.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    o = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(logits, -1), v64)
    out = torch.empty(b, s, hq, d, dtype=qb.dtype).transpose(1, 2)
    out.copy_(o)
    return out, lse.float()[..., None], None, None, 0, 0, None, None, None


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal,qo_len,kv_len", [(True, 12, 12), (False, 5, 17)])
def test_cudnn_route_plumbing_with_an_emulated_op(layout, causal, qo_len, kv_len, monkeypatch, fake_gpu):
    """Views of the ragged rows, the output viewed back, base-2 LSE, scales and caller buffers, on the CPU: the
    cuDNN op itself replaced by a float64 emulation (tests/test_routing_gpu.py runs the real one)."""
    fake_gpu(sms=2)
    _table(monkeypatch, cudnn_min_rows={("bfloat16", 64, 2, causal): 1})
    if not causal:
        monkeypatch.setattr(routing, "cudnn_slower", lambda req: None)  # kv_len != qo_len: not in any table
    monkeypatch.setattr(vendor, "_sdpa_cudnn", _emulated_cudnn)
    batch, hq, hkv, d = 3, 4, 2, 64
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch * qo_len, hq, d, generator=gen).to(BF16)
    k = torch.randn(batch * kv_len, hkv, d, generator=gen).to(BF16)
    v = torch.randn(batch * kv_len, hkv, d, generator=gen).to(BF16)
    qo = torch.arange(batch + 1, dtype=I32) * qo_len
    kv = torch.arange(batch + 1, dtype=I32) * kv_len
    kk, vv = (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()) if layout == "HND" else (k, v)
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), layout)
    w.plan(qo, kv, hq, hkv, d, causal=causal, q_data_type=BF16)
    assert w.backend == "cudnn"
    ref, ref_lse = reference.batch_ragged(q, k, v, qo, kv, causal=causal)
    out, lse = w.run(q, kk, vv, return_lse=True)
    assert out.shape == q.shape and out.dtype == BF16 and rel_err(out, ref) < tolerance(BF16)
    check_lse(lse, ref_lse)
    ref_s, ref_s_lse = reference.batch_ragged(q, k, v, qo, kv, causal=causal, k_scale=0.5, v_scale=2.0)
    for ks, vs in ((0.5, 2.0), (torch.tensor([0.5]), torch.tensor([2.0]))):
        for given in (False, True):
            o = torch.full(q.shape, float("nan"), dtype=BF16) if given else None
            l_ = torch.full(q.shape[:2], float("nan")) if given else None
            res = w.run(q, kk, vv, out=o, lse=l_, return_lse=True, k_scale=ks, v_scale=vs)
            assert res[0].dtype == BF16 and rel_err(res[0], ref_s) < tolerance(BF16)
            check_lse(res[1], ref_s_lse)
            if given:
                assert res[0] is o and res[1] is l_
    assert w.backend == "cudnn" and torch.equal(w.run(q, kk, vv), out)


def test_cuda_properties_are_read_once_and_shared(monkeypatch):
    """policy.cuda_properties: one driver read per device, which routing, the decode split and the prefill kernels
    all take their capability and SM count from (a fake device here: no GPU needed)."""
    from types import SimpleNamespace

    from serveattn import decode, policy

    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(major=9, minor=0, multi_processor_count=132)

    policy._cuda_properties.cache_clear()
    routing._cuda_info.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    try:
        assert policy.cuda_properties(torch.device("cuda")) == ((9, 0), 132)
        assert policy.cuda_properties(torch.device("cuda", 3)) == ((9, 0), 132)
        assert routing.device_info("cuda:3") == routing.DeviceInfo("cuda", (9, 0), 132)
        assert decode._num_sms(torch.device("cuda", 3)) == 132
        from serveattn.kernels import attention_ws
        assert attention_ws._capability(torch.device("cuda", 3)) == (9, 0)
        assert attention_ws._num_sms(torch.device("cuda", 3)) == 132
        from serveattn import backend
        assert backend.resolve("plan", "triton", torch.device("cuda", 3)) == "triton"
        assert calls == [3]
    finally:
        policy._cuda_properties.cache_clear()
        routing._cuda_info.cache_clear()


def test_triton_refuses_a_gpu_older_than_sm80(monkeypatch):
    """backend='triton' on a compute-capability-7.x device: refused with the sentence (a fake device, from the one
    cached capability read)."""
    from types import SimpleNamespace

    from serveattn import backend, policy

    policy._cuda_properties.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(major=7, minor=5, multi_processor_count=40))
    try:
        with pytest.raises(NotImplementedError, match=r"compute capability 8\.0 or newer \(got \(7, 5\)\)"):
            backend.resolve("plan", "triton", torch.device("cuda", 0))
    finally:
        policy._cuda_properties.cache_clear()


def test_the_crossovers_restated_rule_is_routings(monkeypatch):
    """bench crossover's taken_route (which lists where a derived table loses) restates routing's rule on plain
    values; with the derived tables installed, routing itself takes the same route at every point of this
    project's H200 runs (session 34: bf16 prefill and decode, fp8 decode)."""
    import json
    import os
    from serveattn.bench import crossover

    runs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "runs")
    points = []
    for name in ("2026-12-05T1712-h200-bench-crossover.json", "2026-12-05T1711-h200-bench-crossover-fp8.json"):
        points += json.load(open(os.path.join(runs, name)))["families"]["crossover"]["points"]
    cudnn, decode = crossover.derive_cudnn(points), crossover.derive_decode(points)
    _table(monkeypatch, cudnn_min_rows={k: lo for k, (lo, hi) in cudnn.items()},
           cudnn_max_rows={k: hi for k, (lo, hi) in cudnn.items() if hi is not None},
           decode_tc_min_programs_per_sm=decode)
    dtypes = {"bfloat16": BF16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
    checked = 0
    for p in points:
        taken = crossover.taken_route(p, cudnn, decode)
        if taken is None:
            continue
        if p["pair"] == "prefill-cudnn":
            n = p["qo_len"]
            req = pf(num_qo_heads=8 * p["group"], causal=p["causal"], batch=p["batch"], min_qo_len=n, max_qo_len=n,
                     min_kv_len=n, max_kv_len=n)
            routed = "cudnn" if routing.cudnn_slower(req) is None else "triton"
        else:
            req = dec(num_qo_heads=8 * p["group"], kv_dtype=dtypes[p["dtype"]], batch=p["batch"])
            assert req.programs_per_sm == pytest.approx(p["programs_per_sm"])
            routed = "tensor-core" if routing.decode_tensor_cores(req)[0] else "bandwidth"
        assert routed == taken, p
        checked += 1
    assert checked > 150
