"""bench.common.run_runners on the CPU: every pass times every ready runner once, each pass starting one runner
later than the one before (the first runner timed after the checks meets a cooler GPU; no runner may hold that
place in every pass), and the reported time is the mean of the pass medians."""
import torch

from serveattn.bench import common


def test_each_pass_starts_one_runner_later(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(common, "discard_first_timing", lambda ready, timing: None)
    order = []
    fake_ms = {"a": [1.0, 3.0, 2.0], "b": [4.0, 4.0, 4.0], "c": [5.0, 7.0, 6.0]}

    def bench_ms(fn, warmup_ms, rep_ms):
        key = fn()
        order.append(key)
        return fake_ms[key][sum(k == key for k in order) - 1]

    monkeypatch.setattr(common, "bench_ms", bench_ms)
    ref = torch.ones(4)

    def prepare(key):
        return common.Prepared(fns=[lambda: key], normalize=lambda out, meta: ref)

    case = {"name": "case", "runners": {}, "ours_ok": True, "reference": "ones"}
    bar = common.Progress(100, "test")
    try:
        common.run_runners(case, ["a", "b", "c"], prepare, titles={"a": "A", "b": "B", "c": "C"}, our_keys=["a"],
                           meta=None, ref=ref, tol=0.1, timing=common.Timing(1, 1, passes=3, sets=1), bar=bar,
                           first_call_label="first call", measure=lambda key, r, b2b: "")
    finally:
        bar.close()
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert case["ours_ok"]
    assert case["runners"]["a"]["ms_runs"] == [1.0, 3.0, 2.0] and case["runners"]["a"]["ms"] == 2.0
    assert case["runners"]["c"]["spread"] == (7.0 - 5.0) / 6.0


def test_flush_option_picks_the_timing_loop(monkeypatch):
    """--flush: every family takes zero (do_bench, the default) or read; bench_ms follows common.FLUSH."""
    import pytest

    from serveattn.bench.__main__ import FAMILIES, build_parser

    for family in list(FAMILIES) + ["all"]:
        assert build_parser().parse_args([family]).flush == "zero"
        assert build_parser().parse_args([family, "--flush", "read"]).flush == "read"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--flush", "none"])
    monkeypatch.setattr(common, "raise_clocks", lambda: None)
    monkeypatch.setattr(common, "_bench_read_flush", lambda fn, warmup_ms, rep_ms: ("read", fn(), warmup_ms, rep_ms))
    monkeypatch.setattr(common, "FLUSH", "read")
    assert common.bench_ms(lambda: 7, 25, 100) == ("read", 7, 25, 100)
