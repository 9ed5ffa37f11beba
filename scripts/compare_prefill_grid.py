"""probe-ws-balance's two crossover runs side by side: one row a causal prefill point (group, batch x length), our
kernel's time under SERVEATTN_PREFILL_WS_BALANCE=0 and =1, cuDNN's time over ours in each run (above 1: ours is
faster; cuDNN is the yardstick that shows drift between the runs), and the balanced grid's gain.

    python3 scripts/compare_prefill_grid.py off.json on.json
"""
import argparse
import json
import os
from typing import List


def points_of(path: str) -> List[dict]:
    """A run's prefill-cudnn points measured ok; none where its JSON is missing."""
    if not os.path.exists(path):
        return []
    families = json.load(open(path))["families"]
    family = families["crossover"] if isinstance(families, dict) else families[0]
    return [p for p in family["points"] if p["pair"] == "prefill-cudnn" and p.get("status") == "ok"]


def table(off: List[dict], on: List[dict]) -> str:
    def key(p):
        return p["dtype"], p["group"], p["causal"], p["batch"], p["qo_len"]
    on_by_key = {key(p): p for p in on}
    lines = ["| dtype | group | causal | batch x len | ours ms, off | ours ms, on | on / off | cuDNN / ours, off | "
             "cuDNN / ours, on |", "| --- " * 9 + "|"]
    for p in sorted(off, key=key):
        q = on_by_key.get(key(p))
        cells = ["-"] * 4 if q is None else [f"{q['triton_ms']:.4f}", f"{q['triton_ms'] / p['triton_ms']:.3f}",
                                             f"{p['ratio']:.2f}", f"{q['ratio']:.2f}"]
        lines.append(f"| {p['dtype']} | {p['group']} | {p['causal']} | {p['batch']}x{p['qo_len']} | "
                     f"{p['triton_ms']:.4f} | " + " | ".join(cells[:2]) + f" | {p['ratio']:.2f} | "
                     + (cells[3] if q is not None else "-") + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("off", help="crossover JSON under SERVEATTN_PREFILL_WS_BALANCE=0")
    ap.add_argument("on", help="crossover JSON under SERVEATTN_PREFILL_WS_BALANCE=1")
    args = ap.parse_args(argv)
    print(table(points_of(args.off), points_of(args.on)))


if __name__ == "__main__":
    main()
