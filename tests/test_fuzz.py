"""Keeps the differential fuzzer (scripts/fuzz.py) alive in CI: a fixed handful of seeds per family, each a
random configuration of the public API checked against the float64 reference (see the script's docstring)."""
import importlib.util
import os
import re
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "fuzz.py")
_spec = importlib.util.spec_from_file_location("serveattn_fuzz", _PATH)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fuzz  # its dataclasses look their module up there
_spec.loader.exec_module(fuzz)

SEEDS_PER_FAMILY = 10


@pytest.mark.parametrize("seed", range(SEEDS_PER_FAMILY))
@pytest.mark.parametrize("family", fuzz.FAMILIES)
def test_fuzz_seed(family, seed, device):
    case = fuzz.run_case(family, seed, device=device)  # on a GPU machine: the compiled kernels, fuzz.py --device cuda
    assert not case.failures, f"{case.failures[0]}\nconfig: {fuzz.short(case.config)}\nrepro: {case.repro()}"
    unexpected = [msg for expected, msg in case.refusals if not expected]
    assert not unexpected, unexpected


def test_a_seed_is_one_configuration(device):
    """The reproducer line is worth something only if a seed always draws the same case."""
    a, b = fuzz.run_case("decode", 3, device=device), fuzz.run_case("decode", 3, device=device)
    assert a.config == b.config and a.config


@pytest.mark.parametrize("family", ["prefill", "decode", "cascade"])
def test_the_checks_bite(family, monkeypatch, device):
    """A reference that is off by 1% must fail every family's first seeds: the fuzzer's checks are not vacuous."""
    real = fuzz.reference.attention

    def off(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out * 1.01, lse
    monkeypatch.setattr(fuzz.reference, "attention", off)
    cases = [fuzz.run_case(family, seed, recycle=False, device=device) for seed in range(6)]
    assert any("rel_err" in f for c in cases for f in c.failures)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's tiles (the script runs on the CPU here)")
def test_alone_check_is_bitwise_where_the_tiles_agree():
    """Decode seed 1601700 (tree verify on the tensor-core route): request 0 alone plans BLOCK_M 32, the batch 64;
    under the interpreter the two differ in the last bit of one LSE (numpy's float32 matmul rows depend on the row
    count), so the check falls back to closeness there, and says so in the case's configuration."""
    case = fuzz.run_case("decode", 1601700, recycle=False)
    assert not case.failures, case.failures
    assert case.config["alone_tiles"] == ((64, 32, 4, None), (32, 32, 4, None))  # (block_m, block_n, warps, chunk)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's tiles and SM count (the script runs on the CPU here)")
def test_alone_check_is_close_where_only_the_request_alone_splits(monkeypatch):
    """Decode seed 95313 (RoPE, so the tensor-core route): one request of 377 keys alone is split (256-key chunks on
    the interpreter's 2 "SMs"); in the batch of two, which fills them, only the ragged split cuts it. With that off
    (SERVEATTN_PREFILL_RAGGED_SPLIT=0) the batch is unsplit: a default plan splits by the batch's size (README), so
    the request's rows are close, not bitwise (fixed_split_size / disable_split_kv are the batch-invariant plans).
    By default the ragged split cuts it into the same 256-key chunks here: the same tiles, so bitwise."""
    monkeypatch.setenv("SERVEATTN_PREFILL_RAGGED_SPLIT", "0")
    case = fuzz.run_case("decode", 95313, recycle=False)
    assert not case.failures, case.failures
    assert case.config["alone_tiles"] == ((16, 32, 4, None), (16, 32, 4, 256))
    monkeypatch.delenv("SERVEATTN_PREFILL_RAGGED_SPLIT")
    case = fuzz.run_case("decode", 95313, recycle=False)
    assert not case.failures, case.failures
    assert "alone_tiles" not in case.config  # same tiles and chunks: checked bitwise


class DevicePlumbing(TorchFunctionMode):
    """--device cuda on a machine without one: fuzz.on_device replaced by a transfer to a pretend device (CPU tensors
    in fresh storage, recorded), then every tensor the fuzzer hands serveattn must be one it moved, one derived from
    those, or a plan index tensor it put on the host; and no torch call of the fuzzer's own (outside serveattn) may mix
    device tensors with CPU ones (on a GPU, an error). Tensors are told apart by their storage."""

    EXEMPT = (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_)  # CPU indices / sources: fine

    def __init__(self):
        super().__init__()
        self.device_storage, self.host_storage, self.alive = set(), set(), []
        self.inside_api = 0
        self.problems = []

    @staticmethod
    def tensors(x):
        if isinstance(x, torch.Tensor):
            return [x] if x.numel() else []  # empty tensors share storage address 0
        if isinstance(x, (tuple, list)):
            return [t for y in x for t in DevicePlumbing.tensors(y)]
        if isinstance(x, dict):
            return DevicePlumbing.tensors(list(x.values()))
        return []

    def mark(self, x, storage_set):
        for t in self.tensors(x):
            storage_set.add(t.untyped_storage().data_ptr())
            self.alive.append(t)  # a freed address is not reused while we remember it

    def on_device(self, x, device=None):
        if x is None:
            return None
        if isinstance(x, (tuple, list)):
            return type(x)(self.on_device(t, device) for t in x)
        # fuzz.use_device makes INDEX_DEVICE the DEVICE object itself unless the index tensors go to the host
        to_host = device is not None and device is not fuzz.DEVICE
        if self.on_pretend_device(x) or to_host:
            self.mark(x, self.host_storage if to_host else self.device_storage)
            return x
        base = x if x._base is None else x._base
        moved = base.clone()  # fresh storage, as a transfer gives; a view stays a view of its moved base
        moved = moved if x._base is None else moved.as_strided(x.shape, x.stride(), x.storage_offset())
        self.mark(moved, self.device_storage)
        return moved

    def on_pretend_device(self, t):
        return t.numel() > 0 and t.untyped_storage().data_ptr() in self.device_storage

    @staticmethod
    def where():
        """The innermost line of scripts/fuzz.py on the stack."""
        frame = sys._getframe(1)
        while frame and frame.f_code.co_filename != _PATH:
            frame = frame.f_back
        return f"fuzz.py:{frame.f_lineno}" if frame else "?"

    def api(self, name, fn):
        def checked(*args, **kwargs):
            outermost = not self.inside_api  # serveattn calling itself (a cascade's levels) is not the fuzzer's doing
            for t in self.tensors((args, kwargs)) if outermost else []:
                if not self.on_pretend_device(t) and t.untyped_storage().data_ptr() not in self.host_storage:
                    self.problems.append(f"{name} got a tensor {tuple(t.shape)} {t.dtype} that was never moved "
                                         f"({self.where()})")
            self.inside_api += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                self.inside_api -= 1
            if outermost:
                self.mark(result, self.device_storage)  # what serveattn returns lives on the device
            return result
        return checked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self.inside_api:
            return result
        ins = self.tensors((args, kwargs))
        if func is torch.Tensor.cpu:
            # a copy, as from a GPU (on the CPU .cpu() returns the tensor itself); it is no device tensor
            return result.clone() if any(map(self.on_pretend_device, ins)) else result
        if any(map(self.on_pretend_device, ins)):
            if func not in self.EXEMPT and any(t.dim() and not self.on_pretend_device(t) for t in ins):
                self.problems.append(f"{getattr(func, '__name__', func)} mixes device and CPU tensors ({self.where()})")
            self.mark(result, self.device_storage)
        elif any(t.untyped_storage().data_ptr() in self.host_storage for t in ins):
            self.mark(result, self.host_storage)  # derived from a host index tensor (a slice's clone): on the host
        return result


def plumbed(monkeypatch):
    """A DevicePlumbing whose checks guard every serveattn entry point the fuzzer calls."""
    check = DevicePlumbing()
    monkeypatch.setattr(fuzz, "on_device", check.on_device)
    for name in sorted(set(re.findall(r"serveattn\.(\w+)\(", open(_PATH).read()))):
        entry = getattr(fuzz.serveattn, name)
        if not isinstance(entry, type):
            monkeypatch.setattr(fuzz.serveattn, name, check.api(name, entry))
            continue
        for klass in [k for k in entry.__mro__ if k.__module__.startswith("serveattn")]:  # plan / run inherited too
            for method in ("__init__", "plan", "run", "forward"):
                if method in vars(klass):
                    monkeypatch.setattr(klass, method, check.api(f"{klass.__name__}.{method}", vars(klass)[method]))
    return check


@pytest.mark.skipif(torch.cuda.is_available(), reason="a pretend device, for machines without a GPU")
@pytest.mark.parametrize("family", fuzz.FAMILIES)
def test_device_plumbing(family, monkeypatch):
    """fuzz.py --device cuda, as far as a CPU can show it: a seed draws the same configuration for device "cpu" and
    for a device object sent through the transfer path (so a GPU failure replays on the CPU), the cases still pass
    with every input in fresh storage, and nothing reaches serveattn, or meets a device tensor, unmoved."""
    seeds = range(8)
    plain = [fuzz.run_case(family, seed) for seed in seeds]
    check = plumbed(monkeypatch)
    with check:
        moved = [fuzz.run_case(family, seed, device=torch.device("cpu")) for seed in seeds]
    assert check.device_storage, "nothing went through fuzz.on_device"
    assert not check.problems, "\n".join(sorted(set(check.problems)))
    for a, b in zip(plain, moved):
        assert a.config == b.config, (a.seed, fuzz.short(a.config), fuzz.short(b.config))
        assert not b.failures, (b.seed, b.failures[0], fuzz.short(b.config))
    assert {c.config["index_on"] for c in moved} == {"host", "device"}


def test_repro_names_device_and_scale():
    assert fuzz.Case("decode", 5, device="cuda", scale=2).repro().endswith(" --device cuda --scale 2 -v")
    assert fuzz.Case("decode", 5).repro() == "python scripts/fuzz.py --family decode --start 5 --seeds 1 -v"


@pytest.mark.gpu
@pytest.mark.parametrize("family", fuzz.FAMILIES)
def test_fuzz_on_the_gpu_at_scale(family):
    """fuzz.py --device cuda --scale 4: longer requests (several tiles, split chunks) through the compiled kernels."""
    saved_scale, fuzz.SCALE = fuzz.SCALE, 4
    try:
        cases = [fuzz.run_case(family, seed, device="cuda") for seed in range(4)]
    finally:
        fuzz.SCALE = saved_scale
    for case in cases:
        assert not case.failures, f"{case.failures[0]}\nrepro: {case.repro()}"
