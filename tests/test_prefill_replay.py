"""kernels/replay.py on the CPU: a plan's later plain run() launches the warp-specialized kernel, or prefill_kernel,
with exactly the arguments the full path gives, and anything its first launch followed from that moved (q/out/lse
layout or alignment, another cache, scales, a switch, a dropped cache) takes the full path. The kernels' compiled
launchers are recording stand-ins (the kernels run in tests/test_prefill_ws_gpu.py and the GPU suite)."""
import gc
import weakref

import pytest
import torch

import serveattn
from serveattn import knobs
from triton.runtime.jit import JITFunction

from serveattn.kernels import attention
from serveattn.kernels import attention_ws as ws
from serveattn.kernels import launch as fast
from serveattn.kernels import replay

S, HQ, HKV, D, PAGE = 256, 8, 2, 64, 16


class _Driver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 77)


class _Compiled:
    function, packed_metadata = "fn", ("meta",)

    def __init__(self, launches):
        self.launches = launches

    def run(self, *launch_args):  # the compiled launcher: grid, stream, function, metadata, hooks, then the arguments
        self.launches.append(("replayed-or-keyed", launch_args[9:]))


class _Launches(list):
    kind = None


@pytest.fixture(params=["warp-specialized", "prefill_kernel"])
def recorded(monkeypatch, request):
    """Every launch of the kernel under test, on CPU tensors: ("first", args) for the one that compiles, then
    ("replayed-or-keyed", args) for each one through a kept entry; plus each full-path attention.launch. The
    warp-specialized kernel is taken by faking serves(); prefill_kernel (an interpreted function under
    TRITON_INTERPRET=1) by a JITFunction of its source, never compiled."""
    launches, full = _Launches(), []
    monkeypatch.setattr(fast, "ENABLED", True)
    monkeypatch.setattr(fast, "_driver", _Driver)
    monkeypatch.setattr(fast, "_interpreted", lambda jit_fn: False)
    monkeypatch.setattr(serveattn.backend, "interpreting", lambda: True)  # backend="triton" on CPU tensors
    if request.param == "warp-specialized":
        monkeypatch.setattr(ws, "serves", lambda *a, **k: True)
        monkeypatch.setattr(ws, "_num_sms", lambda device: 132)
        kernel = ws.prefill_ws_kernel
    else:
        kernel = JITFunction(attention.prefill_kernel.fn)
        monkeypatch.setattr(attention, "prefill_kernel", kernel)
    monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: (
        launches.append(("first", args)), _Compiled(launches))[1])
    real, real_replay, replayed = attention.launch, replay.Replay.__call__, []

    def replay_spy(self, *args, **kwargs):
        ran = real_replay(self, *args, **kwargs)
        replayed.append(ran)
        return ran

    def spy(*args, **kwargs):  # full: the calls no replay launched
        replayed.clear()
        result = real(*args, **kwargs)
        if not any(replayed):
            full.append(True)
        return result
    monkeypatch.setattr(replay.Replay, "__call__", replay_spy)
    monkeypatch.setattr(attention, "launch", spy)
    monkeypatch.setattr(fast._launches_of(kernel), "entries", {})
    launches.kind = request.param
    return launches, full


def _same(a, b):
    """Launch arguments alike: the same tensors, descriptors of the same base and fields, equal values."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, ws.TensorDescriptor):
            if not (isinstance(y, ws.TensorDescriptor) and x.base is y.base
                    and dict(x.__dict__, base=None) == dict(y.__dict__, base=None)):
                return False
        elif not (x is y or (type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y)):
            return False
    return True


def _paged(gen):
    pages = S // PAGE
    cache = torch.randn(pages + 3, 2, PAGE, HKV, D, generator=gen).to(torch.bfloat16)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="triton")
    w.plan(torch.tensor([0, S], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
           torch.randperm(pages + 3, generator=gen)[:pages].to(torch.int32), torch.tensor([PAGE], dtype=torch.int32),
           HQ, HKV, D, PAGE, causal=True, q_data_type=torch.bfloat16)
    return w, cache


def _ragged(gen):
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="triton")
    qo = torch.tensor([0, S], dtype=torch.int32)
    w.plan(qo, qo, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16)
    return w


def _q(gen):
    return torch.randn(S, HQ, D, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("with_lse", [False, True])
def test_replay_passes_what_the_full_path_passes(recorded, kind, with_lse):
    launches, full = recorded
    gen = torch.Generator().manual_seed(1)
    if kind == "paged":
        w, cache = _paged(gen)
        kv = lambda: (cache,)  # noqa: E731  (a server's cache: the same tensor every step)
    else:
        w = _ragged(gen)
        kv = lambda: tuple(torch.randn(S, HKV, D, generator=gen).to(torch.bfloat16) for _ in range(2))  # noqa: E731
    kw = dict(return_lse=True) if with_lse else {}
    w.run(_q(gen), *kv(), **kw)
    assert full == [True] and [k for k, _ in launches] == ["first"]
    assert replay.KEY in w._plan.launch_memo
    for _ in range(2):  # replayed: no full path, each call's own q, out (and lse), K/V descriptors
        q, args = _q(gen), kv()
        w.run(q, *args, **kw)
        assert full == [True]
        replayed = launches[-1][1]
        del w._plan.launch_memo[replay.KEY]  # the same call on the full path, through the kept entry
        at = 4 if launches.kind == "warp-specialized" else 3  # out's position: after the TMA operands, or K/V
        w.run(q, *args, out=replayed[at], lse=replayed[at + 1] if with_lse else None, **kw)
        assert full == [True, True] and _same(replayed, launches[-1][1])
        full.pop()
    assert replayed[0] is q
    if launches.kind == "warp-specialized":
        assert replayed[1].base is q  # q by TMA
        if kind == "ragged":
            assert replayed[2].base is args[0] and replayed[3].base is args[1]
    elif kind == "ragged":
        assert replayed[1] is args[0] and replayed[2] is args[1]


@pytest.mark.parametrize("change", ["q-strides", "q-misaligned", "out-strides", "lse", "other-cache",
                                    "cache-moved", "k-scale", "switch", "replanned"])
def test_what_moved_takes_the_full_path(recorded, monkeypatch, change):
    launches, full = recorded
    gen = torch.Generator().manual_seed(2)
    w, cache = _paged(gen)
    w.run(_q(gen), cache)
    w.run(_q(gen), cache)
    assert full == [True]
    q, kw = _q(gen), {}
    if change == "q-strides":
        q = torch.randn(S, HQ + 1, D, generator=gen).to(torch.bfloat16)[:, :HQ]
    elif change == "q-misaligned":
        q = torch.randn(S * HQ * D + 1, generator=gen).to(torch.bfloat16)[1:].view(S, HQ, D)
    elif change == "out-strides":
        kw["out"] = torch.empty(S, HQ, D + 16, dtype=torch.bfloat16)[..., :D]
    elif change == "lse":
        kw["return_lse"] = True
    elif change == "other-cache":
        cache = cache.clone()
    elif change == "cache-moved":  # the same tensor object, new storage
        other = cache.clone()
        cache.set_(other.untyped_storage(), 0, other.shape, other.stride())
    elif change == "k-scale":
        kw["k_scale"] = 0.5
    elif change == "switch":
        monkeypatch.setenv("SERVEATTN_PREFILL_WS_QTMA", "0")
    elif change == "replanned":  # the same request planned again: a new plan, its own memo
        w.plan(torch.tensor([0, S], dtype=torch.int32), torch.tensor([0, S // PAGE], dtype=torch.int32),
               w._plan.kv_indices.cpu(), torch.tensor([PAGE], dtype=torch.int32), HQ, HKV, D, PAGE, causal=True,
               q_data_type=torch.bfloat16)
    w.run(q, cache, **kw)
    assert full == [True, True], f"{change}: replayed"
    assert launches[-1][1][0] is q


def test_replay_keeps_no_dropped_cache(recorded):
    """The replay holds the cache's views and descriptors weakly: a dropped cache goes, views and descriptors too."""
    launches, _ = recorded
    gen = torch.Generator().manual_seed(3)
    w, cache = _paged(gen)
    w.run(_q(gen), cache)
    launches.clear()  # the recorded arguments hold the descriptors
    dead = weakref.ref(cache)
    repeat = w._plan.launch_memo[replay.KEY]
    del cache
    gc.collect()
    assert dead() is None
    assert all(ref() is None for ref in (repeat.kv_held[0], repeat.kv_held[1], repeat.kv_held[4], repeat.kv_held[5]))


def test_every_switch_on_the_launch_path_is_watched():
    """A replay skips the decisions attention.launch and attention_ws.launch make from switches read per call, so
    each such switch must be in replay.SWITCHES (a changed one then takes the full path)."""
    import pathlib
    import re
    read = set()
    for module in (attention, ws):
        read |= set(re.findall(r'knobs\.get\("([A-Z0-9_]+)"', pathlib.Path(module.__file__).read_text()))
    assert read and read <= set(replay.SWITCHES), sorted(read - set(replay.SWITCHES))


def _fp8_paged(gen):
    enc = torch.float8_e4m3fn
    pages = S // PAGE
    cache = torch.randn(pages + 3, 2, PAGE, HKV, D, generator=gen).to(enc)
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="triton")
    w.plan(torch.tensor([0, S], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
           torch.randperm(pages + 3, generator=gen)[:pages].to(torch.int32), torch.tensor([PAGE], dtype=torch.int32),
           HQ, HKV, D, PAGE, causal=True, q_data_type=enc, kv_data_type=enc)
    return w, cache


def _descales(gen, per_head=False):
    return dict(scale_q=torch.rand(HQ if per_head else 1, generator=gen) + 0.5, scale_k=torch.rand(1, generator=gen) + 0.5,
                scale_v=torch.rand(1, generator=gen) + 0.5)


def test_fp8_attention_replays_its_transpose_with_the_calls_descales(recorded, monkeypatch):
    """fp8 attention (V^T made by transpose_v_kernel at each call): a later call replays both launches, with its own
    q, V^T (in V's descriptor) and descales, and otherwise what the full path passes; descales of another shape
    (per head) take the full path."""
    launches, full = recorded
    if launches.kind != "warp-specialized":
        pytest.skip("fp8 attention replays on the warp-specialized kernel only")
    transposes = []
    t_kernel = JITFunction(attention.transpose_v_kernel.fn)
    monkeypatch.setattr(attention, "transpose_v_kernel", t_kernel)
    monkeypatch.setattr(t_kernel, "run", lambda *args, grid, warmup, **kwargs: (
        transposes.append(("first", args)), _Compiled(transposes))[1])
    monkeypatch.setattr(fast._launches_of(t_kernel), "entries", {})
    gen = torch.Generator().manual_seed(4)
    w, cache = _fp8_paged(gen)
    q8 = lambda: _q(gen).to(torch.float8_e4m3fn)  # noqa: E731
    w.run(q8(), cache, **_descales(gen))
    assert full == [True] and w._plan.launch_memo[replay.KEY].descales is not None
    q, scales = q8(), _descales(gen)
    w.run(q, cache, **scales)
    assert full == [True], "not replayed"
    replayed, t_replayed = launches[-1][1], transposes[-1][1]
    assert replayed[0] is q and replayed[1].base is q
    assert replayed[3].base is t_replayed[1], "V's descriptor is not this call's V^T"
    at = next(i for i, a in enumerate(replayed) if a is w._plan.kv_tok_indptr) + 1  # the descales follow it
    assert all(a is b for a, b in zip(replayed[at:at + 3], (scales["scale_q"], scales["scale_k"], scales["scale_v"])))
    del w._plan.launch_memo[replay.KEY]  # the same call on the full path
    w.run(q, cache, out=replayed[4], **scales)
    assert full == [True, True]
    on_full, t_on_full = launches[-1][1], transposes[-1][1]
    # the same but for V^T, a new tensor of the same shape at each call
    assert _same(replayed[:3] + replayed[4:], on_full[:3] + on_full[4:])
    assert dict(replayed[3].__dict__, base=None) == dict(on_full[3].__dict__, base=None)
    assert _same(t_replayed[:1] + t_replayed[2:], t_on_full[:1] + t_on_full[2:])
    assert t_replayed[1].shape == t_on_full[1].shape and t_replayed[1].dtype == t_on_full[1].dtype
    w.run(q8(), cache, **_descales(gen))  # replayed again (the full path kept a new replay)
    assert full == [True, True]
    w.run(q8(), cache, **_descales(gen, per_head=True))
    assert full == [True, True, True], "per-head descales replayed a per-tensor launch"


class _FakePack:
    """launch.Pack's face to replay.Gathered: a key, and launches recorded."""

    def __init__(self, launched):
        self.launched = launched

    def arguments_key(self, args):
        return (("kw",), ("parts",))

    def launch_keyed(self, grid, args, key):
        self.launched.append(("copy", args))


class _FakeInner:
    """replay.Replay's face to replay.Gathered: prepare() says whether it may (as Replay, not where a watched
    switch moved since it was made), launch() records."""

    def __init__(self, launched, may=True):
        self.launched, self.may, self.prepared = launched, may, []
        self.switches = knobs.snapshot(replay.SWITCHES)

    def prepare(self, q, k, v, out, lse, grid0, gather_ok, scales=None):
        self.prepared.append((k, v, scales))
        may = self.may and knobs.snapshot(replay.SWITCHES) == self.switches
        return ("ready", k, v) if may else None

    def launch(self, ready):
        self.launched.append(ready)


def _gathered(launched, may=True, rows=(64, 2, 8)):
    k, v = torch.randn(6, 16, 2, 8), torch.randn(6, 16, 2, 8)
    inner = _FakeInner(launched, may)
    g = replay.Gathered((_FakePack(launched), (k, v, None, None, "plan-tensors"), (6, 1)), inner, k, v, rows,
                        torch.bfloat16)
    return g, inner, k, v


def test_gathered_copies_then_launches_with_the_calls_scales():
    launched = []
    g, inner, k, v = _gathered(launched)
    q = torch.randn(4, 2, 8).to(torch.bfloat16)
    scales = (0.5, 2.0, "k-ptr", "v-ptr", False, False)
    assert g(q, k, v, q, None, 3, scales)
    (copy, args), ready = launched
    assert copy == "copy" and args[0] is k and args[1] is v and args[4] == "plan-tensors"
    ko, vo = args[2], args[3]
    assert ko.shape == vo.shape == (64, 2, 8) and ko.dtype == torch.bfloat16 and ko is not vo
    assert ready == ("ready", ko, vo) and inner.prepared[-1][2] is scales  # the rows it copied into, these scales


@pytest.mark.parametrize("change", ["other-k", "moved-v", "q-dtype", "switch", "inner-refuses"])
def test_gathered_launches_nothing_where_it_may_not(change, monkeypatch):
    launched = []
    g, inner, k, v = _gathered(launched, may=change != "inner-refuses")
    q = torch.randn(4, 2, 8).to(torch.bfloat16)
    if change == "other-k":
        k = k.clone()
    elif change == "moved-v":  # the same object, new storage
        other = v.clone()
        v.set_(other.untyped_storage(), 0, other.shape, other.stride())
    elif change == "q-dtype":
        q = q.to(torch.float16)
    elif change == "switch":
        monkeypatch.setenv("SERVEATTN_PREFILL_GATHER", "force")
    assert not g(q, k, v, q, None, 3, (1.0, 1.0, None, None, False, False))
    assert launched == [], f"{change}: launched {launched}"
