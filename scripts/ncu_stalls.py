"""Summarises Nsight Compute's per-instruction source page (`ncu -i R.ncu-rep --page source --csv --print-source
sass`): where a kernel's warps stall. No GPU needed; scripts/gpu_run.sh probe-ncu-decode runs it on the device.

    python scripts/ncu_stalls.py REPORT-sass.csv [...] [--top 20] [--window 100]

Per file: the stall reasons summed over every instruction (share of all warp samples), the samples and executed
warp-instructions by SASS opcode, the hottest instructions, the instructions with the most excessive shared-memory
wavefronts (bank conflicts), and with --window N the samples of each run of N instructions of the hot loop (the
instructions of the execution count that holds the most samples) with their dominant stalls and opcodes.
"""
import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def opcode(source: str) -> str:
    words = source.split()
    if not words:
        return ""
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def summarise(path: str, top: int, window: int) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r)
    names, data = rows[header], rows[header + 1:]
    col = {name: i for i, name in enumerate(names)}

    def num(row, name):
        try:
            return int(float(row[col[name]] or 0))
        except (KeyError, ValueError, IndexError):
            return 0

    stalls = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    total = sum(num(r, SAMPLES) for r in data) or 1
    print(f"{path}: {total} warp samples over {len(data)} instructions")
    reasons = collections.Counter({s: sum(num(r, s) for r in data) for s in stalls})
    for reason, n in reasons.most_common(10):
        print(f"  {reason:28s} {n:8d} {100 * n / total:5.1f}%")
    by_op, executed = collections.Counter(), collections.Counter()
    for r in data:
        op = opcode(r[col["Source"]])
        by_op[op] += num(r, SAMPLES)
        executed[op] += num(r, EXECUTED)
    print("  by opcode: samples (share), executed warp-instructions")
    for op, n in by_op.most_common(top):
        print(f"    {op:10s} {n:7d} {100 * n / total:5.1f}%  {executed[op]}")
    print("  hottest instructions: samples (share), executed, index, SASS")
    hot = sorted(range(len(data)), key=lambda i: -num(data[i], SAMPLES))[:top]
    for i in hot:
        n = num(data[i], SAMPLES)
        source = data[i][col["Source"]].strip()
        print(f"    {n:6d} {100 * n / total:5.1f}%  {num(data[i], EXECUTED):9d}  #{i:<5d} {source}")
    if "L1 Wavefronts Shared Excessive" in col:
        print("  most excessive shared wavefronts: excessive / all wavefronts, executed, SASS")
        worst = sorted(range(len(data)), key=lambda i: -num(data[i], "L1 Wavefronts Shared Excessive"))[:top // 2]
        for i in worst:
            excess, waves = num(data[i], "L1 Wavefronts Shared Excessive"), num(data[i], "L1 Wavefronts Shared")
            if excess:
                print(f"    {excess:9d} / {waves:9d}  {num(data[i], EXECUTED):9d}  {data[i][col['Source']].strip()}")
    if window:
        # the hot loop: the instructions of the execution count that holds the most samples
        weight = collections.Counter()
        for r in data:
            weight[num(r, EXECUTED)] += num(r, SAMPLES)
        count = weight.most_common(1)[0][0]
        loop = [i for i, r in enumerate(data) if num(r, EXECUTED) == count]
        print(f"  hot loop: {len(loop)} instructions executed {count} times each, #{loop[0]}-#{loop[-1]}; "
              f"by runs of {window}")
        for start in range(loop[0], loop[-1] + 1, window):
            part = data[start:start + window]
            n = sum(num(r, SAMPLES) for r in part)
            why = collections.Counter({s: sum(num(r, s) for r in part) for s in stalls}).most_common(3)
            ops = collections.Counter(opcode(r[col["Source"]]) for r in part).most_common(4)
            print(f"    #{start:<5d} {100 * n / total:5.1f}%  " + ", ".join(f"{s[6:]} {v}" for s, v in why) +
                  " | " + ", ".join(f"{o} {c}" for o, c in ops))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--window", type=int, default=100, help="instructions a run of the hot loop (0: none)")
    args = ap.parse_args()
    for path in args.csv:
        summarise(path, args.top, args.window)


if __name__ == "__main__":
    main()
