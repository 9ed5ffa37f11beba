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

A wrapper that plans again and again passes its `Kept`: its next plan's arrays then land in the same device buffer,
at the same offsets while each array fits the room it had (rooms are powers of two), so the buffer is not
allocated and the views of arrays whose size did not change are not made again (each costs a torch call of host
time). The copy is ordered on the stream after every kernel enqueued before it, as FlashInfer's re-plan into its
int workspace is: a run() of the previous plan on another stream, still pending, must be waited for first.

On CUDA the copy and the events go straight to the driver (cuMemcpyHtoDAsync, cuEventRecord through ctypes, on
the stream torch reports as current): torch's copy_, current_stream and Event cost 3-7 us of host time each on
the H200 host, the driver calls under 1 us (scripts/probe_staging.py).
"""
from __future__ import annotations

import ctypes
from typing import Dict, Optional, Union

import numpy as np
import torch

_ALIGN = 16  # bytes: 16 so that every array is 16-byte aligned (Triton specializes pointer arguments on it)


_RING = 4  # pinned buffers per device: a plan waits only if the copy 4 plans ago is still in flight


class _Driver:
    """The CUDA driver calls the copy needs, through ctypes (None where libcuda cannot be loaded)."""

    def __init__(self, lib):
        self.lib = lib
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuEventCreate.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self.raw_stream = torch._C._cuda_getCurrentRawStream

    @staticmethod
    def check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"serveattn: the CUDA driver's {call} returned error {result} while copying a "
                               f"plan's arrays to the device.")

    def event(self):
        ev = ctypes.c_void_p()
        self.check(self.lib.cuEventCreate(ctypes.byref(ev), 2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        return ev

    def copy(self, dst: int, src: int, nbytes: int, device: torch.device) -> None:
        self.check(self.lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, self.raw_stream(device.index)),
                   "cuMemcpyHtoDAsync")

    def record(self, event, device: torch.device) -> None:
        self.check(self.lib.cuEventRecord(event, self.raw_stream(device.index)), "cuEventRecord")

    def wait(self, event) -> None:
        self.check(self.lib.cuEventSynchronize(event), "cuEventSynchronize")


_driver: Union[_Driver, None, bool] = False  # False: not loaded yet


def _get_driver() -> Optional[_Driver]:
    global _driver
    if _driver is False:
        try:
            _driver = _Driver(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            _driver = None
    return _driver


class _PinnedRing:
    def __init__(self, driver: Optional[_Driver]):
        self.buffers = [None] * _RING  # (pinned uint8 tensor, its numpy view)
        self.driver = driver
        # driver events, made once: a slot's copy is recorded on it (torch.cuda.Event without the driver)
        self.events = [driver.event() if driver else None for _ in range(_RING)]
        self.recorded = [False] * _RING
        self.next = 0

    def stage(self, nbytes: int):
        """(pinned uint8 tensor, its numpy view, slot) of at least nbytes, after the copy that last read that
        slot is done."""
        i = self.next
        self.next = (i + 1) % _RING
        if self.recorded[i]:
            self.driver.wait(self.events[i]) if self.driver else self.events[i].synchronize()
        buf = self.buffers[i]
        if buf is None or buf[0].numel() < nbytes:
            t = torch.empty(max(4096, 1 << (nbytes - 1).bit_length()), dtype=torch.uint8, pin_memory=True)
            buf = self.buffers[i] = (t, t.numpy())
        return buf[0], buf[1], i

    def copy(self, slot: int, dst: torch.Tensor, nbytes: int, device: torch.device) -> None:
        """The first nbytes of slot's pinned buffer into dst (a device uint8 tensor), on the current stream."""
        staged = self.buffers[slot][0]
        if self.driver is not None:
            self.driver.copy(dst.data_ptr(), staged.data_ptr(), nbytes, device)
        else:
            dst[:nbytes].copy_(staged[:nbytes], non_blocking=True)
        self.copied(slot, device)

    def copied(self, slot: int, device: torch.device) -> None:
        """Records slot's copies so far: stage() waits for them before refilling it."""
        if self.driver is not None:
            self.driver.record(self.events[slot], device)
        else:
            event = self.events[slot] or torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events[slot] = event
        self.recorded[slot] = True


class Kept:
    """A wrapper's device copy of its plan arrays, kept for its next plan (to_device's `kept`): the buffer, each
    array's room in bytes, and the views made last time with what they were made for."""
    __slots__ = ("blob", "rooms", "views")

    def __init__(self):
        self.blob: Optional[torch.Tensor] = None
        self.rooms: Dict[str, int] = {}
        self.views: Dict[str, tuple] = {}


_rings: Dict[tuple, _PinnedRing] = {}  # (device, through the driver)


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


def _ring(device: torch.device) -> _PinnedRing:
    """device's pinned ring; through the driver only for the current device (the driver's current context)."""
    fast = device.index == torch.cuda.current_device()
    ring = _rings.get((device, fast))
    if ring is None:
        ring = _rings[(device, fast)] = _PinnedRing(_get_driver() if fast else None)
    return ring


class Captured:
    """The buffers a captured CUDA graph reads, by name (1-D tensors of one device, fixed at a wrapper's first plan
    under use_cuda_graph=True), with what every re-plan asks of each read once: its capacity, dtype and address. A
    re-plan is paid every serving step, and each read of a tensor's attribute is a torch call of host time (0.3-1
    us on the H200 host; re-plans read ~5 a buffer before this)."""
    __slots__ = ("bufs", "caps", "dtypes", "ptrs", "device")

    def __init__(self, bufs: Dict[str, torch.Tensor]):
        self.bufs = bufs
        self.caps = {name: b.numel() for name, b in bufs.items()}
        self.dtypes = {name: b.dtype for name, b in bufs.items()}
        # an address where the driver may copy straight into the buffer: contiguous, on the current CUDA device
        self.device = None
        self.ptrs = {}
        first = next(iter(bufs.values()), None)
        if first is not None and first.device.type == "cuda":
            self.device = first.device if first.device.index is not None else torch.device(
                "cuda", torch.cuda.current_device())
            self.ptrs = {name: b.data_ptr() for name, b in bufs.items()
                         if b.is_contiguous() and b.device == self.device}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.bufs[name]


def size(t: Union[torch.Tensor, np.ndarray]) -> int:
    """Elements of a plan array (numpy: an attribute read, not a torch call)."""
    return t.size if isinstance(t, np.ndarray) else t.numel()


def to_buffers(arrays: Dict[str, Union[torch.Tensor, np.ndarray]], bufs: Captured) -> None:
    """Each array (host or device) into the start of bufs[name] (large enough, of its dtype): host arrays bound
    for CUDA packed into one pinned buffer, then one driver copy each straight into its buffer (torch's copy_ of a
    slice costs two torch calls a buffer); anything else by copy_."""
    host = {}
    for name, t in arrays.items():
        if bufs.device is not None and (isinstance(t, np.ndarray) or t.device.type == "cpu"):
            host[name] = t
        else:
            src = torch.as_tensor(t)
            bufs[name][: src.numel()].copy_(src, non_blocking=True)
    if not host:
        return
    arrays_np = _host_arrays(host)
    device = bufs.device
    layout, total = _layout(arrays_np)
    ring = _ring(device)
    staged, staged_np, slot = ring.stage(max(total, _ALIGN))
    _fill(staged_np, arrays_np, layout)
    base = staged.data_ptr()
    for name, start, nbytes, dtype, _ in layout:
        if not nbytes:
            continue
        ptr = bufs.ptrs.get(name)
        if ring.driver is not None and ptr is not None and bufs.dtypes[name] == dtype:
            ring.driver.copy(ptr, base + start, nbytes, device)
        else:  # torch's copy_ follows any strides and converts any dtype
            buf = bufs[name]
            flat = buf.view(-1) if buf.is_contiguous() else buf  # the buffers are 1-D
            flat[: nbytes // dtype.itemsize].copy_(staged[start:start + nbytes].view(dtype), non_blocking=True)
    ring.copied(slot, device)


def _kept_layout(arrays: Dict[str, np.ndarray], kept: Kept):
    """_layout's (layout, total) with each array at the start of its room (a power of two of at least 64 bytes,
    kept while the array fits and the arrays are the same names), and whether any room moved."""
    same_names = list(kept.rooms) == list(arrays)
    rooms, moved = {}, not same_names
    layout, offset = [], 0
    for name, a in arrays.items():
        room = kept.rooms[name] if same_names else 0
        if room < a.nbytes:
            room, moved = max(64, 1 << (a.nbytes - 1).bit_length()), True
        rooms[name] = room
        layout.append((name, offset, a.nbytes, _TORCH[a.dtype], a.shape))
        offset += room
    kept.rooms = rooms
    return layout, offset, moved


def to_device(arrays: Dict[str, Union[torch.Tensor, np.ndarray, None]],
              device: torch.device, kept: Optional[Kept] = None) -> Dict[str, Optional[torch.Tensor]]:
    """name -> tensor, the plan's own numpy array, or None, to name -> a copy of it on `device` (None stays None):
    host arrays in one packed copy to a CUDA device, every other tensor copied on its own, and on the host the
    plan's own arrays wrapped as they are (torch.from_numpy: no copy). With `kept` (CUDA), the packed copy goes
    into the buffer the previous call with it filled, whose views then hold these values (see the module's
    docstring)."""
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
        if kept is not None:
            layout, total, moved = _kept_layout(arrays_np, kept)
            if moved or kept.blob is None or kept.blob.device != device:
                kept.blob, kept.views = torch.empty(total, dtype=torch.uint8, device=device), {}
            blob = kept.blob
        else:
            layout, total = _layout(arrays_np)
            blob = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=device)
        end = layout[-1][1] + layout[-1][2]  # the last array's last byte: rooms past it are not copied
        if end:
            ring = _ring(device)
            staged, staged_np, slot = ring.stage(end)
            _fill(staged_np, arrays_np, layout)
            ring.copy(slot, blob, end, device)
        if kept is None:
            out.update(unpack(blob, layout))
        else:
            out.update(_kept_views(blob, layout, kept))
    return out


def _kept_views(blob: torch.Tensor, layout, kept: Kept) -> Dict[str, torch.Tensor]:
    """unpack's views of blob, made again only for entries (offset, bytes, dtype, shape) that changed."""
    views = kept.views
    stale = [entry for entry in layout if views.get(entry[0], (None,))[0] != entry]
    if stale:
        for entry, view in zip(stale, unpack(blob, stale).values()):
            views[entry[0]] = (entry, view)
    return {entry[0]: views[entry[0]][1] for entry in layout}


_TORCH = {np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8, np.dtype(np.int16): torch.int16,
          np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool,
          np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}
