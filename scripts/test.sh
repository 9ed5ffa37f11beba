#!/usr/bin/env bash
# The test suite, with its own set-up: a venv with CPU torch, triton and the test extra, then pytest.
# On a machine without a GPU the Triton kernels run through Triton's interpreter; @gpu tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
# torch 2.13.0 is the CPU build on local disk; never let pip pull a CUDA build here.
"$VENV/bin/python" -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q "pytest>=7" "hypothesis>=6" "pytest-xdist" "tqdm" "matplotlib"
# The README's support matrix is generated from serveattn/policy.py and serveattn/routing.py: fail on drift.
"$VENV/bin/python" scripts/support_matrix.py --check
set +e
"$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose (exit code 5 must not pass)." >&2
  exit 1
fi
exit "$rc"
