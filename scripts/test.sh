#!/usr/bin/env bash
# Install titan_thd with the test extra (quick when already installed), then run the suite: every
# test except the `extended` ones (the heaviest end-to-end parity runs; cheaper tests cover their
# numerics), on 2 pytest workers (a file stays on one worker: its module fixtures run once).
#   ./scripts/test.sh              what CI runs (how long it takes: CONTRIBUTING.md, "Test")
#   ./scripts/test.sh --extended   everything, the extended parity runs too
# Other arguments go to pytest, e.g. ./scripts/test.sh -x -k loss
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./scripts/setup_env.sh test
VENV="${TITAN_THD_VENV:-$ROOT/.venv}"
# One thread per process: 2 workers on 2 cores, and the multi-process tests start 2-8 ranks each
# (more threads than cores thrash). OMP_NUM_THREADS=2 ./scripts/test.sh runs with two.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Lint first: seconds, and a style error fails CI like a test does.
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
select=(-m "not extended")
if [[ "${1:-}" == "--extended" ]]; then
  select=()
  shift
fi
exec "$VENV/bin/python" -m pytest tests -n "${PYTEST_WORKERS:-2}" --dist loadfile "${select[@]}" "$@"
