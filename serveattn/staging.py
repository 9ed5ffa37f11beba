"""Host -> device transfer of a plan's small index arrays in one copy.

A plan holds several small arrays (the work list, indptrs, the page table, mask words). Copied one by one,
each pays a staged host-to-device copy, 10-30 us of host time apiece on the H200 host; packed into one byte
buffer they pay it once. Tensors already on the device are cloned there (a plan never aliases the caller's
tensors, which the caller may reuse after plan()).

The bytes are packed into page-locked (pinned) host memory, so the copy is queued on the current stream and
plan() returns without waiting for it. A small ring of pinned buffers is reused; a buffer is refilled only
after the copy that last read it has finished (its event), so a later plan can never overwrite bytes still
in flight.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

_ALIGN = 8  # bytes: every array starts where its dtype (int64 at most) may be viewed


_RING = 4  # pinned buffers per device: a plan waits only if the copy 4 plans ago is still in flight


class _PinnedRing:
    def __init__(self):
        self.buffers = [None] * _RING
        self.events = [None] * _RING
        self.next = 0

    def stage(self, nbytes: int, device: torch.device):
        """(a pinned uint8 host tensor of nbytes, its slot), after the copy that last read that slot is done."""
        i = self.next
        self.next = (i + 1) % _RING
        if self.events[i] is not None:
            self.events[i].synchronize()
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(4096, 1 << (nbytes - 1).bit_length()), dtype=torch.uint8, pin_memory=True)
            self.buffers[i] = buf
        return buf[:nbytes], i

    def copied(self, slot: int, device: torch.device):
        event = self.events[slot] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self.events[slot] = event


_rings: Dict[torch.device, _PinnedRing] = {}


def pack(arrays: Dict[str, torch.Tensor]):
    """(one uint8 host tensor, layout) holding the host tensors' bytes, each at an 8-byte aligned offset."""
    chunks, layout, total = _chunks(arrays)
    return (torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)), layout


def _chunks(arrays: Dict[str, torch.Tensor]):
    """(byte chunks with alignment padding, layout, total bytes) of host tensors packed back to back."""
    layout, chunks, offset = [], [], 0
    for name, t in arrays.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        pad = -offset % _ALIGN
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
        layout.append((name, offset, raw.numel(), t.dtype, t.shape))
        chunks.append(raw)
        offset += raw.numel()
    return chunks, layout, offset


def unpack(blob: torch.Tensor, layout) -> Dict[str, torch.Tensor]:
    """Views of `blob` (wherever it lives) with each array's dtype and shape."""
    return {name: blob[start:start + nbytes].view(dtype).reshape(shape)
            for name, start, nbytes, dtype, shape in layout}


def to_device(arrays: Dict[str, Optional[torch.Tensor]], device: torch.device) -> Dict[str, Optional[torch.Tensor]]:
    """name -> tensor (or None) to name -> a copy of it on `device`: host tensors in one packed copy to a CUDA
    device, every other tensor copied on its own."""
    device = torch.device(device)
    out: Dict[str, Optional[torch.Tensor]] = {}
    host = {}
    for name, t in arrays.items():
        if t is None:
            out[name] = None
        elif device.type == "cuda" and t.device.type == "cpu":
            host[name] = t
        else:
            out[name] = t.to(device, copy=True)
    if host:
        chunks, layout, total = _chunks(host)
        if total == 0:
            blob = torch.empty(0, dtype=torch.uint8, device=device)
        else:
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            ring = _rings.setdefault(device, _PinnedRing())
            staged, slot = ring.stage(total, device)
            torch.cat(chunks, out=staged)
            blob = torch.empty(total, dtype=torch.uint8, device=device)
            blob.copy_(staged, non_blocking=True)
            ring.copied(slot, device)
        out.update(unpack(blob, layout))
    return out
