"""An export's output folder: never one of its inputs, and written whole or not at all.

    refuse_overlap(out, {"base folder": base, "checkpoint": step_dir})   # ValueError in one line
    with staged(out) as tmp:                # a fresh folder beside `out`
        write everything into tmp
    # here: tmp's files are in `out`; an error above left `out` as it was and removed tmp

Writing into a folder that is, contains or lies inside an input would delete or mix with what the
export is reading (a merge into the base folder used to remove the base's `model.safetensors` before
reading it). Staging beside the target (same file system: the renames are atomic) means a crash, a
full disk or a bad tensor halfway leaves the old output intact and no half-written one.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

STALE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json)$")
"""Files of an earlier export that a new one replaces as a set: a 3-file export over a 5-file one
must not leave files 4 and 5 behind (the index would not name them, transformers' glob would)."""


def refuse_overlap(out: Path, inputs: Mapping[str, Path | str | None]) -> None:
    """ValueError when `out` is, contains or lies inside one of `inputs` ({what: path}; None skipped)."""
    o = Path(out).resolve()
    for what, path in inputs.items():
        if path is None:
            continue
        i = Path(path).resolve()
        if o == i:
            rel = "is"
        elif i in o.parents:
            rel = "lies inside"
        elif o in i.parents:
            rel = "contains"
        else:
            continue
        raise ValueError(f"{out}: the output folder {rel} the {what} {path}; write to a folder outside it")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out` to write the export into. On success its files move into `out`
    (created if missing; an earlier export's shards and index go first, other files stay unless
    replaced by name); on an error `out` is untouched and the staging folder is removed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder; name a folder for the export")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would make the export private to its writer
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not out.exists():
        tmp.rename(out)
        return
    for old in out.iterdir():
        if STALE.match(old.name):
            old.unlink()
    for new in tmp.iterdir():
        target = out / new.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(new, target)
    tmp.rmdir()
