"""How a rank ends: one line and an exit code for what went wrong, and the exit itself.

Exit codes: 0 the run finished, or a stop signal ended it after a step (SIGTERM, Ctrl-C); 2 bad
input (`USER_ERRORS`: the message says what to fix); 1 a run failure (`RUN_FAILURES`: the message
says what was kept) or a crash (a bug, which keeps its traceback); 130 Ctrl-C before the first step
or a second Ctrl-C.

`report(line, code)` says why a rank ends with one line, in up to three places:
- stderr, unless `titan_thd.launcher` (what run_train.sh starts torchrun with) prints it: the
  launcher prints the one line of the rank that failed, after torchrun, instead of torchrun's
  failure report;
- under torchrun, this rank's torchrun error file (TORCHELASTIC_ERROR_FILE), which the launcher reads;
- in a multi-process torchrun run, the rendezvous store: a failing rank leaves its collectives,
  so the others then fail on a lost connection; `peer_failure()` finds the line there, and such a
  rank ends with the same code and its error file names the rank that failed, without a
  traceback of the lost connection.

`exit_process(code)` ends the process without finalizing the interpreter. The reason is a race in
torch 2.13's gloo backend: a worker thread of `ProcessGroupGloo` (`pt_gloo_runloop`) marks a
collective complete, which lets the caller return, and only afterwards drops its reference to the
work object; when that is the last one, the work's tensors (Python-owned) are freed on that thread,
which takes the GIL to do so. If the main thread has meanwhile returned from `main()` and started
finalizing, Python 3.11 ends any thread that takes the GIL with `pthread_exit`, whose unwinding
through the work's `noexcept` destructor calls `std::terminate`: SIGABRT, exit code -6, after every
step ran and was logged (the CI flake of a DP2 x CP2 run; the core dump of a reproduction shows
`~AsyncBarrierWork` -> `take_gil` -> `PyThread_exit_thread` -> `std::terminate`). The worker
threads are joined only when the process group objects are destroyed; `destroy_process_group` does
not destroy them, and torch's own DTensor caches keep them alive until finalization. A process that
ends with `os._exit` after flushing its output has no finalization for such a thread to run into.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from titan_thd.components.checkpoint import CheckpointError
from titan_thd.config import Config
from titan_thd.launcher import ERROR_FILE_KEY, LAUNCHER_ENV

logger = logging.getLogger("titan_thd")

# What bad input raises (a wrong value, a missing or unreadable file): one `error:` line and exit
# code 2; anything else is a bug and keeps its traceback.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
# What stops a run that started well: a save that failed on some rank (full disk), a non-finite
# loss or gradient. The messages say what was kept; exit code 1.
RUN_FAILURES = (CheckpointError, FloatingPointError)
INTERRUPTED = 130
"""Exit code of a run that Ctrl-C ended before its first step (128 + SIGINT, as a shell reports it)."""
DEBUG_ENV = "TITAN_THD_DEBUG"
"""Environment variable: `TITAN_THD_DEBUG=1` shows the traceback of user errors too."""


def one_line(error: BaseException) -> str:
    """A (possibly multi-line) error message as one line, for the `error:` line of the command lines."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    out = lines[0] if lines else type(error).__name__
    for line in lines[1:]:
        out += (" " if out.endswith(":") else "; ") + line
    return out


def check_finite(step: int, values: dict[str, float]) -> None:
    """FloatingPointError (a run failure) when a step's global values are not all finite: it is
    raised before the optimizer step, so neither the weights nor a checkpoint hold that step."""
    if not all(math.isfinite(v) for v in values.values()):
        raise FloatingPointError(
            f"step {step}: not finite: "
            + ", ".join(f"{k} = {v}" for k, v in values.items())
            + ". Stopped before the optimizer step: neither the weights nor a checkpoint hold this "
            "step (the newest checkpoint is the last good state); lower optimizer.lr or check the data"
        )


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def failure_code(e: Exception) -> int | None:
    """The exit code of a rank that `e` ends, after its one-line report; None for a bug (and for
    everything with TITAN_THD_DEBUG=1): then `e` keeps its traceback."""
    if debug_enabled():
        return None
    code = peer_failure()  # first: a lost peer can also surface here as, e.g., a failed save
    if code is not None:
        return code
    if isinstance(e, USER_ERRORS):  # the message says what to fix, a traceback would not
        return report(f"error: {e}", 2)
    if isinstance(e, RUN_FAILURES):  # the run itself failed (a save, a diverging step)
        return report(f"error: {e}", 1)
    # A bug: its traceback follows (run_main); the other ranks only need to know that they lost a
    # peer to it, not to add their own traceback of the lost connection.
    _publish(f"rank {_rank()} crashed: {type(e).__name__}: {e}", 1, crash=True)
    return None


def report(line: str, code: int) -> int:
    """Say why this rank ends (see the module docstring); returns `code`."""
    if os.environ.get(LAUNCHER_ENV) != "1":
        print(line, file=sys.stderr, flush=True)
    _write_error_file(line, {"code": code, "rank": _rank(), "cause": _rank(), "crash": False})
    _publish(line, code, crash=False)
    return code


def peer_failure() -> int | None:
    """When another rank of this torchrun run has failed (reported, or crashed): note it in this
    rank's error file and return its exit code (this rank's own error is its consequence); else None."""
    store = _store()
    try:
        if store is None or not store.check([_failure_key()]):
            return None
        failure = json.loads(store.get(_failure_key()))
    except RuntimeError:  # no store, no known cause: this rank's own error is the report
        return None
    logger.info("rank %d: stopped because rank %d failed", _rank(), failure["rank"])
    entry = {"code": failure["code"], "rank": _rank(), "cause": failure["rank"], "crash": failure["crash"]}
    _write_error_file(failure["line"], entry)
    return failure["code"]


def record_crash() -> None:
    """The traceback of the exception being handled into this rank's torchrun error file: torchrun's
    report shows it, also for a rank whose console output is not shown."""
    _write_error_file(traceback.format_exc(), {"code": 1, "rank": _rank(), "cause": _rank(), "crash": True})


def stopped_line(
    received: signal.Signals | None, step: int, saved: Path | None, argv: list[str], cfg: Config
) -> str:
    """The last line of a run that a stop signal ended: its checkpoint and the command that resumes."""
    how = f"stopped by {received.name if received else 'a signal to another rank'} after step {step}"
    if saved is None:
        return (
            f"{how}, without a checkpoint (checkpoint.enable = false): run with --checkpoint.enable true "
            "to save one when stopped and to resume from it"
        )
    return f"{how}: checkpoint {saved}; resume with: {resume_command(argv, cfg)}"


def summary_line(
    cfg: Config,
    argv: list[str],
    *,
    first_step: int,
    step: int,
    tokens: int,
    seconds: float,
    loss: float | None,
    checkpoint: Path | None,
    stopped: bool,
) -> str:
    """What a run did and where its outputs are: the last line of a finished run; a stopped run's
    `stopped_line` follows it (it names the checkpoint and the resume command). `first_step`: the
    step the run started after (the resumed checkpoint's); `checkpoint`: the newest one, or None."""
    minutes, secs = divmod(round(seconds), 60)
    did = (
        f"steps {first_step + 1}-{step} of {cfg.training.steps}"
        if step > first_step
        else f"no step (at step {step})"
    )
    final = f", final loss {loss:.4f}" if loss is not None else ""
    dump = Path(cfg.job.dump_folder)
    tb = f", TensorBoard {dump / 'tb'}" if cfg.metrics.enable_tensorboard else ""
    if stopped:
        ckpt = ""
    elif checkpoint is None:
        ckpt = "; no checkpoint (--checkpoint.enable true saves them and resumes)"
    else:
        more = f"; {train_further(argv, cfg, step)}" if step >= cfg.training.steps else ""
        ckpt = f"; checkpoint {checkpoint}; resume with: {resume_command(argv, cfg)}{more}"
    return (
        f"summary: {did}, {tokens:,} tokens in all, {minutes}m{secs:02d}s{final}; "
        f"metrics {dump / 'metrics.jsonl'}{tb}{ckpt}"
    )


def train_further(argv: list[str], cfg: Config, step: int) -> str:
    """How a finished run trains on, as a command that is accepted as printed (to twice its steps). With
    `lr_scheduler.total_steps = 0` the schedule's length is training.steps, so more steps change the
    LR schedule, a run setting that a resume refuses unless checkpoint.allow_changes names it
    (components/run_settings.py): the command names it, and the message says what it changes."""
    more = ["--training.steps", str(2 * step)]
    pinned = cfg.lr_scheduler.total_steps
    if pinned:
        why = f"the LR schedule keeps its lr_scheduler.total_steps = {pinned}"
    else:
        key = "lr_scheduler.total_steps"
        allowed = [*cfg.checkpoint.allow_changes, *([key] * (key not in cfg.checkpoint.allow_changes))]
        more += ["--checkpoint.allow_changes", ",".join(allowed)]
        why = f"the LR schedule is {2 * step} steps long from here on"
    kept, rest = [], iter(argv)  # the values replaced: each flag once in the command
    for arg in rest:
        if arg in more[::2]:
            next(rest, None)
        elif arg.split("=")[0] not in more[::2]:
            kept.append(arg)
    return f"to train to step {2 * step} ({why}): {resume_command([*kept, *more], cfg)}"


def resume_command(argv: list[str], cfg: Config) -> str:
    """The run_train.sh command of this run (`argv`: the trainer's arguments), which resumes it."""
    args, rest = [], iter(argv)
    for arg in rest:
        if arg == "--job.config_file":
            next(rest, None)
        elif not arg.startswith("--job.config_file="):
            args.append(arg)
    if cfg.checkpoint.load_step != -1:  # the last value of a key wins: resume from the newest
        args += ["--checkpoint.load_step", "-1"]
    config = Path(cfg.job.config_file)
    recipes = Path(__file__).resolve().parents[1] / "train_configs"
    name = config.name if config.resolve().parent == recipes else str(config or "<config>")
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    env = [f"NGPU={local}"] * (local > 1) + [f"NNODES={world // local}"] * (world > local)
    command = shlex.join([*env, "./run_train.sh", "--config", name, *args])
    return command + (" (on every node)" if world > local else "")


def run_main(main: Callable[[], int]) -> NoReturn:
    """`python -m titan_thd.train`: `main()`, then `exit_process` with its code; a crash (a bug)
    prints its traceback as Python would and exits 1."""
    try:
        code = main()
    except KeyboardInterrupt:  # after main's own handling: during the teardown of a finished run
        code = INTERRUPTED
    except Exception:
        sys.excepthook(*sys.exc_info())
        record_crash()
        code = 1
    exit_process(code)


def exit_process(code: int) -> NoReturn:
    """Flush the output and end the process with `code`, without finalizing the interpreter (the
    gloo shutdown race of the module docstring)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say there
            pass
    os._exit(code)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_error_file(message: str, entry: dict) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time()), ERROR_FILE_KEY: entry}, f)
    except OSError as e:  # the line is still on stderr or in the store
        logger.warning("could not write the torchrun error file %s: %s", path, e)


def _publish(line: str, code: int, crash: bool) -> None:
    """This rank's failure in the rendezvous store (the first one stays: that is the cause)."""
    store = _store()
    if store is None:
        return
    try:
        failure = json.dumps({"line": line, "code": code, "rank": _rank(), "crash": crash})
        store.compare_set(_failure_key(), "", failure)
    except RuntimeError as e:  # the launcher still has the error file
        logger.warning("could not publish this rank's failure in the rendezvous store: %s", e)


def _failure_key() -> str:
    run, attempt = (
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )
    return f"titan_thd/failure/{run}/{attempt}"


def _store() -> dist.TCPStore | None:
    """A client of torchrun's rendezvous store (None outside a multi-process torchrun run, or when
    the store is gone: then the launcher has nothing to read anyway)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=10),
            wait_for_workers=False,
        )
    except (KeyError, ValueError, RuntimeError) as e:
        logger.warning(
            "rendezvous store not reachable (%s): the other ranks cannot read this rank's error", e
        )
        return None
