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


def test_read_flush_and_back_to_back_loops_on_fake_events(monkeypatch):
    """The timing loops' plumbing on the CPU: CUDA events faked (each elapsed_time a fixed 0.5 ms), the flush
    buffer a CPU tensor. The read flush runs after_flush after every flush and returns the median; back to back
    divides its loop's time by its call count."""
    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 0.5

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(common, "_flush_buffer", [torch.ones(16, dtype=torch.int32)])
    calls, flushes = [], []
    ms = common._bench_read_flush(lambda: calls.append(1), 1.0, 4.0, after_flush=lambda: flushes.append(1))
    # the estimate: 0.5 ms over 5 repetitions, 0.1 each; then 1 ms / 0.1 of warm-up and 4 ms / 0.1 timed, each timed
    # call (and each estimating one) after a flush
    assert ms == 0.5 and len(calls) == 1 + 5 + 10 + 40 and len(flushes) == 5 + 40
    calls.clear()
    assert common.back_to_back_ms(lambda: calls.append(1), 1.0, 4.0) == 0.5 / 40
    assert len(calls) == 1 + 5 + 10 + 40
