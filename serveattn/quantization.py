"""Bit packing for custom attention masks, under FlashInfer's names (plain torch; CPU and CUDA alike).

Both bit orders are served, with FlashInfer's default ("big": element 8*i + j is bit 7 - j of byte i).
`packed_custom_mask` must be packed with bitorder="little" (element 8*i + j is bit j), as in FlashInfer.
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import policy


def _check_bitorder(entry: str, bitorder: str) -> None:
    if bitorder not in ("big", "little"):
        policy.refuse(entry, f"bitorder={bitorder!r} is not a bit order; supported: 'big', 'little'.")


def _check_bits(entry: str, x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        policy.refuse(entry, f"x must be a 1-D tensor of binary values, got {shape}.")


def _pack_rows(bits: torch.Tensor, bitorder: str) -> torch.Tensor:
    """bits bool `[n, 8]` -> uint8 `[n]`."""
    shifts = range(8) if bitorder == "little" else range(7, -1, -1)
    weights = torch.tensor([1 << j for j in shifts], dtype=torch.int32, device=bits.device)
    return (bits.to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """x: 1-D tensor (nonzero = 1) -> uint8 `[(len(x) + 7) // 8]`, the last byte zero-padded."""
    entry = "packbits"
    _check_bitorder(entry, bitorder)
    _check_bits(entry, x)
    bits = x.ne(0)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8), value=False)
    return _pack_rows(bits.reshape(-1, 8), bitorder)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor,
                     bitorder: str = "big") -> Tuple[torch.Tensor, torch.Tensor]:
    """Packs each segment x[indptr[i]:indptr[i+1]] into its own whole bytes.

    Returns (packed uint8 `[new_indptr[-1]]`, new_indptr int32 `[batch + 1]`, in bytes). Sizing the output
    reads new_indptr[-1] on the host: one synchronisation on a GPU, as in FlashInfer.
    """
    entry = "segment_packbits"
    _check_bitorder(entry, bitorder)
    _check_bits(entry, x)
    policy.check_index(entry, "indptr", indptr, min_len=1)
    policy.check_same_device(entry, x.device, indptr=indptr)
    if indptr.device.type == "cpu":
        policy.check_indptr(entry, "indptr", indptr.long(), total=x.numel())
    seg_bytes = (indptr[1:] - indptr[:-1] + 7) // 8
    new_indptr = torch.zeros_like(indptr)
    new_indptr[1:] = torch.cumsum(seg_bytes, dim=0)
    total_bytes = int(new_indptr[-1])
    if total_bytes == 0:
        return torch.zeros(0, dtype=torch.uint8, device=x.device), new_indptr
    byte_ids = torch.arange(total_bytes, dtype=torch.int32, device=x.device)
    segment = torch.searchsorted(new_indptr[1:], byte_ids, right=True)
    # Element j of byte o reads x at its segment's start + 8 * (o - the segment's first byte) + j.
    src = (indptr[segment] + (byte_ids - new_indptr[segment]) * 8).long()[:, None] \
        + torch.arange(8, device=x.device)[None, :]
    inside = src < indptr[1:][segment].long()[:, None]
    bits = x.ne(0)[src.clamp(max=x.numel() - 1)] & inside
    return _pack_rows(bits, bitorder), new_indptr
