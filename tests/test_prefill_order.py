"""SERVEATTN_PREFILL_ORDER: prefill_kernel's eager plans list every tile of the batch costliest first
(prefill.build_work's costliest_first) instead of request by request, where the batch's K/V bytes x group stay
under prefill.ORDER_COST_MAX_BYTES (=cost-small, the default), for every batch (=cost, measuring only), or never
(=""). The order moves no bit: each (request, tile) is computed whole by one program."""
import numpy as np
import pytest
import torch

import serveattn
from serveattn import reference
from serveattn.prefill import build_work
from helpers import check_lse, make_paged_batch, nan_like, rel_err, run_under_switch, tolerance


@pytest.mark.parametrize("causal", [True, False])
def test_by_cost_lists_the_same_tiles_costliest_first(causal):
    qo, kv = np.array([300, 0, 40, 129]), np.array([300, 7, 900, 129])
    today, n = build_work(qo, kv, 2, 64, causal)
    ordered, m = build_work(qo, kv, 2, 64, causal, costliest_first=True)
    pairs, by_cost = today.reshape(n, 2), ordered.reshape(m, 2)
    assert m == n and sorted(map(tuple, pairs)) == sorted(map(tuple, by_cost))
    req, tile = by_cost[:, 0], by_cost[:, 1]
    keys = kv[req] - (qo[req] - (np.minimum((tile + 1) * 64, qo[req] * 2) - 1) // 2 if causal else 0)
    assert np.all(np.diff(keys) <= 0)


def test_one_request_is_already_costliest_first():
    """make_plan skips the reorder for one request: build_work lists its tiles last to first, whose costs never
    rise, so the stable costliest-first sort is the identity (random shapes, causal or not, groups 1-8)."""
    from serveattn.prefill import costliest_first_order
    rng = np.random.default_rng(52)
    for _ in range(300):
        qo = np.array([int(rng.integers(0, 3000))])
        kv = qo + int(rng.integers(0, 5000))
        group, block_m = int(rng.choice([1, 2, 4, 8])), int(rng.choice([16, 64, 128]))
        for causal in (False, True):
            work, _ = build_work(qo, kv, group, block_m, causal)
            assert np.array_equal(costliest_first_order(work, qo, kv, group, block_m, causal), work)


def test_order_moves_no_bit(device, monkeypatch):
    """A paged causal batch (shuffled pages, a partial last page, an empty request) planned both ways: the same
    bits, every element written, the reference's result; the knob's plan lists its tiles costliest first."""
    gen = torch.Generator().manual_seed(91)
    qo_lens, kv_lens = [70, 0, 33, 130], [200, 5, 33, 260]
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    def planned(_order):
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8, device=device),
                                                          backend="triton")
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, causal=True,
               q_data_type=torch.bfloat16, disable_split_kv=True)
        return w
    results = run_under_switch(monkeypatch, "SERVEATTN_PREFILL_ORDER", ("", "cost"), planned, b.q, b.cache, device)
    (out, lse, w), (out_c, lse_c, w_c) = results[""], results["cost"]
    plan, plan_c = w._plan, w_c._plan
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert not torch.isnan(out).any()
    ref_out, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                             causal=True)
    assert rel_err(out, ref_out) < tolerance(torch.bfloat16)
    check_lse(lse, ref_lse)
    if device == "cpu":  # prefill_kernel's plan (the warp-specialized kernel keeps the request-by-request order)
        pairs = plan_c.work.cpu().numpy().reshape(-1, 2)
        last_tile_of_3 = pairs[pairs[:, 0] == 3, 1].max()  # request 3's last tile sees all 260 keys: the dearest
        assert tuple(pairs[0]) == (3, last_tile_of_3) and not torch.equal(plan.work.cpu(), plan_c.work.cpu())


def test_cost_small_orders_only_small_batches(device, monkeypatch):
    """=cost-small: a batch of 1506 keys (x 2 KV heads x 64 x 2 bytes, K and V: 771072 bytes, x group 2) is listed
    costliest first where that product is under prefill.ORDER_COST_MAX_BYTES and request by request where it is
    not, also with the switch unset (its default); the same bits either way (the order is checked on the CPU,
    where prefill_kernel plans the batch; on a GPU the warp-specialized kernel serves head dim 64 in its own order,
    and only the bits are compared)."""
    from serveattn import prefill
    gen = torch.Generator().manual_seed(92)
    qo_lens, kv_lens = [130, 0, 33, 70], [768, 5, 33, 700]  # requests 0 and 3 interleave by cost
    b = make_paged_batch(gen, qo_lens=qo_lens, kv_lens=kv_lens, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.bfloat16, device=device)
    product = 2 * sum(kv_lens) * 2 * 64 * 2 * 2

    def planned(order, bound: int):
        if order is None:
            monkeypatch.delenv("SERVEATTN_PREFILL_ORDER", raising=False)
        else:
            monkeypatch.setenv("SERVEATTN_PREFILL_ORDER", order)
        monkeypatch.setattr(prefill, "ORDER_COST_MAX_BYTES", bound)
        w = serveattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8, device=device),
                                                          backend="triton")
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, 4, 2, 64, 16, causal=True,
               q_data_type=torch.bfloat16, disable_split_kv=True)
        out = nan_like(b.q.shape, b.q.dtype, device)
        w.run(b.q, b.cache, out=out)
        assert not out.isnan().any()
        return out, None if w._plan.work is None else w._plan.work.cpu()

    default = prefill.ORDER_COST_MAX_BYTES
    (out, plain), (_, by_cost) = planned("", default), planned("cost", default)
    on_cpu = device == "cpu"
    assert not on_cpu or not torch.equal(plain, by_cost)
    for order, bound, want in (("cost-small", default, by_cost), ("cost-small", product + 1, by_cost),
                               ("cost-small", product, plain), (None, default, by_cost), (None, product, plain)):
        got_out, got = planned(order, bound)
        assert not on_cpu or torch.equal(got, want), (order, bound)
        assert torch.equal(got_out, out)
