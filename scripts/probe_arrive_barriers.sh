#!/usr/bin/env bash
# What the warp-specialized prefill's `bar.sync` before each one-thread mbarrier.arrive costs (GPU; measuring only:
# without the barrier, an arrive is not ordered after the other warps of its group). Triton's membar pass puts a
# barrier of the group's 128 threads before every arrive in the consumer loop (turn, k_empty, v_empty); Gluon 3.6
# has no arrive it does not see. So: compile once with the PTX dumped (TRITON_KERNEL_DUMP), delete those lines from
# the dumped PTX, and time the kernel compiled from the edited PTX (TRITON_KERNEL_OVERRIDE) against the unedited
# one, alternating processes, each with its own Triton cache.
#
#   scripts/probe_arrive_barriers.sh [cases] [kinds] [rounds]     # defaults 1x8192,16x2048  bf16,fp8  3
set -u
cd "$(dirname "$0")/.."
CASES=${1:-1x8192,16x2048}
KINDS=${2:-bf16,fp8}
ROUNDS=${3:-3}
W=$(mktemp -d)
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
probe() { timeout 150 python3 scripts/probe_prefill.py --cases "$CASES" --kinds "$KINDS" 2>&1 | grep -v Warn; }
echo "== compile with the PTX dumped"
TRITON_CACHE_DIR=$W/cache-base TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=$W/dump probe
python3 - "$W/dump" "$W/override" <<'PY'
import pathlib, re, sys
dump, override = map(pathlib.Path, sys.argv[1:])
edited = 0
for ptx in dump.glob("*/prefill_ws_kernel.ptx"):
    lines = ptx.read_text().split("\n")
    keep = []
    for i, line in enumerate(lines):
        after = [l for l in lines[i + 1:i + 4] if not l.strip().startswith("//")]
        if re.match(r"\s*bar\.sync\s+\d+, 128;", line) and after and "mbarrier.arrive" in after[0]:
            edited += 1
            continue
        keep.append(line)
    out = override / ptx.parent.name / ptx.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(keep))
print(f"removed {edited} bar.sync lines before mbarrier.arrive in {len(list(dump.glob('*/prefill_ws_kernel.ptx')))} PTX files")
PY
for r in $(seq "$ROUNDS"); do
  echo "== with the barriers, round $r"
  TRITON_CACHE_DIR=$W/cache-base probe
  echo "== without them, round $r"
  TRITON_CACHE_DIR=$W/cache-edit TRITON_KERNEL_OVERRIDE=1 TRITON_OVERRIDE_DIR=$W/override probe
done
rm -rf "$W"
