"""The fakes that let our fast launch path (kernels/launch.py) run on the CPU down to a no-op launcher: Triton's
driver answers device 0 and stream 0, and each given JIT function's run() (Triton's path, compiling) hands back a
compiled kernel whose launcher does nothing. backend="triton" is taken on CPU tensors. For the host probes only."""
from serveattn import backend
from serveattn.kernels import launch as fast


class _FakeDriver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 0)


class _CompiledStandIn:
    """What JITFunction.run returns once compiled, with a launcher that does nothing."""
    function = None
    packed_metadata = ()

    def run(self, *args):
        pass


def fast_launch_to_nothing(*jit_fns):
    backend.interpreting = lambda: True  # backend="triton" on CPU tensors
    fast._driver, fast.ENABLED = _FakeDriver, True
    for jit_fn in jit_fns:
        jit_fn.run = lambda *args, grid, warmup, **kwargs: _CompiledStandIn()
