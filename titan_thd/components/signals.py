"""SIGTERM → "save a checkpoint and exit after this step".

The handler only sets a flag: the step in flight (and a save in flight) finishes normally. The
trainer asks `CheckpointManager.should_stop()` after every step, which agrees on the flag over
all ranks (a scheduler may signal the ranks at slightly different times, and every rank must
stop after the same step or the collectives of the next step would hang).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class StopSignal:
    """Records whether one of `signals` arrived since `install()`."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        # Python only delivers signals to the main thread; elsewhere (a test runner thread) the
        # default behaviour stays in place.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
