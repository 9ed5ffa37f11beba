"""Which implementation runs a call: this library's Triton kernels or the plain PyTorch path."""
from __future__ import annotations

import logging

import torch

from . import knobs, policy

log = logging.getLogger("serveattn")
_ALIASES = {"fa2": "triton", "fa3": "triton"}
_logged_aliases: set = set()


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return knobs.get("TRITON_INTERPRET", "0") == "1"


def resolve(entry: str, backend: str, device: torch.device) -> str:
    """Returns "triton" or "torch" for a call on `device`, or refuses with a sentence."""
    policy.check_backend(entry, backend)
    if backend in _ALIASES:
        if backend not in _logged_aliases:
            _logged_aliases.add(backend)
            log.info("serveattn: backend=%r is an alias of 'triton'.", backend)
        backend = _ALIASES[backend]
    device = torch.device(device)
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not interpreting():
        policy.unsupported(entry, f"backend='triton' needs CUDA tensors (got {device}); use backend='torch' "
                                  f"or 'auto' on the CPU, or set TRITON_INTERPRET=1 before import to run the "
                                  f"kernels through Triton's interpreter.")
    if backend == "triton" and device.type == "cuda" and policy.cuda_properties(device)[0][0] < 8:
        policy.unsupported(entry, f"backend='triton' needs a GPU of compute capability 8.0 or newer "
                                  f"(got {policy.cuda_properties(device)[0]}).")
    return backend
