"""The benchmark charts on the CPU: every committed H200 JSON plots to a PNG, the ``plot`` subcommand, and ``--plot``
after a (stubbed) measuring run."""
import copy
import json
import os

import pytest

pytest.importorskip("matplotlib")

from serveattn.bench import plot  # noqa: E402
from serveattn.bench.__main__ import FAMILIES, build_parser, main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "docs", "runs")
COMMITTED = {
    "prefill": "2026-12-02T1129-prefill.json",
    "decode": "2026-12-02T1158-decode.json",
    "fp8": "2026-12-02T1412-fp8.json",
    "verify": "2026-12-02T1413-verify.json",
}
PNG = b"\x89PNG\r\n\x1a\n"


def _load(family):
    with open(os.path.join(RUNS, COMMITTED[family])) as f:
        return json.load(f)


def _is_png(path):
    with open(path, "rb") as f:
        head = f.read(8)
    return head == PNG and os.path.getsize(path) > 10_000


@pytest.mark.parametrize("family", sorted(COMMITTED))
def test_committed_json_plots(family, tmp_path):
    paths = plot.plot_result(_load(family), tmp_path, source=COMMITTED[family])
    assert paths == [str(tmp_path / f"{family}.png")]
    assert _is_png(paths[0])


def test_one_family_result_plots(tmp_path):
    """A family's own result dict (no payload around it) plots too, without a GPU name or a command."""
    paths = plot.plot_result(_load("decode")["families"]["decode"], tmp_path)
    assert [os.path.basename(p) for p in paths] == ["decode.png"] and _is_png(paths[0])


def test_untimed_runners_and_skipped_families(tmp_path):
    data = copy.deepcopy(_load("prefill"))
    for c in data["families"]["prefill"]["cases"]:  # a peer that failed everywhere, ours wrong in one case
        c["runners"]["cudnn"].update(status="failed", reason="RuntimeError: no cuDNN here", ms=None)
    data["families"]["prefill"]["cases"][0]["runners"]["paged"].update(status="wrong", reason="relative error 1")
    data["families"]["decode"] = {"family": "decode", "ok": False, "error": "RuntimeError: boom"}
    data["families"]["made-up"] = {"family": "made-up", "ok": True, "cases": [{"name": "x", "runners": {}}]}
    logged = []
    paths = plot.plot_result(data, tmp_path, log=logged.append)
    assert [os.path.basename(p) for p in paths] == ["prefill.png"] and _is_png(paths[0])
    assert any("decode has no cases" in m and "boom" in m for m in logged)
    assert any("'made-up'" in m for m in logged)


def test_plot_subcommand_writes_every_family(tmp_path, capsys):
    files = [os.path.join(RUNS, COMMITTED[f]) for f in ("prefill", "decode", "fp8", "verify")]
    assert main(["plot", *files, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / f"{f}.png") for f in ("prefill", "decode", "fp8", "verify")]
    assert all(_is_png(p) for p in printed)


def test_plot_subcommand_same_family_twice(tmp_path):
    """Two files holding the same family: each chart is named after its file, neither overwrites the other."""
    src = os.path.join(RUNS, COMMITTED["decode"])
    other = tmp_path / "other-run.json"
    other.write_text(open(src).read())
    paths = plot.plot_files([src, str(other)], tmp_path / "out")
    assert sorted(os.path.basename(p) for p in paths) == ["decode-2026-12-02T1158-decode.png",
                                                           "decode-other-run.png"]
    assert all(_is_png(p) for p in paths)


def test_plot_subcommand_help(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["plot", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "JSON" in out and "--out" in out and "docs/plots" in out


def test_parser_plot_is_not_a_measuring_family():
    assert "plot" not in FAMILIES
    args = build_parser().parse_args(["plot", "a.json", "b.json"])
    assert args.json_files == ["a.json", "b.json"] and args.out == os.path.join("docs", "plots")
    for family in list(FAMILIES) + ["all"]:
        assert build_parser().parse_args([family, "--plot", "charts"]).plot == "charts"
        assert build_parser().parse_args([family]).plot is None


def test_plot_option_after_a_run(tmp_path, monkeypatch, capsys):
    """``decode --plot DIR``: the run (stubbed with the committed result: no GPU here) is followed by its chart."""
    from serveattn.bench import common, decode

    fam = _load("decode")["families"]["decode"]
    monkeypatch.setattr(common, "require_cuda", lambda: None)
    monkeypatch.setattr(decode, "run", lambda args, ceilings, checkpoint: dict(fam, report="## decode (stub)"))
    out_json = tmp_path / "run.json"
    assert main(["decode", "--json", str(out_json), "--plot", str(tmp_path / "charts")]) == 0
    assert _is_png(tmp_path / "charts" / "decode.png")
    assert "chart: " in capsys.readouterr().out
    assert json.loads(out_json.read_text())["families"]["decode"]["cases"]


def test_missing_matplotlib_is_one_sentence(monkeypatch):
    import builtins
    import sys

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(ImportError) as exc:
        plot.require_matplotlib()
    msg = str(exc.value)
    assert "needs matplotlib" in msg and "pip install matplotlib" in msg and msg.count(". ") == 0
    with pytest.raises(SystemExit) as exc:
        main(["plot", os.path.join(RUNS, COMMITTED["decode"])])
    assert "needs matplotlib" in str(exc.value)
