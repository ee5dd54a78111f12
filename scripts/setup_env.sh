#!/usr/bin/env bash
# Create (or reuse) the project virtual environment and install titan_thd with the given extras.
# Idempotent and quick when nothing changed: a stamp records what was installed.
#   scripts/setup_env.sh            runtime dependencies
#   scripts/setup_env.sh test       runtime + test extra
# Env: TITAN_THD_VENV overrides the venv location (default: <repo>/.venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TITAN_THD_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"

want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/constraints.txt" | sha256sum | cut -c1-16)-[$EXTRAS]"
stamp="$VENV/.titan_thd_stamp"
if [[ -x "$VENV/bin/python" && -f "$stamp" ]] && grep -qxF -- "$want" "$stamp"; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating virtual environment at $VENV" >&2
  "$PY" -m venv "$VENV"
fi
spec="$ROOT"
[[ -n "$EXTRAS" ]] && spec="$ROOT[$EXTRAS]"
echo "[setup] installing titan_thd${EXTRAS:+[$EXTRAS]} (torch pinned by constraints.txt)" >&2
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  -c "$ROOT/scripts/constraints.txt" -e "$spec" >&2
echo "$want" > "$stamp"
