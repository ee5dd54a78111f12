"""torchrun as run_train.sh starts it (several processes): the signals that run_train.sh routes, and
a failing rank's one line instead of torchrun's failure report.

    python -m titan_thd.launcher [torchrun arguments] -m titan_thd.train [trainer arguments]

Signals:
- The launcher runs in a session of its own, so the terminal's Ctrl-C reaches run_train.sh only,
  which routes it: the first one to every rank as SIGINT (they finish the step, save, exit 0), a
  second one kills the ranks and the launcher. The launcher dies with run_train.sh
  (PR_SET_PDEATHSIG), and the ranks die with the launcher (`die_with_launcher`).
- SIGTERM is caught and dropped: torchrun answers a SIGTERM of its own by killing its ranks after a
  30 s grace and exiting 1, and SLURM signals every process of a job step, torchrun included. The
  ranks get the SIGTERM too (from SLURM, or from run_train.sh) and stop after their step.
- SIGINT stops the launch (exit 130); run_train.sh sends it only before the ranks exist. torchrun
  handles SIGHUP and SIGQUIT itself (it stops its ranks); run_train.sh forwards those.

Failures (titan_thd/exits.py): the ranks leave their one-line report to the launcher. When ranks
fail and one of them wrote such a line into its torchrun error file (a user error: exit code 2; a
run failure: 1; Ctrl-C during start-up: 130), the launcher prints that line, of rank 0 when rank 0
has one, else of the lowest rank, and exits with its code. Ranks that failed only because another
one did carry that rank's line, so every node of a multi-node run prints the same line. A crash (a
bug) ends with torchrun's report: the crashed rank's traceback, and for the ranks that lost it as
a peer one line each.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

from titan_thd.parallel.distributed import die_with_parent

LAUNCHER_ENV = "TITAN_THD_LAUNCHER"
"""Set (to 1) by the launcher for its ranks: the launcher prints a failing rank's one line."""
ERROR_FILE_KEY = "titan_thd"
"""The key of this project's entry in a torchrun error file (titan_thd/exits.py writes it):
{"code", "rank", "cause", "crash"} (cause: the rank that failed first, this rank itself unless it
failed because that one did; crash: that failure was a bug, whose traceback torchrun's report shows)."""


def reported_failure(failures: dict[int, ProcessFailure]) -> tuple[str, int] | None:
    """(line, exit code) of the failure that a rank reported in one line; None when the first
    failure was a crash (or no rank said anything): then torchrun's report tells it."""
    entries = {
        rank: f.error_file_data[ERROR_FILE_KEY]
        for rank, f in failures.items()
        if isinstance(f.error_file_data, dict) and ERROR_FILE_KEY in f.error_file_data
    }
    if not entries:
        return None
    own = [rank for rank, entry in entries.items() if entry["cause"] == entry["rank"]]
    rank = min(own or entries)  # rank 0 first; a consequence only when no cause is among these ranks
    if entries[rank]["crash"]:
        return None
    return failures[rank].error_file_data["message"], int(entries[rank]["code"])


def stop_the_launch(signum: int, frame: object) -> None:
    print("stopped before the ranks started: nothing to save", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def main(argv: list[str]) -> int:
    try:
        os.setsid()
    except PermissionError:  # already a session leader: the terminal's signals are not ours anyway
        pass
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, stop_the_launch)
    os.environ[LAUNCHER_ENV] = "1"  # inherited by the ranks
    # torchrun logs each failed and each stopped rank (ERROR / WARNING): the report below says it once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = parse_args(["--signals-to-handle", "SIGHUP,SIGQUIT", *argv])
    try:
        run(args)
    except ChildFailedError as e:
        reported = reported_failure(e.failures)
        if reported is None:
            print(e, file=sys.stderr)  # torchrun's report (without the launcher's own traceback)
            return 1
        line, code = reported
        print(line, file=sys.stderr)
        return code
    except SignalException as e:  # SIGHUP / SIGQUIT: torchrun stopped the ranks
        print(f"stopped by {e.sigval.name}: the ranks were stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    sys.exit(main(sys.argv[1:]))
