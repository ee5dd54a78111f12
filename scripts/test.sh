#!/usr/bin/env bash
# Install titan_thd with the test extra (quick when already installed), then run the whole suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -x -k loss
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./scripts/setup_env.sh test
VENV="${TITAN_THD_VENV:-$ROOT/.venv}"
exec "$VENV/bin/python" -m pytest tests "$@"
