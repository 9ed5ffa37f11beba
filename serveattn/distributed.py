"""Context-parallel decode: each request's KV pages are sharded across the ranks of a process group.

Every rank holds a contiguous run of each request's pages (its *shard*; `shard_page_table` cuts one) and
runs the decode wrapper on it with `return_lse=True`. The partial states (output in `o_data_type`, base-2
LSE in float32) go through one `all_gather` (NCCL on GPUs, gloo on the CPU) and every rank merges them with
`merge_states`, in rank order: the exact single-GPU answer up to the rounding of the partial outputs.

    group = dist.new_group(...)                       # or None: the default group
    cp = ContextParallelDecode(group, workspace, "NHD")
    cp.plan(*shard_page_table(indptr, indices, last_page_len, page_size, world, rank),
            num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type=torch.bfloat16)
    out, lse = cp.run(q, this_ranks_paged_kv_cache, return_lse=True)   # the same on every rank

Token order: the request's KV is the concatenation of the shards in rank order (rank 0 first). Only the
speculative-verify mask depends on positions, and it is built from that order (below); a shard may end in a
partial page, and a rank may hold no page of a request (its partial state is empty: output 0, LSE -inf).

Verify (`plan(q_len_per_req=k)`, k > 1). A request of L tokens has k draft rows, the last k KV positions;
row r (0-based) sees keys 0 .. L-k+r (bottom-right causal). With its shard covering global positions
[a, b), a rank serves each request in one of three exact ways, chosen at plan time from every rank's shard
lengths (exchanged there):

* b <= L-k+1 (the shard ends before the masked keys L-k+1 .. L-1): every row sees the whole shard, so no mask.
  The k rows are folded into the query heads (q `[k, Hq, D]` -> `[1, Hq*k, D]`, head h*k + r, so the KV group
  becomes group*k) and the shard runs as one-row decode: its pages are read once for all k rows.
* b == L and b - a >= k (the last shard, holding all k draft positions): bottom-right causal on the shard's
  own length is exactly the global mask, so the shard runs on the verify route, `plan(q_len_per_req=k)`.
* otherwise (a shard that ends inside the masked keys but before L, or a last shard shorter than k): the
  shard's page-aligned head [a, a+c), c = the largest multiple of page_size with a+c <= L-k+1, is seen by
  every row and runs folded as above; each row r then gets the rest of the shard truncated to what it
  sees, [a+c, min(b, L-k+r+1)), as its own one-row request (its first page starts at a page boundary;
  fewer than page_size + k tokens per row), and the two states of the row are merged locally with
  `merge_state` before the exchange. (c is capped at the shard's length.)

Plan is collective: every rank calls `plan()` together. It exchanges a header (batch, heads, head dim, page
size, q_len_per_req, dtypes, scale, soft cap) and the shard lengths, builds its sub-plans, then exchanges
a verdict; a refusal on any rank raises on every rank (the refusing rank raises its own sentence, the
others name that rank), and no rank installs the plan. `run()` is collective too: its own argument checks
are local, so a rank that refuses at run() leaves the others waiting in the all_gather until the process
group's timeout.

Not served: `pos_encoding_mode="ROPE_LLAMA"` and `window_left >= 0` (both need global positions inside the
kernel; apply RoPE before appending K), tree verify (`tree_parents`), CUDA graphs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from . import backend as backends
from . import policy
from .cascade import merge_state, merge_states
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import split_paged_cache

ENTRY = "ContextParallelDecode"
SHARD_ENTRY = "shard_page_table"

#: dtype codes of the plan header (every rank must agree on each).
_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32)
_HEADER = ("status", "batch", "q_len_per_req", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
           "q_data_type", "kv_data_type", "o_data_type", "sm_scale", "logits_soft_cap", "kv_layout")
_OK, _VALUE_ERROR, _NOT_IMPLEMENTED = 0, 1, 2


# ---------------------------------------------------------------- sharding a page table

def shard_page_table(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int,
                     world_size: int, rank: int, *, pages_per_rank=None
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's shard of a CSR page table: (indptr, indices, last_page_len), int32 on indptr's device.

    Each request's page list is cut into `world_size` contiguous runs, rank 0 taking the first. By default
    request i's n pages are cut at `j * n // world_size` (so the last ranks take the remainder, and with
    fewer pages than ranks the first ranks hold none); `pages_per_rank`, an int `[batch, world_size]` array
    (tensor, numpy or nested lists) of page counts whose rows sum to each request's page count, gives any
    other cut, uneven or with empty shards. Page ids are passed through unchanged: a rank's cache must hold
    the pages of its shard at those ids. A shard's last_page_len is the request's own when the shard holds
    the request's last page, page_size for an earlier non-empty shard, and 0 for an empty one.
    """
    entry = SHARD_ENTRY
    policy.paged_kv_lens(entry, indptr, indices, last_page_len, page_size, names=policy.DECODE_TABLE_NAMES)
    for name, value in (("world_size", world_size), ("rank", rank)):
        if not policy.is_int(value):
            policy.refuse(entry, f"{name}={value!r} must be an int.")
    if world_size < 1:
        policy.refuse(entry, f"world_size={world_size} must be at least 1.")
    if not 0 <= rank < world_size:
        policy.refuse(entry, f"rank={rank} must lie in 0..world_size-1={world_size - 1}.")
    ip = policy.host_array(indptr)
    idx = policy.host_array(indices)
    last = policy.host_array(last_page_len)
    pages = ip[1:] - ip[:-1]
    batch = pages.size
    if pages_per_rank is None:
        j = np.arange(world_size + 1)
        cuts = j[None, :] * pages[:, None] // world_size  # [batch, world + 1]
    else:
        counts = _pages_per_rank(entry, pages_per_rank, batch, world_size)
        sums = counts.sum(1)
        if (sums != pages).any():
            i = int(np.nonzero(sums != pages)[0][0])
            policy.refuse(entry, f"pages_per_rank[{i}] sums to {int(sums[i])} but request {i} owns {int(pages[i])} "
                                 f"pages; each row must cut all of its request's pages.")
        cuts = np.concatenate([np.zeros((batch, 1), dtype=np.int64), np.cumsum(counts, 1)], 1)
    lo, hi = cuts[:, rank], cuts[:, rank + 1]
    own = hi - lo
    new_indptr = np.concatenate([[0], np.cumsum(own)])
    new_indices = np.concatenate([idx[ip[i] + lo[i]: ip[i] + hi[i]] for i in range(batch)]) if batch else \
        np.zeros(0, dtype=np.int64)
    holds_last = (own > 0) & (hi == pages)
    new_last = np.where(own == 0, 0, np.where(holds_last, last, page_size))
    i32 = dict(dtype=torch.int32, device=indptr.device)
    return (torch.tensor(new_indptr, **i32), torch.tensor(new_indices, **i32), torch.tensor(new_last, **i32))


def _pages_per_rank(entry: str, value, batch: int, world_size: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            policy.refuse(entry, f"pages_per_rank has dtype {value.dtype}; page counts must be integers.")
        counts = value.detach().to("cpu").numpy().astype(np.int64)
    else:
        try:
            counts = np.asarray(value)
        except ValueError:  # rows of unequal lengths
            policy.refuse(entry, f"pages_per_rank must be a (batch, world_size) = ({batch}, {world_size}) table of "
                                 f"page counts; its rows differ in length.")
        if counts.dtype.kind not in "iu" and counts.size:
            policy.refuse(entry, f"pages_per_rank holds {counts.dtype} values; page counts must be integers.")
        counts = counts.astype(np.int64)
    if counts.shape != (batch, world_size):
        policy.refuse(entry, f"pages_per_rank has shape {tuple(counts.shape)}; expected (batch, world_size) = "
                             f"({batch}, {world_size}).")
    if counts.size and int(counts.min()) < 0:
        policy.refuse(entry, f"pages_per_rank holds a negative page count ({int(counts.min())}).")
    return counts


# ---------------------------------------------------------------- collectives

def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """One all_gather of a 1-D tensor into a 1-D output of world_size times its length (rank-major; gloo takes
    only this concatenated form): all_gather_single where torch has it (2.13 deprecates
    all_gather_into_tensor), all_gather_into_tensor otherwise."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def _backend_name(group) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - a group without a name: treat it as device-only
        return ""


# ---------------------------------------------------------------- the plan

class _ShardDecode(BatchDecodeWithPagedKVCacheWrapper):
    """The decode wrapper one rank runs on (part of) its shard; its refusals name ContextParallelDecode."""
    _entry = ENTRY


@dataclass
class _Table:
    """A sub-batch: page table (CPU int32) and, per entry, what it serves."""
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    ids: torch.Tensor  # request ids (fold, verify) or row ids (rows), int64 on the device


@dataclass
class _CPPlan:
    batch: int
    q_len: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    device: torch.device
    fold: Optional[BatchDecodeWithPagedKVCacheWrapper]
    verify: Optional[BatchDecodeWithPagedKVCacheWrapper]
    rows: Optional[BatchDecodeWithPagedKVCacheWrapper]
    fold_ids: Optional[torch.Tensor]
    verify_ids: Optional[torch.Tensor]
    row_ids: Optional[torch.Tensor]
    send: torch.Tensor  # uint8 [nbytes]: rows * Hq * D of o_dtype, then rows * Hq float32 (a contiguous prefix)
    recv: torch.Tensor  # uint8 [world * nbytes], rank-major (a contiguous prefix)
    kv_offsets: np.ndarray  # this rank's first global position per request
    kv_lens_total: np.ndarray  # each request's kv_len over all ranks

    @property
    def rows_total(self) -> int:
        return self.batch * self.q_len

    def views(self, world: int):
        """(send_o, send_lse, recv_o [world, rows, Hq, D], recv_lse [world, rows, Hq]) over the byte buffers."""
        rows, hq, d = self.rows_total, self.num_qo_heads, self.head_dim
        o_bytes = rows * hq * d * torch.empty(0, dtype=self.o_dtype).element_size()
        send_o = self.send[:o_bytes].view(self.o_dtype).view(rows, hq, d)
        send_lse = self.send[o_bytes:].view(torch.float32).view(rows, hq)
        recv = self.recv.view(world, -1)
        recv_o = recv[:, :o_bytes].view(self.o_dtype).view(world, rows, hq, d)
        recv_lse = recv[:, o_bytes:].view(torch.float32).view(world, rows, hq)
        return send_o, send_lse, recv_o, recv_lse


def _table(entries: List[Tuple[int, np.ndarray, int]], page_size: int, device) -> _Table:
    """entries: (id, pages, kv_len) -> CSR page table; kv_len may end inside the last page."""
    ip, idx, last, ids = [0], [], [], []
    for ident, pages, n in entries:
        used = pages[: -(-n // page_size)]
        ip.append(ip[-1] + used.size)
        idx.append(used)
        last.append(n - (used.size - 1) * page_size if used.size else 0)
        ids.append(ident)
    i32 = dict(dtype=torch.int32)
    return _Table(torch.tensor(ip, **i32), torch.tensor(np.concatenate(idx) if idx else [], **i32),
                  torch.tensor(last, **i32), torch.tensor(ids, dtype=torch.int64, device=device))


def split_for_verify(kv_lens: np.ndarray, kv_offsets: np.ndarray, kv_lens_total: np.ndarray, q_len: int,
                     page_size: int):
    """How one rank serves each request under verify (see the module docstring), as plain lists:
    fold [(request, first_pages, kv_len)], verify [request], rows [(request, row, first_page, kv_len)].

    first_pages of a fold entry counts the shard's leading pages it reads; a rows entry reads kv_len tokens
    starting at the shard's page first_page. Empty row entries (rows that see nothing of the shard past its
    folded head) are left out: their state is the folded head's, or empty."""
    fold, verify, rows = [], [], []
    k = q_len
    for i, (n, a, total) in enumerate(zip(kv_lens.tolist(), kv_offsets.tolist(), kv_lens_total.tolist())):
        if n == 0:
            continue
        b = a + n
        free_end = total - k + 1  # keys before this position are seen by every row
        if b <= free_end:
            fold.append((i, -(-n // page_size), n))
            continue
        if b == total and n >= k:
            verify.append(i)
            continue
        c = min(max(free_end - a, 0), n) // page_size * page_size
        if c:
            fold.append((i, c // page_size, c))
        for r in range(k):
            seen = min(max(free_end + r - a - c, 0), n - c)
            if seen:
                rows.append((i, r, c // page_size, seen))
    return fold, verify, rows


class ContextParallelDecode:
    """Decode (and chain verify) with each request's KV sharded across `process_group` (module docstring).

    `plan()` takes THIS rank's shard of the page table (see `shard_page_table`) and the decode wrapper's
    arguments; `run(q, paged_kv_cache, ...)` takes the whole batch's q `[batch * q_len_per_req, Hq, D]` (the
    same on every rank) and this rank's cache, and returns the merged out (and base-2 lse) on every rank.
    `metadata_group` (optional, e.g. a gloo group over the same ranks) carries plan()'s small exchanges on
    the CPU instead of `process_group`'s device collectives.
    """

    def __init__(self, process_group, workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_tensor_cores: bool = False, backend: str = "auto", metadata_group=None,
                 use_cuda_graph: bool = False):
        entry = ENTRY
        policy.check_kv_layout(entry, kv_layout)
        policy.check_backend(entry, backend)
        if use_cuda_graph:
            policy.unsupported(entry, "use_cuda_graph=True is not served: plan() and run() exchange data between "
                                      "ranks outside a graph.")
        if not isinstance(workspace_buffer, torch.Tensor):
            policy.refuse(entry, "workspace_buffer must be a torch.Tensor.")
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            policy.refuse(entry, "torch.distributed is not initialized; call torch.distributed.init_process_group "
                                 "(nccl on GPUs, gloo on the CPU) on every rank first.")
        group = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        if rank < 0:
            policy.refuse(entry, "this process is not a member of process_group.")
        device = workspace_buffer.device
        name = _backend_name(group)
        if device.type == "cpu" and name and "gloo" not in name:
            policy.refuse(entry, f"process_group's backend {name!r} cannot exchange CPU tensors and the workspace "
                                 f"is on the CPU; use a gloo group, or a CUDA workspace with nccl.")
        meta = metadata_group if metadata_group is not None else group
        if metadata_group is not None:
            ranks, meta_ranks = dist.get_process_group_ranks(group), dist.get_process_group_ranks(meta)
            if list(ranks) != list(meta_ranks):
                policy.refuse(entry, f"metadata_group spans global ranks {list(meta_ranks)} but process_group spans "
                                     f"{list(ranks)}; both must hold the same ranks in the same order.")
        self._group = group
        self._meta_group = meta
        self._meta_device = torch.device("cpu") if "gloo" in _backend_name(meta) or device.type == "cpu" else device
        self._workspace = workspace_buffer
        self._kv_layout = kv_layout
        self._use_tensor_cores = use_tensor_cores
        self._backend_request = backend
        self._plan: Optional[_CPPlan] = None
        self._buffer_bases: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        #: None, or a callable run() calls with "attention", "all_gather", "merge" and "end" as it enters each
        #: phase of a step (the benchmark records CUDA events there); it must not synchronize.
        self.phase_marker = None
        self.backend = backends.resolve(entry, backend, device)

    @property
    def device(self) -> torch.device:
        return self._workspace.device

    @property
    def kv_offsets(self) -> Optional[np.ndarray]:
        """This rank's first global KV position per request (from the last plan)."""
        return None if self._plan is None else self._plan.kv_offsets.copy()

    @property
    def kv_lens(self) -> Optional[np.ndarray]:
        """Each request's kv_len over all ranks (from the last plan)."""
        return None if self._plan is None else self._plan.kv_lens_total.copy()

    # ------------------------------------------------------------ plan

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, *positional_rest, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, o_data_type=None, fixed_split_size=None, disable_split_kv=False,
             q_len_per_req=1, tree_parents=None, **unsupported_kwargs):
        """The decode wrapper's plan on this rank's shard; collective (every rank calls it together). As the
        decode wrapper's, it binds optional arguments by position in FlashInfer 0.7's order."""
        entry = ENTRY + ".plan"
        if positional_rest:
            try:
                given = locals()
                keywords = policy.bind_positions(entry, policy.DECODE_PLAN_POSITIONS, 5, positional_rest, {
                    **{name: given[name] for name in _PLAN_KEYWORDS}, **unsupported_kwargs}, _PLAN_DEFAULTS)
            except ValueError as exc:  # agreed like any other local refusal: every rank raises
                self._agree_header(entry, None, exc)
                raise
            return self.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                             pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, **keywords)
        if data_type is not None and kv_data_type is None:
            kv_data_type = data_type
        local, error = None, None
        try:
            local = self._check_local(entry, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                                      page_size, pos_encoding_mode, window_left, logits_soft_cap, q_data_type,
                                      kv_data_type, o_data_type, sm_scale, q_len_per_req, tree_parents,
                                      unsupported_kwargs)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone raises
            error = exc
        self._agree_header(entry, local, error)
        kv_lens_all = self._gather_lengths(local["kv_lens"])  # [world, batch]
        totals = kv_lens_all.sum(0)
        k = local["q_len"]
        if k > 1 and totals.size and int(totals.min()) < k:
            i = int(np.nonzero(totals < k)[0][0])
            policy.refuse(entry, f"q_len_per_req={k} needs kv_len >= {k} for every request (the draft rows are its "
                                 f"last {k} KV positions); request {i} has kv_len={int(totals[i])} over all ranks.")
        offsets = kv_lens_all[: self.rank].sum(0)
        plan, error = None, None
        try:
            plan = self._build(entry, local, indptr, indices, last_page_len, offsets, totals, num_qo_heads,
                               num_kv_heads, head_dim, page_size, logits_soft_cap, q_data_type, kv_data_type,
                               o_data_type, rope_scale, rope_theta, fixed_split_size, disable_split_kv)
        except Exception as exc:  # noqa: BLE001
            error = exc
        self._agree(entry, error)
        self._plan = plan

    def _check_local(self, entry, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type,
                     sm_scale, q_len_per_req, tree_parents, unsupported_kwargs) -> dict:
        if unsupported_kwargs:
            policy.extra_kwargs(entry, unsupported_kwargs)
        if tree_parents is not None:
            policy.unsupported(entry, "tree_parents (tree verify) is not served across ranks; chain verify "
                                      "(q_len_per_req=k) is.")
        if not policy.is_int(q_len_per_req) or q_len_per_req < 1:
            policy.refuse(entry, f"q_len_per_req={q_len_per_req!r} must be a positive int.")
        policy.check_pos_encoding(entry, pos_encoding_mode)
        if pos_encoding_mode != "NONE":
            policy.unsupported(entry, f"pos_encoding_mode={pos_encoding_mode!r} is not served across ranks: a "
                                      f"shard's kernel sees shard-local positions; apply RoPE before appending K "
                                      f"and passing q.")
        policy.check_scalars(entry, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap)
        if window_left >= 0:
            policy.unsupported(entry, f"window_left={window_left} is not served across ranks (the window needs "
                                      f"global positions); only window_left=-1.")
        policy.check_heads(entry, num_qo_heads, num_kv_heads)
        policy.check_head_dim(entry, head_dim)
        kv_lens = policy.paged_kv_lens(entry, indptr, indices, last_page_len, page_size,
                                       names=policy.DECODE_TABLE_NAMES).numpy()
        q_dtype, kv_dtype, o_dtype = policy.decode_dtypes(
            entry, q_data_type, kv_data_type, o_data_type,
            "an fp8 query is not served across ranks; an fp8 KV cache under a 16-bit query is (kv_data_type with "
            "k_scale/v_scale).")
        return dict(kv_lens=kv_lens.astype(np.int64), q_len=q_len_per_req, batch=kv_lens.size, q_dtype=q_dtype,
                    kv_dtype=kv_dtype, o_dtype=o_dtype,
                    sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim),
                    soft_cap=float(logits_soft_cap or 0.0),
                    header=[num_qo_heads, num_kv_heads, head_dim, page_size])

    def _agree_header(self, entry: str, local: Optional[dict], error: Optional[BaseException]) -> None:
        """Exchanges the header; raises on every rank if any rank refused or the ranks disagree."""
        if error is None:
            hq, hkv, d, ps = local["header"]
            row = [_OK, local["batch"], local["q_len"], hq, hkv, d, ps, _DTYPES.index(local["q_dtype"]),
                   _DTYPES.index(local["kv_dtype"]), _DTYPES.index(local["o_dtype"]), local["sm_scale"],
                   local["soft_cap"], ("NHD", "HND").index(self._kv_layout)]
        else:
            row = [_status(error)] + [-1.0] * (len(_HEADER) - 1)
        mine = torch.tensor(row, dtype=torch.float64, device=self._meta_device)
        table = torch.empty(self.world_size * len(_HEADER), dtype=torch.float64, device=self._meta_device)
        _all_gather(table, mine, self._meta_group)
        table = table.cpu().numpy().reshape(self.world_size, len(_HEADER))
        self._raise_on_refusal(entry, table[:, 0], error)
        for col, name in enumerate(_HEADER[1:], 1):
            values = table[:, col]
            if (values != values[0]).any():
                shown = ", ".join(f"rank {r}: {_header_value(name, v)}" for r, v in enumerate(values))
                policy.refuse(entry, f"{name} differs between ranks ({shown}); every rank must plan the same batch, "
                                     f"heads, head dim, page size, q_len_per_req, dtypes, sm_scale, soft cap and "
                                     f"layout.")

    def _gather_lengths(self, kv_lens: np.ndarray) -> np.ndarray:
        mine = torch.from_numpy(kv_lens).to(self._meta_device)
        table = torch.empty(self.world_size * kv_lens.size, dtype=torch.int64, device=self._meta_device)
        if kv_lens.size:
            _all_gather(table, mine, self._meta_group)
        return table.cpu().numpy().reshape(self.world_size, kv_lens.size)

    def _agree(self, entry: str, error: Optional[BaseException]) -> None:
        mine = torch.tensor([_OK if error is None else _status(error)], dtype=torch.int64, device=self._meta_device)
        table = torch.empty(self.world_size, dtype=torch.int64, device=self._meta_device)
        _all_gather(table, mine, self._meta_group)
        self._raise_on_refusal(entry, table.cpu().numpy(), error)

    def _raise_on_refusal(self, entry: str, status: np.ndarray, error: Optional[BaseException]) -> None:
        if error is not None:
            raise error
        bad = np.nonzero(status != _OK)[0]
        if bad.size:
            r = int(bad[0])
            message = (f"rank {r} refused its plan() arguments (its own error names them); no rank installed this "
                       f"plan, and the previous plan, if any, still runs.")
            if int(status[r]) == _NOT_IMPLEMENTED:
                policy.unsupported(entry, message)
            policy.refuse(entry, message)

    def _build(self, entry, local, indptr, indices, last_page_len, offsets, totals, num_qo_heads, num_kv_heads,
               head_dim, page_size, logits_soft_cap, q_data_type, kv_data_type, o_data_type, rope_scale, rope_theta,
               fixed_split_size, disable_split_kv) -> _CPPlan:
        """Sub-plans on fresh wrappers and the exchange buffers; installs nothing."""
        device = self.device
        k, batch = local["q_len"], local["batch"]
        common = dict(head_dim=head_dim, page_size=page_size, logits_soft_cap=logits_soft_cap,
                      q_data_type=local["q_dtype"], kv_data_type=local["kv_dtype"], o_data_type=local["o_dtype"],
                      sm_scale=local["sm_scale"], rope_scale=rope_scale, rope_theta=rope_theta)
        split = dict(fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv)
        fold = verify = rows = None
        fold_ids = verify_ids = row_ids = None
        if batch and k == 1:  # plain decode: this rank's page table as given, empty requests included
            fold = self._wrapper()
            fold.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, **common, **split)
        elif batch:
            ip = policy.host_array(indptr)
            idx = policy.host_array(indices)
            pages_of = [idx[ip[i]:ip[i + 1]] for i in range(batch)]
            f, v, r = split_for_verify(local["kv_lens"], offsets, totals, k, page_size)
            if f:
                t = _table([(i, pages_of[i][:n_pages], n) for i, n_pages, n in f], page_size, device)
                fold, fold_ids = self._wrapper(), t.ids
                fold.plan(t.indptr, t.indices, t.last_page_len, num_qo_heads * k, num_kv_heads, **common, **split)
            if v:
                t = _table([(i, pages_of[i], int(local["kv_lens"][i])) for i in v], page_size, device)
                verify, verify_ids = self._wrapper(), t.ids
                verify.plan(t.indptr, t.indices, t.last_page_len, num_qo_heads, num_kv_heads, **common,
                            q_len_per_req=k)
            if r:
                t = _table([(i * k + row, pages_of[i][first:], n) for i, row, first, n in r], page_size, device)
                rows, row_ids = self._wrapper(), t.ids
                rows.plan(t.indptr, t.indices, t.last_page_len, num_qo_heads, num_kv_heads, **common, **split)
        o_size = torch.empty(0, dtype=local["o_dtype"]).element_size()
        nbytes = batch * k * num_qo_heads * (head_dim * o_size + 4)
        send, recv = self._buffers(nbytes)
        return _CPPlan(batch=batch, q_len=k, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       q_dtype=local["q_dtype"], kv_dtype=local["kv_dtype"], o_dtype=local["o_dtype"], device=device,
                       fold=fold, verify=verify, rows=rows, fold_ids=fold_ids, verify_ids=verify_ids, row_ids=row_ids,
                       send=send, recv=recv, kv_offsets=offsets.astype(np.int64),
                       kv_lens_total=totals.astype(np.int64))

    def _wrapper(self) -> BatchDecodeWithPagedKVCacheWrapper:
        # One workspace for every sub-wrapper: their runs are sequential on one stream.
        return _ShardDecode(self._workspace, self._kv_layout, use_tensor_cores=self._use_tensor_cores,
                            backend=self._backend_request)

    def _buffers(self, nbytes: int):
        """Contiguous prefixes of the exchange buffers, reused from the previous plan when large enough."""
        if self._buffer_bases is None or self._buffer_bases[0].numel() < nbytes:
            self._buffer_bases = (torch.empty(nbytes, dtype=torch.uint8, device=self.device),
                                  torch.empty(self.world_size * nbytes, dtype=torch.uint8, device=self.device))
        send, recv = self._buffer_bases
        return send[:nbytes], recv[: self.world_size * nbytes]

    # ------------------------------------------------------------ run

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, **unsupported_kwargs):
        """q `[batch * q_len_per_req, Hq, D]` (the whole batch, the same on every rank), this rank's paged cache
        -> out `[batch * q_len_per_req, Hq, D]` (and the base-2 lse `[.., Hq]`), merged over all ranks;
        collective. k_scale / v_scale (fp8 cache) go to every sub-run unchanged; q_scale, enable_pdl, window_left
        (only -1, the plan's) and FlashInfer's later keywords at their no-op values as the decode wrapper's run()."""
        entry = ENTRY + ".run"
        if args:
            policy.unsupported(entry, "run() takes q, paged_kv_cache and the keywords q_scale, k_scale, v_scale, "
                                      "out, lse, return_lse.")
        if unsupported_kwargs:
            policy.extra_kwargs(entry, unsupported_kwargs, "run() argument(s)")
        if window_left is not None and window_left != -1:
            policy.refuse(entry, f"window_left={window_left!r} given to run() differs from the plan's -1 (no window "
                                 f"is served across ranks).")
        k_scale = policy.fold_q_scale(entry, q_scale, k_scale)
        plan = self._plan
        if plan is None:
            policy.refuse(entry, "run() was called before plan().")
        rows = plan.rows_total
        policy.check_tensor(entry, "q", q, (rows, plan.num_qo_heads, plan.head_dim), plan.q_dtype, plan.device)
        if out is not None:
            policy.check_tensor(entry, "out", out, q.shape, plan.o_dtype, plan.device)
        if lse is not None:
            policy.check_tensor(entry, "lse", lse, q.shape[:2], torch.float32, plan.device)
        # the cache's form, dtype and device and the scales, before anything runs (the sub-wrappers check the rest)
        for name, t in zip("kv", split_paged_cache(entry, paged_kv_cache, self._kv_layout)):
            if t.dtype != plan.kv_dtype:
                policy.refuse(entry, f"{name} cache has dtype {t.dtype} but the plan declared {plan.kv_dtype}.")
            if t.device != plan.device:
                policy.refuse(entry, f"{name} cache is on {t.device}; expected {plan.device}.")
        policy.check_scales(entry, plan.device, k_scale=k_scale, v_scale=v_scale)
        if rows == 0:  # every rank planned an empty batch: nothing to exchange
            out = out if out is not None else torch.empty(q.shape, dtype=plan.o_dtype, device=plan.device)
            lse = lse if lse is not None else torch.empty(q.shape[:2], dtype=torch.float32, device=plan.device)
            return (out, lse) if return_lse else out
        send_o, send_lse, recv_o, recv_lse = plan.views(self.world_size)
        kw = dict(k_scale=k_scale, v_scale=v_scale, return_lse=True)
        marker = self.phase_marker
        if marker is not None:
            marker("attention")
        if plan.q_len == 1:  # this rank's page table as planned: out/lse straight into the send buffer
            plan.fold.run(q, paged_kv_cache, out=send_o, lse=send_lse, **kw)
        else:
            self._run_verify(plan, q, paged_kv_cache, send_o, send_lse, kw)
        if marker is not None:
            marker("all_gather")
        _all_gather(plan.recv, plan.send, self._group)
        if marker is not None:
            marker("merge")
        # [world, rows, ...] -> [rows, world, ...]: states merged in rank order (KV order), the same on every rank
        merged_o, merged_lse = merge_states(recv_o.transpose(0, 1), recv_lse.transpose(0, 1), backend=self.backend)
        if out is not None:
            out.copy_(merged_o)
        else:
            out = merged_o
        if lse is not None:
            lse.copy_(merged_lse)
        else:
            lse = merged_lse
        if marker is not None:
            marker("end")
        return (out, lse) if return_lse else out

    def _run_verify(self, plan: _CPPlan, q, cache, send_o, send_lse, kw) -> None:
        """q_len_per_req > 1: fold / verify / rows sub-runs scattered into the send buffer (rows merged in)."""
        k, hq, d = plan.q_len, plan.num_qo_heads, plan.head_dim
        send_o.zero_()
        send_lse.fill_(float("-inf"))
        by_req_o = send_o.view(plan.batch, k, hq, d)
        by_req_lse = send_lse.view(plan.batch, k, hq)
        q_req = q.reshape(plan.batch, k, hq, d)
        if plan.fold is not None:
            ids = plan.fold_ids
            n = ids.numel()
            q_fold = q_req[ids].transpose(1, 2).reshape(n, hq * k, d)  # head h*k + r: the KV group grows k-fold
            o, s = plan.fold.run(q_fold, cache, **kw)
            by_req_o[ids] = o.view(n, hq, k, d).transpose(1, 2)
            by_req_lse[ids] = s.view(n, hq, k).transpose(1, 2)
        if plan.verify is not None:
            ids = plan.verify_ids
            o, s = plan.verify.run(q_req[ids].reshape(ids.numel() * k, hq, d), cache, **kw)
            by_req_o[ids] = o.view(-1, k, hq, d)
            by_req_lse[ids] = s.view(-1, k, hq)
        if plan.rows is not None:
            ids = plan.row_ids
            o, s = plan.rows.run(q[ids], cache, **kw)
            # the row's folded head (or an empty state) merged with the rest of its shard
            merged_o, merged_s = merge_state(send_o[ids], send_lse[ids], o, s, backend=self.backend)
            send_o[ids] = merged_o
            send_lse[ids] = merged_s


# plan()'s keyword defaults, for FlashInfer 0.7's positional order (policy.bind_positions)
_PLAN_KEYWORDS, _PLAN_DEFAULTS = policy.keyword_signature(ContextParallelDecode.plan)


def _status(error: BaseException) -> int:
    return _NOT_IMPLEMENTED if isinstance(error, NotImplementedError) else _VALUE_ERROR


def _header_value(name: str, value: float) -> str:
    if name in ("q_data_type", "kv_data_type", "o_data_type") and 0 <= value < len(_DTYPES):
        return str(_DTYPES[int(value)]).replace("torch.", "")
    if name == "kv_layout" and value in (0, 1):
        return ("NHD", "HND")[int(value)]
    if name in ("sm_scale", "logits_soft_cap"):
        return f"{value:g}"
    return str(int(value))


__all__ = ["ContextParallelDecode", "shard_page_table", "split_for_verify"]
