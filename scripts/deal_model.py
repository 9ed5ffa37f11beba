"""The warp-specialized prefill kernel's static deal, modelled and fitted to a crossover run (CPU; no GPU needed):
for each causal prefill point, the busiest program's key blocks under the SM count's grid and under the grid
attention_ws.persistent_programs picks, a least-squares fit of our measured time to the first, and what the fit
predicts for the second against cuDNN.

    python3 scripts/deal_model.py docs/runs/2026-12-05T1712-h200-bench-crossover.json [--overhead 0] [--sms 132]

The fit: time = a x (the busiest program's blocks of 128 x 128, plus --overhead blocks a task) + b. A task is a
(work item, KV head), 8 KV heads as the crossover runs them; one request's tasks fit one round where they can.
"""
import argparse
import json
import os
import sys
from typing import List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from serveattn.kernels import attention_ws  # noqa: E402
from serveattn.prefill import build_work, item_costs  # noqa: E402

KV_HEADS, BLOCK = 8, 128


def busiest(batch: int, length: int, group: int, overhead: float, sms: int, balanced: bool) -> float:
    """The busiest program's blocks for `batch` causal requests of `length` tokens (the grid balanced or not)."""
    qo = np.full(batch, length)
    work, n = build_work(qo, qo, group, BLOCK, True)
    costs = item_costs(work, qo, qo, group, BLOCK, BLOCK, True)  # key blocks + 1 (the plan's model)
    tasks = np.repeat(costs - 1 + overhead, KV_HEADS).astype(np.float64)  # this fit's: key blocks + overhead
    if tasks.size <= sms:
        return float(tasks.max())
    programs = attention_ws.persistent_programs(costs, KV_HEADS, sms, n // batch) if balanced and batch > 1 else sms
    return float(attention_ws.program_loads(tasks, programs).max())


def points_of(path: str) -> List[dict]:
    families = json.load(open(path))["families"]
    family = families["crossover"] if isinstance(families, dict) else families[0]
    return [p for p in family["points"] if p["pair"] == "prefill-cudnn" and p["causal"] and p.get("triton_ms")]


def fit(points: List[dict], overhead: float, sms: int):
    """(a ms a block, b ms, rows): the least-squares fit and, per point, (point, model ms, balanced model ms)."""
    loads = np.array([busiest(p["batch"], p["qo_len"], p["group"], overhead, sms, False) for p in points])
    times = np.array([p["triton_ms"] for p in points])
    (a, b), *_ = np.linalg.lstsq(np.vstack([loads, np.ones_like(loads)]).T, times, rcond=None)
    rows = [(p, a * load + b, a * busiest(p["batch"], p["qo_len"], p["group"], overhead, sms, True) + b)
            for p, load in zip(points, loads)]
    return a, b, rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crossover_json")
    ap.add_argument("--overhead", type=float, default=0.0, help="blocks a task adds (q load, output store)")
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args(argv)
    a, b, rows = fit(points_of(args.crossover_json), args.overhead, args.sms)
    errors = [abs(model - p["triton_ms"]) / p["triton_ms"] for p, model, _ in rows]
    print(f"fit: {a * 1e3:.2f} us a block x the busiest program's blocks + {b * 1e3:.1f} us; relative error median "
          f"{np.median(errors):.3f}, max {max(errors):.3f} over {len(rows)} points\n")
    print("| group | batch x len | ours ms | model ms | balanced model ms | cuDNN ms | cuDNN / ours | "
          "cuDNN / balanced model |")
    print("| --- " * 8 + "|")
    for p, model, balanced in sorted(rows, key=lambda r: (r[0]["group"], r[0]["batch"], r[0]["qo_len"])):
        cudnn = p.get("cudnn_ms")
        ratios = (f"{cudnn / p['triton_ms']:.2f} | {cudnn / balanced:.2f}") if cudnn else "- | -"
        print(f"| {p['group']} | {p['batch']}x{p['qo_len']} | {p['triton_ms']:.4f} | {model:.4f} | {balanced:.4f} | "
              f"{f'{cudnn:.4f}' if cudnn else '-'} | {ratios} |")


if __name__ == "__main__":
    main()
