"""The warp-specialized prefill kernel's persistent grid (kernels/attention_ws.persistent_programs): the host's
model of the kernel's static deal, the cost of a work item, and the grid it picks. CPU only: the deal is the
kernel's arithmetic (_task, _num_rounds) replayed here; tests/test_prefill_ws_gpu.py runs a balanced plan."""
import numpy as np
import pytest

from serveattn.prefill import build_work, item_costs

attention_ws = pytest.importorskip("serveattn.kernels.attention_ws")


def _deal_by_the_kernel(task_costs, programs):
    """Each program's load, task by task as the kernel takes them: _num_rounds rounds, round r's task _task(r)."""
    num_tasks, loads = len(task_costs), np.zeros(programs)
    full, rem = divmod(num_tasks, programs)
    for p in range(programs):
        last = p < rem if full % 2 == 0 else p >= programs - rem
        for r in range(full + int(last)):
            t = r * programs + (p if r % 2 == 0 else programs - 1 - p)
            loads[p] += task_costs[t]
    return loads


@pytest.mark.parametrize("seed", range(6))
def test_program_loads_is_the_kernels_deal(seed):
    rng = np.random.default_rng(seed)
    costs = rng.integers(1, 40, int(rng.integers(1, 2000))).astype(np.float64)
    for programs in (1, 7, 128, 132):
        assert np.array_equal(attention_ws.program_loads(costs, programs), _deal_by_the_kernel(costs, programs))


def test_item_costs_count_the_key_blocks_a_tile_sees():
    """Causal bottom-right: a tile's last row decides its keys; a tile of group-interleaved rows ends at token
    (last row) // group; non-causal: every tile sees the whole KV. One more for the tile's q and output."""
    qo, kv = np.array([300, 2]), np.array([300, 1000])
    work, n = build_work(qo, kv, 4, 128, True)
    pairs = work.reshape(n, 2)
    costs = item_costs(work, qo, kv, 4, 128, 128, True)
    for (req, tile), cost in zip(pairs, costs):
        last_token = (min((tile + 1) * 128, qo[req] * 4) - 1) // 4
        keys = kv[req] - qo[req] + last_token + 1
        assert cost == -(-keys // 128) + 1
    assert list(costs[pairs[:, 0] == 1]) == [8 + 1]  # 2 rows x 4 heads in one tile: all 1000 keys
    assert set(item_costs(work, qo, kv, 4, 128, 128, False)) == {3 + 1, 8 + 1}


def _busiest_over_mean(qo, group, programs, num_kv_heads=8):
    work, _ = build_work(qo, qo, group, 128, True)
    tasks = np.repeat(item_costs(work, qo, qo, group, 128, 128, True), num_kv_heads)
    loads = attention_ws.program_loads(tasks, programs)
    return loads.max() / loads.mean(), tasks


def test_equal_causal_requests_get_a_grid_the_deal_balances():
    """Eight causal requests of 2048 tokens, group 1, 8 KV heads on 132 SMs: 1024 tasks whose costs repeat every
    128, so the 132-program snake loads its busiest program 1.68x the mean; 128 programs deal them evenly."""
    qo = np.full(8, 2048)
    before, tasks = _busiest_over_mean(qo, 1, 132)
    assert before > 1.6
    work, _ = build_work(qo, qo, 1, 128, True)
    programs = attention_ws.persistent_programs(item_costs(work, qo, qo, 1, 128, 128, True), 8, 132)
    assert programs == 128
    after, _ = _busiest_over_mean(qo, 1, programs)
    assert after < 1.05
    # the time the model gives (the busiest program) drops, though 4 SMs idle
    assert attention_ws.program_loads(tasks, 128).max() < 0.65 * attention_ws.program_loads(tasks, 132).max()


@pytest.mark.parametrize("qo, group", [(np.full(16, 2048), 4), (np.full(1, 4096), 4), (np.array([3000, 17]), 1)])
def test_a_balanced_or_small_plan_keeps_one_program_an_sm(qo, group):
    work, n = build_work(qo, qo, group, 128, True)
    programs = attention_ws.persistent_programs(item_costs(work, qo, qo, group, 128, 128, True), 8, 132)
    assert programs == min(132, n * 8)


def test_the_grid_never_loads_its_busiest_program_more():
    """Over random ragged batches: the chosen grid's busiest program carries no more than the SM count's, and a
    grid is never below the SM count by more than BALANCE_SPAN."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        batch, group = int(rng.integers(2, 33)), int(rng.choice([1, 4, 8]))
        qo = rng.integers(64, 4097, batch) if rng.random() < 0.5 else np.full(batch, int(rng.choice([512, 2048])))
        kv = qo + (rng.integers(0, 4096, batch) if rng.random() < 0.3 else 0)
        work, n = build_work(qo, kv, group, 128, True)
        costs = item_costs(work, qo, kv, group, 128, 128, True)
        programs = attention_ws.persistent_programs(costs, 8, 132)
        tasks = np.repeat(costs.astype(np.float64), 8)
        if tasks.size <= 132:
            assert programs == tasks.size
            continue
        assert 132 - attention_ws.BALANCE_SPAN <= programs <= 132
        assert attention_ws.program_loads(tasks, programs).max() <= attention_ws.program_loads(tasks, 132).max()


def test_past_the_search_rounds_aligned_grids_are_tried():
    """19 requests of 4096 tokens, group 1: 4864 tasks, past SEARCH_ROUNDS x 132, so only grids whose rounds hold
    whole halves of a request are tried (128: a request's 256 tasks in two rounds, each tile met by its mirror);
    told nothing of the requests, the plan keeps 132."""
    qo = np.full(19, 4096)
    work, n = build_work(qo, qo, 1, 128, True)
    costs = item_costs(work, qo, qo, 1, 128, 128, True)
    assert n * 8 > attention_ws.SEARCH_ROUNDS * 132
    assert attention_ws.persistent_programs(costs, 8, 132, n // 19) == 128
    assert attention_ws.persistent_programs(costs, 8, 132, None) == 132
    tasks = np.repeat(costs, 8)
    assert attention_ws.program_loads(tasks, 128).max() < 0.8 * attention_ws.program_loads(tasks, 132).max()


def test_deal_model_script_recovers_a_fit(tmp_path):
    """scripts/deal_model.py (the model against a crossover run): times made by the model itself (2 us a block +
    7 us) come back as that fit with no error, and a balanced grid never reads slower than the SM count's."""
    import json
    from helpers import script_module
    model = script_module("deal_model")
    points = [dict(pair="prefill-cudnn", causal=True, group=g, batch=b, qo_len=n, cudnn_ms=0.1,
                   triton_ms=2e-3 * model.busiest(b, n, g, 0.0, 132, False) + 7e-3)
              for g in (1, 4) for b in (1, 8) for n in (512, 2048)]
    (tmp_path / "x.json").write_text(json.dumps({"families": {"crossover": {"points": points}}}))
    a, b, rows = model.fit(model.points_of(str(tmp_path / "x.json")), 0.0, 132)
    assert abs(a - 2e-3) < 1e-9 and abs(b - 7e-3) < 1e-9
    assert all(abs(m - p["triton_ms"]) < 1e-9 and balanced <= m + 1e-12 for p, m, balanced in rows)


def test_grid_candidates_let_a_plan_skip_its_item_costs():
    """grid_candidates: the grids persistent_programs would try; none past SEARCH_ROUNDS rounds of a ragged batch (or
    of equal requests with no aligned grid in the span), so the plan skips computing item costs there."""
    sms = 132
    assert attention_ws.grid_candidates(100, 8, sms) == []  # one round or less: every task its own program
    assert attention_ws.grid_candidates(1024, 8, sms) == [131, 130, 129, 128]  # 8 rounds: every grid in the span
    assert attention_ws.grid_candidates(1024, 8, sms, 16) == [128, 131, 130, 129]  # 16 items x 8 heads: 128 first
    many = attention_ws.SEARCH_ROUNDS * sms + 1
    assert attention_ws.grid_candidates(many, 8, sms) == []
    assert attention_ws.grid_candidates(many, 8, sms, 16) == [128]
    assert attention_ws.grid_candidates(many, 8, sms, 19) == []
    costs = np.ones(many // 8 + 1, dtype=np.int64)
    assert attention_ws.persistent_programs(costs, 8, sms) == sms


@pytest.mark.parametrize("batch,qo_len,kv_len,group,causal", [
    (8, 2048, 2048, 1, True), (16, 2048, 2048, 4, True), (16, 512, 512, 8, True), (64, 512, 512, 4, True),
    (5, 300, 900, 4, True), (12, 1000, 1000, 2, False)])
def test_equal_batches_take_the_general_grid(batch, qo_len, kv_len, group, causal):
    """make_plan's shortcut for batches of equal requests (prefill._equal_batch_programs, kept per shape) picks the
    grid the general search picks from the batch's own work list and item costs."""
    from serveattn.prefill import _equal_batch_programs
    hkv, sms, block_m, block_n = 32 // group, 132, 128, 128
    qo, kv = np.full(batch, qo_len), np.full(batch, kv_len)
    work, n = build_work(qo, kv, group, block_m, causal)
    candidates = attention_ws.grid_candidates(n * hkv, hkv, sms, n // batch)
    general = attention_ws.persistent_programs(item_costs(work, qo, kv, group, block_m, block_n, causal), hkv,
                                               sms, n // batch, candidates) if candidates else sms
    assert _equal_batch_programs(batch, qo_len, kv_len, group, block_m, block_n, causal, hkv, sms,
                                 tuple(candidates)) == general
