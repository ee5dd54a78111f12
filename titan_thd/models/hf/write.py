"""Write a Hugging Face safetensors folder in files of bounded size, one group of tensors at a time,
and the one safetensors writer of the package (`SafetensorsFile`, also the PEFT adapter file's).

    tensors = DcpExport("RUN/checkpoint/step-60")   # or ModelExport(model): our names -> tensors
    files = write_weights(tensors, out_dir, items, max_shard_size=parse_size("5GB"))

An export's tensors (`ModelExport`, `DcpExport`, titan_thd/export/merge.py `MergedExport`, models/hf/
base.py `FrozenBase`) answer `entries()` (our name -> (shape, dtype)) and `load(names)` (those
tensors, whole). The opposite direction, a folder's tensors read into ours, is models/hf/io.py's
`Source`s.

`items(key, tensor)` yields the HF (name, tensor) pairs of one of our tensors (a family's name
mapping; an expert stack one expert at a time). Tensors are loaded in groups of about
`max_shard_size` bytes (a DCP checkpoint through a partial state dict: only those entries are read),
so the process holds at most one file's worth of tensors being written plus the group being
converted, never the whole model. One file is `model.safetensors`; several are
`model-0000K-of-0000N.safetensors` with `model.safetensors.index.json` (transformers' names, so
`from_pretrained` and `SafetensorsFolder` read them).
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from titan_thd.models.hf.io import DTYPES, INDEX_FILE

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""Bytes per safetensors file, transformers' default ("5GB")."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """Bytes of "5GB" / "500MB" / "2GiB" / "123" (ValueError naming the value otherwise)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class ExportTensors(Protocol):
    """Our tensors an export writes, a group at a time (see the module docstring)."""

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def load(self, names: list[str]) -> dict[str, torch.Tensor]: ...


class ModelExport:
    """The tensors of a model's state dict; a DTensor is gathered with `full_tensor()` when its group
    is loaded (a collective: every rank of its mesh iterates the same groups)."""

    def __init__(self, model: torch.nn.Module):
        self.state = model.state_dict()

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for k in names:
            v = self.state[k]
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = v.detach().cpu()
        return out


class DcpExport:
    """The entries `<prefix><name>` of a DCP checkpoint folder (a trainer checkpoint's `model.` or a
    to-dcp folder), read a group at a time with a partial state dict (DCP reads only those entries)."""

    def __init__(self, path: str | Path, prefix: str = "model."):
        import torch.distributed.checkpoint as dcp

        self.path, self.prefix = Path(path), prefix
        if not (self.path / ".metadata").is_file():
            raise ValueError(f"{self.path}: not a DCP checkpoint (no .metadata)")
        metadata = dcp.FileSystemReader(self.path).read_metadata().state_dict_metadata
        self.metadata = {
            k.removeprefix(prefix): v
            for k, v in metadata.items()
            if k.startswith(prefix) and hasattr(v, "size")
        }

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.size), v.properties.dtype) for k, v in self.metadata.items()}

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        part = {
            f"{self.prefix}{k}": torch.empty(self.metadata[k].size, dtype=self.metadata[k].properties.dtype)
            for k in names
        }
        with warnings.catch_warnings():  # one process, no process group: intended
            warnings.simplefilter("ignore")
            dcp.load(
                part,
                storage_reader=dcp.FileSystemReader(self.path),
                planner=DefaultLoadPlanner(allow_partial_load=True),
            )
        return {k.removeprefix(self.prefix): v for k, v in part.items()}


_HEADER_DTYPE = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """One safetensors file written as its tensors arrive, its header planned from `entries` (name ->
    (shape, dtype)): tensors come in that order (checked), each appended without a copy of the file's
    other tensors; `close()` moves the finished file into place. Data is laid out by decreasing element
    size (as safetensors' own writer), so every tensor starts aligned to its element."""

    def __init__(self, path: Path, entries: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.order = sorted(entries, key=lambda k: -entries[k][1].itemsize)  # stable: same size, same order
        header: dict = {"__metadata__": {"format": "pt"}}
        at = 0
        for name in self.order:
            shape, dtype = entries[name]
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _HEADER_DTYPE[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts on 8 bytes
        self.path, self.tmp, self.entries, self.bytes = path, Path(f"{path}.tmp"), entries, at
        self.written = 0
        self.file = self.tmp.open("wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self.written]
        assert name == expected, (name, expected)
        assert (tuple(tensor.shape), tensor.dtype) == self.entries[name], (name, tensor.shape, tensor.dtype)
        self.file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.written += 1

    def close(self) -> Path:
        """Move the file into place once safetensors' own reader has read its header back: the header
        is written here by hand, so a reader that refuses it is found by the export, not by a server."""
        from safetensors import safe_open

        assert self.written == len(self.order), (self.path, self.written, len(self.order))
        self.file.close()
        with safe_open(str(self.tmp), "pt") as f:
            assert set(f.keys()) == set(self.entries), self.tmp
        self.tmp.replace(self.path)
        return self.path


class ShardedWriter:
    """safetensors files of at most `max_shard_size` bytes (a larger single tensor gets a file of its
    own), written as tensors arrive; `close()` names them and writes the index."""

    def __init__(self, out: Path, max_shard_size: int):
        self.out, self.max = out, max_shard_size
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0
        # `out` is a fresh folder (models/hf/staging.py `staged`): an earlier export's shards are
        # replaced as a set when the new ones move in, and only then.

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + n > self.max:
            self.flush()
        self.buffer[name] = tensor
        self.size += n
        self.total += n

    def flush(self) -> None:
        if not self.buffer:
            return
        f = self.out / f"model-part-{len(self.files):05d}.safetensors.part"
        file = SafetensorsFile(f, {k: (tuple(v.shape), v.dtype) for k, v in self.buffer.items()})
        for name in file.order:
            file.write(name, self.buffer[name])
        self.files.append((file.close(), list(self.buffer)))
        self.buffer, self.size = {}, 0

    def close(self) -> list[Path]:
        self.flush()
        n = len(self.files)
        if n == 1:
            names = [self.out / "model.safetensors"]
        else:
            names = [self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, keys), final in zip(self.files, names, strict=True):
            tmp.replace(final)
            weight_map |= dict.fromkeys(keys, final.name)
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names


def groups(entries: dict[str, tuple[tuple[int, ...], torch.dtype]], max_bytes: int) -> Iterator[list[str]]:
    """Consecutive names whose tensors add up to about `max_bytes` (one name at least)."""
    group, size = [], 0
    for k, (shape, dtype) in entries.items():
        n = math.prod(shape) * dtype.itemsize
        if group and size + n > max_bytes:
            yield group
            group, size = [], 0
        group.append(k)
        size += n
    if group:
        yield group


def write_weights(
    source: ExportTensors,
    out: Path,
    items: Callable[[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]],
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    write: bool = True,
) -> list[Path]:
    """Stream `source` into safetensors files under `out` (see the module docstring). `write` False:
    take part in the collectives of a ModelExport of DTensors without writing (ranks other than 0)."""
    writer = ShardedWriter(out, max_shard_size) if write else None
    # Groups of a quarter file: the buffer of the file being filled plus one group stay ~1.25 files.
    for names in groups(source.entries(), max(1, max_shard_size // 4)):
        loaded = source.load(names)
        for k in names:
            value = loaded.pop(k)
            if writer is not None:
                for name, tensor in items(k, value):
                    writer.add(name, tensor)
            del value
    return writer.close() if writer is not None else []
