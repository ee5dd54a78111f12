#!/usr/bin/env bash
# Train with titan_thd: installs what it needs (quick when installed), then launches the trainer
# (one process directly, NGPU > 1 with torchrun).
#
#   ./run_train.sh --config debug_dense_thd.toml [--section.field value ...]
#
# --config NAME   train_configs/NAME, or a path to a TOML file
# other args      config overrides, e.g. --training.steps 50 --checkpoint.enable true
# Env:
#   NGPU=N        processes on this node (default 1); the CPU uses gloo, GPUs use NCCL
#   LOG_RANK=0,1  local ranks whose output is shown (default 0)
#   COMM_MODE=fake  one process simulates NGPU ranks on a fake process group for one step
#                   (a dry run of the parallel layout; losses are meaningless)
#   TITAN_THD_DEBUG=1  show the Python traceback of an input error (without it, a bad config value,
#                   data file, tokenizer, checkpoint, ... ends with one `error: ...` line, exit code 2)
# SIGTERM (kill -TERM <pid of run_train.sh>): every rank finishes its step, saves a checkpoint
# (with checkpoint.enable) and the run exits 0.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

available() {
  local names
  names="$(cd "$ROOT/train_configs" 2>/dev/null && ls -1 -- *.toml 2>/dev/null | sed 's/^/  /')"
  echo "available configs (train_configs/):" >&2
  echo "${names:-  (none)}" >&2
}

config=""
args=()
while (($#)); do
  case "$1" in
    -h | --help)
      awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
      echo
      "$ROOT/scripts/setup_env.sh"
      exec "${TITAN_THD_VENV:-$ROOT/.venv}/bin/python" -m titan_thd.config --help
      ;;
    --config)
      if (($# < 2)); then echo "error: --config needs a value" >&2; available; exit 2; fi
      config="$2"
      shift 2
      ;;
    --config=*)
      config="${1#--config=}"
      shift
      ;;
    *)
      args+=("$1")
      shift
      ;;
  esac
done

if [[ -z "$config" ]]; then
  echo "usage: ./run_train.sh --config NAME [--section.field value ...]" >&2
  available
  exit 2
fi
if [[ -f "$config" ]]; then
  config_file="$config"
elif [[ -f "$ROOT/train_configs/$config" ]]; then
  config_file="$ROOT/train_configs/$config"
else
  echo "error: config '$config' not found (neither a file nor train_configs/$config)" >&2
  available
  exit 2
fi

"$ROOT/scripts/setup_env.sh"
VENV="${TITAN_THD_VENV:-$ROOT/.venv}"
NGPU="${NGPU:-1}"
LOG_RANK="${LOG_RANK:-0}"
# Config errors surface here in a fraction of a second, without torchrun's failure report.
"$VENV/bin/python" -m titan_thd.config --job.config_file "$config_file" "${args[@]}" >/dev/null
if [[ "$NGPU" != 1 && -z "${COMM_MODE:-}" ]]; then
  # So do the data, tokenizer, layout and checkpoint errors of a multi-process run (one process reads
  # them; the data cache it writes is the run's), instead of every rank's error and torchrun's report.
  NGPU="$NGPU" "$VENV/bin/python" -m titan_thd.train --job.config_file "$config_file" "${args[@]}" \
    --job.preflight true
fi

if [[ -n "${COMM_MODE:-}" ]]; then
  # No torchrun: one process plays rank 0 of an NGPU-rank world.
  NGPU="$NGPU" exec "$VENV/bin/python" -m titan_thd.train --job.config_file "$config_file" "${args[@]}" \
    --comm.mode "$COMM_MODE" --training.steps 1
fi
if [[ "$NGPU" == 1 ]]; then
  # One process needs no launcher; `kill -TERM` then reaches the trainer itself.
  exec "$VENV/bin/python" -m titan_thd.train --job.config_file "$config_file" "${args[@]}"
fi
"$VENV/bin/torchrun" --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m titan_thd.train --job.config_file "$config_file" "${args[@]}" &
launcher=$!
# SIGTERM goes to the ranks (torchrun's children), not to torchrun: each rank finishes its step,
# saves a checkpoint and exits 0, and torchrun then exits 0 too. (torchrun itself would answer a
# SIGTERM with a SignalException, exit 1, and kill ranks still saving after its shutdown timeout.)
# Before the ranks exist there is nothing to save: then torchrun gets it.
trap 'pkill -TERM -P "$launcher" || kill -TERM "$launcher" 2>/dev/null || true' TERM
status=0
wait "$launcher" || status=$?
while kill -0 "$launcher" 2>/dev/null; do # `wait` returns early when the trap runs
  status=0
  wait "$launcher" || status=$?
done
exit "$status"
