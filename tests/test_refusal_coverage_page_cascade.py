"""Refusals of page.py (append, index helpers) and cascade.py (merges, the cascade wrapper), each type and sentence."""
import pytest
import torch

import serveattn

I32 = torch.int32
HEADS, DIM, PAGE = 2, 64, 4


def _append_args(nnz=3, num_pages=3, dtype=torch.float16):
    """Valid append_paged_kv_cache arguments: one request owning all pages, its last page holding nnz tokens."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(num_pages, 2, PAGE, HEADS, DIM, generator=g).to(dtype)
    return dict(append_key=torch.randn(nnz, HEADS, DIM, generator=g).to(dtype),
                append_value=torch.randn(nnz, HEADS, DIM, generator=g).to(dtype),
                batch_indices=torch.zeros(nnz, dtype=I32),
                positions=torch.arange((num_pages - 1) * PAGE, (num_pages - 1) * PAGE + nnz, dtype=I32),
                paged_kv_cache=cache, kv_indices=torch.randperm(num_pages, generator=g).to(I32),
                kv_indptr=torch.tensor([0, num_pages], dtype=I32), kv_last_page_len=torch.tensor([nnz], dtype=I32))


def _head_dim_strided(cache):
    """The same cache values with head_dim not at unit stride (head_dim and page_size axes swapped in memory)."""
    return cache.transpose(2, 4).contiguous().transpose(2, 4)


APPEND_REFUSALS = [
    # (id, overrides of _append_args (a callable gets the valid arguments), sentence fragment)
    ("cache_tuple_of_three", lambda a: dict(paged_kv_cache=(a["paged_kv_cache"][:, 0],) * 3),
     r"paged_kv_cache as a tuple must be \(k_cache, v_cache\), two tensors; got 3 items "
     r"\(Tensor, Tensor, Tensor\)\."),
    ("cache_tuple_not_tensors", lambda a: dict(paged_kv_cache=(a["paged_kv_cache"][:, 0], None)),
     r"paged_kv_cache as a tuple must be \(k_cache, v_cache\), two tensors; got 2 items "
     r"\(Tensor, NoneType\)\."),
    ("cache_not_tensor", dict(paged_kv_cache={"k": 1}),
     r"paged_kv_cache must be a tensor or a \(k_cache, v_cache\) tuple, got dict\."),
    ("cache_head_dim_strided", lambda a: dict(paged_kv_cache=_head_dim_strided(a["paged_kv_cache"])),
     r"paged_kv_cache must have a contiguous head_dim \(strides \(.*\) and \(.*\) received\)\."),
    ("key_not_tensor", lambda a: dict(append_key=a["append_key"].tolist()),
     r"append_key must be a torch\.Tensor, got list\."),
    ("value_not_tensor", lambda a: dict(append_value=a["append_value"].numpy()),
     r"append_value must be a torch\.Tensor, got ndarray\."),
    ("value_token_count", lambda a: dict(append_value=a["append_value"][:2]),
     r"append_value has 2 tokens but append_key has 3\."),
    ("batch_indices_count", dict(batch_indices=torch.zeros(2, dtype=I32)),
     r"batch_indices has 2 entries for 3 appended tokens\."),
    ("positions_count", dict(positions=torch.tensor([8, 9, 10, 11], dtype=I32)),
     r"positions has 4 entries for 3 appended tokens\."),
    ("last_page_len_count", dict(kv_last_page_len=torch.tensor([3, 1], dtype=I32)),
     r"kv_last_page_len has 2 entries for a batch of 1 \(kv_indptr has 2\)\."),
    # every token below -1 or padding (none live); a one-request batch names its one request
    ("batch_indices_below_padding", dict(batch_indices=torch.tensor([-2, -1, -3], dtype=I32)),
     r"batch_indices holds -3; the one request is 0, and -1 marks padding\."),
    ("batch_indices_past_one_request", dict(batch_indices=torch.tensor([0, 1, 0], dtype=I32)),
     r"batch_indices holds 1; the one request is 0\."),
]


@pytest.mark.parametrize("case", APPEND_REFUSALS, ids=[c[0] for c in APPEND_REFUSALS])
def test_append_refusals(case):
    _, over, match = case
    args = _append_args()
    args.update(over(args) if callable(over) else over)
    with pytest.raises(ValueError, match=r"^append_paged_kv_cache: " + match):
        serveattn.append_paged_kv_cache(**args)


INDEX_REFUSALS = [
    # (id, function, arguments, sentence fragment)
    ("seq_lens_count", "get_batch_indices_positions",
     (torch.tensor([0, 2, 3], dtype=I32), torch.tensor([5], dtype=I32), 3),
     r"^get_batch_indices_positions: seq_lens has 1 entries for a batch of 2 \(append_indptr has 3\)\."),
    ("nnz_negative", "get_batch_indices_positions",
     (torch.tensor([0, 2], dtype=I32), torch.tensor([5], dtype=I32), -1),
     r"^get_batch_indices_positions: nnz=-1 must be an int >= 0\."),
    ("nnz_float", "get_batch_indices_positions",
     (torch.tensor([0, 2], dtype=I32), torch.tensor([5], dtype=I32), 2.0),
     r"^get_batch_indices_positions: nnz=2\.0 must be an int >= 0\."),
    ("nnz_bool", "get_batch_indices_positions",
     (torch.tensor([0, 1], dtype=I32), torch.tensor([5], dtype=I32), True),
     r"^get_batch_indices_positions: nnz=True must be an int >= 0\."),
    ("get_seq_lens_last_count", "get_seq_lens",
     (torch.tensor([0, 1, 3], dtype=I32), torch.tensor([2], dtype=I32), PAGE),
     r"^get_seq_lens: kv_last_page_len has 1 entries for a batch of 2 \(kv_indptr has 3\)\."),
]


@pytest.mark.parametrize("case", INDEX_REFUSALS, ids=[c[0] for c in INDEX_REFUSALS])
def test_index_helper_refusals(case):
    _, fn, args, match = case
    with pytest.raises(ValueError, match=match):
        getattr(serveattn, fn)(*args)


def _state(rows=3, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(rows, HEADS, DIM, generator=g).half().to(device),
            torch.randn(rows, HEADS, generator=g).to(device))


# An LSE on another device than its values. A "meta" tensor has a shape and dtype, so every earlier
# check passes and the device check is reached on the CPU.
MERGE_DEVICE_REFUSALS = [
    ("merge_state_s_a", "merge_state", lambda v, s: (v, s.to("meta"), v.clone(), s.clone()),
     r"^merge_state: s_a is on meta but v_a is on cpu\."),
    ("merge_state_s_b", "merge_state", lambda v, s: (v, s, v.clone(), s.to("meta")),
     r"^merge_state: s_b is on meta but v_b is on cpu\."),
    ("merge_state_in_place_s_other", "merge_state_in_place", lambda v, s: (v, s, v.clone(), s.to("meta")),
     r"^merge_state_in_place: s_other is on meta but v_other is on cpu\."),
    ("merge_states_s", "merge_states", lambda v, s: (v[:, None], s[:, None].to("meta")),
     r"^merge_states: s is on meta but v is on cpu\."),
]


@pytest.mark.parametrize("case", MERGE_DEVICE_REFUSALS, ids=[c[0] for c in MERGE_DEVICE_REFUSALS])
def test_merge_lse_on_another_device(case):
    _, fn, build, match = case
    with pytest.raises(ValueError, match=match):
        getattr(serveattn, fn)(*build(*_state()))


@pytest.mark.gpu
def test_merge_lse_on_cpu_values_on_cuda():
    """An LSE on another device than its values, with real devices."""
    v, s = _state(device="cuda")
    with pytest.raises(ValueError, match=r"^merge_state: s_a is on cpu but v_a is on cuda:0\."):
        serveattn.merge_state(v, s.cpu(), v.clone(), s.clone())


@pytest.mark.parametrize("workspace", [None, [0] * 64], ids=["none", "list"])
def test_cascade_workspace_must_be_a_tensor(workspace):
    with pytest.raises(ValueError, match=r"^MultiLevelCascadeAttentionWrapper: float_workspace_buffer must be a "
                                         r"torch\.Tensor\."):
        serveattn.MultiLevelCascadeAttentionWrapper(2, workspace)


def _two_levels(total_q, device):
    """Plan arguments of a 2-level cascade on `device`: one request of total_q rows over a shared page, then a page
    of its own."""
    qo = [torch.tensor([0, total_q], dtype=I32, device=device)] * 2
    indptr = [torch.tensor([0, 1], dtype=I32, device=device)] * 2
    indices = [torch.tensor([0], dtype=I32, device=device), torch.tensor([1], dtype=I32, device=device)]
    last = [torch.tensor([PAGE], dtype=I32, device=device), torch.tensor([3], dtype=I32, device=device)]
    return qo, indptr, indices, last, HEADS, HEADS, DIM, PAGE


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cascade_graph_replan_needs_larger_intermediates(backend, device):
    """Under use_cuda_graph=True the intermediates of the first plan are kept; a re-plan with more
    query rows is refused (on the CPU, plan() alone reaches it: no run, so no level pins its captured q rows).
    backend='triton' plans on the test device; 'torch' on the CPU (under CUDA graphs it is refused on CUDA)."""
    device = device if backend == "triton" else "cpu"
    w = serveattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 16, dtype=torch.uint8, device=device),
                                                    use_cuda_graph=True, backend=backend)
    w.plan(*_two_levels(2, device))
    w.plan(*_two_levels(1, device))  # fewer rows fit the first plan's intermediates
    with pytest.raises(ValueError, match=r"^MultiLevelCascadeAttentionWrapper\.plan: under use_cuda_graph=True the "
                                         r"re-plan needs intermediates of shape \(5, 2, 64\) \(torch\.float16\) but "
                                         r"the first plan sized them \(2, 2, 64\) \(torch\.float16\); plan the "
                                         r"largest batch first\."):
        w.plan(*_two_levels(5, device))
