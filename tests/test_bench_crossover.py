"""The crossover benchmark's plumbing on the CPU: the whole flow once with tiny shapes (Triton interpreter,
perf_counter, no graphs), the thresholds it derives, and the docs section it writes."""
import json
import os

import pytest

from serveattn.bench import common, crossover
from serveattn.bench.__main__ import FAMILIES, build_parser
from helpers import script_module

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRETED, reason="the CPU dry run needs TRITON_INTERPRET=1 set before triton is imported")
def test_cpu_dry_run_measures_every_pair_and_writes_its_section(tmp_path):
    doc = tmp_path / "routing.md"
    doc.write_text("# Routing\n\nkept\n\n<!-- crossover:cpu:begin -->\nold\n<!-- crossover:cpu:end -->\n\n"
                   "<!-- crossover:append -->\n")
    result = crossover.cpu_dry_run(["--routing-md", str(doc)])
    assert crossover.DEVICE == "cuda" and crossover.HKV == 8  # restored
    assert result["ok"], result["report"]
    by_pair = {}
    for p in result["points"]:
        by_pair.setdefault(p["pair"], []).append(p)
    assert set(by_pair) == set(crossover.PAIRS)
    (pre,) = by_pair["prefill-cudnn"]  # cuDNN needs CUDA: declined with the route's sentence, ours still timed
    assert pre["status"] == "declined" and "cudnn: the cuDNN route runs on CUDA tensors only" in pre["reason"]
    assert pre["triton_ms"] > 0 and pre.get("ratio") is None
    for p in by_pair["decode-tc"] + by_pair["decode-split"]:  # one KV head on 2 "SMs": both batches split
        assert p["status"] == "ok", p
        assert p["diff"] < crossover.TOL and p["ratio"] > 0 and p["programs_per_sm"] == p["batch"] / 2
    assert set(result["derived"]["decode_tc_min_programs_per_sm"]) == {"('bfloat16', 64, 2)"}
    assert result["derived"]["cudnn_min_rows"] == {}  # a declined point leaves its config unmeasured

    text = doc.read_text()
    assert text.startswith("# Routing\n\nkept\n") and "\nold\n" not in text and text.count("crossover:cpu:begin") == 1
    for name in ("#### Table cpu-prefill-cudnn", "#### Table cpu-decode-tc", "#### Table cpu-decode-split",
                 "ratio bandwidth/tensor-core", "decode_tc_min_programs_per_sm={", "<!-- crossover:append -->"):
        assert name in text, name
    assert result["written"] == str(doc)
    common.write_json(str(tmp_path / "x.json"), {"families": {"crossover": {k: v for k, v in result.items()
                                                                             if k != "report"}}})
    back = json.loads((tmp_path / "x.json").read_text())["families"]["crossover"]
    assert len(back["points"]) == len(result["points"])


@pytest.mark.skipif(not INTERPRETED, reason="the CPU dry run needs TRITON_INTERPRET=1 set before triton is imported")
def test_cpu_dry_run_measures_an_fp8_cache_in_a_table_of_its_own(tmp_path):
    """--dtypes float8_e4m3fn: the decode pairs read an e4m3 cache under a bf16 query (the prefill pair skips it);
    its points key the derived entry by the KV dtype and fill table <arch>-decode-tc-fp8, the name routing's
    reasons give for an fp8 key (ArchTable.decode_table_for)."""
    doc = tmp_path / "routing.md"
    result = crossover.cpu_dry_run(["--routing-md", str(doc), "--pairs", "decode-tc,prefill-cudnn",
                                    "--dtypes", "bfloat16,float8_e4m3fn"])
    assert result["ok"], result["report"]
    fp8 = [p for p in result["points"] if p["dtype"] == "float8_e4m3fn"]
    assert fp8 and all(p["pair"] == "decode-tc" and p["status"] == "ok" and p["diff"] < crossover.TOL for p in fp8)
    assert set(result["derived"]["decode_tc_min_programs_per_sm"]) == {"('bfloat16', 64, 2)",
                                                                        "('float8_e4m3fn', 64, 2)"}
    text = doc.read_text()
    assert "#### Table cpu-decode-tc\n" in text and "#### Table cpu-decode-tc-fp8\n" in text
    fp8_table = text.split("#### Table cpu-decode-tc-fp8")[1].split("####")[0]
    assert "| float8_e4m3fn |" in fp8_table and "| bfloat16 |" not in fp8_table
    assert "| float8_e4m3fn |" not in text.split("#### Table cpu-decode-tc\n")[1].split("####")[0]


def _pt(pair, ratio, status="ok", **kw):
    return dict(pair=pair, ratio=ratio, status=status, **kw)


def test_derive_cudnn_takes_the_longest_run_of_lengths_cudnn_won_at_every_batch():
    key = dict(dtype="bfloat16", head_dim=128, group=4, causal=True)
    pts = [_pt("prefill-cudnn", r, qo_len=s, batch=b, **key)
           for s, b, r in ((512, 1, 1.2), (1024, 1, 0.9), (1024, 8, 1.01), (2048, 1, 0.8), (2048, 8, 0.7),
                           (4096, 1, 0.8))]
    assert crossover.derive_cudnn(pts) == {("bfloat16", 128, 4, True): (2048, None)}
    # won at the short lengths, lost from 4096 on (the host-bound eager case): a range with an upper end
    short = [_pt("prefill-cudnn", r, qo_len=s, batch=1, **key)
             for s, r in ((512, 0.3), (1024, 0.4), (2048, 0.9), (4096, 1.09), (8192, 1.07))]
    assert crossover.derive_cudnn(short) == {("bfloat16", 128, 4, True): (512, 4096)}
    # two runs: the longer one (512-1024 against 4096 alone)
    two = [_pt("prefill-cudnn", r, qo_len=s, batch=1, **key)
           for s, r in ((512, 0.3), (1024, 0.4), (2048, 1.1), (4096, 0.9), (8192, 1.2))]
    assert crossover.derive_cudnn(two) == {("bfloat16", 128, 4, True): (512, 2048)}
    never = [_pt("prefill-cudnn", 1.1, qo_len=s, batch=1, **dict(key, group=8)) for s in (1024, 4096)]
    assert crossover.derive_cudnn(never)[("bfloat16", 128, 8, True)] == (None, None)
    gap = [_pt("prefill-cudnn", 0.8, qo_len=1024, batch=1, **key),
           _pt("prefill-cudnn", None, "failed", qo_len=2048, batch=1, **key)]
    assert crossover.derive_cudnn(gap) == {}  # a failed point: the config stays unmeasured


def test_derive_decode_takes_the_smallest_load_from_which_tensor_cores_never_lost():
    key = dict(dtype="bfloat16", head_dim=128, group=4)
    pts = [_pt("decode-tc", r, programs_per_sm=x, batch=0, kv_len=0, **key)
           for x, r in ((0.06, 0.22), (0.48, 0.68), (0.97, 0.96), (1.94, 1.06), (3.88, 1.0), (7.76, 1.01))]
    assert crossover.derive_decode(pts) == {("bfloat16", 128, 4): 1.94}
    dip = pts + [_pt("decode-tc", 0.99, programs_per_sm=7.76, batch=0, kv_len=0, **key)]
    assert crossover.derive_decode(dip) == {("bfloat16", 128, 4): None}
    literal = crossover.table_literal((9, 0), "H200", {("bfloat16", 128, 4, True): (2048, 8192),
                                                       ("bfloat16", 128, 8, True): (512, None)},
                                      {("bfloat16", 128, 4): 1.94})
    assert "(9, 0): ArchTable(" in literal and "('bfloat16', 128, 4, True): 2048," in literal
    assert "cudnn_max_rows={\n            ('bfloat16', 128, 4, True): 8192,\n        }," in literal
    assert "# docs/routing.md, table sm90-decode-tc" in literal and "('bfloat16', 128, 4): 1.94," in literal


def test_slower_routes_lists_where_the_derived_table_loses():
    """The points where the derived table takes the slower route (ties aside), worst first: prefill keyed on length
    only (a batch of eight where cuDNN won outside its range, one request where ours won inside it), decode on a
    minimum programs per SM (one long request the tensor-core route won below every threshold)."""
    pre = dict(dtype="bfloat16", head_dim=128, group=4, causal=True)
    pts = [_pt("prefill-cudnn", r, qo_len=s, batch=b, **pre)
           for s, b, r in ((512, 1, 0.8), (512, 8, 0.7), (1024, 1, 1.1), (1024, 8, 0.9), (2048, 1, 1.0),
                           (2048, 8, 0.8))]
    dec = dict(dtype="bfloat16", head_dim=128, group=8)
    pts += [_pt("decode-tc", r, programs_per_sm=x, batch=b, kv_len=n, **dec)
            for x, b, n, r in ((0.06, 1, 16384, 1.4), (0.48, 8, 16384, 0.7), (3.88, 64, 1024, 0.99))]
    cudnn, decode = crossover.derive_cudnn(pts), crossover.derive_decode(pts)
    assert cudnn == {("bfloat16", 128, 4, True): (512, 1024)} and decode == {("bfloat16", 128, 8): None}
    slower = crossover.slower_routes(pts, cudnn, decode)
    assert [(m["pair"], m["batch"], m["length"], m["taken"], round(m["slower"], 3)) for m in slower] == [
        ("decode-tc", 1, 16384, "bandwidth", 1.4), ("prefill-cudnn", 8, 2048, "triton", 1.25),
        ("prefill-cudnn", 8, 1024, "triton", 1.111)]  # 2048 x 1 is a tie: not listed
    text = "".join(crossover.slower_lines(slower, most=2))
    assert "3 measured point(s)" in text and "the 2 worst" in text
    assert "decode-tc bfloat16 g8 1x16384: bandwidth taken, 1.40x" in text
    assert "faster route at every measured point" in crossover.slower_lines([])[0]


def test_command_line():
    assert "crossover" in FAMILIES
    args = build_parser().parse_args(["crossover", "--quick", "--pairs", "decode-tc", "--no-write"])
    assert crossover._list(args, "decode_batches", int) == [1, 8, 32, 128] and args.no_write
    pts = crossover._points(args, "decode-tc", 132)
    assert [p["batch"] for p in pts] == [1, 8, 32, 128] and pts[2]["programs_per_sm"] == 32 * 8 / 132
    full = build_parser().parse_args(["crossover"])
    pre = crossover._points(full, "prefill-cudnn", 132)
    assert all(p["batch"] * p["qo_len"] <= crossover.MAX_PREFILL_TOKENS for p in pre) and len(pre) == 60


def test_compare_decode_long_lines_the_settings_up(tmp_path):
    """scripts/compare_decode_long.py (probe-decode-long's summary): a row a point, a column a setting, the best
    setting and its gain on the first; a point one run lacks, or a run's missing JSON, reads '-'."""
    compare = script_module("compare_decode_long")

    def run(name, ratios):
        pts = [dict(pair="decode-tc", dtype="bfloat16", head_dim=128, group=8, batch=1, kv_len=n, status="ok",
                    ratio=r, **{"tensor-core_ms": 0.04}) for n, r in ratios]
        (tmp_path / name).write_text(json.dumps({"families": {"crossover": {"points": pts}}}))
        return str(tmp_path / name)
    runs = [run("a.json", [(8192, 1.0), (16384, 1.4)]), run("b.json", [(16384, 0.7)]), str(tmp_path / "gone.json")]
    text = compare.table(["-", "SERVEATTN_DECODE_MAX_SLOTS=32", "X=1"], [compare.points_of(p) for p in runs])
    rows = text.splitlines()
    assert rows[0].startswith("| KV dtype |") and "today: bandwidth / tc" in rows[0] and len(rows) == 4
    assert rows[2] == "| bfloat16 | 8 | 1x8192 | 0.0400 | 1.000 | - | - | today | 1.00x |"
    assert rows[3] == "| bfloat16 | 8 | 1x16384 | 0.0400 | 1.400 | 0.700 | - | SERVEATTN_DECODE_MAX_SLOTS=32 | 2.00x |"


def test_compare_prefill_grid_pairs_the_runs(tmp_path):
    """scripts/compare_prefill_grid.py (probe-ws-balance's summary): a row a point of the first run, our times off
    and on, on / off, cuDNN over ours in each; a point the second run lacks reads '-'."""
    compare = script_module("compare_prefill_grid")

    def run(name, points):
        pts = [dict(pair="prefill-cudnn", dtype="bfloat16", head_dim=128, group=1, causal=True, batch=b, qo_len=2048,
                    status="ok", triton_ms=t, cudnn_ms=0.15, ratio=0.15 / t) for b, t in points]
        pts.append(dict(pair="prefill-cudnn", dtype="bfloat16", head_dim=256, group=1, causal=True, batch=1,
                        qo_len=512, status="declined", triton_ms=0.01, ratio=None))  # cuDNN declined: ours timed
        (tmp_path / name).write_text(json.dumps({"families": {"crossover": {"points": pts}}}))
        return str(tmp_path / name)
    rows = compare.table(compare.points_of(run("off.json", [(1, 0.03), (8, 0.2)])),
                         compare.points_of(run("on.json", [(8, 0.125)]))).splitlines()
    assert rows[0].startswith("| dtype | head dim | group |") and len(rows) == 5
    assert rows[2] == "| bfloat16 | 128 | 1 | True | 1x2048 | 0.0300 | - | - | 5.00 | - |"
    assert rows[3] == "| bfloat16 | 128 | 1 | True | 8x2048 | 0.2000 | 0.1250 | 0.625 | 0.75 | 1.20 |"
    assert rows[4] == "| bfloat16 | 256 | 1 | True | 1x512 | 0.0100 | 0.0100 | 1.000 | - | - |"
