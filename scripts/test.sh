#!/usr/bin/env bash
# Install titan_thd with the test extra (quick when already installed), then run the whole suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -x -k loss
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./scripts/setup_env.sh test
VENV="${TITAN_THD_VENV:-$ROOT/.venv}"
# Lint first: seconds, and a style error fails CI like a test does.
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
exec "$VENV/bin/python" -m pytest tests "$@"
