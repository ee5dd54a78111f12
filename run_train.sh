#!/usr/bin/env bash
# Train with titan_thd: installs what it needs (quick when installed), then launches the trainer
# (one process directly; more processes, or more nodes, with torchrun).
#
#   ./run_train.sh --config debug_dense_thd.toml [--section.field value ...]
#
# --config NAME   train_configs/NAME, or a path to a TOML file
# other args      config overrides, e.g. --training.steps 50 --checkpoint.enable true
# Env:
#   NGPU=N        processes on this node (default 1); the CPU uses gloo, GPUs use NCCL
#   LOG_RANK=0,1  local ranks whose output is shown, on every node (default 0)
#   COMM_MODE=fake  one process simulates NNODES x NGPU ranks on a fake process group for one step
#                   (a dry run of the parallel layout; losses are meaningless)
#   TITAN_THD_DEBUG=1  show the Python traceback of an input error (without it, a bad config value,
#                   data file, tokenizer, checkpoint, ... ends with one `error: ...` line, exit code 2)
#   TITAN_THD_MALLOC=reuse|system  reuse (default with NGPU=1): glibc keeps freed memory for the next
#                   step (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_ huge, unless you set them); system
#                   (default with NGPU>1): glibc's defaults, which hand every freed block over 32 MiB
#                   back to the OS
# Several nodes (run this script once per node, same arguments; scripts/slurm_train.sbatch):
#   NNODES=N      nodes in the job (default 1)
#   NODE_RANK=I   this node, 0..NNODES-1 (default 0); node 0 hosts the rendezvous store
#   RDZV_ENDPOINT=host:port  where node 0 can be reached (required when NNODES > 1; falls back
#                 to MASTER_ADDR:MASTER_PORT, port 29500 by default); one node: localhost:0
#   RDZV_ID=ID    the job's name in the rendezvous (default titan_thd)
#   torchrun's c10d rendezvous orders the nodes by hostname (then process id), not NODE_RANK:
#   global rank 0, which writes the metrics, need not be on node 0, so job.dump_folder belongs
#   on a filesystem all nodes share (as the checkpoint shards of all ranks do anyway).
# SIGTERM (kill -TERM <pid of run_train.sh>, or to every process of it as SLURM signals a job
# step) and Ctrl-C: every rank finishes its step, saves a checkpoint (with checkpoint.enable) and
# the run exits 0, with a line naming the checkpoint and the command that resumes from it. A second
# Ctrl-C aborts at once (exit code 130).
# A failure ends with one `error: ...` line (exit code 2: bad input; 1: the run failed, e.g. a save);
# a crash (a bug) with its traceback.
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

# The launch environment; its mistakes fail here in one line, before any install or start-up.
env_error() {
  echo "error: $*" >&2
  exit 2
}
NGPU="${NGPU:-1}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
LOG_RANK="${LOG_RANK:-0}"
RDZV_ID="${RDZV_ID:-titan_thd}"
[[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || env_error "NGPU='$NGPU': expected a positive integer (processes per node)"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || env_error "NNODES='$NNODES': expected a positive integer (nodes in the job)"
[[ "$NODE_RANK" =~ ^(0|[1-9][0-9]*)$ ]] || env_error "NODE_RANK='$NODE_RANK': expected an integer 0..NNODES-1"
((NODE_RANK < NNODES)) || env_error "NODE_RANK=$NODE_RANK with NNODES=$NNODES: expected 0 <= NODE_RANK < NNODES"
if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
  if ((NNODES == 1)) || [[ -n "${COMM_MODE:-}" ]]; then
    RDZV_ENDPOINT="localhost:0" # torchrun picks a free port (COMM_MODE: no rendezvous at all)
  elif [[ -n "${MASTER_ADDR:-}" ]]; then
    RDZV_ENDPOINT="$MASTER_ADDR:${MASTER_PORT:-29500}"
  else
    env_error "NNODES=$NNODES needs RDZV_ENDPOINT=host:port (or MASTER_ADDR), an address of node 0 every node reaches"
  fi
fi
# Several ranks on a host: each rank's kept heap (FSDP's gathered and reduced buffers of every size)
# nearly doubled its RSS (4.11 vs 2.24 GiB per rank, 4 ranks of a 420M dsv4, docs/results.md §12).
TITAN_THD_MALLOC="${TITAN_THD_MALLOC:-$( ((NGPU > 1)) && echo system || echo reuse)}"
[[ "$TITAN_THD_MALLOC" =~ ^(reuse|system)$ ]] || env_error "TITAN_THD_MALLOC='$TITAN_THD_MALLOC': expected reuse or system"
[[ "$RDZV_ENDPOINT" =~ ^.+:[0-9]+$ ]] || env_error "RDZV_ENDPOINT='$RDZV_ENDPOINT': expected host:port"
# Port 0 means "any free port", which only the host itself would know.
if ((NNODES > 1)) && [[ -z "${COMM_MODE:-}" && "$RDZV_ENDPOINT" =~ :0+$ ]]; then
  env_error "RDZV_ENDPOINT='$RDZV_ENDPOINT': NNODES=$NNODES needs a fixed port that every node knows"
fi

if [[ "$TITAN_THD_MALLOC" == reuse ]]; then
  # glibc gives every freed block over 32 MiB back to the OS and the next step faults its pages in
  # again (zeroed): at d = 1,024 and 4K rows the [T, N, d] mHC streams are 64 MiB each, and those
  # faults were a third of a CPU training step (docs/results.md §17.4). One process keeps freed memory in
  # the heap for reuse at little cost beyond its step's peak; several ranks would each keep theirs.
  export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-1099511627776}"
fi
"$ROOT/scripts/setup_env.sh"
VENV="${TITAN_THD_VENV:-$ROOT/.venv}"
# Config errors surface here in a fraction of a second, without torchrun's failure report.
"$VENV/bin/python" -m titan_thd.config --job.config_file "$config_file" "${args[@]}" >/dev/null
if ((NGPU * NNODES != 1)) && [[ -z "${COMM_MODE:-}" ]]; then
  # So do the data, tokenizer, layout and checkpoint errors of a multi-process run (one process per
  # node reads them; the data cache it writes is the run's), instead of every rank's error and
  # torchrun's report. NGPU is the world size here.
  NGPU="$((NGPU * NNODES))" "$VENV/bin/python" -m titan_thd.train --job.config_file "$config_file" "${args[@]}" \
    --job.preflight true
fi

if [[ -n "${COMM_MODE:-}" ]]; then
  # No torchrun: one process plays rank 0 of the whole NNODES x NGPU world (on any one machine;
  # NODE_RANK and the rendezvous play no part).
  NGPU="$((NNODES * NGPU))" exec "$VENV/bin/python" -m titan_thd.train --job.config_file "$config_file" \
    "${args[@]}" --comm.mode "$COMM_MODE" --training.steps 1
fi
if ((NNODES == 1 && NGPU == 1)); then
  # One process needs no launcher; `kill -TERM` then reaches the trainer itself.
  exec "$VENV/bin/python" -m titan_thd.train --job.config_file "$config_file" "${args[@]}"
fi
# c10d rendezvous: node 0 hosts its store at RDZV_ENDPOINT and the others connect to it (and keep
# retrying until it is there). Saying so (is_host) rather than letting torchrun guess from the
# hostname makes a busy port on node 0 an error, not a connection to whatever holds the port.
# (torchrun's --node-rank only applies to its static rendezvous.)
is_host=false
if ((NODE_RANK == 0)); then is_host=true; fi
# torchrun runs in titan_thd/launcher.py: in a session of its own (the terminal's signals reach this
# script only, which routes them below), with SIGTERM caught and dropped (torchrun would kill its
# ranks after a 30 s grace), and a failing rank's one `error:` line instead of torchrun's report.
"$VENV/bin/python" -m titan_thd.launcher --nnodes="$NNODES" --nproc-per-node="$NGPU" \
  --rdzv-backend c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" --rdzv-conf="is_host=$is_host" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m titan_thd.train --job.config_file "$config_file" "${args[@]}" &
launcher=$!
# SIGTERM goes to the ranks (the launcher's children), not to torchrun: each rank finishes its step,
# saves a checkpoint and exits 0, and torchrun then exits 0 too. Before the ranks exist there is
# nothing to save: then the launcher gets SIGINT and stops.
trap 'pkill -TERM -P "$launcher" || kill -INT "$launcher" 2>/dev/null || true' TERM
# Ctrl-C: the first one does what SIGTERM does; a second one kills the ranks at once (a rank waiting
# in a collective would only see a signal once the collective returns).
interrupts=0
on_interrupt() {
  interrupts=$((interrupts + 1))
  if ((interrupts > 1)); then
    pkill -KILL -P "$launcher" || true
    kill -KILL "$launcher" 2>/dev/null || true
    echo "aborted by a second Ctrl-C: the ranks were killed; nothing saved after the last checkpoint" >&2
    exit 130
  fi
  # (no bare `return` in a trap: it returns the interrupted `wait`'s status, which set -e exits on)
  pkill -INT -P "$launcher" || kill -INT "$launcher" 2>/dev/null || true
}
trap on_interrupt INT
# The terminal's hangup and Ctrl-\ reach the launcher through here too (torchrun stops its ranks).
trap 'kill -HUP "$launcher" 2>/dev/null || true' HUP
trap 'kill -QUIT "$launcher" 2>/dev/null || true' QUIT
status=0
wait "$launcher" || status=$?
while kill -0 "$launcher" 2>/dev/null; do # `wait` returns early when a trap runs
  status=0
  wait "$launcher" || status=$?
done
exit "$status"
