#!/usr/bin/env bash
# A/B of a source patch on the GPU: the working tree against the working tree with PATCH applied (a copy under
# $TMPDIR), alternating processes of scripts/probe_prefill.py (AB_PROBE: another probe script, e.g.
# scripts/probe_host.py for plan() / run() host us) so clock drift stays out of the comparison.
#
#   scripts/ab_patch.sh docs/dev/fp8-descale-prefetch.patch [rounds] [probe args...]
#   e.g. scripts/ab_patch.sh docs/dev/x.patch 3 --cases 1x4096,1x8192 --kinds fp8 --profile
#        AB_PROBE=scripts/probe_host.py scripts/ab_patch.sh docs/dev/tc-plan-host.patch 2
set -u
cd "$(dirname "$0")/.."
PATCH=$1; ROUNDS=${2:-3}; shift; shift
W=$(mktemp -d)
cp -r serveattn "$W/"
(cd "$W" && patch -s -p1 < "$OLDPWD/$PATCH") || { echo "ab_patch: $PATCH does not apply"; exit 2; }
probe() { PYTHONPATH="$1:$PWD/scripts" timeout 150 python3 "${AB_PROBE:-scripts/probe_prefill.py}" "${@:2}" 2>&1 | grep -v Warn; }
for r in $(seq "$ROUNDS"); do
  echo "== base (working tree), round $r"; probe "$PWD" "$@"
  echo "== patched ($PATCH), round $r"; probe "$W" "$@"
done
rm -rf "$W"
