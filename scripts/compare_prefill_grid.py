"""Two prefill crossover runs side by side (a switch off, then on: probe-ws-balance, probe-prefill-order): one row a
point (group, batch x length), our kernel's time in each run, on / off, and cuDNN's time over ours in each run
(above 1: ours is faster; cuDNN is the yardstick that shows drift between the runs).

    python3 scripts/compare_prefill_grid.py off.json on.json
"""
import argparse
import json
import os
from typing import List


def points_of(path: str) -> List[dict]:
    """A run's prefill-cudnn points where our kernel was timed (cuDNN may have declined); none where its JSON is
    missing."""
    if not os.path.exists(path):
        return []
    families = json.load(open(path))["families"]
    family = families["crossover"] if isinstance(families, dict) else families[0]
    return [p for p in family["points"] if p["pair"] == "prefill-cudnn" and p.get("triton_ms") is not None]


def _ratio(p) -> str:
    return f"{p['ratio']:.2f}" if p.get("status") == "ok" and p.get("ratio") is not None else "-"


def table(off: List[dict], on: List[dict]) -> str:
    def key(p):
        return p["dtype"], p["head_dim"], p["group"], p["causal"], p["batch"], p["qo_len"]
    on_by_key = {key(p): p for p in on}
    lines = ["| dtype | head dim | group | causal | batch x len | ours ms, off | ours ms, on | on / off | "
             "cuDNN / ours, off | cuDNN / ours, on |", "| --- " * 10 + "|"]
    for p in sorted(off, key=key):
        q = on_by_key.get(key(p))
        on_cells = ["-", "-", "-"] if q is None else [f"{q['triton_ms']:.4f}", f"{q['triton_ms'] / p['triton_ms']:.3f}",
                                                      _ratio(q)]
        lines.append(f"| {p['dtype']} | {p['head_dim']} | {p['group']} | {p['causal']} | {p['batch']}x{p['qo_len']} | "
                     f"{p['triton_ms']:.4f} | {on_cells[0]} | {on_cells[1]} | {_ratio(p)} | {on_cells[2]} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("off", help="crossover JSON with the switch off")
    ap.add_argument("on", help="crossover JSON with the switch on")
    args = ap.parse_args(argv)
    print(table(points_of(args.off), points_of(args.on)))


if __name__ == "__main__":
    main()
