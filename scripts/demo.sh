#!/usr/bin/env bash
# The main job: `python -m serveattn demo`, with its own set-up (a CPU venv when none is there).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4" tqdm
"$VENV/bin/python" -m pip install -q --no-deps -e .
exec "$VENV/bin/python" -m serveattn demo "$@"
