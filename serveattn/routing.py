"""backend="auto": which route serves a plan, and why the others were declined.

Routes. Prefill (single, ragged, paged, cascade levels): ``cudnn`` (torch's cuDNN SDPA, serveattn/vendor.py),
``triton`` (our prefill kernel on tensor cores), ``torch`` (plain PyTorch). Decode: ``triton`` with the
``bandwidth`` kernel (kernels/decode.py, split-KV) or the ``tensor-core`` route (the prefill kernel, one row per
request), or ``torch``.

Two kinds of function, kept apart:

- capability (``*_declines(req)``): can the route serve this request at all? They take a ``Request`` of plain
  values (dtypes, head dim, flags, device type, architecture), so CPU tests cover them with any architecture,
  and return ``None`` or the decline reason.
- routing (``choose_prefill``, ``choose_decode``): among the capable routes, the one measured fastest. A capable
  but slower route is not chosen; an incapable route is never chosen, however fast. The thresholds are the
  per-architecture tables below, each naming the docs/routing.md table it was read from
  (``python -m serveattn.bench crossover`` measures them); an architecture without a table gets the safe
  defaults (our kernels, the bandwidth decode kernel, never cuDNN) and the reason says so.

Every decline reason comes from one producer function (registered in ``PRODUCERS``); its text names the rule and
its threshold, never the observed value, so that ``backend='auto'`` warns once per (device, reason) in the
``serveattn`` logger. The wrappers keep the joined reasons in ``wrapper.backend_fallback_reason``.

``auto`` resolves again on every ``plan()``, except under ``use_cuda_graph=True``: the first resolution holds
(a captured graph holds that route's buffers), and the wrapper passes it back in as ``held``. An explicit
backend is honoured or refused with a sentence (serveattn/backend.py), never rerouted; ``fa2``/``fa3`` are
aliases of ``triton``; any other name is refused.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import torch

from . import backend as backends
from . import knobs, policy

log = logging.getLogger("serveattn")

TORCH, TRITON, CUDNN = "torch", "triton", "cudnn"
BANDWIDTH, TENSOR_CORE = "bandwidth", "tensor-core"

#: Head dims the cuDNN route takes: 256 needs cuDNN > 9.22 with frontend >= 1.24 on sm 9.0/10.x (torch's own
#: check), which this library does not rely on.
CUDNN_HEAD_DIMS = (64, 128)
#: cuDNN SDPA refuses a key/value length of 1 (torch's check_cudnn_tensor_shapes).
CUDNN_MIN_KV = 2
#: cuDNN SDPA runs on compute capability 8.0 to 12.1 (torch's check_cudnn_hardware_support).
CUDNN_ARCHS = ((8, 0), (12, 1))
#: ``SERVEATTN_CUDNN=0`` keeps ``auto`` off the cuDNN route (cuDNN builds an execution plan per new shape).
CUDNN_ENV = "SERVEATTN_CUDNN"


# ---------------------------------------------------------------- the measured tables

@dataclasses.dataclass(frozen=True)
class ArchTable:
    """Crossovers measured on one GPU architecture (compute capability ``arch``).

    ``cudnn_min_rows[(dtype, head_dim, group, causal)]``: cuDNN serves prefill when every request has at least
    this many query rows (and kv_len == qo_len, the measured shape class); None: our kernel at every measured
    size. ``cudnn_max_rows[same key]``: and fewer than this many (absent or None: no upper bound), where our
    kernel was faster again at the longer lengths. ``decode_tc_min_programs_per_sm[(kv dtype, head_dim, group)]``: with ``use_tensor_cores=False`` the
    tensor-core route serves decode when batch x num_kv_heads / SMs reaches this; None: never. A key that is
    absent was not measured, and the default route holds there.
    """

    arch: Tuple[int, int]
    name: str  # the docs/routing.md section: "sm90"
    measured: str  # GPU, date, command of the numbers behind the constants
    cudnn_min_rows: Mapping[Tuple[str, int, int, bool], Optional[int]]
    decode_tc_min_programs_per_sm: Mapping[Tuple[str, int, int], Optional[float]]
    cudnn_max_rows: Mapping[Tuple[str, int, int, bool], Optional[int]] = dataclasses.field(default_factory=dict)

    @property
    def prefill_table(self) -> str:
        return f"docs/routing.md, table {self.name}-prefill-cudnn"

    @property
    def decode_table(self) -> str:
        return f"docs/routing.md, table {self.name}-decode-tc"

    def decode_table_for(self, kv_dtype: str) -> str:
        """The table behind a decode key: fp8 caches have their own (FP8_TABLE_SUFFIX; bench crossover writes it)."""
        return self.decode_table + (FP8_TABLE_SUFFIX if is_fp8_name(kv_dtype) else "")


#: The docs/routing.md table of an fp8 cache's decode keys is the 16-bit table's name with this suffix.
FP8_TABLE_SUFFIX = "-fp8"


def is_fp8_name(dtype_name: str) -> bool:
    """Whether a table key's dtype name (dtype_name()) is an fp8 one."""
    return dtype_name.startswith("float8")


TABLES: Dict[Tuple[int, int], ArchTable] = {
    (9, 0): ArchTable(
        arch=(9, 0), name="sm90",
        measured="NVIDIA H200 (132 SMs), torch 2.11.0+cu130, triton 3.6.0, 2026-12-05 17:12: python -m serveattn.bench "
                 "crossover (defaults: groups 1,4,8, batches 1,8, lengths 512-8192, causal and none; "
                 "docs/runs/2026-12-05T1712-h200-bench-crossover.log); fp8 caches 17:11: --pairs decode-tc --dtypes "
                 "float8_e4m3fn,float8_e5m2 (docs/runs/2026-12-05T1711-h200-bench-crossover-fp8.log)",
        # docs/routing.md, table sm90-prefill-cudnn, re-measured after our prefill's later gains (output through
        # shared memory, split-KV for few long requests): cuDNN now wins by less (0.74-0.99x where it wins) and at
        # fewer points. Each range is the longest run of lengths where cuDNN won at every batch (1 and 8): group 1
        # non-causal from 512 up; group 4 non-causal 1024-2048 (one request of 512 ours by 1.05x, 8 x 4096 by
        # 1.003x); group 4 causal 512 only; group 8 non-causal 512-1024 (8 x 2048 ours by 1.02x). Group 1 and 8
        # causal are ours at every length: one request was ours at each (1.01-1.57x), where eight were cuDNN's
        # (group 1 at every length, 0.74-0.96x; group 8 at 512-1024, 0.79-0.93x); the table keys on length only,
        # and a batch of equal lengths (all the cuDNN route serves) is most often one request. (The 2026-12-04
        # 14:14 run had cuDNN win more widely: docs/routing.md's history.)
        cudnn_min_rows={
            ("bfloat16", 128, 1, False): 512,
            ("bfloat16", 128, 1, True): None,
            ("bfloat16", 128, 4, False): 1024,
            ("bfloat16", 128, 4, True): 512,
            ("bfloat16", 128, 8, False): 512,
            ("bfloat16", 128, 8, True): None,
        },
        cudnn_max_rows={
            ("bfloat16", 128, 4, False): 4096,
            ("bfloat16", 128, 4, True): 1024,
            ("bfloat16", 128, 8, False): 2048,
        },
        # docs/routing.md, table sm90-decode-tc: bandwidth / tensor-core 0.15-0.77 below 0.97 KV-head programs per
        # SM, 1.01-1.09 at 1.94, and within 1% either way from 3.88 on (ties); groups 1 and 8 had a point at or
        # above every threshold where the bandwidth kernel was faster (by under 1%), so they keep the bandwidth
        # kernel. Group 4, re-measured after the bandwidth kernel's 64-key tiles and graph grid (table
        # sm90-decode-tc-g4, 2026-12-02T21:46): 1.01-1.03 at 1.94, 0.96-1.00 from 3.88 on, so no threshold holds
        # at every point above it: the bandwidth kernel everywhere.
        # (the 2026-12-03, 2026-12-04 and 2026-12-05 17:12 runs, the last with K_OPERAND on, measured the same:
        # None for groups 1, 4 and 8. Since the prefill kernel's split-KV, the 17:12 run has one request of 16384
        # keys on the tensor-core route's side, 1.02 / 1.14 / 1.41 for groups 1 / 4 / 8: below every size where the
        # bandwidth kernel wins, which a minimum programs per SM cannot say; docs/performance.md, session 34)
        decode_tc_min_programs_per_sm={
            ("bfloat16", 128, 1): None,
            ("bfloat16", 128, 4): None,
            ("bfloat16", 128, 8): None,
            # docs/routing.md, table sm90-decode-tc-fp8 (bench crossover, H200, 2026-12-05 17:11, K_OPERAND on): e4m3
            # and e5m2 caches under a bf16 query, groups 1 / 4 / 8, batch 1-128, KV 1024-16384: the bandwidth
            # kernel takes 0.69-0.96x the tensor-core route's time from batch 8 on, and 0.85-0.90x at one request
            # up to 4096 keys (group 8 at 4096: 1.02x). One request of 16384 keys is the tensor-core route's (1.00 /
            # 1.08 / 1.32x for groups 1 / 4 / 8): below every size the bandwidth kernel wins, so no minimum programs
            # per SM (the table's rule) holds it. An H100 (16:56) measured the same shape (1.08-1.39x there only).
            ("float8_e4m3fn", 128, 1): None,
            ("float8_e4m3fn", 128, 4): None,
            ("float8_e4m3fn", 128, 8): None,
            ("float8_e5m2", 128, 1): None,
            ("float8_e5m2", 128, 4): None,
            ("float8_e5m2", 128, 8): None,
        },
    ),
}


def table_for(arch: Optional[Tuple[int, int]]) -> Optional[ArchTable]:
    return TABLES.get(tuple(arch)) if arch is not None else None


def _measured_archs() -> str:
    return ", ".join(f"sm {a[0]}.{a[1]}" for a in sorted(TABLES)) or "none"


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- requests

@dataclasses.dataclass(frozen=True)
class Request:
    """What a plan asks for, in plain values (the capability functions read nothing else)."""

    kind: str = "prefill"  # "prefill" or "decode"
    device_type: str = "cuda"
    arch: Optional[Tuple[int, int]] = (9, 0)
    num_sms: int = 132
    q_dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = torch.bfloat16
    o_dtype: torch.dtype = torch.bfloat16
    head_dim: int = 128
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    paged: bool = False
    causal: bool = False
    custom_mask: bool = False
    tree: bool = False
    window_left: int = -1
    soft_cap: float = 0.0
    rope: bool = False
    use_cuda_graph: bool = False
    batch: int = 1
    min_qo_len: int = 1
    max_qo_len: int = 1
    min_kv_len: int = 1
    max_kv_len: int = 1
    q_len_per_req: int = 1  # decode
    use_tensor_cores: bool = False  # decode
    # fixed_split_size or disable_split_kv given (FlashInfer's batch-invariance arguments): the route may not
    # follow the batch's sizes, so a request gets the same bits alone or in any batch
    batch_invariant: bool = False

    @property
    def group(self) -> int:
        return max(1, self.num_qo_heads // max(1, self.num_kv_heads))

    @property
    def equal_lengths(self) -> bool:
        return self.min_qo_len == self.max_qo_len and self.min_kv_len == self.max_kv_len

    @property
    def programs_per_sm(self) -> float:
        return self.batch * self.num_kv_heads / max(1, self.num_sms)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    type: str
    arch: Optional[Tuple[int, int]]
    num_sms: int


def device_info(device) -> DeviceInfo:
    """The device type, compute capability and SM count routing reads (tests replace this function)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _host_info(device.type)
    return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_info(index: int) -> DeviceInfo:  # built once: a frozen dataclass costs a microsecond a construction
    return DeviceInfo("cuda", *policy.cuda_properties(torch.device("cuda", index)))


@functools.lru_cache(maxsize=None)
def _host_info(device_type: str) -> DeviceInfo:
    return DeviceInfo(device_type, None, 0)


def _dtype_or(value, default):
    """A dtype from a torch dtype or its name, else ``default``: routing never refuses (policy does, later)."""
    try:
        return policy.canonical_dtype("routing", "dtype", value)
    except ValueError:
        return default


def _int_or(value, default: int) -> int:
    return value if policy.is_int(value) else default


def prefill_request(device, *, paged, q_dtype, kv_dtype, o_dtype, head_dim, num_qo_heads, num_kv_heads, causal,
                    custom_mask, tree, window_left, soft_cap, rope, use_cuda_graph, qo_lens, kv_lens,
                    batch_invariant: bool = False) -> Request:
    """The request of a validated prefill plan (lengths as int tensors on the host)."""
    info = device_info(device)
    qo_lens, kv_lens = np.asarray(qo_lens), np.asarray(kv_lens)  # host tensors: numpy views, cheaper reductions
    batch = int(qo_lens.size)
    return Request(
        kind="prefill", device_type=info.type, arch=info.arch, num_sms=info.num_sms, q_dtype=q_dtype,
        kv_dtype=kv_dtype, o_dtype=o_dtype, head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        paged=paged, causal=bool(causal), custom_mask=bool(custom_mask), tree=bool(tree), window_left=window_left,
        soft_cap=float(soft_cap or 0.0), rope=bool(rope), use_cuda_graph=bool(use_cuda_graph), batch=batch,
        min_qo_len=int(qo_lens.min()) if batch else 0, max_qo_len=int(qo_lens.max()) if batch else 0,
        min_kv_len=int(kv_lens.min()) if batch else 0, max_kv_len=int(kv_lens.max()) if batch else 0,
        batch_invariant=bool(batch_invariant))


def decode_request(device, *, batch, num_qo_heads, num_kv_heads, head_dim, q_data_type, kv_data_type,
                   pos_encoding_mode, window_left, logits_soft_cap, q_len_per_req, tree, use_tensor_cores,
                   use_cuda_graph, batch_invariant: bool = False) -> Request:
    """The request of a decode plan, read before validation: values policy will refuse become harmless."""
    q_dtype = _dtype_or(q_data_type, torch.float16)
    return _decode_request(
        device_info(device), q_dtype, _dtype_or(kv_data_type if kv_data_type is not None else q_dtype, q_dtype),
        _int_or(head_dim, 0), max(1, _int_or(num_qo_heads, 1)), max(1, _int_or(num_kv_heads, 1)), bool(tree),
        _int_or(window_left, -1), float(logits_soft_cap) if isinstance(logits_soft_cap, (int, float)) else 0.0,
        isinstance(pos_encoding_mode, str) and pos_encoding_mode == "ROPE_LLAMA", bool(use_cuda_graph),
        max(0, int(batch)), _int_or(q_len_per_req, 1), bool(use_tensor_cores), bool(batch_invariant))


@functools.lru_cache(maxsize=1024, typed=True)
def _decode_request(info, q_dtype, kv_dtype, head_dim, num_qo_heads, num_kv_heads, tree, window_left, soft_cap,
                    rope, use_cuda_graph, batch, q_len_per_req, use_tensor_cores, batch_invariant) -> Request:
    """Built once per distinct request (a frozen dataclass of 26 fields costs microseconds per plan); the
    arguments are normalized plain values, so equal arguments make equal requests."""
    return Request(
        kind="decode", device_type=info.type, arch=info.arch, num_sms=info.num_sms, q_dtype=q_dtype,
        kv_dtype=kv_dtype, o_dtype=q_dtype, head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        paged=True, causal=False, tree=tree, window_left=window_left, soft_cap=soft_cap, rope=rope,
        use_cuda_graph=use_cuda_graph, batch=batch, q_len_per_req=q_len_per_req, use_tensor_cores=use_tensor_cores,
        batch_invariant=batch_invariant)


# ---------------------------------------------------------------- decline reasons: one producer each

#: producer name -> function. Every reason a wrapper can carry comes from one of these.
PRODUCERS: Dict[str, Callable[..., str]] = {}


def _producer(fn: Callable[..., str]) -> Callable[..., str]:
    PRODUCERS[fn.__name__] = fn
    return fn


@_producer
def triton_needs_cuda() -> str:
    return ("triton: backend='auto' runs the Triton kernels on CUDA tensors only; other devices run "
            "backend='torch' (backend='triton' with TRITON_INTERPRET=1 runs the kernels through Triton's "
            "interpreter).")


@_producer
def triton_needs_sm80() -> str:
    return "triton: the Triton kernels need compute capability 8.0 or newer; backend='torch' serves older GPUs."


@_producer
def unmeasured_arch(route: str) -> str:
    return (f"{route}: docs/routing.md has no crossover table for this GPU architecture (measured: "
            f"{_measured_archs()}), so the safe defaults hold: our kernels, the bandwidth decode kernel for "
            f"use_tensor_cores=False, never cuDNN.")


@_producer
def cudnn_needs_cuda() -> str:
    return "cudnn: the cuDNN route runs on CUDA tensors only."


@_producer
def cudnn_needs_arch() -> str:
    lo, hi = CUDNN_ARCHS
    return f"cudnn: cuDNN SDPA runs on compute capability {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} only."


@_producer
def cudnn_not_prefill() -> str:
    return "cudnn: the cuDNN route serves prefill (single and ragged), not decode."


@_producer
def cudnn_paged() -> str:
    return "cudnn: a paged KV cache is not served (cuDNN SDPA reads contiguous K/V)."


@_producer
def cudnn_mask() -> str:
    return "cudnn: a custom mask or tree mask is not served (only causal or no mask)."


@_producer
def cudnn_window() -> str:
    return "cudnn: window_left >= 0 (a sliding window) is not served."


@_producer
def cudnn_soft_cap() -> str:
    return "cudnn: logits_soft_cap > 0 is not served."


@_producer
def cudnn_rope() -> str:
    return "cudnn: pos_encoding_mode='ROPE_LLAMA' is not served (apply RoPE before the call)."


@_producer
def cudnn_dtype() -> str:
    return "cudnn: q, K/V and the output must share one 16-bit dtype (float16 or bfloat16); fp8 is not served."


@_producer
def cudnn_head_dim() -> str:
    return f"cudnn: head dims {', '.join(map(str, CUDNN_HEAD_DIMS))} only."


@_producer
def cudnn_cuda_graph() -> str:
    return "cudnn: not under use_cuda_graph=True (the cuDNN route allocates its output per call)."


@_producer
def cudnn_unequal_lengths() -> str:
    return ("cudnn: requests of different lengths are not served (dense [B, H, S, D] only; torch's cuDNN "
            "nested-tensor path is experimental and padding would waste the work).")


@_producer
def cudnn_causal_offset() -> str:
    return ("cudnn: causal with kv_len != qo_len is not served (API.md's causal mask is bottom-right aligned; "
            "SDPA's is_causal is top-left).")


@_producer
def cudnn_short() -> str:
    return f"cudnn: a request needs at least 1 query row and {CUDNN_MIN_KV} keys (cuDNN SDPA refuses kv length 1)."


@_producer
def cudnn_batch_invariant() -> str:
    return ("cudnn: a plan given fixed_split_size or disable_split_kv stays on our kernel, whose bits do not depend "
            "on the batch; the cuDNN route is chosen by the batch's lengths.")


@_producer
def cudnn_unavailable() -> str:
    return ("cudnn: this torch has no cuDNN SDPA (torch.backends.cudnn.is_available() is False, or "
            "torch.ops.aten._scaled_dot_product_cudnn_attention or torch.backends.cuda.can_use_cudnn_attention "
            "is missing).")


@_producer
def cudnn_torch_declines() -> str:
    return ("cudnn: torch.backends.cuda.can_use_cudnn_attention declines this shape or setting (cuDNN version, "
            "head-dim limit, torch.use_deterministic_algorithms, torch.backends.cuda.enable_cudnn_sdp(False)).")


@_producer
def cudnn_disabled_env() -> str:
    return f"cudnn: disabled by the environment ({CUDNN_ENV}=0)."


@_producer
def cudnn_unmeasured(table: str) -> str:
    return (f"cudnn: no crossover measured for this dtype, head dim, group size and mask mode with kv_len == "
            f"qo_len ({table}); our kernel holds until python -m serveattn.bench crossover measures it.")


@_producer
def cudnn_below_crossover(min_rows: Optional[int], table: str) -> str:
    if min_rows is None:
        return (f"cudnn: from no measured length on was it faster at every longer one; our kernel holds "
                f"({table}).")
    return f"cudnn: below {min_rows} query rows per request our kernel is faster or unmeasured ({table})."


@_producer
def cudnn_above_crossover(max_rows: int, table: str) -> str:
    return f"cudnn: from {max_rows} query rows per request on our kernel is faster ({table})."


@_producer
def cudnn_failed_at_run() -> str:
    return "cudnn: cuDNN raised at run(); this plan runs on our kernel from then on."


@_producer
def cudnn_failed_before() -> str:
    return ("cudnn: cuDNN raised at run() on a plan of this shape earlier in this process; our kernel serves it "
            "(one warning per shape).")


# The bandwidth kernel's tile holds a request's draft rows x the KV group's query heads (one tile per KV head).
BANDWIDTH_MAX_ROWS = 32


def fits_bandwidth_tile(q_len_per_req: int, group: int) -> bool:
    """Whether a request's rows (draft tokens x query heads per KV head) fit the bandwidth kernel's tile."""
    return q_len_per_req * group <= BANDWIDTH_MAX_ROWS


@_producer
def bandwidth_rows() -> str:
    return (f"bandwidth: the bandwidth decode kernel serves at most {BANDWIDTH_MAX_ROWS} rows (q_len_per_req x "
            f"query heads per KV head).")


@_producer
def bandwidth_tree() -> str:
    return "bandwidth: the bandwidth decode kernel does not serve tree_parents."


@_producer
def bandwidth_rope() -> str:
    return "bandwidth: pos_encoding_mode='ROPE_LLAMA' is served on the tensor-core route only."


@_producer
def bandwidth_fp8_query() -> str:
    return "bandwidth: an fp8 query is served on the tensor-core route only."


@_producer
def bandwidth_mask() -> str:
    return "bandwidth: the bandwidth decode kernel serves no custom mask."


@_producer
def bandwidth_above_crossover(threshold: float, table: str) -> str:
    return (f"bandwidth: at {threshold:.2f} or more KV-head programs per SM (batch x num_kv_heads / SMs) the "
            f"tensor-core route is as fast or faster ({table}).")


@_producer
def tensor_core_below_crossover(threshold: Optional[float], table: str) -> str:
    if threshold is None:
        return (f"tensor-core: from no measured size on was it as fast or faster at every larger one; the "
                f"bandwidth kernel holds ({table}).")
    return (f"tensor-core: below {threshold:.2f} KV-head programs per SM (batch x num_kv_heads / SMs) the "
            f"bandwidth kernel's split-KV is faster ({table}).")


@_producer
def tensor_core_unmeasured(table: str) -> str:
    return (f"tensor-core: no crossover measured for this KV dtype, head dim and group size ({table}); the "
            f"bandwidth kernel holds until python -m serveattn.bench crossover measures it.")


@_producer
def tensor_core_hint_overruled(table: str) -> str:
    return (f"tensor-core: use_tensor_cores=True is a speed hint under backend='auto', and here the bandwidth "
            f"kernel (tensor cores over the group's query heads, with split-KV) was measured faster ({table}); "
            f"backend='triton' takes the flag literally.")


@_producer
def crossover_batch_invariant(declined: str) -> str:
    return (f"{declined}: a plan given fixed_split_size or disable_split_kv takes use_tensor_cores literally under "
            f"backend='auto' (the measured crossover follows the batch's size, and each kernel has its own bits).")


# ---------------------------------------------------------------- capability (plain arguments)

def torch_declines(req: Request) -> Optional[str]:
    """backend='torch' serves every request policy accepts (float32 math, eager), but a CUDA graph on CUDA."""
    if req.use_cuda_graph and req.device_type == "cuda":
        return torch_graph()
    return None


def torch_graph() -> str:
    return ("torch: under use_cuda_graph=True on CUDA the torch route is not served: its per-request loop runs on "
            "the host, so a captured graph would replay the first plan's shapes; use backend='triton' or 'auto'.")


def triton_declines(req: Request) -> Optional[str]:
    """Our Triton kernels, as ``auto`` would take them."""
    if req.device_type != "cuda":
        return triton_needs_cuda()
    if req.arch is None or tuple(req.arch) < (8, 0):
        return triton_needs_sm80()
    return None


def bandwidth_declines(req: Request) -> Optional[str]:
    """The bandwidth decode kernel (one row per request, or a chain's k; no mask or tree; rope and fp8 queries
    on tensor cores)."""
    why = triton_declines(req)
    if why is not None:
        return why
    if not fits_bandwidth_tile(req.q_len_per_req, req.group):
        return bandwidth_rows()
    if req.tree:
        return bandwidth_tree()
    if req.custom_mask:
        return bandwidth_mask()
    if req.rope:
        return bandwidth_rope()
    if req.q_dtype in policy.FP8_DTYPES:
        return bandwidth_fp8_query()
    return None


def cudnn_declines(req: Request) -> Optional[str]:
    """torch's cuDNN SDPA as this library runs it (serveattn/vendor.py): single or ragged prefill of requests of
    one length, contiguous K/V, causal only when kv_len == qo_len, one 16-bit dtype, no mask, window, soft cap,
    RoPE or CUDA graph. torch's own check (vendor.torch_declines) is asked after this, on the real device."""
    if req.device_type != "cuda":
        return cudnn_needs_cuda()
    lo, hi = CUDNN_ARCHS
    if req.arch is None or not lo <= tuple(req.arch) <= hi:
        return cudnn_needs_arch()
    if req.kind != "prefill":
        return cudnn_not_prefill()
    if req.paged:
        return cudnn_paged()
    if req.custom_mask or req.tree:
        return cudnn_mask()
    if req.window_left >= 0:
        return cudnn_window()
    if req.soft_cap > 0:
        return cudnn_soft_cap()
    if req.rope:
        return cudnn_rope()
    if req.q_dtype not in policy.HALF_DTYPES or req.kv_dtype != req.q_dtype or req.o_dtype != req.q_dtype:
        return cudnn_dtype()
    if req.head_dim not in CUDNN_HEAD_DIMS:
        return cudnn_head_dim()
    if req.use_cuda_graph:
        return cudnn_cuda_graph()
    if req.batch_invariant:
        return cudnn_batch_invariant()
    if not req.equal_lengths:
        return cudnn_unequal_lengths()
    if req.batch == 0 or req.min_qo_len < 1 or req.min_kv_len < CUDNN_MIN_KV:
        return cudnn_short()
    if req.causal and req.min_qo_len != req.min_kv_len:
        return cudnn_causal_offset()
    return None


# ---------------------------------------------------------------- routing (measured crossovers)

def cudnn_slower(req: Request) -> Optional[str]:
    """Why the table does not choose cuDNN for a capable request, or None when it does."""
    if knobs.get(CUDNN_ENV, "1") == "0":
        return cudnn_disabled_env()
    table = table_for(req.arch)
    if table is None:
        return unmeasured_arch(CUDNN)
    key = (dtype_name(req.q_dtype), req.head_dim, req.group, bool(req.causal))
    if key not in table.cudnn_min_rows or req.min_qo_len != req.min_kv_len:
        return cudnn_unmeasured(table.prefill_table)
    min_rows = table.cudnn_min_rows[key]
    if min_rows is None or req.min_qo_len < min_rows:
        return cudnn_below_crossover(min_rows, table.prefill_table)
    max_rows = table.cudnn_max_rows.get(key)
    if max_rows is not None and req.max_qo_len >= max_rows:
        return cudnn_above_crossover(max_rows, table.prefill_table)
    return None


def decode_tensor_cores(req: Request) -> Tuple[bool, Optional[str]]:
    """For a request the bandwidth kernel can serve: (take the tensor-core route?, the declined route's reason).
    use_tensor_cores=True is FlashInfer's speed hint: taken where the table has no measurement for the request's
    kind (no reason then), overruled where it measured the bandwidth kernel (tensor cores too, over the group's
    query heads, with split-KV) faster. A batch-invariant plan takes the hint literally."""
    if req.batch_invariant:
        return req.use_tensor_cores, crossover_batch_invariant(BANDWIDTH if req.use_tensor_cores else TENSOR_CORE)
    table = table_for(req.arch)
    key = (dtype_name(req.kv_dtype), req.head_dim, req.group)
    if table is None or key not in table.decode_tc_min_programs_per_sm:
        if req.use_tensor_cores:
            return True, None
        return False, unmeasured_arch(TENSOR_CORE) if table is None else \
            tensor_core_unmeasured(table.decode_table_for(key[0]))
    threshold, measured = table.decode_tc_min_programs_per_sm[key], table.decode_table_for(key[0])
    if threshold is not None and req.programs_per_sm >= threshold:
        return True, bandwidth_above_crossover(threshold, measured)
    if req.use_tensor_cores:
        return False, tensor_core_hint_overruled(measured)
    return False, tensor_core_below_crossover(threshold, measured)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The resolved route: backend ("cudnn", "triton", "torch"), for decode the kernel ("bandwidth",
    "tensor-core"), and the reasons of the declined candidates."""

    backend: str
    kernel: Optional[str] = None
    reasons: Tuple[str, ...] = ()
    # a cuDNN decision keeps its request: a failure at run() is remembered by it (remember_cudnn_failure)
    request: Optional[Request] = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def reason(self) -> Optional[str]:
        return " ".join(self.reasons) if self.reasons else None


# a reasonless decision (explicit backends), one instance each: a frozen dataclass costs a microsecond a plan
_route = functools.lru_cache(maxsize=None)(Decision)

_FORCED: Dict[str, Optional[str]] = {"prefill": None, "decode": None}


@contextlib.contextmanager
def forced(prefill: Optional[str] = None, decode: Optional[str] = None):
    """Within the block, ``auto`` takes the given route when it is capable and refuses with its reason when not
    (for the crossover benchmark and tests): prefill "cudnn" | "triton" | "torch", decode "bandwidth" |
    "tensor-core" | "torch". Not thread-safe; not for serving."""
    saved = dict(_FORCED)
    _FORCED.update(prefill=prefill, decode=decode)
    try:
        yield
    finally:
        _FORCED.update(saved)


_warned: set = set()

# (device, request) of auto plans on which cuDNN raised at run(): later plans of that shape stay on our kernel, so
# a serving loop that re-plans every step does not retry (and warn about) the failing call each time
_cudnn_failed: set = set()


def remember_cudnn_failure(device, decision: Decision) -> bool:
    """Records that cuDNN raised on ``decision``'s request; True the first time (the caller warns then)."""
    if decision.request is None:  # an explicit or forced cuDNN route: nothing to remember, warn each time
        return True
    key = (str(device), decision.request)
    if key in _cudnn_failed:
        return False
    _cudnn_failed.add(key)
    return True


def warn_once(device, reason: str) -> None:
    """Logs ``reason`` at WARNING once per (device, reason) in this process."""
    key = (str(device), reason)
    if key not in _warned:
        _warned.add(key)
        log.warning("serveattn on %s, backend='auto': %s", device, reason)


def _explicit(entry: str, backend: str, device) -> str:
    return backends.resolve(entry, backend, device)


def _auto_done(device, decision: Decision) -> Decision:
    for reason in decision.reasons:
        warn_once(device, reason)
    return decision


def resolved_route(backend: str) -> Decision:
    """choose_prefill's decision for an explicit backend that its caller resolved already (backends.resolve, on the
    same device, in the same call: the decode wrapper's inner plan), without resolving it again."""
    return _route(backend)


def choose_prefill(entry: str, backend: str, req: Optional[Request], device,
                   held: Optional[Decision] = None) -> Decision:
    """The route of a prefill plan: an explicit backend as given (or refused), ``held`` under CUDA graphs, else
    cuDNN where capable and measured faster, else our kernel, else torch. ``req`` is read only under auto without
    ``held`` (None elsewhere: building it costs a plan microseconds)."""
    policy.check_backend(entry, backend)
    if backend != "auto":
        return _route(_explicit(entry, backend, device))
    if held is not None:
        return held
    forced_route = _FORCED["prefill"]
    if forced_route is not None:
        return _forced_prefill(entry, forced_route, req, device)
    why_triton = triton_declines(req)
    if why_triton is not None:
        return _auto_done(device, _torch_fallback(entry, req, why_triton))
    why = cudnn_declines(req) or cudnn_slower(req) or _vendor_declines(req, device)
    if why is None and _cudnn_failed and (str(device), req) in _cudnn_failed:  # an empty set: no hash a plan
        why = cudnn_failed_before()
    if why is None:
        return _auto_done(device, Decision(CUDNN, request=req))
    return _auto_done(device, Decision(TRITON, reasons=(why,)))


def _torch_fallback(entry: str, req: Request, why_triton: str) -> Decision:
    """The torch route where our kernels cannot serve; refused where it cannot either (a CUDA graph on a GPU below
    sm 8.0: the captured graph would replay the first plan's shapes)."""
    if torch_declines(req) is not None:
        policy.unsupported(entry, no_graph_route(why_triton))
    return Decision(TORCH, reasons=(why_triton,))


def no_graph_route(why_triton: str) -> str:
    return (f"under use_cuda_graph=True backend='auto' has no route for this plan: the Triton kernels cannot serve "
            f"it ({why_triton}), and the torch route cannot be captured (its per-request loop runs on the host); "
            f"construct the wrapper with use_cuda_graph=False.")


def _vendor_declines(req: Request, device) -> Optional[str]:
    from . import vendor  # torch's own cuDNN check, on the device: asked last
    return vendor.torch_declines(req, device)


def _forced_prefill(entry: str, route: str, req: Request, device) -> Decision:
    if route == TORCH:
        return Decision(TORCH)
    if route == CUDNN:
        why = cudnn_declines(req) or _vendor_declines(req, device)
    else:
        why = triton_declines(req)
    if why is not None:
        policy.unsupported(entry, f"the forced route {route!r} cannot serve this plan: {why}")
    return Decision(route)


def choose_decode(entry: str, backend: str, req: Request, device, held: Optional[Decision] = None) -> Decision:
    """The route of a decode plan. Explicit backends take ``use_tensor_cores`` literally (trees, and chains of
    more rows than the bandwidth kernel's tile holds, run on tensor cores, as documented; ROPE on the bandwidth
    kernel is refused). Under ``auto``, ``use_tensor_cores`` is a hint (decode_tensor_cores): ``True`` is taken
    where the table has no measurement and overruled where it measured the bandwidth kernel faster; ``False``
    lets the table choose between the two kernels."""
    policy.check_backend(entry, backend)
    if backend != "auto":
        chosen = _explicit(entry, backend, device)
        if chosen == TORCH:
            return _route(TORCH)
        if req.rope and not req.use_tensor_cores:
            policy.unsupported(entry, "pos_encoding_mode='ROPE_LLAMA' is served on the tensor-core route only; "
                                      "construct the wrapper with use_tensor_cores=True.")
        if req.use_tensor_cores or not fits_bandwidth_tile(req.q_len_per_req, req.group) or req.tree:
            return _route(TRITON, TENSOR_CORE)
        return _route(TRITON, BANDWIDTH)
    if held is not None:
        return held
    forced_route = _FORCED["decode"]
    if forced_route is not None:
        return _forced_decode(entry, forced_route, req)
    why_triton = triton_declines(req)
    if why_triton is not None:
        return _auto_done(device, _torch_fallback(entry, req, why_triton))
    why_bandwidth = bandwidth_declines(req)
    if why_bandwidth is not None:
        return _auto_done(device, Decision(TRITON, TENSOR_CORE, (why_bandwidth,)))
    take_tc, why = decode_tensor_cores(req)
    return _auto_done(device, Decision(TRITON, TENSOR_CORE if take_tc else BANDWIDTH, (why,) if why else ()))


def _forced_decode(entry: str, route: str, req: Request) -> Decision:
    if route == TORCH:
        return Decision(TORCH)
    why = triton_declines(req)
    if why is None and route == BANDWIDTH:
        why = bandwidth_declines(req)
    if why is not None:
        policy.unsupported(entry, f"the forced route {route!r} cannot serve this plan: {why}")
    return Decision(TRITON, route)
