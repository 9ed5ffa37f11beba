"""Cascade attention with FlashInfer's names: merging attention states, and multi-level attention.

An attention state is (v, s): the softmax-weighted values and the base-2 LSE of one query row over one
KV segment. States over disjoint segments merge exactly into the state over their union, which is how
`MultiLevelCascadeAttentionWrapper` attends to a shared prefix once for many requests: level 0 (typically
one prefix for all query rows) and every further level run as paged prefill with their own page tables,
and their states are merged in place.
"""
from __future__ import annotations

import functools

from typing import Optional

import torch

from . import backend as backends
from . import policy
from .prefill import BatchPrefillWithPagedKVCacheWrapper, check_workspace_reset, make_plan, split_paged_cache

V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NEG_INF = float("-inf")


# ---------------------------------------------------------------- validation

def _shape_of(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_state(entry: str, v_name: str, v, s_name: str, s, v_dims: int) -> None:
    """v has v_dims dimensions and a served dtype; s is float32 with v's shape minus head_dim."""
    layout = "[seq_len, num_heads, head_dim]" if v_dims == 3 else "[seq_len, num_states, num_heads, head_dim]"
    if not isinstance(v, torch.Tensor) or v.dim() != v_dims:
        policy.refuse(entry, f"{v_name} has shape {_shape_of(v)}; expected a {v_dims}-D tensor {layout}.")
    if v.dtype not in V_DTYPES:
        policy.unsupported(entry, f"{v_name} has dtype {v.dtype}; supported: float16, bfloat16, float32.")
    if v.shape[-1] < 1 or v.shape[-2] < 1:
        policy.refuse(entry, f"{v_name} has shape {tuple(v.shape)}; num_heads and head_dim must be positive.")
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != tuple(v.shape[:-1]):
        policy.refuse(entry, f"{s_name} has shape {_shape_of(s)}; expected {tuple(v.shape[:-1])} "
                             f"({v_name}'s shape without head_dim).")
    if s.dtype != torch.float32:
        policy.refuse(entry, f"{s_name} has dtype {s.dtype}; the LSE must be float32.")
    if s.device != v.device:
        policy.refuse(entry, f"{s_name} is on {s.device} but {v_name} is on {v.device}.")


def _check_pair(entry: str, names, v_a, s_a, v_b, s_b) -> None:
    va_name, sa_name, vb_name, sb_name = names
    _check_state(entry, va_name, v_a, sa_name, s_a, 3)
    _check_state(entry, vb_name, v_b, sb_name, s_b, 3)
    if v_b.shape != v_a.shape:
        policy.refuse(entry, f"{vb_name} has shape {tuple(v_b.shape)} but {va_name} has {tuple(v_a.shape)}; "
                             f"the two states must match.")
    if v_b.dtype != v_a.dtype:
        policy.refuse(entry, f"{vb_name} has dtype {v_b.dtype} but {va_name} has {v_a.dtype}; "
                             f"the two states must share one dtype.")
    policy.check_same_device(entry, v_a.device, **{vb_name: v_b})


# ---------------------------------------------------------------- the two implementations

def _merge_torch(v: torch.Tensor, s: torch.Tensor):
    """v `[rows, N, H, D]`, s `[rows, N, H]` -> fp32 (v `[rows, H, D]`, s `[rows, H]`); the kernels' math."""
    if s.shape[1] == 0:
        return (v.new_zeros(v.shape[0], *v.shape[2:], dtype=torch.float32),
                s.new_full((s.shape[0], s.shape[2]), NEG_INF))
    s_max = s.amax(dim=1)  # NaN propagates: a NaN state makes its row NaN, never an empty one
    empty = s_max == NEG_INF
    shift = s_max.masked_fill(empty, 0.0)  # all-empty rows: exp2(-inf - 0) = 0, not NaN
    weight = torch.exp2(s - shift[:, None])
    # An empty state (weight 0) is never multiplied in: its v may hold anything (a NaN weight reaches the row
    # through the total).
    weighted = torch.where(weight[..., None] > 0, v.float() * weight[..., None], 0.0).sum(dim=1)
    total = weight.sum(dim=1)
    safe_total = torch.where(empty, 1.0, total)  # all states empty: weighted is 0, so v = 0 and s = -inf
    return weighted / safe_total[..., None], torch.where(empty, NEG_INF, shift + torch.log2(safe_total))


def _merge_two(backend: str, v_a, s_a, v_b, s_b, v_out, s_out, keep=None) -> None:
    """Writes merge(a, b) into v_out/s_out (which may be v_a/s_a); keep: uint8 `[rows]` or None."""
    if backend == "triton":
        from .kernels import merge as merge_kernel  # Triton is imported only when its kernels run
        merge_kernel.merge_two(v_a, s_a, v_b, s_b, v_out, s_out, keep)
        return
    v, s = _merge_torch(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))
    if keep is None:
        v_out.copy_(v)
        s_out.copy_(s)
        return
    rows = keep.bool()  # only these rows are written: the others keep their bits (a NaN's payload included)
    v_out[rows] = v[rows].to(v_out.dtype)
    s_out[rows] = s[rows]


# ---------------------------------------------------------------- merge entry points

def merge_state(v_a, s_a, v_b, s_b, *, backend: str = "auto"):
    """Merges two states: v `[seq_len, num_heads, head_dim]` (fp16/bf16/fp32), s `[seq_len, num_heads]`
    float32 base-2 LSE -> (v_merged in v's dtype, s_merged float32)."""
    entry = "merge_state"
    _check_pair(entry, ("v_a", "s_a", "v_b", "s_b"), v_a, s_a, v_b, s_b)
    chosen = backends.resolve(entry, backend, v_a.device)
    v_merged = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    s_merged = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    _merge_two(chosen, v_a, s_a, v_b, s_b, v_merged, s_merged)
    return v_merged, s_merged


def merge_state_in_place(v, s, v_other, s_other, mask: Optional[torch.Tensor] = None, *,
                         backend: str = "auto") -> None:
    """(v, s) <- merge((v, s), (v_other, s_other)); with a bool/uint8 `mask` `[seq_len]`, only rows where it
    is true (nonzero) change."""
    entry = "merge_state_in_place"
    _check_pair(entry, ("v", "s", "v_other", "s_other"), v, s, v_other, s_other)
    # v and s are written row by row while v_other and s_other are read: another view of the same memory would
    # read rows already merged (the very same view, a state merged with itself, reads each row before writing it)
    for out_name, out in (("v", v), ("s", s)):
        if any(stride == 0 and size > 1 for stride, size in zip(out.stride(), out.shape)):
            policy.refuse(entry, f"{out_name} is an expanded view (a zero stride); it is written in place, so each "
                                 f"row must have memory of its own.")
        for in_name, t in (("v_other", v_other), ("s_other", s_other)):
            same_view = t.data_ptr() == out.data_ptr() and t.stride() == out.stride() and t.shape == out.shape
            if not same_view and policy.overlaps(out, t):
                policy.refuse(entry, f"{in_name} overlaps {out_name}, which is written in place; pass them in "
                                     f"separate memory.")
    keep = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (v.shape[0],):
            policy.refuse(entry, f"mask has shape {_shape_of(mask)}; expected ({v.shape[0]},), one flag per row.")
        if mask.dtype not in (torch.bool, torch.uint8):
            policy.refuse(entry, f"mask has dtype {mask.dtype}; it must be bool or uint8.")
        policy.check_same_device(entry, v.device, mask=mask)
        # same bytes: the kernel reads one byte per row either way, at unit stride (a strided view is copied)
        keep = mask.contiguous().view(torch.uint8)
    chosen = backends.resolve(entry, backend, v.device)
    _merge_two(chosen, v, s, v_other, s_other, v, s, keep)


def merge_states(v, s, *, backend: str = "auto"):
    """Merges num_states states per row in index order: v `[seq_len, num_states, num_heads, head_dim]`,
    s `[seq_len, num_states, num_heads]` float32 -> (v `[seq_len, num_heads, head_dim]`, s `[seq_len, num_heads]`)."""
    entry = "merge_states"
    _check_state(entry, "v", v, "s", s, 4)
    chosen = backends.resolve(entry, backend, v.device)
    rows, _, num_heads, head_dim = v.shape
    v_merged = torch.empty(rows, num_heads, head_dim, dtype=v.dtype, device=v.device)
    s_merged = torch.empty(rows, num_heads, dtype=torch.float32, device=v.device)
    if chosen == "triton":
        from .kernels import merge as merge_kernel
        merge_kernel.merge_many(v, s, v_merged, s_merged)
    else:
        merged_v, merged_s = _merge_torch(v, s)
        v_merged.copy_(merged_v)
        s_merged.copy_(merged_s)
    return v_merged, s_merged


# ---------------------------------------------------------------- multi-level cascade

_LEVEL_ARRAYS = ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr", "paged_kv_last_page_len")


def _check_graph_install(entry: str, level: BatchPrefillWithPagedKVCacheWrapper, plan):
    """The refusals that a level's commit would raise under use_cuda_graph=True, made up front: a level's
    commit overwrites its captured buffers, so every level must be known to pass before the first commits.
    Returns the buffers the commit writes (allocated here at a level's first plan; the torch backend's: the
    capacities its re-plans keep)."""
    return level.check_graph_plan(entry, plan)


class MultiLevelCascadeAttentionWrapper:
    """Attention over KV split into levels of one paged cache (FlashInfer's wrapper of the same name).

    Level i has its own qo_indptr and page table: query rows qo_indptr[i][j]:qo_indptr[i][j+1] attend to
    that level's j-th KV segment. Every level must cover the same query rows. Each level runs as a
    `BatchPrefillWithPagedKVCacheWrapper`; `causal` applies to the last level only (as in FlashInfer),
    where bottom-right alignment makes it equal to causal attention over the concatenated KV. A window
    (window_left >= 0) or RoPE over several levels is refused: each level would count positions from its own
    first key (FlashInfer's wrapper computes that silently).
    """
    _entry = "MultiLevelCascadeAttentionWrapper"

    def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None,
                 paged_kv_last_page_len_buf_arr=None, backend="auto"):
        entry = self._entry
        if not policy.is_int(num_levels) or num_levels < 1:
            policy.refuse(entry, f"num_levels={num_levels!r} must be a positive int.")
        policy.check_kv_layout(entry, kv_layout)
        policy.check_backend(entry, backend)
        if not isinstance(float_workspace_buffer, torch.Tensor):
            policy.refuse(entry, "float_workspace_buffer must be a torch.Tensor.")
        policy.check_graph_backend(entry, backend, use_cuda_graph, float_workspace_buffer.device)
        buf_arrs = dict(qo_indptr_buf_arr=qo_indptr_buf_arr, paged_kv_indptr_buf_arr=paged_kv_indptr_buf_arr,
                        paged_kv_indices_buf_arr=paged_kv_indices_buf_arr,
                        paged_kv_last_page_len_buf_arr=paged_kv_last_page_len_buf_arr)
        for name, arr in buf_arrs.items():
            if arr is not None and (not isinstance(arr, (list, tuple)) or len(arr) != num_levels):
                got = f"{len(arr)} entries" if isinstance(arr, (list, tuple)) else type(arr).__name__
                policy.refuse(entry, f"{name} has {got} for num_levels={num_levels}; pass one buffer per level.")
        workspaces = [float_workspace_buffer] * num_levels
        if use_cuda_graph and float_workspace_buffer.dtype == torch.uint8:
            # Under CUDA graphs each level gets its own 256-byte aligned slice, whose size sets the capacity of the
            # work list the level keeps in a buffer of its own (prefill._graph_work_ints), as it did when work
            # lists lived in the workspace.
            chunk = float_workspace_buffer.numel() // num_levels // 256 * 256
            workspaces = [float_workspace_buffer[i * chunk:(i + 1) * chunk] for i in range(num_levels)]
        self._levels = [
            BatchPrefillWithPagedKVCacheWrapper(
                workspaces[i], kv_layout, use_cuda_graph,
                **{key: None if arr is None else arr[i] for key, arr in zip(
                    ("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf"),
                    buf_arrs.values())},
                backend=backend)
            for i in range(num_levels)]
        for level in self._levels:  # a level's run() refusal names this wrapper's run, the entry the caller used
            level._entry = entry
        self._num_levels = num_levels
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._backend_request = backend
        self._device = float_workspace_buffer.device
        self._planned = False
        # Plan-time intermediates (a level's out/lse, the merged lse when the caller keeps none), so that
        # run() allocates nothing when given out/lse, and a captured graph keeps reading the same memory.
        self._level_out: Optional[torch.Tensor] = None
        self._level_lse: Optional[torch.Tensor] = None
        self._merged_lse: Optional[torch.Tensor] = None
        self._total_q = 0
        self.backend = None
        self.backend_fallback_reason = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffers=None) -> None:
        """FlashInfer's: every level's next plan() works in this buffer (int_workspace_buffers are taken and not
        used). The plan is dropped: plan() again before run()."""
        check_workspace_reset(self._entry + ".reset_workspace_buffer", float_workspace_buffer,
                              self._use_cuda_graph)
        for level in self._levels:
            level.reset_workspace_buffer(float_workspace_buffer)
        self._device = float_workspace_buffer.device
        self._planned = False

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim, page_size, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None, **unsupported_kwargs):
        """One plan for all levels: the four *_arr arguments are lists with one tensor per level. Every
        level is validated before any is installed; a plan() that raises leaves the previous plan running."""
        entry = self._entry + ".plan"
        policy.extra_kwargs(entry, unsupported_kwargs)
        arrays = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
        for name, arr in zip(_LEVEL_ARRAYS, arrays):
            if not isinstance(arr, (list, tuple)) or len(arr) != self._num_levels:
                got = f"{len(arr)} entries" if isinstance(arr, (list, tuple)) else f"a {type(arr).__name__}"
                policy.refuse(entry, f"{name} has {got} but the wrapper was built with num_levels="
                                     f"{self._num_levels}; pass a list with one tensor per level.")
        if self._num_levels > 1:
            # a level sees only its own keys: a window or RoPE positions would count from the level's first key,
            # not the concatenated KV's (FlashInfer's wrapper computes that silently)
            if policy.is_int(window_left) and window_left >= 0:
                policy.unsupported(entry, f"window_left={window_left} with num_levels={self._num_levels} is not "
                                          f"served: each level would measure the window from its own keys, not "
                                          f"the concatenated KV's; use one level (a paged prefill over the whole "
                                          f"KV) or window_left=-1.")
            if pos_encoding_mode == "ROPE_LLAMA":
                policy.unsupported(entry, f"pos_encoding_mode='ROPE_LLAMA' with num_levels={self._num_levels} is "
                                          f"not served: each level would rotate by positions within its own keys, "
                                          f"not the concatenated KV's; apply RoPE to q and K before appending "
                                          f"(pos_encoding_mode='NONE').")
        # Every level is validated (and its schedule built) before any level is installed.
        last = self._num_levels - 1
        plans = [make_plan(
            f"{entry} (level {i})", paged=True, qo_indptr=qo_indptr_arr[i], kv_indptr=paged_kv_indptr_arr[i],
            kv_indices=paged_kv_indices_arr[i], last_page_len=paged_kv_last_page_len[i], page_size=page_size,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_vo=None,
            custom_mask=None, packed_custom_mask=None, causal=bool(causal) and i == last,
            pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=None, device=level.device,
            backend=self._backend_request, graph_tiles=self._use_cuda_graph)
            for i, level in enumerate(self._levels)]
        total_q = plans[0].total_q
        for i, plan in enumerate(plans):
            if plan.total_q != total_q:
                policy.refuse(entry, f"qo_indptr_arr[{i}][-1]={plan.total_q} but qo_indptr_arr[0][-1]={total_q}; "
                                     f"every level must cover the same query rows.")
        graph_bufs = [None] * self._num_levels
        if self._use_cuda_graph:
            graph_bufs = [_check_graph_install(f"{entry} (level {i})", level, plan)
                          for i, (level, plan) in enumerate(zip(self._levels, plans))]
        scratch = self._scratch_for(entry, plans[-1])
        # Nothing below raises: install every level (into the buffers checked above), then the intermediates.
        for level, plan, bufs in zip(self._levels, plans, graph_bufs):
            level._commit(plan, bufs)
        self._level_out, self._level_lse, self._merged_lse = scratch
        self._total_q = total_q
        self._planned = True
        self.backend = self._levels[-1].backend
        self.backend_fallback_reason = self._levels[-1].backend_fallback_reason

    def _scratch_for(self, entry: str, plan):
        """(level out, level lse, merged lse) for this plan: the current ones when they fit, else new."""
        if self._num_levels == 1:
            return None, None, None
        shape = (plan.total_q, plan.num_qo_heads, plan.head_dim)
        current = self._level_out
        if current is not None and current.shape[0] >= shape[0] and current.shape[1:] == shape[1:] \
                and current.dtype == plan.o_dtype and current.device == plan.device:
            return self._level_out, self._level_lse, self._merged_lse
        if self._use_cuda_graph and current is not None:
            policy.refuse(entry, f"under use_cuda_graph=True the re-plan needs intermediates of shape {shape} "
                                 f"({plan.o_dtype}) but the first plan sized them {tuple(current.shape)} "
                                 f"({current.dtype}); plan the largest batch first.")
        return (torch.empty(shape, dtype=plan.o_dtype, device=plan.device),
                torch.empty(shape[:2], dtype=torch.float32, device=plan.device),
                torch.empty(shape[:2], dtype=torch.float32, device=plan.device))

    def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None, out=None, lse=None, return_lse=False,
            **unsupported_kwargs):
        """q `[total_q, num_qo_heads, head_dim]` -> out (and the base-2 lse with return_lse=True)."""
        entry = self._entry + ".run"
        if unsupported_kwargs:
            policy.extra_kwargs(entry, unsupported_kwargs, "run() argument(s)")
        if not self._planned:
            policy.refuse(entry, "run() was called before plan().")
        k, _ = split_paged_cache(entry, paged_kv_cache, self._kv_layout)
        if k.dim() == 4:  # a malformed cache is refused by the first level's own checks
            for i, level in enumerate(self._levels):
                if level._plan.max_page >= k.shape[0]:
                    policy.refuse(entry, f"paged_kv_indices_arr[{i}] refers to page {level._plan.max_page}, "
                                         f"beyond the cache's {k.shape[0]} pages.")
        last = self._levels[-1]
        if self._num_levels > 1 and isinstance(out, torch.Tensor) and isinstance(q, torch.Tensor) and \
                policy.overlaps(out, q):
            policy.refuse(entry, "out overlaps q; with several levels the first level's output is written before "
                                 "the other levels read q, so out must be other memory.")
        if self._num_levels == 1:
            return last.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                            return_lse=return_lse)
        rows = self._total_q
        if lse is None:  # a returned lse is the caller's to keep: only an unreturned one lives in scratch
            lse = self._merged_lse[:rows] if not return_lse else None
        # The last level's own checks (q, cache, out, lse) hold for every level: they all run before any
        # launch, and the other levels differ only in page tables, checked above.
        out, lse = last.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                            return_lse=True)
        level_out, level_lse = self._level_out[:rows], self._level_lse[:rows]
        for level in self._levels[:-1]:  # fixed order: levels 0, 1, ... merged into the last level's state
            level.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, out=level_out, lse=level_lse,
                      return_lse=True)
            _merge_two(self.backend, out, lse, level_out, level_lse, out, lse)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

    # FlashInfer's deprecated names: begin_forward() for plan(), forward() for run(), end_forward() a no-op
    def begin_forward(self, *args, **kwargs):
        return self.plan(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.run(*args, **kwargs)

    forward_return_lse = functools.partialmethod(forward, return_lse=True)

    def end_forward(self) -> None:
        """FlashInfer's deprecated end_forward(): nothing to release."""
