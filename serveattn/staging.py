"""Host -> device transfer of a plan's small index arrays in one copy.

A plan holds several small arrays (the work list, indptrs, the page table, mask words). Copied one by one,
each pays a staged host-to-device copy, 10-30 us of host time apiece on the H200 host; packed into one byte
buffer they pay it once. Tensors already on the device are cloned there (a plan never aliases the caller's
tensors, which the caller may reuse after plan()). A numpy array is the plan's own (built for this plan, held by
nothing else): it joins the packed copy to a CUDA device and becomes a tensor without a copy on the host.

The bytes are packed into page-locked (pinned) host memory, so the copy is queued on the current stream and
plan() returns without waiting for it. A small ring of pinned buffers is reused; a buffer is refilled only
after the copy that last read it has finished (its event), so a later plan can never overwrite bytes still
in flight.
"""
from __future__ import annotations

from typing import Dict, Optional, Union

import numpy as np
import torch

_ALIGN = 16  # bytes: 16 so that every array is 16-byte aligned (Triton specializes pointer arguments on it)


_RING = 4  # pinned buffers per device: a plan waits only if the copy 4 plans ago is still in flight


class _PinnedRing:
    def __init__(self):
        self.buffers = [None] * _RING  # (pinned uint8 tensor, its numpy view)
        self.events = [None] * _RING
        self.next = 0

    def stage(self, nbytes: int):
        """(pinned uint8 tensor, its numpy view, slot) of at least nbytes, after the copy that last read that
        slot is done."""
        i = self.next
        self.next = (i + 1) % _RING
        if self.events[i] is not None:
            self.events[i].synchronize()
        buf = self.buffers[i]
        if buf is None or buf[0].numel() < nbytes:
            t = torch.empty(max(4096, 1 << (nbytes - 1).bit_length()), dtype=torch.uint8, pin_memory=True)
            buf = self.buffers[i] = (t, t.numpy())
        return buf[0], buf[1], i

    def copied(self, slot: int, device: torch.device):
        event = self.events[slot] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self.events[slot] = event


_rings: Dict[torch.device, _PinnedRing] = {}


def _layout(arrays: Dict[str, np.ndarray]):
    """(layout: (name, byte offset, bytes, torch dtype, shape) per array, total bytes): each array at a 16-byte
    aligned offset (Triton compiles a kernel variant per pattern of 16-byte aligned pointer arguments: at 8 the
    pattern moved with the batch size, and a new batch size compiled mid-serving); total rounded up to 16 too."""
    layout, offset = [], 0
    for name, a in arrays.items():
        offset += -offset % _ALIGN
        layout.append((name, offset, a.nbytes, _TORCH[a.dtype], a.shape))
        offset += a.nbytes
    return layout, offset + (-offset % _ALIGN)


def _host_arrays(arrays: Dict[str, Union[torch.Tensor, np.ndarray]]) -> Dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(t if isinstance(t, np.ndarray) else t.numpy()) for name, t in arrays.items()}


def _fill(dst: np.ndarray, arrays: Dict[str, np.ndarray], layout) -> None:
    for (name, start, nbytes, _, _), a in zip(layout, arrays.values()):
        dst[start:start + nbytes] = a.reshape(-1).view(np.uint8)


def pack(arrays: Dict[str, torch.Tensor]):
    """(one uint8 host tensor, layout) holding the host tensors' bytes, each at a 16-byte aligned offset."""
    host = _host_arrays(arrays)
    layout, total = _layout(host)
    blob = np.zeros(total, dtype=np.uint8)
    _fill(blob, host, layout)
    return torch.from_numpy(blob), layout


def unpack(blob: torch.Tensor, layout) -> Dict[str, torch.Tensor]:
    """Views of `blob` (wherever it lives) with each array's dtype and shape: one typed view of the blob per
    dtype, then one slice per array (each torch op on a CUDA tensor costs microseconds of host time)."""
    typed: Dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for name, start, nbytes, dtype, shape in layout:
        if dtype not in typed:
            typed[dtype] = blob.view(dtype)
        size = dtype.itemsize
        t = typed[dtype][start // size:(start + nbytes) // size]
        out[name] = t if len(shape) == 1 else t.view(shape)
    return out


def to_device(arrays: Dict[str, Union[torch.Tensor, np.ndarray, None]],
              device: torch.device) -> Dict[str, Optional[torch.Tensor]]:
    """name -> tensor, the plan's own numpy array, or None, to name -> a copy of it on `device` (None stays None):
    host arrays in one packed copy to a CUDA device, every other tensor copied on its own, and on the host the
    plan's own arrays wrapped as they are (torch.from_numpy: no copy)."""
    device = torch.device(device)
    out: Dict[str, Optional[torch.Tensor]] = {}
    host = {}
    for name, t in arrays.items():
        if t is None:
            out[name] = None
        elif isinstance(t, np.ndarray):
            if device.type == "cuda":
                host[name] = t
            else:
                out[name] = torch.from_numpy(t) if device.type == "cpu" else torch.from_numpy(t).to(device)
        elif device.type == "cuda" and t.device.type == "cpu":
            host[name] = t
        else:
            out[name] = t.to(device, copy=True)
    if host:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        # numpy for the packing: a numpy slice assignment costs a fraction of a torch op's dispatch
        arrays_np = _host_arrays(host)
        layout, total = _layout(arrays_np)
        blob = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=device)
        if total:
            ring = _rings.setdefault(device, _PinnedRing())
            staged, staged_np, slot = ring.stage(total)
            _fill(staged_np, arrays_np, layout)
            blob.copy_(staged[:total] if staged.numel() != total else staged, non_blocking=True)
            ring.copied(slot, device)
        out.update(unpack(blob, layout))
    return out


_TORCH = {np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8, np.dtype(np.int16): torch.int16,
          np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool,
          np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}
