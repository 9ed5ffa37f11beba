"""Host -> device transfer of a plan's small index arrays in one copy.

A plan holds several small arrays (the work list, indptrs, the page table, mask words). Copied one by one,
each pays a staged host-to-device copy, 10-30 us of host time apiece on the H200 host; packed into one byte
buffer they pay it once. Tensors already on the device are cloned there (a plan never aliases the caller's
tensors, which the caller may reuse after plan()).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

_ALIGN = 8  # bytes: every array starts where its dtype (int64 at most) may be viewed


def pack(arrays: Dict[str, torch.Tensor]):
    """(one uint8 host tensor, layout) holding the host tensors' bytes, each at an 8-byte aligned offset."""
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
    return (torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)), layout


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
        blob, layout = pack(host)
        out.update(unpack(blob.to(device, non_blocking=True), layout))
    return out
