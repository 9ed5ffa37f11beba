"""Host cost of one cached decode launch on this machine's CPU (no GPU): Triton's C launcher (CudaLauncher, as a
cached entry of kernels/launch.py calls it) against kernels/launch.py's direct launcher, on the same sm_90 compile of
decode_kernel and the same arguments. Every driver call goes to a stub libcuda built here with gcc (each a no-op),
so this is the Python / C argument handling alone: what the real driver's calls cost (Triton's launcher makes a
cuPointerGetAttribute per pointer argument, 13 for decode) only the GPU host shows (`scripts/gpu_run.sh
probe-direct-launch`). Also Triton's launcher given the pointers as ints (what the descriptor launcher now passes).

    python scripts/probe_launch_cpu.py
"""
import os
import subprocess
import sys
import tempfile
import timeit

STUB = r"""
#include <stdint.h>
typedef int CUresult;
static int ctx;
CUresult cuGetErrorString(int e, const char **s) { *s = "stub"; return 0; }
CUresult cuPointerGetAttribute(void *data, int attr, uint64_t ptr) { *(uint64_t *)data = ptr; return 0; }
CUresult cuCtxGetCurrent(void **c) { *c = &ctx; return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = &ctx; return 0; }
CUresult cuCtxSetCurrent(void *c) { return 0; }
CUresult cuFuncSetAttribute(void *f, int a, int v) { return 0; }
CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) { return 0; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) { return 0; }
CUresult cuMemcpyHtoDAsync_v2(void) { return 0; }
CUresult cuEventRecord(void) { return 0; }
CUresult cuEventSynchronize(void) { return 0; }
CUresult cuEventCreate(void) { return 0; }
CUresult cuTensorMapEncodeTiled(void) { return 0; }
CUresult cuTensorMapEncodeIm2col(void) { return 0; }
"""


def main():
    if os.environ.get("_PROBE_STUB") is None:  # build the stub, then run again with it first on the library path
        stub_dir = tempfile.mkdtemp()
        with open(os.path.join(stub_dir, "stub.c"), "w") as f:
            f.write(STUB)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", os.path.join(stub_dir, "libcuda.so.1"),
                        os.path.join(stub_dir, "stub.c")], check=True)
        os.symlink("libcuda.so.1", os.path.join(stub_dir, "libcuda.so"))
        env = dict(os.environ, _PROBE_STUB="1", TRITON_LIBCUDA_PATH=stub_dir,
                   LD_LIBRARY_PATH=stub_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
        env.pop("TRITON_INTERPRET", None)
        sys.exit(subprocess.run([sys.executable] + sys.argv, env=env).returncode)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import compile_probe
    from triton.backends.nvidia.driver import CudaLauncher
    from serveattn.kernels import launch as fast

    kernel = compile_probe.compile_decode("bf16", "bf16", "bf16", 128, 4, 64, 2, 4, 16)
    signature = list(kernel.src.signature.values())
    storage = torch.zeros(1 << 16)
    params = [storage[16:] if t.startswith("*") else 3 if t == "i32" else 0.5 if t == "fp32" else 64 for t in signature]
    as_ints = [p.data_ptr() if isinstance(p, torch.Tensor) else p for p in params]
    triton_launcher = CudaLauncher(kernel.src, kernel.metadata)
    direct = fast._direct_launcher(kernel, params, triton_launcher)
    assert direct is not None
    packed = kernel.packed_metadata
    cases = {
        "Triton's C launcher": lambda: triton_launcher(256, 8, 1, 0, 1234, packed, None, None, None, *params),
        "  the same, pointers as ints": lambda: triton_launcher(256, 8, 1, 0, 1234, packed, None, None, None,
                                                                *as_ints),
        "direct launcher": lambda: direct(256, 8, 1, 0, 1234, packed, None, None, None, *params),
    }
    pointers = sum(t.startswith("*") for t in signature)
    runtime = sum(t != "constexpr" for t in signature)
    print(f"decode_kernel: {pointers} pointer and {runtime} runtime parameters; stub driver (every call a no-op)")
    for _ in range(2):
        for name, fn in cases.items():
            best = min(timeit.repeat(fn, number=20000, repeat=7)) / 20000 * 1e6
            print(f"{name:30s} {best:.2f} us")


if __name__ == "__main__":
    main()
