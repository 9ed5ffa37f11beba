"""kernels/launch.py on the CPU: our argument key is at least as fine as Triton's own specialization (checked against
Triton's binder for the sm_90 backend), the cached path passes the launcher what JITFunction.run would, and every
case that must take Triton's path does (switch off, interpreter, hooks, unknown argument kinds, callable grids)."""
import importlib
import itertools
import random

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import JITFunction, create_function_from_signature

from serveattn.kernels import launch as fast


def _probe(X, Y, Z, n, m, k, scale, flag, OPT, D, BLOCK: tl.constexpr, MODE: tl.constexpr = 0, W=None):
    """Parameter kinds of our kernels (never compiled here: only its signature matters)."""
    pass


def _probe_jit():
    # a JITFunction even under TRITON_INTERPRET=1 (triton.jit would give an InterpretedFunction there)
    return JITFunction(_probe, do_not_specialize=["m"], do_not_specialize_on_alignment=["Y"])


def _triton_binder(jit_fn):
    return create_function_from_signature(jit_fn.signature, jit_fn.params, make_backend(GPUTarget("cuda", 90, 32)))


_STORAGE = {dt: torch.zeros(4096, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int32,
                                                        torch.float8_e4m3fn)}
_INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2 ** 31 - 1, 2 ** 31 - 16, 2 ** 31, 2 ** 31 + 1, -2 ** 31,
         -2 ** 31 - 1, -2 ** 31 - 16, 2 ** 63 - 1, 2 ** 63 - 16, 2 ** 63, 2 ** 63 + 16, 2 ** 64 - 1, 2 ** 64 - 16]


def _descriptor(rng):
    dtype = rng.choice([torch.bfloat16, torch.float16])
    block = rng.choice([[64, 64], [32, 64], [64, 128]])
    base = torch.zeros(256, 128, dtype=dtype)
    layout = rng.choice([gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16
                                                              else gl.float16),
                         gl.NVMMASharedLayout(64, 16), gl.NVMMASharedLayout(128, 16, transposed=True)])
    return TensorDescriptor(base, [256, 128], [128, 1], block, layout, padding=rng.choice(["zero", "nan"]))


def _random_arg(rng):
    kind = rng.choice(["tensor", "tensor", "int", "int", "int", "float", "bool", "none", "desc"])
    if kind == "tensor":
        storage = _STORAGE[rng.choice(list(_STORAGE))]
        return storage[rng.choice([0, 1, 2, 4, 8, 16, 24]):]  # offsets give 16-byte aligned and unaligned pointers
    if kind == "int":
        return rng.choice(_INTS)
    if kind == "float":
        return rng.choice([0.0, 1.0, 0.5, -3.0, 1e30, 1e300])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "none":
        return None
    return _descriptor(rng)


def _random_call(rng):
    args = [_random_arg(rng) for _ in range(10)]
    args.append(rng.choice([16, 32, 64, 1, True, False, 0]))  # BLOCK (constexpr) by position
    kwargs = {}
    if rng.random() < 0.5:
        kwargs["MODE"] = rng.choice([0, 1, 2])
    if rng.random() < 0.5:
        kwargs["num_warps"] = rng.choice([4, 8])
    if rng.random() < 0.3:
        kwargs["enable_fp_fusion"] = rng.choice([True, False])
    return args, kwargs


def test_key_at_least_as_fine_as_triton():
    """Calls with equal keys must get equal Triton specializations (and options): one compiled kernel per key.
    Around each of 40 random bases, three parameters take values from pools of six random ones (any kinds) and the
    keyword arguments vary a little, so that many calls of different values share a key."""
    jit_fn = _probe_jit()
    binder = _triton_binder(jit_fn)
    launches = fast._KernelLaunches(jit_fn)
    rng = random.Random(0)
    groups = {}
    for _ in range(40):
        base, kwargs = _random_call(rng)
        pools = {position: [_random_arg(rng) for _ in range(6)] for position in rng.sample(range(10), 3)}
        for _ in range(150):
            args = [rng.choice(pools[i]) if i in pools else base[i] for i in range(11)]
            call_kwargs = dict(kwargs, MODE=rng.choice([0, 1]))
            _, specialization, options = binder(*args, **dict(call_kwargs))
            ours = fast.arguments_key(launches, args, call_kwargs)
            groups.setdefault(ours, {})[tuple(map(id, args))] = (tuple(specialization), str(options))
    shared = [calls for calls in groups.values() if len(calls) > 1]
    assert len(shared) > 300  # keys that several distinct argument lists share
    for ours, calls in groups.items():
        assert len(set(calls.values())) == 1, (ours, set(calls.values()))


@pytest.mark.parametrize("position", range(10))
def test_key_at_least_as_fine_per_parameter(position):
    """One parameter varied over every kind and edge value, the rest fixed: denser coverage of each flag mix."""
    jit_fn = _probe_jit()
    binder = _triton_binder(jit_fn)
    launches = fast._KernelLaunches(jit_fn)
    rng = random.Random(position)
    base, kwargs = _random_call(rng)
    values = [_random_arg(rng) for _ in range(300)] + _INTS + [True, False, None, 0.0, 2.0]
    groups = {}
    for value in values:
        args = list(base)
        args[position] = value
        _, specialization, options = binder(*args, **dict(kwargs))
        groups.setdefault(fast.arguments_key(launches, args, kwargs), set()).add((tuple(specialization), str(options)))
    for ours, triton_keys in groups.items():
        assert len(triton_keys) == 1, (ours, triton_keys)


def test_key_follows_the_parameter_flags():
    """do_not_specialize / do_not_specialize_on_alignment: no cache entry per value class Triton does not split."""
    jit_fn = _probe_jit()
    launches = fast._KernelLaunches(jit_fn)
    t = _STORAGE[torch.bfloat16]
    base = [t, t, t, 5, 5, 5, 1.0, True, None, None, 16]

    def key_with(position, value):
        args = list(base)
        args[position] = value
        return fast.arguments_key(launches, args, {})
    m, n, y, x = 4, 3, 1, 0
    assert key_with(m, 1) == key_with(m, 16) == key_with(m, 17)  # m: do_not_specialize
    assert len({key_with(n, 1), key_with(n, 16), key_with(n, 17)}) == 3
    assert key_with(y, t[1:]) == key_with(y, t[8:])  # Y: do_not_specialize_on_alignment
    assert key_with(x, t[1:]) != key_with(x, t[8:])


@pytest.mark.parametrize("value", ["a string", np.int64(3), (1, 2), torch.bfloat16, object()])
def test_unknown_argument_kinds_raise(value):
    launches = fast._KernelLaunches(_probe_jit())
    t = _STORAGE[torch.bfloat16]
    with pytest.raises(fast.UnkeyedArgument, match=f"^{type(value).__name__}$"):  # it names the type it cannot key
        fast.arguments_key(launches, [t, t, value, 5, 5, 5, 1.0, True, None, None, 16], {})


# ---- the launch path itself, against a stand-in for the driver and for JITFunction.run ----

class _FakeDriver:
    """driver.active's device and stream calls, without a GPU."""

    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


class _FakeKernel:
    def __init__(self):
        self.launches = []
        self.function = "cu-function"
        self.packed_metadata = ("packed",)

    @property
    def run(self):
        return self._launcher

    def _launcher(self, *launch_args):
        self.launches.append(launch_args)


@pytest.fixture
def fake_triton(monkeypatch):
    """ENABLED on, a fake driver, and the JIT function's run() replaced by what Triton's does on a cache hit with
    idle hooks: bind (Triton's own binder), then call the launcher. Records the calls that took Triton's path."""
    monkeypatch.setattr(fast, "ENABLED", True)
    monkeypatch.setattr(fast, "_driver", _FakeDriver)
    monkeypatch.setattr(fast, "_interpreted", lambda jit_fn: False)  # the suite runs under TRITON_INTERPRET=1
    jit_fn = _probe_jit()
    binder = _triton_binder(jit_fn)
    kernel = _FakeKernel()
    triton_calls = []

    def triton_run(*args, grid, warmup, **kwargs):
        bound, _, _ = binder(*args, **kwargs)
        triton_calls.append(grid)
        if callable(grid):
            grid = grid(bound)
        size = len(grid)
        kernel.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, 1234, kernel.function,
                   kernel.packed_metadata, None, None, None, *bound.values())
        return kernel
    monkeypatch.setattr(jit_fn, "run", triton_run)
    return jit_fn, kernel, triton_calls


def _same(a, b):
    return len(a) == len(b) and all(x is y or (type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y)
                                    for x, y in zip(a, b))


def _args(offset=0):
    t = torch.zeros(64, dtype=torch.bfloat16)
    return [t[offset:], t, t, 48, 7, 9, 0.5, True, None, None, 32]


def test_cached_call_passes_what_triton_passes(fake_triton):
    jit_fn, kernel, triton_calls = fake_triton
    assert fast.launch(jit_fn, (3, 2), *_args(), MODE=1, num_warps=4) is kernel
    assert len(triton_calls) == 1 and len(kernel.launches) == 1
    for grid in [(5, 2), (7,), (1, 2, 3)]:  # new tensors of the same class, other grids: the cached path
        args = _args()
        assert fast.launch(jit_fn, grid, *args, MODE=1, num_warps=4) is kernel
        assert len(triton_calls) == 1
        # what Triton's own path passes for the same call
        expected = list(grid) + [1] * (3 - len(grid)) + [1234, "cu-function", ("packed",), None, None, None]
        expected += [*args, 1, None]  # MODE by name, W's default
        assert _same(kernel.launches[-1], expected)
    launches = fast._launches_of(jit_fn)
    assert len(launches.entries) == 1


def test_class_changes_take_triton_path_and_a_new_entry(fake_triton):
    jit_fn, kernel, triton_calls = fake_triton
    fast.launch(jit_fn, (1, 1), *_args(), MODE=1)
    fast.launch(jit_fn, (1, 1), *_args(offset=1), MODE=1)  # X no longer 16-byte aligned
    fast.launch(jit_fn, (1, 1), *_args(), MODE=2)  # another constexpr
    fast.launch(jit_fn, (1, 1), *_args(), MODE=1, num_warps=8)  # another option
    assert len(triton_calls) == 4 and len(fast._launches_of(jit_fn).entries) == 4
    fast.launch(jit_fn, (1, 1), *_args(offset=1), MODE=1)
    assert len(triton_calls) == 4 and len(kernel.launches) == 5


@pytest.mark.parametrize("case", ["unknown kind", "runtime argument by name", "callable grid", "hook", "pre-run hook"])
def test_falls_back_to_triton(fake_triton, case):
    jit_fn, kernel, triton_calls = fake_triton
    args, kwargs, grid = _args(), {"MODE": 1}, (1, 1)
    if case == "unknown kind":
        args[3] = (48, 16)  # a tuple: Triton takes it, our key does not
    elif case == "runtime argument by name":
        kwargs["W"] = torch.zeros(4)
    elif case == "callable grid":
        grid = lambda meta: (1, 1)  # noqa: E731
    elif case == "hook":
        hook = lambda metadata: None  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
    else:
        jit_fn.add_pre_run_hook(lambda *a, **k: None)
    try:
        for _ in range(3):
            fast.launch(jit_fn, grid, *args, **kwargs)
    finally:
        if case == "hook":
            knobs.runtime.launch_enter_hook.remove(hook)
    assert len(triton_calls) == 3
    launches = fast._launches_of(jit_fn)
    assert launches is None or not launches.entries


def test_rebound_global_takes_triton_path(fake_triton):
    """A global the kernel reads, rebound after the entry was made: Triton's path (which checks, and raises)."""
    jit_fn, kernel, triton_calls = fake_triton
    namespace = {"SCALE": tl.constexpr(2)}
    jit_fn.used_global_vals = {("SCALE", id(namespace)): (tl.constexpr(2), namespace)}
    for _ in range(2):
        fast.launch(jit_fn, (1, 1), *_args(), MODE=1)
    assert len(triton_calls) == 1
    namespace["SCALE"] = tl.constexpr(3)
    fast.launch(jit_fn, (1, 1), *_args(), MODE=1)
    assert len(triton_calls) == 2


def test_off_means_triton_path(fake_triton, monkeypatch):
    jit_fn, kernel, triton_calls = fake_triton
    monkeypatch.setattr(fast, "ENABLED", False)
    for _ in range(3):
        fast.launch(jit_fn, (1, 1), *_args(), MODE=1)
    assert len(triton_calls) == 3 and fast._STATE_ATTR not in jit_fn.__dict__


def test_on_by_default_on_triton_3_6_only(monkeypatch):
    monkeypatch.delenv("SERVEATTN_FAST_LAUNCH", raising=False)
    try:
        assert importlib.reload(fast).ENABLED is triton.__version__.startswith("3.6.")
        monkeypatch.setattr(triton, "__version__", "3.7.0")
        assert importlib.reload(fast).ENABLED is False  # internals not checked there: Triton's own path
        monkeypatch.setenv("SERVEATTN_FAST_LAUNCH", "1")
        assert importlib.reload(fast).ENABLED is True
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        monkeypatch.setenv("SERVEATTN_FAST_LAUNCH", "0")
        assert importlib.reload(fast).ENABLED is False
        monkeypatch.delenv("SERVEATTN_FAST_LAUNCH")
        assert importlib.reload(fast).ENABLED is True
    finally:
        monkeypatch.undo()
        importlib.reload(fast)


@triton.jit
def _add_one_kernel(X, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(X + i, tl.load(X + i, mask=i < n) + 1, mask=i < n)


@pytest.mark.skipif(not knobs.runtime.interpret, reason="checks the interpreter")
def test_interpreter_takes_triton_path(monkeypatch):
    monkeypatch.setattr(fast, "ENABLED", True)
    x = torch.zeros(8)
    for _ in range(2):
        fast.launch(_add_one_kernel, (1,), x, 8, BLOCK=8)
    assert torch.equal(x, torch.full((8,), 2.0))
    assert fast._launches_of(_add_one_kernel) is None


def test_kinds_never_collide():
    """Key parts of different kinds at one position differ (the generated expression's claim)."""
    jit_fn = _probe_jit()
    launches = fast._KernelLaunches(jit_fn)
    t = _STORAGE[torch.bfloat16]
    rng = random.Random(1)
    samples = [t, t[1:], _STORAGE[torch.float32], 0, 1, 17, 2 ** 40, 2 ** 63, 1.5, True, False, None,
               _descriptor(rng)]
    for position in (0, 1, 3, 4):
        keys = {}
        for value in samples:
            args = [t, t, t, 5, 5, 5, 1.0, True, None, None, 16]
            args[position] = value
            keys.setdefault(fast.arguments_key(launches, args, {}), []).append(value)
        for a, b in itertools.combinations(samples, 2):
            if type(a) is not type(b):
                ka = [k for k, v in keys.items() if any(x is a for x in v)][0]
                kb = [k for k, v in keys.items() if any(x is b for x in v)][0]
                assert ka != kb, (position, a, b)


# ---- host TensorDescriptor arguments: each encoding made once per (address, shape, strides, padding) ----

class _FakeCudaLauncher:
    """CudaLauncher's attributes the descriptor launcher reads, with Triton's own descriptor wrapper (triton 3.6
    wrap_handle_tensordesc) around a recording stand-in for the compiled C launcher."""

    def __init__(self, signature, metas):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc
        self.raw_calls = []
        self.launch = wrap_handle_tensordesc(lambda *a: self.raw_calls.append(a), signature, metas)
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.global_scratch_size = self.profile_scratch_size = 0

    def __call__(self, gx, gy, gz, stream, function, *args):  # CudaLauncher.__call__ without scratch
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


def test_descriptor_launcher_passes_what_triton_passes_and_encodes_once(monkeypatch):
    import triton.backends.nvidia.driver as nvidia
    encodings = []

    def encode(desc, meta):  # stands for the CUtensorMap encoding (needs a GPU): what it is made of
        encodings.append(desc)
        return [("map", desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), desc.padding, meta["id"]),
                *desc.shape, *desc.strides]
    monkeypatch.setattr(nvidia, "make_tensordesc_arg", encode)
    monkeypatch.setattr(fast, "_make_tensordesc_arg", encode)
    signature = {0: "*bf16", 1: "tensordesc<bf16[64, 64]>", 2: "i32", 3: "tensordesc<bf16[32, 64]>", 4: "constexpr"}
    run = _FakeCudaLauncher(signature, [{"id": "a"}, {"id": "b"}])
    kernel = type("Kernel", (), {"run": run})()
    launch = fast._descriptor_launcher(kernel)
    assert launch is not None

    cache = torch.zeros(256, 128, dtype=torch.bfloat16)
    other = torch.zeros(256, 128, dtype=torch.bfloat16)

    def desc(base, rows=256, padding="zero"):
        return TensorDescriptor(base, [rows, 128], [128, 1], [64, 64], gl.NVMMASharedLayout(128, 16),
                                padding=padding)
    calls = [(desc(cache), desc(cache)), (desc(cache), desc(cache)), (desc(other), desc(cache)),
             (desc(cache, 128), desc(cache)), (desc(cache, padding="nan"), desc(cache)), (desc(cache), desc(other))]
    for a, b in calls:
        params = (torch.zeros(4), a, 7, b, 16)
        run(3, 2, 1, 99, "fn", "packed", None, None, None, *params)  # Triton's launcher
        launch(3, 2, 1, 99, "fn", "packed", None, None, None, *params)  # ours
        assert _same(run.raw_calls[-1], run.raw_calls[-2])
    # Triton encoded 2 per call (12); ours only what it had not seen: a's 4 kinds + b's 2 kinds
    assert len(encodings) == 12 + 6


def test_descriptor_launcher_declines_what_it_does_not_know():
    signature = {0: "tensordesc<bf16[64, 64]>"}
    run = _FakeCudaLauncher(signature, [{"id": "a"}])
    run.global_scratch_size = 128  # a kernel that needs scratch: CudaLauncher allocates it per call
    assert fast._descriptor_launcher(type("Kernel", (), {"run": run})()) is None
    run = _FakeCudaLauncher(signature, None)  # no descriptor metadata: Triton passes descriptors decomposed
    assert fast._descriptor_launcher(type("Kernel", (), {"run": run})()) is None
    run.launch = lambda *a: None  # not Triton 3.6's wrapper
    assert fast._descriptor_launcher(type("Kernel", (), {"run": run})()) is None


# ---- launch.Pack: a plan's own arguments keyed once ----

def test_pack_passes_what_launch_passes_and_shares_its_entries(fake_triton):
    jit_fn, kernel, triton_calls = fake_triton
    fixed = _args()
    pack = fast.Pack(jit_fn, fixed, {"MODE": 1, "num_warps": 4}, fixed_positions=(1, 2, 10))
    fast.launch(jit_fn, (3, 2), *_args(), MODE=1, num_warps=4)  # compiles (Triton's path) and keeps an entry
    assert len(triton_calls) == 1
    for grid in [(5, 2), (7,)]:
        args = _args()
        args[1], args[2], args[10] = fixed[1], fixed[2], fixed[10]  # the plan's objects, the rest new
        assert pack(grid, *args) is kernel
        expected = list(grid) + [1] * (3 - len(grid)) + [1234, "cu-function", ("packed",), None, None, None]
        expected += [*args, 1, None]
        assert _same(kernel.launches[-1], expected)
    assert len(triton_calls) == 1 and len(fast._launches_of(jit_fn).entries) == 1  # launch()'s own entry


def test_pack_key_follows_the_free_positions(fake_triton):
    """A free argument's class still decides the entry (an unaligned X compiles anew), as in launch()."""
    jit_fn, kernel, triton_calls = fake_triton
    fixed = _args()
    pack = fast.Pack(jit_fn, fixed, {"MODE": 1}, fixed_positions=(1, 2))
    pack((1, 1), *fixed)
    args = _args(offset=1)
    args[1], args[2] = fixed[1], fixed[2]
    pack((1, 1), *args)
    assert len(triton_calls) == 2 and len(fast._launches_of(jit_fn).entries) == 2


def test_pack_with_other_objects_at_fixed_positions_takes_launch(fake_triton, monkeypatch):
    """Another object where the pack expects its own is keyed by launch(): here an unaligned Z, whose class is
    not the one the pack's cached key part says (reusing it would launch the aligned kernel)."""
    jit_fn, kernel, triton_calls = fake_triton
    fixed = _args()
    pack = fast.Pack(jit_fn, fixed, {"MODE": 1}, fixed_positions=(2,))
    pack((1, 1), *fixed)
    seen = []
    real_launch = fast.launch
    monkeypatch.setattr(fast, "launch", lambda *a, **k: seen.append(a[2:]) or real_launch(*a, **k))
    other = _args()
    other[2] = torch.zeros(64, dtype=torch.bfloat16)[1:]
    pack((1, 1), *other)
    assert len(seen) == 1 and seen[0][2] is other[2]
    assert len(triton_calls) == 2 and len(fast._launches_of(jit_fn).entries) == 2


def test_pack_off_means_triton_path(fake_triton, monkeypatch):
    jit_fn, kernel, triton_calls = fake_triton
    pack = fast.Pack(jit_fn, _args(), {"MODE": 1}, fixed_positions=(1,))
    monkeypatch.setattr(fast, "ENABLED", False)
    args = _args()
    pack((1, 1), *args)
    pack((1, 1), *args)
    assert len(triton_calls) == 2


def test_pack_key_is_launch_key_whatever_the_classes(fake_triton):
    """A pack tests first for the classes it was made with; any other class at a free position still gets launch()'s
    key part."""
    jit_fn, _, _ = fake_triton
    launches = fast._launches_of(jit_fn)
    base = _args()
    pack = fast.Pack(jit_fn, base, {}, fixed_positions=(1,))
    rng = random.Random(5)
    for _ in range(300):
        args = [_random_arg(rng) for _ in range(10)] + [rng.choice([16, 32, True])]
        args[1] = base[1]
        assert pack.key_function(*args) == fast.arguments_key(launches, args, {})[1]


def test_packs_of_one_layout_share_their_generated_code(fake_triton):
    """A plan's Packs are made at its first run, every step: the key function is generated (exec, ~1 ms) once per
    layout, and each pack binds its own objects."""
    jit_fn, _, _ = fake_triton
    first, second = _args(), _args()
    packs = [fast.Pack(jit_fn, args, {"MODE": 1}, fixed_positions=(1, 2)) for args in (first, second)]
    assert len(fast._launches_of(jit_fn).pack_makers) == 1
    assert packs[0].key_function.__code__ is packs[1].key_function.__code__
    assert packs[0].key_function(*first) is not None and packs[0].key_function(*second) is None
    assert packs[1].key_function(*second) is not None
