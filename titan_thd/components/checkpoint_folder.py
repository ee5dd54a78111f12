"""A checkpoint folder: its name (`step-N`, `step-N.tmp-<tag>` while written), its `meta.json` (step,
world size, the model fingerprint, every file's size and CRC-32) and the model fingerprint a resume
is checked against. components/checkpoint.py writes and reads the folders; conversions
(scripts/convert_hf.py) write `meta.json` themselves with `write_meta`.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn

from titan_thd.parallel.shards import canonical_name

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-\d+\.tmp-")
META_FILE = "meta.json"
SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<n>.distcp
RESERVED_KEYS = ("model", "optimizer", "lr_scheduler", "rng")
PER_EXPERT_PARAM = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
"""A routed-expert parameter of the layout before stacking (a dsv4 checkpoint to convert)."""


# ============================================================================ fingerprint
def model_fingerprint(model_parts: Sequence[nn.Module], **info: Any) -> dict[str, Any]:
    """`info` (e.g. model="llama", flavor="debug") plus every parameter's name and global shape."""
    params = {}
    for part in model_parts:
        for name, p in part.named_parameters():
            params[canonical_name(name)] = list(p.shape)
    return {**info, "params": params}


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any], limit: int = 8) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they agree)."""

    def some(names: list[str]) -> str:
        return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")

    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if key != "params" and saved.get(key) != current.get(key)
    ]
    old, new = saved.get("params", {}), current.get("params", {})
    only_old = [n for n in old if n not in new]
    only_new = [n for n in new if n not in old]
    reshaped = [f"{n} {old[n]} -> {new[n]}" for n in old if n in new and old[n] != new[n]]
    if only_old:
        diffs.append(f"parameters only in the checkpoint: {some(only_old)}")
    if only_new:
        diffs.append(f"parameters only in this run's model: {some(only_new)}")
    if reshaped:
        diffs.append(f"parameters with other shapes (checkpoint -> this run): {some(reshaped)}")
    return diffs


# ============================================================================ folder helpers
def flat_keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """DCP's flattened keys: nested mappings are joined with '.', everything else is a leaf."""
    keys = []
    for k, v in tree.items():
        if isinstance(v, Mapping):
            keys += flat_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


def check_contents(path: Path, state_dict: Mapping[str, Any]) -> None:
    """ValueError naming the shard files missing from the checkpoint folder `path` (by its DCP index)
    or the entries of `state_dict` it does not hold."""
    if not (path / ".metadata").is_file():
        raise ValueError(f"checkpoint {path}: the DCP index file .metadata is missing")
    metadata = dcp.FileSystemReader(path).read_metadata()
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    absent = [f for f in files if not (path / f).is_file()]
    if absent:
        raise ValueError(f"checkpoint {path}: shard files missing: {', '.join(absent)} (of {len(files)})")
    saved = set(metadata.state_dict_metadata)
    missing = [
        k for k in flat_keys(state_dict) if k not in saved and not any(s.startswith(k + ".") for s in saved)
    ]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {path} lacks entries this run needs: {shown}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_meta(folder: Path, step: int, world_size: int, fingerprint: dict[str, Any]) -> None:
    """meta.json of a checkpoint folder written by one process outside the trainer (a conversion):
    every other file's size and CRC-32, as `CheckpointManager.save` records them."""
    files = {f.name: [f.stat().st_size, crc32(f)] for f in sorted(folder.iterdir()) if f.name != META_FILE}
    meta = {
        "step": step,
        "world_size": world_size,
        "fingerprint": fingerprint,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "files": files,
    }
    (folder / META_FILE).write_text(json.dumps(meta))


def checkpoint_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in `folder` (folders named exactly step-<N>), ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name)))


def resolve_step_dir(path: str | Path, checkpoint_folder: str = "checkpoint") -> Path:
    """The `step-N` folder that `path` (a command line's --checkpoint) names: itself, the newest complete
    step of a checkpoint folder, or of a run folder's `checkpoint_folder`; ValueError otherwise."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--checkpoint {str(path)!r}: no such folder")
    if STEP_DIR.match(p.name) and p.is_dir():
        return p
    for folder in (p, p / checkpoint_folder):
        if steps := checkpoint_steps(folder):
            return folder / f"step-{steps[-1]}"
    raise ValueError(
        f"--checkpoint {str(path)!r}: not a checkpoint (expected RUN/{checkpoint_folder}/step-N, a folder of "
        f"step-N checkpoints, or a run folder holding {checkpoint_folder}/step-N)"
    )
