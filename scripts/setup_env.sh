#!/usr/bin/env bash
# Create (or reuse) the project virtual environment and install titan_thd with the given extras.
# Idempotent and quick when nothing changed: a stamp records the hash of pyproject.toml +
# constraints.txt and the extras installed; a request for a subset of those extras does nothing
# (a runtime-only request is satisfied by an existing test install).
#   scripts/setup_env.sh            runtime dependencies
#   scripts/setup_env.sh test       runtime + test extra (comma-separate several: test,hf)
# Env: TITAN_THD_VENV overrides the venv location (default: <repo>/.venv); PYTHON the interpreter
# that creates it (default: python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TITAN_THD_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.titan_thd_stamp"
hash="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/constraints.txt" | sha256sum | cut -c1-16)"

sorted_extras() { tr ',' '\n' | sed '/^$/d' | sort -u; }
requested="$(echo "${1:-}" | sorted_extras)"
installed=""
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(sed -n 1p "$stamp")" == "$hash" ]]; then
  installed="$(sed -n '2,$p' "$stamp" | sorted_extras)"
  # The test extra lists the hf extra's packages (pyproject.toml): an hf request is then satisfied.
  if grep -qx test <<<"$installed"; then requested="$(grep -vx hf <<<"$requested" || true)"; fi
  # Nothing to do when every requested extra is already installed.
  if [[ -z "$(comm -23 <(echo "$requested") <(echo "$installed") | sed '/^$/d')" ]]; then
    exit 0
  fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating virtual environment at $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# Keep what an earlier install of the same project state had, so the stamp stays truthful.
extras="$(printf '%s\n%s\n' "$requested" "$installed" | sorted_extras | paste -sd, -)"
spec="$ROOT"
[[ -n "$extras" ]] && spec="$ROOT[$extras]"
echo "[setup] installing titan_thd${extras:+[$extras]} (torch pinned by scripts/constraints.txt)" >&2
# Some machines' pip config names local wheel folders that do not exist; pip warns about each of
# them for every package, which drowns the one line that matters.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  -c "$ROOT/scripts/constraints.txt" -e "$spec" 2>&1 |
  { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }  # pipefail keeps pip's status
printf '%s\n%s\n' "$hash" "$extras" > "$stamp"
