"""FlashInfer 0.7's workspace_size(...): the (float, int) workspace bytes a plan() with the same arguments needs.
Here the float workspace holds split-KV's partial states; a workspace of exactly the bytes returned gives plan() the
same split and run() the same bits as a large one, one byte less does not hold the split, and asking never touches
the wrapper's installed plan. Also FlashInfer 0.7's prewarm_paged_kv_stride_variant, a checked no-op here."""
import pytest
import torch

import serveattn
from helpers import make_paged_batch, nan_like
from serveattn import policy

BF16 = torch.bfloat16
HQ, HKV, D, PAGE = 8, 2, 64, 16


def _ws(device, nbytes=8 << 20):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _case(kind, device, seed):
    """(wrapper, plan args, plan kwargs, run(), the split rows of the installed plan)."""
    gen = torch.Generator().manual_seed(seed)
    decode = kind.startswith("decode")
    b = make_paged_batch(gen, qo_lens=[1, 0, 1] if not decode else [1, 1, 1], kv_lens=[900, 0, 77],
                         num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE, dtype=BF16, device=device)
    kw = dict(q_data_type=BF16, fixed_split_size=5)
    table = (b.kv_indptr, b.kv_indices, b.last_page_len)
    if decode:
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(_ws(device), use_tensor_cores=kind == "decode-tc",
                                                         backend="triton")
        args, q = (*table, HQ, HKV, D, PAGE), b.q.view(3, HQ, D)
    elif kind == "paged":
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(_ws(device), backend="triton")
        args, q = (b.qo_indptr, *table, HQ, HKV, D, PAGE), b.q
        kw["causal"] = True
    else:
        w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), backend="triton")
        kv_indptr = torch.tensor([0, 900, 900, 977], dtype=torch.int32, device=device)
        k, v = (torch.randn(977, HKV, D, generator=gen).to(device, BF16) for _ in range(2))
        args, q = (b.qo_indptr, kv_indptr, HQ, HKV, D), b.q
        kw["causal"] = True

    def rows():
        """The installed plan's split-KV partial rows (decode: a slot per chunk, one row each)."""
        if kind == "decode-tc":
            return w._prefill._plan.split_rows
        return w._plan.num_slots if kind == "decode" else w._plan.split_rows
    cache = (k, v) if kind == "ragged" else (b.cache,)

    def run():
        out = nan_like(q.shape, BF16, device)
        w.run(q, *cache, out=out)
        assert not out.isnan().any()
        return out
    return w, args, kw, run, rows


@pytest.mark.parametrize("kind", ["decode", "decode-tc", "paged", "ragged"])
def test_workspace_size_gives_the_plan_its_split(kind, device):
    w, args, kw, run, rows = _case(kind, device, seed=11)
    w.plan(*args, **kw)
    split_rows = rows()
    assert split_rows > 0  # 900 keys in chunks of 5 pages: the plan splits
    before, installed = run(), (w._plan, getattr(w, "_prefill", None))
    float_bytes, int_bytes = w.workspace_size(*args, **kw)
    assert (float_bytes, int_bytes) == (policy.split_state_bytes(split_rows, HQ, D), 0)
    assert (w._plan, getattr(w, "_prefill", None)) == installed  # asking installs nothing
    assert torch.equal(run(), before)
    w.reset_workspace_buffer(_ws(device, float_bytes), _ws(device, int_bytes))
    w.plan(*args, **kw)
    assert rows() == split_rows
    assert torch.equal(run(), before)
    # a byte less: fixed_split_size's chunks no longer fit, and the plan says so
    w.reset_workspace_buffer(_ws(device, float_bytes - 1), _ws(device, 0))
    with pytest.raises(ValueError, match=f"holds {float_bytes - 1} bytes"):
        w.plan(*args, **kw)


@pytest.mark.parametrize("kind", ["decode", "paged"])
def test_workspace_size_without_fixed_split_size(kind, device):
    """The planner's own split: the bytes it takes with room unbounded; a smaller workspace plans unsplit."""
    w, args, kw, run, rows = _case(kind, device, seed=12)
    del kw["fixed_split_size"]
    float_bytes, _ = w.workspace_size(*args, **kw)
    w.reset_workspace_buffer(_ws(device, float_bytes), _ws(device, 0))
    w.plan(*args, **kw)
    assert float_bytes == policy.split_state_bytes(rows(), HQ, D)
    split = run()
    w.reset_workspace_buffer(_ws(device, 0), _ws(device, 0))
    w.plan(*args, **kw)
    assert rows() == 0
    unsplit = run()
    assert float_bytes > 0  # one long request among few: the planner splits it
    torch.testing.assert_close(split, unsplit, rtol=1e-2, atol=1e-2)  # they differ only in rounding


def test_workspace_size_of_an_unsplit_plan_is_zero(device):
    w, args, kw, _, _ = _case("decode", device, seed=13)
    assert w.workspace_size(*args, **{**kw, "fixed_split_size": None, "disable_split_kv": True}) == (0, 0)


def test_workspace_size_refusals(device):
    w, args, kw, _, _ = _case("decode", device, seed=14)
    bad = (*args[:3], 5, *args[4:])
    with pytest.raises(ValueError, match="BatchDecodeWithPagedKVCacheWrapper.workspace_size: .*num_qo_heads=5"):
        w.workspace_size(*bad, **kw)
    bufs = [torch.zeros(n, dtype=torch.int32, device=device) for n in (9, 64, 8)]
    g = serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(_ws(device), *bufs)
    with pytest.raises(NotImplementedError, match="workspace_size is served without use_cuda_graph only"):
        g.workspace_size(*args, **kw)


def test_prewarm_paged_kv_stride_variant_is_checked_and_loads_nothing(device):
    """FlashInfer 0.7's FA2 prewarm before a graph capture: K and V strides are separate kernel arguments here."""
    w, args, kw, run, _ = _case("paged", device, seed=15)
    with pytest.raises(ValueError, match="prewarm_paged_kv_stride_variant\\(\\) was called before plan\\(\\)"):
        w.prewarm_paged_kv_stride_variant()
    w.plan(*args, **kw)
    with pytest.raises(ValueError, match="variant='shared': the only variant is 'independent'"):
        w.prewarm_paged_kv_stride_variant("shared")
    assert w.prewarm_paged_kv_stride_variant() is None
    run()
