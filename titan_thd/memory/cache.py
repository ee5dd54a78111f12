"""Activation measurements kept on disk per model shape: a dry run that measures on narrowed copies
(a minute or more of CPU for DSv4-Flash) measures once per model, microbatch length, dtype and
recomputation, whatever the layout (dp, cp at the same tokens per rank, ep, pp: the per-layer bytes
are the same), and reads the figures back in the next dry run (docs/results.md §14).

    value = cache.load(key)              # None: not measured yet (or unreadable)
    cache.store(key, value)              # JSON, written atomically

The key holds the measurement's inputs and a fingerprint of this package's source and torch's
version, so a change to any model, to the measurement or to torch measures again. Where:
$TITAN_THD_CACHE, else $XDG_CACHE_HOME/titan_thd, else ~/.cache/titan_thd (`TITAN_THD_CACHE=off`
disables it); a cache that cannot be read or written is measured around, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

PACKAGE = Path(__file__).resolve().parents[1]


@functools.cache
def source_fingerprint() -> str:
    """sha256 of every .py file of the titan_thd package (path and content) and torch's version."""
    h = hashlib.sha256(torch.__version__.encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def folder() -> Path | None:
    """The cache folder (None: disabled)."""
    root = os.environ.get("TITAN_THD_CACHE", "")
    if root == "off":
        return None
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "titan_thd")
    return Path(root) / "activations"


def path_of(key: str) -> Path | None:
    where = folder()
    if where is None:
        return None
    digest = hashlib.sha256((source_fingerprint() + "\0" + key).encode()).hexdigest()[:32]
    return where / f"{digest}.json"


def load(key: str) -> Any | None:
    """The value stored under `key` by this source and torch (None when there is none)."""
    path = path_of(key)
    try:
        record = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    return record["value"] if isinstance(record, dict) and record.get("key") == key else None


def store(key: str, value: Any) -> Path | None:
    """Write `value` (JSON-able) under `key`; the file, or None where the cache is off or not writable."""
    path = path_of(key)
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "value": value}))
        os.replace(tmp, path)
    except OSError:
        return None
    return path
