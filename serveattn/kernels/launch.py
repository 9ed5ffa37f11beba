"""Kernel launches that skip most of Triton's per-call host work (JITFunction.run), for the eager path.

`launch(jit_fn, grid, *args, **kwargs)` stands for `jit_fn[grid](*args, **kwargs)`. With the switch on
(the default on the Triton it was written against, 3.6; SERVEATTN_FAST_LAUNCH=0 turns it off, =1 forces it on another
Triton; read at import into ENABLED, tests and probes flip the attribute) a call whose arguments
fall in a class seen before goes straight to the compiled kernel's launcher: no binder (a native_specialize_impl
call per parameter), no cache-key string, no launch-metadata dict, no hook calls, and the globals the kernel reads
checked by identity instead of by value. The class is our own key of the arguments, at least as fine as Triton's
specialization (tests/test_fast_launch.py checks that against Triton's binder), so a class maps to one compiled
kernel. The first call of a class, and any call we cannot key, takes Triton's own path, which compiles or finds the
kernel and launches it.

Triton internals relied on (triton 3.6): JITFunction.params (KernelParam: is_constexpr, do_not_specialize,
do_not_specialize_on_alignment, default), JITFunction.pre_run_hooks / used_global_vals, CompiledKernel.run /
function / packed_metadata, the launcher's argument order (grid x3, stream, function, packed metadata, launch
metadata, enter hook, exit hook, every parameter in signature order), knobs.runtime.launch_enter_hook /
launch_exit_hook as HookChain, and what native_specialize_impl distinguishes.
"""
import os

import torch
import triton
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver as _driver
from triton.runtime.jit import JITFunction

try:  # Gluon's host-side TMA descriptor (the warp-specialized prefill kernel takes three)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonTensorDescriptor
except ImportError:  # pragma: no cover - a Triton without Gluon
    _GluonTensorDescriptor = None
try:  # how Triton's CUDA launcher turns a host TensorDescriptor into launch arguments (a CUtensorMap encoded)
    from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
except ImportError:  # pragma: no cover - another backend
    _make_tensordesc_arg = None

# On by default only where the internals above were checked: another Triton takes its own path unless asked.
_SWITCH = os.environ.get("SERVEATTN_FAST_LAUNCH", "")
ENABLED = _SWITCH == "1" or (_SWITCH == "" and triton.__version__.startswith("3.6."))

_STATE_ATTR = "_serveattn_fast_launch"


class UnkeyedArgument(Exception):
    """An argument of a kind our key does not cover: the call takes Triton's own path."""


class _KernelLaunches:
    """Per JIT function: the key functions (one per count of positional arguments) and the launch entries."""

    def __init__(self, jit_fn):
        self.params = jit_fn.params
        self.key_functions = {}
        self.pack_makers = {}  # Pack's generated key functions, one per layout (_pack_key_maker)
        # (device, debug, instrumentation mode, keyword arguments, positional key) ->
        # (launcher, CUfunction, packed metadata, trailing parameter values, CompiledKernel, globals read)
        self.entries = {}


def _param_key_expression(name: str, param, hint=None) -> str:
    """Python expression of one parameter's key part. Parts of different argument kinds never compare equal: a
    tensor gives a torch.dtype (16-byte aligned, or alignment not specialized) or a 1-tuple, an i32 int an int in
    -1..1 (or just 0), the rest strings, None or tuples of 2 or more. hint: the class this position is expected to
    hold (Pack's), tested first; any other class still gets the same part."""
    if param.is_constexpr:
        return name  # Triton compiles one kernel per value (and, like Triton, takes True == 1)
    specialize = not param.do_not_specialize
    align = specialize and not param.do_not_specialize_on_alignment
    tensor = f"({name}.dtype if not {name}.data_ptr() & 15 else ({name}.dtype,))" if align else f"{name}.dtype"
    # an i32 int: 1 (a constant to Triton), divisible by 16 (-1) or neither (0); unspecialized: its type only
    small = f"(({name} == 1) - (not {name} & 15))" if specialize else "0"
    integer = f"({small} if -0x80000000 <= {name} <= 0x7fffffff else _wide_int_key({name}, {specialize}))"
    generic = (f"({tensor} if {name}.__class__ is _Tensor else {integer} if {name}.__class__ is int "
               f"else 'fp32' if {name}.__class__ is float else _other_key({name}))")
    if hint is torch.Tensor:
        return f"({tensor} if {name}.__class__ is _Tensor else {generic})"
    if hint is int:
        return f"({small} if {name}.__class__ is int and -0x80000000 <= {name} <= 0x7fffffff else {generic})"
    if hint is float:
        return f"('fp32' if {name}.__class__ is float else {generic})"
    return generic


def _wide_int_key(value: int, specialize: bool):
    """An int outside i32: Triton's i64 or u64 (above u64 Triton raises; so will the launcher), divisibility."""
    return ("u64" if value > 0x7fffffffffffffff else "i64", specialize and not value & 15)


def _other_key(value):
    """Key part of the argument kinds the generated expression leaves out (every parameter flag at its finest)."""
    cls = value.__class__
    if cls is bool:
        return "u1"  # Triton: ("u1", None) whatever the value
    if cls is float:
        return "fp32"  # Triton: ("fp32", None) whatever the value
    if value is None:
        return None  # Triton: ("constexpr", None)
    if cls is _GluonTensorDescriptor:
        # Triton's string holds the dtype, block shape and layout; padding goes in too (finer costs nothing)
        return ("desc", value.base.dtype, tuple(value.block_shape), value.layout, value.padding)
    if isinstance(value, torch.Tensor):  # a subclass (nn.Parameter, ...)
        return (value.dtype, not value.data_ptr() & 15)
    raise UnkeyedArgument(cls.__name__)


_KEY_GLOBALS = {"_Tensor": torch.Tensor, "_other_key": _other_key, "_wide_int_key": _wide_int_key}


def _key_function(launches: _KernelLaunches, num_args: int):
    """The positional arguments' key as one generated function (an expression per parameter: no call per
    argument, no loop)."""
    if num_args > len(launches.params):
        raise UnkeyedArgument("more positional arguments than parameters")
    names = [f"a{i}" for i in range(num_args)]
    parts = [_param_key_expression(n, p) for n, p in zip(names, launches.params)]
    source = f"def positional_key({', '.join(names)}):\n    return ({''.join(p + ', ' for p in parts)})\n"
    namespace = dict(_KEY_GLOBALS)
    exec(source, namespace)
    return namespace["positional_key"]


def _pack_key_maker(launches: _KernelLaunches, num_args: int, fixed_positions, hints):
    """make(the objects at the fixed positions) -> Pack's key function: None when a fixed position holds another
    object than the pack's, else the key launch() would make, the fixed positions' parts made once, in make.
    Generated (exec costs ~1 ms) once per JIT function and layout (the positions, the classes expected at the
    others), not per Pack: a plan's Packs are made at its first run, and a server plans every step."""
    layout = (num_args, fixed_positions, hints)
    maker = launches.pack_makers.get(layout)
    if maker is not None:
        return maker
    if num_args > len(launches.params):
        raise UnkeyedArgument("more positional arguments than parameters")
    names = [f"a{i}" for i in range(num_args)]
    parts = [f"p{i}" if i in fixed_positions else _param_key_expression(n, p, h)
             for i, (n, p, h) in enumerate(zip(names, launches.params, hints))]
    moved = " or ".join(f"a{i} is not f{i}" for i in fixed_positions) or "False"
    source = (f"def make({', '.join(f'f{i}' for i in fixed_positions)}):\n"
              + "".join(f"    p{i} = {_param_key_expression(f'f{i}', launches.params[i])}\n" for i in fixed_positions)
              + f"    def pack_key({', '.join(names)}):\n"
              f"        if {moved}:\n"
              f"            return None\n"
              f"        return ({''.join(p + ', ' for p in parts)})\n"
              f"    return pack_key\n")
    namespace = dict(_KEY_GLOBALS)
    exec(source, namespace)
    maker = launches.pack_makers[layout] = namespace["make"]
    return maker


def _launches_of(jit_fn):
    """The JIT function's launch state; None when the fast path never applies to it (an interpreted function
    under TRITON_INTERPRET=1 is no JITFunction, and Gluon's JIT function is one)."""
    launches = jit_fn.__dict__.get(_STATE_ATTR)
    if launches is None:
        launches = False if _interpreted(jit_fn) else _KernelLaunches(jit_fn)
        setattr(jit_fn, _STATE_ATTR, launches)
    return launches or None


def _interpreted(jit_fn) -> bool:
    return not isinstance(jit_fn, JITFunction) or knobs.runtime.interpret


def _hook_idle(hook) -> bool:
    return hook is None or (hook.__class__ is HookChain and not hook.calls)


def arguments_key(launches: _KernelLaunches, args, kwargs):
    """Our key of one call's arguments (without the device and Triton's debug knobs); raises UnkeyedArgument."""
    key_function = launches.key_functions.get(len(args))
    if key_function is None:
        key_function = launches.key_functions[len(args)] = _key_function(launches, len(args))
    return tuple(kwargs.items()), key_function(*args)


def _trailing_values(launches: _KernelLaunches, num_args: int, kwargs):
    """Values of the parameters after the positional ones, in signature order, defaults applied (what Triton's
    binder passes); None when one is a runtime argument given by name (its value changes per call)."""
    values = []
    for param in launches.params[num_args:]:
        if param.name in kwargs:
            if not param.is_constexpr:
                return None
            values.append(kwargs[param.name])
        elif param.has_default:
            values.append(param.default)
        else:
            return None
    return tuple(values)


_MISSING = object()


def _globals_read(jit_fn):
    """(namespace, name, object) of each global the kernel reads. Triton compares values on every call
    (constexpr comparisons: 4.5 us for prefill_kernel's seven, 0.7 us for decode_kernel's one, on a 2-core dev CPU); an
    identity check is ~0.1 us each."""
    return tuple((namespace, name, namespace.get(name, _MISSING))
                 for (name, _), (_, namespace) in jit_fn.used_global_vals.items())


ENCODED_MAX = 64  # encoded descriptors kept per kernel entry and argument (a cache's few addresses, q's few)


def _descriptor_launcher(kernel):
    """kernel.run, for a kernel with host TensorDescriptor arguments, without encoding each descriptor at every
    call: Triton's launcher (CudaLauncher.launch, wrap_handle_tensordesc's `inner`) encodes a CUtensorMap on the
    host per descriptor and call, ~20% of a prefill run() on the H200's host (session 14). This one keeps each
    encoding, keyed by everything it is made of (the base's address, shape, strides, padding; the element type,
    block and swizzle are the compiled kernel's, fixed per entry), so a KV cache that stays where it is is encoded
    once. None (Triton's launcher stays) where the launcher is not laid out as in triton 3.6 or needs scratch."""
    run = kernel.run
    inner = getattr(run, "launch", None)
    code = getattr(inner, "__code__", None)
    if _make_tensordesc_arg is None or code is None or code.co_name != "inner" or not inner.__closure__:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in inner.__closure__)))
    raw, positions, metas = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
    if (raw is None or not positions or not metas or any(m is None for m in metas)
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)):
        return None
    descriptors = tuple(zip(sorted(positions), metas))  # Triton pairs them in position order
    fixed = (run.launch_cooperative_grid, run.launch_pdl, None, None)  # no scratch: CudaLauncher passes None
    encoded = [{} for _ in descriptors]

    def launch(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *params):
        final = [gx, gy, gz, stream, function, *fixed, packed_metadata, launch_metadata, enter_hook, exit_hook]
        start = 0
        for (position, meta), memo in zip(descriptors, encoded):
            desc = params[position]
            key = (desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), desc.padding)
            args = memo.get(key)
            if args is None:
                if len(memo) >= ENCODED_MAX:
                    memo.clear()
                args = memo[key] = _make_tensordesc_arg(desc, meta)
            final += params[start:position]
            final += args
            start = position + 1
        final += params[start:]
        raw(*final)
    return launch


def _runnable(jit_fn, grid):
    """The JIT function's launch state when this call may take the fast path, else None."""
    if not ENABLED:
        return None
    launches = _launches_of(jit_fn)
    runtime = knobs.runtime
    if (launches is None or jit_fn.pre_run_hooks or callable(grid)
            or not (_hook_idle(runtime.launch_enter_hook) and _hook_idle(runtime.launch_exit_hook))):
        return None
    return launches


def launch(jit_fn, grid, *args, **kwargs):
    """jit_fn[grid](*args, **kwargs), without Triton's per-call work once this argument class has launched."""
    launches = _runnable(jit_fn, grid)
    if launches is None:
        return jit_fn[grid](*args, **kwargs)
    try:
        arg_key = arguments_key(launches, args, kwargs)
    except Exception:  # an argument we cannot key (or an unhashable constexpr): Triton's path decides
        return jit_fn[grid](*args, **kwargs)
    return _launch_keyed(jit_fn, launches, grid, args, kwargs, arg_key)


def _launch_keyed(jit_fn, launches, grid, args, kwargs, arg_key):
    """launch() once the arguments' key is made: the cached entry's launcher, or Triton's path (which compiles or
    finds the kernel) and a new entry."""
    active = _driver.active
    device = active.get_current_device()
    runtime = knobs.runtime
    try:
        key = (device, runtime.debug, knobs.compilation.instrumentation_mode) + arg_key
        entry = launches.entries.get(key)
    except Exception:  # an unhashable constexpr: Triton's path decides
        return jit_fn[grid](*args, **kwargs)
    if entry is None:
        kernel = jit_fn[grid](*args, **kwargs)
        trailing = _trailing_values(launches, len(args), kwargs)
        if kernel is not None and trailing is not None:
            # kernel.run is the launcher once the call above has loaded the binary
            launcher = (_descriptor_launcher(kernel) if _GluonTensorDescriptor is not None and any(
                a.__class__ is _GluonTensorDescriptor for a in args) else None) or kernel.run
            launches.entries[key] = (launcher, kernel.function, kernel.packed_metadata, trailing, kernel,
                                     _globals_read(jit_fn))
        return kernel
    launcher, function, packed_metadata, trailing, kernel, globals_read = entry
    for namespace, name, value in globals_read:
        if namespace.get(name, _MISSING) is not value:  # rebound since: Triton's path checks (and raises)
            return jit_fn[grid](*args, **kwargs)
    size = len(grid)
    # launch metadata and hooks: None, as the launcher skips both then (Triton passes empty HookChains)
    launcher(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, active.get_current_stream(device),
             function, packed_metadata, None, None, None, *args, *trailing)
    return kernel


class Pack:
    """launch() for calls whose arguments at some positions are the same objects every time (a plan's own
    tensors, a plan's keywords): their key parts and the keywords' key are made once, here, instead of at every
    call. A call whose fixed positions hold other objects takes launch() as it is; the key is the one launch()
    makes (the same cache entries)."""

    def __init__(self, jit_fn, args, kwargs, fixed_positions):
        self.jit_fn = jit_fn
        self.kwargs = dict(kwargs)
        self.fixed = tuple((i, args[i]) for i in fixed_positions)
        self.num_args = len(args)
        self.key_function = None
        launches = _launches_of(jit_fn) if ENABLED else None
        if launches is None:
            return
        try:
            positions = tuple(sorted(set(fixed_positions)))
            make = _pack_key_maker(launches, len(args), positions, tuple(map(type, args)))
            self.key_function = make(*[args[i] for i in positions])
            self.kwargs_key = tuple(self.kwargs.items())
            hash(self.kwargs_key)
        except Exception:  # noqa: BLE001 - an argument we cannot key: every call takes launch()
            self.key_function = None

    def __call__(self, grid, *args):
        launches = _runnable(self.jit_fn, grid) if self.key_function is not None else None
        if launches is None or len(args) != self.num_args:
            return launch(self.jit_fn, grid, *args, **self.kwargs)
        try:
            parts = self.key_function(*args)  # None: another object at a fixed position
        except Exception:  # noqa: BLE001
            return self.jit_fn[grid](*args, **self.kwargs)
        if parts is None:
            return launch(self.jit_fn, grid, *args, **self.kwargs)
        return _launch_keyed(self.jit_fn, launches, grid, args, self.kwargs, (self.kwargs_key, parts))

    def arguments_key(self, args):
        """The key __call__ makes for args, or None where __call__ would not launch through a key."""
        if self.key_function is None or len(args) != self.num_args:
            return None
        try:
            parts = self.key_function(*args)
        except Exception:  # noqa: BLE001
            return None
        return None if parts is None else (self.kwargs_key, parts)

    def launch_keyed(self, grid, args, arg_key):
        """__call__(grid, *args) for arguments whose key is arg_key (arguments_key of arguments of the same key
        parts: the caller vouches for that), without making the key again."""
        launches = _runnable(self.jit_fn, grid)
        if launches is None:
            return launch(self.jit_fn, grid, *args, **self.kwargs)
        return _launch_keyed(self.jit_fn, launches, grid, args, self.kwargs, arg_key)
