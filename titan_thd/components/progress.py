"""Start-up never goes quiet: a phase that can run for minutes says what it does when it starts and
then how far it is, every `EVERY` seconds, from a timer thread (docs/results.md §14).

    with Progress("memory plan: measuring saved activations", 6, "forwards", weight=sum(lengths)) as p:
        for n in lengths:
            run(n)
            p.advance(n)         # one part done, of weight n (1 by default)

    "memory plan: measuring saved activations: 2/6 forwards after 41 s, about 80 s left"

With `announce` False the first line comes after `EVERY` seconds (a phase that is usually short).
The ETA is the elapsed time scaled by the weight still to do (each part's weight, 1 by default, of
`weight`, by default the number of parts); before the first part is done the line says how long the
phase has run. Lines go to the
`titan_thd` logger (the ranks that log; `enabled=False` elsewhere), or to `emit` (a command line's
stderr: scripts/convert_hf.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

logger = logging.getLogger("titan_thd")

EVERY = 30.0
"""Seconds between two lines of a running phase."""


class Progress:
    """A phase of `parts` parts (`unit`, e.g. "forwards") weighing `weight` in all; `what` says what
    it does."""

    def __init__(
        self,
        what: str,
        parts: int,
        unit: str = "",
        weight: float | None = None,
        every: float | None = None,
        enabled: bool = True,
        announce: bool = True,
        emit: Callable[[str], None] | None = None,
    ):
        self.what, self.parts, self.unit = what, parts, unit
        self.total = float(parts if weight is None else weight)
        self.every = EVERY if every is None else every
        self.enabled, self.announce = enabled, announce
        self.emit = emit or (lambda line: logger.info("%s", line))
        self.done, self.count = 0.0, 0
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def advance(self, weight: float = 1.0) -> None:
        """One part done (of `weight`, in the units of the phase's `weight`)."""
        self.done += weight
        self.count += 1

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        unit = f" {self.unit}" if self.unit else ""
        text = f"{self.what}: {self.count}/{self.parts}{unit} after {elapsed:.0f} s"
        if 0 < self.done < self.total:
            text += f", about {elapsed * (self.total - self.done) / self.done:.0f} s left"
        return text

    def __enter__(self) -> Progress:
        self.start = time.monotonic()
        if self.enabled:
            if self.announce:
                self.emit(self.line())
            self._thread = threading.Thread(target=self._beat, name="titan_thd-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self.emit(self.line())
