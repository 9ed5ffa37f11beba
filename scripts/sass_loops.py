"""The loops of a SASS dump (`scripts/compile_probe.py --dump DIR` writes DIR/<kernel>.sass) with what each holds:
instructions, exp2 (MUFU.EX2), matrix instructions (HGMMA / QGMMA) and local-memory spills (LDL / STL). A loop is a
backward branch; the innermost hot loop is the smallest range that still holds the exp2s of one block. ptxas -v
says how many bytes spill in all; this says whether they sit in the loop that runs every block (session 15: the
192-key fp8 experiment, docs/dev/fp8-192-key-blocks.patch, spills 60 + 60 a block there; the 128-key kernel none).

    python scripts/sass_loops.py DIR/prefill-ws.sass [--min 150]
"""
import argparse
import re


def loops(path: str):
    """(first address, last address, instruction texts) of every backward branch's range."""
    instructions, labels, label = [], {}, None
    for line in open(path).read().splitlines():
        named = re.match(r"^\s*\.(L_x_\d+):", line)
        if named:
            label = named.group(1)
            labels[label] = None
            continue
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if found:
            address = int(found.group(1), 16)
            instructions.append((address, found.group(2)))
            if label is not None and labels[label] is None:
                labels[label] = address
    for address, text in instructions:
        branch = re.search(r"BRA.*\(\.(L_x_\d+)\)", text)
        target = labels.get(branch.group(1)) if branch else None
        if target is not None and target < address:
            yield target, address, [t for a, t in instructions if target <= a <= address]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass")
    ap.add_argument("--min", type=int, default=150, help="leave out loops of fewer instructions")
    args = ap.parse_args()
    for first, last, body in sorted(loops(args.sass), key=lambda loop: len(loop[2])):
        if len(body) < args.min:
            continue
        counts = {name: sum(1 for t in body if re.search(pattern, t))
                  for name, pattern in (("EX2", r"MUFU\.EX2"), ("GMMA", r"[HQ]GMMA"), ("LDL", r"\bLDL"),
                                        ("STL", r"\bSTL"))}
        print(f"{first:#07x}-{last:#07x}: {len(body)} instructions, "
              + ", ".join(f"{name} {n}" for name, n in counts.items()))


if __name__ == "__main__":
    main()
