"""Refusals of the speculative samplers and the tree-mask builder: argument types, seeds, vocab, devices."""
import pytest
import torch

import serveattn

B, N, V = 2, 3, 8
CHAIN, TREE = "chain_speculative_sampling", "tree_speculative_sampling"


def _args(device="cpu", vocab=V):
    g = torch.Generator().manual_seed(7)
    d = torch.rand(B, N, vocab, generator=g) + 0.1
    t = torch.rand(B, N + 1, vocab, generator=g) + 0.1
    d, t = d / d.sum(-1, keepdim=True), t / t.sum(-1, keepdim=True)
    ids = torch.randint(0, max(vocab, 1), (B, N), generator=g, dtype=torch.int32)
    return dict(draft_probs=d.to(device), draft_token_ids=ids.to(device), target_probs=t.to(device))


def _call(entry, args):
    if entry == TREE:
        args.setdefault("tree_parents", torch.tensor([[-1, 0, 0], [-1, -1, 1]]))
        return serveattn.tree_speculative_sampling(**args)
    return serveattn.chain_speculative_sampling(**args)


def _empty_vocab(a):
    a.update(_args(vocab=0))  # V=0: the probability tensors hold no elements at all


SAMPLING_REFUSALS = [
    # (id, entry, change to the valid arguments, exception, sentence fragment)
    ("probs_list", CHAIN, lambda a: a.update(draft_probs=a["draft_probs"].tolist()), ValueError,
     r"^chain_speculative_sampling: draft_probs must be a float32 torch\.Tensor, got list\.$"),
    ("target_ndarray", TREE, lambda a: a.update(target_probs=a["target_probs"].numpy()), ValueError,
     r"^tree_speculative_sampling: target_probs must be a float32 torch\.Tensor, got ndarray\.$"),
    ("ids_list", CHAIN, lambda a: a.update(draft_token_ids=a["draft_token_ids"].tolist()), ValueError,
     r"^chain_speculative_sampling: draft_token_ids must be an int32 or int64 torch\.Tensor, got list\.$"),
    ("ids_ndarray", TREE, lambda a: a.update(draft_token_ids=a["draft_token_ids"].numpy()), ValueError,
     r"draft_token_ids must be an int32 or int64 torch\.Tensor, got ndarray\."),
    ("seed_float_tensor", CHAIN, lambda a: a.update(seed=torch.tensor([1.5])), ValueError,
     r"seed is a tensor of shape \(1,\) and dtype torch\.float32; expected a Python int or a one-element "
     r"integer tensor\."),
    # 2-D, so not FlashInfer's per-request form (that one is NotImplementedError)
    ("offset_2d_tensor", TREE, lambda a: a.update(seed=1, offset=torch.tensor([[3, 4], [5, 6]])), ValueError,
     r"offset is a tensor of shape \(2, 2\) and dtype torch\.int64; expected a Python int"),
    ("offset_without_seed", CHAIN, lambda a: a.update(offset=3), ValueError,
     r"^chain_speculative_sampling: offset=3 was given without a seed; pass seed as well \(or a generator\)\.$"),
    ("offset_without_seed_tree", TREE, lambda a: a.update(offset=torch.tensor(9)), ValueError,
     r"offset=9 was given without a seed"),
    ("generator_int", CHAIN, lambda a: a.update(generator=1234), ValueError,
     r"^chain_speculative_sampling: generator must be a torch\.Generator, got int\.$"),
    ("generator_str", TREE, lambda a: a.update(generator="cpu"), ValueError,
     r"generator must be a torch\.Generator, got str\."),
    ("vocab_zero", CHAIN, _empty_vocab, ValueError,
     r"^chain_speculative_sampling: draft_probs has vocab_size 0; at least 1 is needed\.$"),
    ("vocab_zero_tree", TREE, _empty_vocab, ValueError, r"draft_probs has vocab_size 0; at least 1 is needed\."),
]


@pytest.mark.parametrize("case", SAMPLING_REFUSALS, ids=[c[0] for c in SAMPLING_REFUSALS])
def test_sampling_refusals(case):
    _, entry, change, exc, match = case
    args = _args()
    change(args)
    with pytest.raises(exc, match=match):
        _call(entry, args)


# Device mismatches need two real devices: a meta tensor is refused earlier, as not dense (_check_dense runs
# before each device comparison), so these run only where CUDA is.
def _counter(a):
    a.update(maybe_output_accepted_token_num=torch.randint(1, 5, (B,), dtype=torch.int32, device="cuda"))


DEVICE_REFUSALS = [
    ("ids_on_cuda", CHAIN, lambda a: a.update(draft_token_ids=a["draft_token_ids"].cuda()),
     r"^chain_speculative_sampling: draft_token_ids is on cuda(:\d+)? but the probabilities are on cpu\.$"),
    ("counter_on_cuda", CHAIN, _counter,
     r"^chain_speculative_sampling: maybe_output_accepted_token_num is on cuda(:\d+)?; expected cpu\.$"),
    ("target_on_cuda", TREE, lambda a: a.update(target_probs=a["target_probs"].cuda()),
     r"^tree_speculative_sampling: target_probs is on cuda(:\d+)? but draft_probs is on cpu\.$"),
    ("tree_parents_on_cuda", TREE, lambda a: a.update(tree_parents=torch.tensor([[-1, 0, 0], [-1, -1, 1]]).cuda()),
     r"^tree_speculative_sampling: tree_parents is on cuda(:\d+)? but the probabilities are on cpu\.$"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DEVICE_REFUSALS, ids=[c[0] for c in DEVICE_REFUSALS])
def test_device_mismatch_refusals(case):
    _, entry, change, match = case
    args = _args()
    change(args)
    with pytest.raises(ValueError, match=match):
        _call(entry, args)


MASK_REFUSALS = [
    # (id, parents_list, prefix_lens, sentence fragment); all ValueError
    ("prefix_2d_tensor", [[-1, 0]], torch.tensor([[4]]),
     r"^tree_parents_to_mask: prefix_lens is a tensor of shape \(1, 1\) and dtype torch\.int64; expected a 1-D "
     r"integer tensor or a sequence of ints\.$"),
    ("parents_float_tensor", [torch.tensor([-1.0, 0.0])], [3],
     r"parents_list\[0\] is a tensor of shape \(2,\) and dtype torch\.float32; expected a 1-D integer tensor"),
    ("prefix_int", [[-1, 0]], 4, r"^tree_parents_to_mask: prefix_lens has type int; expected a sequence of ints\.$"),
    ("parents_none", [None], [2], r"parents_list\[0\] has type NoneType; expected a sequence of ints\."),
    ("prefix_float", [[-1, 0]], [0.5], r"^tree_parents_to_mask: prefix_lens holds 0\.5; expected ints\.$"),
    ("parents_bool", [[-1, True]], [2], r"parents_list\[0\] holds True; expected ints\."),
    ("parents_list_int", 7, [2],
     r"^tree_parents_to_mask: parents_list has type int; expected a sequence of parent arrays, one per "
     r"request\.$"),
]


@pytest.mark.parametrize("case", MASK_REFUSALS, ids=[c[0] for c in MASK_REFUSALS])
def test_tree_mask_refusals(case):
    _, parents_list, prefix_lens, match = case
    with pytest.raises(ValueError, match=match):
        serveattn.tree_parents_to_mask(parents_list, prefix_lens)


PLAN_TREE_REFUSALS = [
    # the decode plan's tree_parents reaches the same checks, its sentences naming tree_parents
    ("plan_tree_parents_int", 7,
     r"tree_parents has type int; expected a sequence of parent arrays, one per request\.$"),
    ("plan_tree_holds_float", [[-1, 0.5]], r"tree_parents\[0\] holds 0\.5; expected ints\.$"),
    ("plan_tree_float_tensor", [torch.tensor([-1.0, 0.0])],
     r"tree_parents\[0\] is a tensor of shape \(2,\) and dtype torch\.float32; expected a 1-D integer tensor"),
]


@pytest.mark.parametrize("case", PLAN_TREE_REFUSALS, ids=[c[0] for c in PLAN_TREE_REFUSALS])
def test_decode_plan_tree_parents_refusals(case):
    _, tree_parents, match = case
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 16, dtype=torch.uint8))
    i32 = torch.int32
    with pytest.raises(ValueError, match=r"^BatchDecodeWithPagedKVCacheWrapper\.plan: " + match):
        w.plan(torch.tensor([0, 1], dtype=i32), torch.tensor([0], dtype=i32), torch.tensor([5], dtype=i32),
               8, 2, 64, 16, q_data_type=torch.bfloat16, tree_parents=tree_parents)
