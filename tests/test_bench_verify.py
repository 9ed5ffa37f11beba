"""The verify benchmark family's plumbing on the CPU: the whole flow once with tiny shapes (Triton interpreter,
perf_counter instead of do_bench, no graph capture), the tree generator, and the command line."""
import json
import os

import pytest

from serveattn.bench import common, verify
from serveattn.bench.__main__ import FAMILIES, build_parser

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRETED, reason="the CPU dry run needs TRITON_INTERPRET=1 set before triton is imported")
def test_cpu_dry_run_reports_every_case(tmp_path):
    result = verify.cpu_dry_run()
    assert verify.DEVICE == "cuda" and verify.HQ == 32 and verify.BACKEND == "auto"  # restored
    assert result["ok"], result["report"]
    # --chains 1,4 --trees 4:2: the tree adds a chain of its depth (2); the one of its node count (4) was asked
    names = [c["name"] for c in result["cases"]]
    assert names == ["k=1", "k=2", "k=4", "tree4"]
    by = {c["name"]: c for c in result["cases"]}
    assert by["k=2"]["why"] == "same depth as tree4" and by["k=4"]["why"] == "asked"
    assert list(by["k=1"]["runners"]) == ["cc", "cc-graph", "tc", "tc-graph", "fi-cc", "fi-tc", "flash"]
    assert list(by["k=4"]["runners"]) == ["cc", "cc-graph", "tc", "tc-graph", "fi-prefill", "flash"]  # 4 x group fits
    assert list(by["tree4"]["runners"]) == ["tc", "tc-graph", "fi-prefill"]
    # each runner's note names the route its plan took: a chain that fits the tile runs cc on the bandwidth kernel
    for name in ("k=1", "k=4"):
        assert "bandwidth kernel" in by[name]["runners"]["cc"]["note"]
        assert "tensor-core route" in by[name]["runners"]["tc"]["note"]
    assert "tensor-core route" in by["tree4"]["runners"]["tc"]["note"]
    for c in result["cases"]:
        assert c["total_rows"] == 2 * c["rows_per_request"]
        assert c["bytes_floor_ms"] > 0 and c["flops_floor_ms"] > 0
        for key, r in c["runners"].items():
            if r["ours"] or key == "flash":  # checked against the float64 oracle, then timed
                assert r["status"] == "ok", (c["name"], key, r)
                assert r["err"] < verify.TOL and r["ms"] > 0 and r["b2b_ms"] > 0 and r["tbps"] > 0
            else:
                try:
                    common.import_flashinfer()
                except ModuleNotFoundError:
                    assert r["status"] == "failed" and "flashinfer" in r["reason"]
    assert "custom_mask from tree_parents_to_mask" in by["tree4"]["reference"]
    assert "causal (bottom-right)" in by["k=4"]["reference"]

    t = result["targets"]
    for form in ("eager", "graph"):
        assert t[form]["ratio"] is not None and t[form]["verdict"].startswith(("met", "missed"))
        assert t[form]["base"] in (("cc", "tc") if form == "eager" else ("cc-graph", "tc-graph"))
    comp = result["comparisons"][0]
    assert comp["tree"] == "tree4" and comp["forms"]["eager"]["chain_depth_k"] == 2
    assert comp["forms"]["graph"]["chain_nodes_k"] == 4 and comp["forms"]["graph"]["tree_over_chain_nodes"] > 0
    assert result["tree_shapes"]["tree4"]["depth"] == 2 and len(result["tree_shapes"]["tree4"]["parents"]) == 2

    rep = result["report"]
    assert "targets: k=4 <= 1.10x of k=1: eager " in rep and "; graph " in rep
    assert "CPU dry run" in rep and "### chains: cost of k rows per request against k=1" in rep
    for row in ("| k=1 | cc | 1 |", "| k=1 | tc-graph | 1 |", "| k=4 | tc | 4 |", "| k=2 | tc-graph | 2 |",
                "| tree4 | 4 | 2 | eager |", "| tree4 | 4 | 2 | graph |", "| k=4 | flash | ok |",
                "| tree4 | fi-prefill |"):
        assert row in rep, row
    assert "best k=1, eager, ms: " in rep and "best k=1, graph, ms: " in rep

    path = tmp_path / "verify.json"  # what --json writes through the shared machinery
    common.write_json(str(path), {"families": {"verify": {k: v for k, v in result.items() if k != "report"}}})
    back = json.loads(path.read_text())["families"]["verify"]
    assert [c["name"] for c in back["cases"]] == names and back["targets"]["eager"]["ratio"] > 0


@pytest.mark.parametrize("nodes,depth", [(16, 4), (64, 6), (8, 2), (5, 5), (10, 1)])
def test_trees_have_the_asked_size_and_depth(nodes, depth):
    trees = verify.make_trees(16, nodes, depth)
    assert trees == verify.make_trees(16, nodes, depth)  # fixed seed
    assert len({tuple(t) for t in trees}) > 1 or nodes == depth or depth == 1  # one random tree per request
    for t in trees:
        assert len(t) == nodes and max(verify.tree_depths(t)) == depth
        assert all(-1 <= p < i for i, p in enumerate(t))  # a parent precedes its child
        assert verify.tree_depths(t) == sorted(verify.tree_depths(t))  # breadth-first
        assert max(t.count(p) for p in set(t)) <= verify.TREE_TOP_K
        assert sum(verify.level_widths(t)) == nodes


def test_command_line():
    assert "verify" in FAMILIES
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["verify", "--help"])
    assert e.value.code == 0
    args = build_parser().parse_args(["verify", "--quick"])
    chains, trees, forms, peers, batch, kv_len = verify._selected(args)
    assert (chains, trees, forms, batch, kv_len) == ([1, 4], [(16, 4)], ["eager", "graph"], 16, 8192)
    assert peers == list(verify.PEER_KEYS)
    names = [c.name for c in verify.plan_cases(chains, trees, batch, kv_len)]
    assert names == ["k=1", "k=4", "k=16", "tree16"]
    full = verify._selected(build_parser().parse_args(["verify"]))
    names = [c.name for c in verify.plan_cases(full[0], full[1], 16, 8192)]
    assert names == ["k=1", "k=2", "k=4", "k=6", "k=8", "k=16", "k=64", "tree16", "tree64"]
    # under 'all' the family's options parse next to the others', and other families' peers do not reach it
    args = build_parser().parse_args(["all", "--quick", "--peers", "cudnn", "--trees", "none", "--forms", "graph"])
    chains, trees, forms, peers, _, _ = verify._selected(args)
    assert trees == [] and forms == ["graph"] and peers == list(verify.PEER_KEYS)
    with pytest.raises(SystemExit, match="unknown peer"):
        verify._selected(build_parser().parse_args(["verify", "--verify-peers", "cudnn"]))
    with pytest.raises(SystemExit, match="nodes must be 1..64"):
        verify._selected(build_parser().parse_args(["verify", "--trees", "65"]))
    with pytest.raises(SystemExit, match="does not fit in depth 1"):
        verify.plan_cases([1], [(12, 1)], 2, 64)
