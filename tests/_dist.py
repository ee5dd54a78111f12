"""The multi-process test helper lives in the package (scripts use it too); tests import it from here."""

from titan_thd.parallel.spawn import free_port, spawn

__all__ = ["free_port", "spawn"]
