"""SIGTERM and Ctrl-C (SIGINT) → "finish this step, save a checkpoint and exit 0".

The handler only sets a flag: the step in flight (and a save in flight) finishes normally. The
Trainer asks `any_rank(stop.requested)` after every step, which agrees on the flag over all ranks
(a scheduler may signal the ranks at slightly different times, and every rank must stop after the
same step or the collectives of the next step would hang).

A second Ctrl-C ends the process at once with exit code 130 and one line, without a traceback
(nothing is saved after the last checkpoint). A second SIGTERM changes nothing (schedulers repeat
it while they wait for the job to end), nor does a first Ctrl-C after a SIGTERM.

run_train.sh with several processes routes the terminal's Ctrl-C itself: the first one reaches
every rank as SIGINT, the second kills the ranks (a rank blocked in a collective would only run a
Python handler once the collective returns).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

logger = logging.getLogger("titan_thd")

ABORT_EXIT_CODE = 130
"""Exit code of a run that a second Ctrl-C aborted (128 + SIGINT, what a shell reports)."""


class StopSignal:
    """Records the first of `signals` that arrived since `install()`; `announce` logs it at once."""

    def __init__(
        self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT), announce: bool = True
    ) -> None:
        self.signals = signals
        self.announce = announce
        self.received: signal.Signals | None = None
        self._seen: set[signal.Signals] = set()
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        # Python only delivers signals to the main thread; elsewhere (a test runner thread) the
        # default behaviour stays in place.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if sig == signal.SIGINT and signal.SIGINT in self._seen:
            # Flushed by hand: os._exit skips the interpreter's shutdown (see titan_thd/exits.py).
            print(
                "aborted by a second Ctrl-C: nothing saved after the last checkpoint",
                file=sys.stderr,
                flush=True,
            )
            os._exit(ABORT_EXIT_CODE)
        self._seen.add(sig)
        if self.received is None:
            self.received = sig
            if self.announce:
                logger.warning(
                    "stop requested (%s): finishing this step, then saving and exiting%s",
                    sig.name,
                    "; Ctrl-C again aborts at once without saving" if sig == signal.SIGINT else "",
                )

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
