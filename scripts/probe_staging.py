"""Host cost of the pieces of a plan's host -> device copy on the GPU host (staging.to_device and what it could be
made of): torch's copy_ from pinned memory against the driver's cuMemcpyHtoDAsync called through ctypes, the
current stream through torch and raw, an event record both ways, a slice.

    PYTHONPATH=$PWD:$PWD/scripts python3 scripts/probe_staging.py
"""
import ctypes

import numpy as np
import torch

from probe_host import per_call_us  # scripts/, beside this file
from serveattn import staging


def main():
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    x = torch.empty(1, device=dev)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    cuda.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    cuda.cuEventQuery.argtypes = [ctypes.c_void_p]
    ev = ctypes.c_void_p()
    assert cuda.cuEventCreate(ctypes.byref(ev), 2) == 0
    rng = np.random.default_rng(0)
    arrays = {"work": rng.integers(0, 100, 4 * 300, dtype=np.int32), "num_work": np.array([300], np.int32),
              "req_first_slot": np.zeros(256, np.int32), "req_num_slots": np.zeros(256, np.int32),
              "kv_indptr": np.arange(257, dtype=np.int32) * 64, "kv_indices": rng.permutation(256 * 64).astype(np.int32),
              "last_page_len": np.full(256, 16, np.int32)}
    nbytes = sum(a.nbytes for a in arrays.values()) + 16 * 7
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    blob = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    raw = torch._C._cuda_getCurrentRawStream
    parts = {
        "staging.to_device (7 arrays)": lambda: staging.to_device(arrays, dev),
        "blob.copy_(pinned, non_blocking=True)": lambda: blob.copy_(pinned, non_blocking=True),
        "blob.copy_(pageable, non_blocking=True)": lambda: blob.copy_(pageable, non_blocking=True),
        "cuMemcpyHtoDAsync via ctypes (raw stream)": lambda: cuda.cuMemcpyHtoDAsync_v2(
            blob.data_ptr(), pinned.data_ptr(), nbytes, raw(0)),
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(dev),
        "torch._C._cuda_getCurrentRawStream(0)": lambda: raw(0),
        "torch.cuda.Event().record()": lambda: torch.cuda.Event().record(),
        "cuEventRecord via ctypes": lambda: cuda.cuEventRecord(ev, raw(0)),
        "cuEventQuery via ctypes": lambda: cuda.cuEventQuery(ev),
        "torch.empty on the GPU": lambda: torch.empty(nbytes, dtype=torch.uint8, device=dev),
        "a slice of a GPU tensor": lambda: blob[16:64],
        "blob.view(torch.int32)": lambda: blob.view(torch.int32),
        "numpy fill of the pinned buffer": lambda: staging._fill(pinned.numpy(), arrays,
                                                                 staging._layout(arrays)[0]),
    }
    for name, fn in parts.items():
        print(f"{name}: {per_call_us(fn):.1f} us", flush=True)
    print(f"reference: a torch add_ launch {per_call_us(lambda: x.add_(1.0)):.1f} us")


if __name__ == "__main__":
    main()
