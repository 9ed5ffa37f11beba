"""probe-decode-long's runs side by side: one row a measured point (KV dtype, group, batch x kv_len), one column a
setting, each cell the bandwidth kernel's time under that setting over the tensor-core route's time in the same
run (below 1: the bandwidth kernel wins), then the best setting and its gain on the first (today's rule).

    python3 scripts/compare_decode_long.py --settings "-;A=1;B=2" run-1.json run-2.json run-3.json

Each JSON is `python -m serveattn.bench crossover --json` output (decode-tc points); the settings name the runs in
order ("-": today's rule), as scripts/gpu_run.sh probe-decode-long passes them.
"""
import argparse
import json
import os
from typing import Dict, List, Tuple


def points_of(path: str) -> List[dict]:
    """A run's decode-tc points; none where its JSON is missing (a setting whose run failed)."""
    if not os.path.exists(path):
        return []
    families = json.load(open(path))["families"]
    family = families["crossover"] if isinstance(families, dict) else families[0]
    return [p for p in family["points"] if p["pair"] == "decode-tc"]


def _cell(p) -> str:
    return f"{p['ratio']:.3f}" if p is not None and p.get("status") == "ok" else "-"


def table(settings: List[str], runs: List[List[dict]]) -> str:
    """The markdown table; a point a run did not measure (or did not measure ok) reads '-'."""
    cells: Dict[Tuple, Dict[int, dict]] = {}
    for i, pts in enumerate(runs):
        for p in pts:
            cells.setdefault((p["dtype"], p["group"], p["batch"], p["kv_len"]), {})[i] = p
    names = ["today" if s == "-" else s for s in settings]
    lines = ["| KV dtype | group | batch x kv_len | tensor-core ms (first run) | "
             + " | ".join(f"{n}: bandwidth / tc" for n in names) + " | best | best vs first |",
             "| --- " * (6 + len(names)) + "|"]
    for key in sorted(cells):
        got = cells[key]
        row = [got.get(i) for i in range(len(runs))]
        ok = [(p["ratio"], i) for i, p in enumerate(row) if p is not None and p.get("status") == "ok"]
        best = min(ok) if ok else None
        first = row[0] if row[0] is not None and row[0].get("status") == "ok" else None
        tc = f"{first['tensor-core_ms']:.4f}" if first else "-"
        gain = f"{first['ratio'] / best[0]:.2f}x" if first and best else "-"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]}x{key[3]} | {tc} | " + " | ".join(map(_cell, row))
                     + f" | {names[best[1]] if best else '-'} | {gain} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", required=True, help="';'-separated, one a JSON, in order ('-': today's rule)")
    ap.add_argument("runs", nargs="+", help="crossover JSON files, in the settings' order")
    args = ap.parse_args(argv)
    settings = args.settings.split(";")
    if len(settings) != len(args.runs):
        ap.error(f"{len(settings)} settings but {len(args.runs)} JSON files")
    print(table(settings, [points_of(path) for path in args.runs]))


if __name__ == "__main__":
    main()
