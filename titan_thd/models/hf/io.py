"""Read a Hugging Face safetensors folder slice by slice into a model's (possibly sharded) tensors.

A family's adapter (`HFAdapter.sources`, models/hf/adapter.py) says how each of its tensors is made
of stored ones (a `Source`: one stored tensor, a stack of per-expert tensors, a part of a fused
tensor, a dequantised pair); this module does the rest, identically for every parallel layout:

    folder = SafetensorsFolder(path)          # index + every header checked; no tensor data read
    load_sources(model, sources, folder)      # each rank reads only the slices it owns

The model's tensors are plain (one process: the slice is the whole tensor) or DTensors of any
placement DCP can save (FSDP / HSDP Shard(0), TP Shard(0|1), EP Shard(0), (Shard(0), Shard(k))):
`parallel/shards.local_box` (through DCP's planner's `compute_local_shape_and_global_offset`) gives
the box of the global tensor that this rank holds, and only that box is read (safetensors'
`get_slice`). `folder.bytes_read` counts the bytes requested, so a test can check that a rank reads
about its share.

Bad input is found before anything is written: a file named in the index but missing, a file shorter
than its header says (truncated), a header that is not JSON or names an unknown dtype (ValueError
naming the file and the tensor).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from titan_thd.models.hf.quant import Format
from titan_thd.parallel.shards import canonical_name, local_box

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
"""safetensors header dtype -> torch dtype (the ones a checkpoint of ours or DeepSeek's holds)."""


@dataclass(frozen=True)
class Stored:
    """One tensor of the folder, as its file's header describes it."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.name} in {self.file}"


class SafetensorsFolder:
    """The tensors of a folder of safetensors files (with or without model.safetensors.index.json);
    headers only until `read`. ValueError naming the file (and a tensor) for a missing shard, a
    truncated file or an unreadable header."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors: dict[str, Stored] = {}
        self.bytes_read = 0
        """Bytes requested from slices so far (tensor data only, headers not counted)."""
        self._handles: dict[Path, object] = {}
        self.raw_headers: dict[Path, tuple[int, bytes, list[tuple[int, int]]]] = {}
        """file -> (its size, its header's bytes, each tensor's data offsets), as parsed: what
        `folder_fingerprint` hashes, so a start-up that fingerprints its base parses no header twice."""
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (ValueError, KeyError, TypeError, AssertionError) as e:
                raise ValueError(f"{index}: not a safetensors index with a weight_map ({e})") from None
            by_file: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                by_file.setdefault(file, []).append(name)
            for file, names in sorted(by_file.items()):
                f = self.path / file
                if not f.is_file():
                    raise ValueError(
                        f"{index} names {f} for {names[0]} ({len(names)} tensors), but that file is missing"
                    )
                header = self._header(f)
                absent = [n for n in names if n not in header]
                if absent:
                    raise ValueError(f"{index} maps {absent[0]} to {f}, but that file does not hold it")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ValueError(
                    f"{self.path}: no *.safetensors files (a Hugging Face folder holds config.json + "
                    "*.safetensors)"
                )
            for f in files:
                self._header(f)

    def _header(self, f: Path) -> dict:
        """Parse `f`'s header, register its tensors, check that the file holds every byte it names."""
        size = f.stat().st_size
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size - 8:
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                raw = fh.read(n)
                header = json.loads(raw)
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{f}: not a safetensors file (unreadable header: {e})") from None
        header.pop("__metadata__", None)
        offsets = []
        for name, info in header.items():
            try:
                begin, end = info["data_offsets"]
                dtype, shape = info["dtype"], tuple(info["shape"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{f}: {name}: malformed header entry {info!r}") from None
            if 8 + n + end > size:
                raise ValueError(
                    f"{f}: truncated: {name} ends at byte {8 + n + end}, the file has {size} bytes"
                )
            if dtype not in DTYPES:
                raise ValueError(
                    f"{f}: {name} has dtype {dtype!r}, an unknown format (known: {', '.join(DTYPES)})"
                )
            if name in self.tensors:
                raise ValueError(f"{f}: {name} is also in {self.tensors[name].file}")
            self.tensors[name] = Stored(name, f, DTYPES[dtype], shape)
            offsets.append((int(begin), int(end)))
        self.raw_headers[f] = (size, raw, offsets)
        return header

    def read(self, stored: Stored, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The `box` (one slice per dimension, None = all) of a stored tensor, in its stored dtype."""
        from safetensors import safe_open

        handle = self._handles.get(stored.file)
        if handle is None:
            # One file open at a time: the pages read from an open (memory-mapped) file stay in the
            # process's RSS until it is closed; the tensors returned are copies.
            self._handles.clear()
            handle = self._handles[stored.file] = safe_open(str(stored.file), "pt")
        if box is None or all(s.start == 0 and s.stop == n for s, n in zip(box, stored.shape, strict=True)):
            out = handle.get_tensor(stored.name)
        else:
            out = handle.get_slice(stored.name)[box]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self._handles.clear()

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in self.tensors.values())


class Source:
    """How one of our tensors is made of stored ones: its global `shape` and `read(folder, box)`,
    the float / stored-dtype values of a box (one slice per dimension) of it. A block-quantised one
    (dsv4's `Quantized`, a stack of them) also says its `format` and reads its stored `read_codes`."""

    shape: tuple[int, ...]
    origin: str
    """The stored tensor(s) it reads, for error messages ("name in file")."""

    @property
    def format(self) -> Format | None:
        """How the folder stores it block-quantised (models/hf/quant.py); None: as plain values."""
        return None

    def read(self, folder: SafetensorsFolder, box: tuple[slice, ...]) -> torch.Tensor:
        raise NotImplementedError

    def read_codes(
        self, folder: SafetensorsFolder, box: tuple[slice, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stored codes of a box as bytes, the scale blocks that cover it as stored), for a box
        on whole blocks of `format`; only a source with a format has codes."""
        raise TypeError(f"{self.origin} is not block-quantised (format None): it has no codes to read")


class Plain(Source):
    def __init__(self, stored: Stored):
        self.stored, self.shape, self.origin = stored, stored.shape, str(stored)

    def read(self, folder: SafetensorsFolder, box: tuple[slice, ...]) -> torch.Tensor:
        return folder.read(self.stored, box)


class Stacked(Source):
    """Per-expert tensors stacked on a new dim 0: a box reads only its experts, each only its box."""

    def __init__(self, parts: list[Source]):
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"{parts[0].origin}: the stacked tensors have different shapes {sorted(shapes)}")
        self.parts, self.shape = parts, (len(parts), *parts[0].shape)
        self.origin = f"{parts[0].origin} (and {len(parts) - 1} more)"

    @property
    def format(self) -> Format | None:
        """The parts' format when they share one (None: plain, or stored differently)."""
        formats = {p.format for p in self.parts}
        return formats.pop() if len(formats) == 1 else None

    def read(self, folder: SafetensorsFolder, box: tuple[slice, ...]) -> torch.Tensor:
        rows = [self.parts[e].read(folder, box[1:]) for e in range(box[0].start, box[0].stop)]
        if not rows:
            return torch.empty(0, *(s.stop - s.start for s in box[1:]))
        return torch.stack(rows)

    def read_codes(
        self, folder: SafetensorsFolder, box: tuple[slice, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # This rank's experts (expert parallelism splits every stack on whole experts: one at least).
        pairs = [self.parts[e].read_codes(folder, box[1:]) for e in range(box[0].start, box[0].stop)]
        assert pairs, (self.origin, box)
        return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


class Narrowed(Source):
    """`length` entries of `dim` from `start` of another source (a half of a fused tensor)."""

    def __init__(self, inner: Source, dim: int, start: int, length: int):
        self.inner, self.dim, self.start = inner, dim, start
        self.shape = tuple(length if d == dim else n for d, n in enumerate(inner.shape))
        self.origin = inner.origin

    def read(self, folder: SafetensorsFolder, box: tuple[slice, ...]) -> torch.Tensor:
        s = box[self.dim]
        shifted = slice(s.start + self.start, s.stop + self.start)
        return self.inner.read(folder, (*box[: self.dim], shifted, *box[self.dim + 1 :]))


@dataclass
class LoadStats:
    tensors: int
    bytes_read: int
    """Bytes this rank requested from the folder's slices (scales included)."""
    folder_bytes: int
    """Bytes of tensor data in the folder (what a full read reads)."""


def check_fits(
    sources: dict[str, Source],
    expected: dict[str, tuple[int, ...]],
    where: str,
    family: str,
    optional: Iterable[str] = (),
) -> list[str]:
    """ValueError (one line) unless `sources` covers `expected` (our names -> global shapes) with the
    same shapes; keys in `optional` may be absent. Returns the absent optional keys."""
    missing = sorted(set(expected) - set(sources))
    unexpected = sorted(set(sources) - set(expected))
    absent = [k for k in missing if k in set(optional)]
    missing = [k for k in missing if k not in set(optional)]
    if missing or unexpected:
        raise ValueError(
            f"{where} does not fit the {family} model: {len(missing)} missing tensors {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; {len(unexpected)} unexpected tensors {unexpected[:20]}"
            f"{' (e.g. ' + sources[unexpected[0]].origin + ')' if unexpected else ''}"
        )
    shapes = [
        f"{k}: {tuple(sources[k].shape)} vs model {tuple(shape)} ({sources[k].origin})"
        for k, shape in expected.items()
        if k in sources and tuple(sources[k].shape) != tuple(shape)
    ]
    if shapes:
        raise ValueError(f"{where}: tensors with the wrong shape: " + "; ".join(shapes[:20]))
    return absent


@torch.no_grad()
def load_sources(model: nn.Module, sources: dict[str, Source], folder: SafetensorsFolder) -> LoadStats:
    """Fill every tensor of `model`'s state dict that `sources` names, in place, each rank its own box
    (call `check_fits` first: nothing here refuses input, so a refusal writes nothing)."""
    start, n = folder.bytes_read, 0
    for key, t in model.state_dict().items():
        source = sources.get(canonical_name(key))
        if source is None:
            continue
        local, box = local_box(t)
        assert len(box) == len(source.shape), (key, box, source.shape)
        if local.numel():
            local.copy_(source.read(folder, box).to(local.dtype))
        n += 1
    folder.close()
    return LoadStats(n, folder.bytes_read - start, folder.total_bytes)


FINGERPRINT_SAMPLE = 4096
"""Bytes of tensor data `folder_fingerprint` reads at the start, the middle and the end of each file."""
TENSOR_SAMPLE = 16
"""Bytes it reads at the start, the middle and the end of each tensor."""


def folder_fingerprint(path: str | Path, parsed: SafetensorsFolder | None = None) -> str:
    """A short hash of what identifies a Hugging Face folder's weights without reading them: config.json,
    the index, every safetensors file's size and header, three samples of each file's tensor bytes and
    three of each tensor's (its first, middle and last 16 bytes: so two checkpoints of one architecture,
    whose headers agree, differ, and so does a folder with one tensor replaced; a change confined to
    bytes not sampled goes unseen). A LoRA run records its base's. 70k tensors (Flash's count) in 7 files:
    1.4 s from the page cache on a 2-core CPU box, 0.85 s of it parsing the headers. `parsed`: the
    folder's headers as already read (`SafetensorsFolder.raw_headers`), not read again."""
    folder = Path(path)
    known = parsed.raw_headers if parsed is not None else {}
    h = hashlib.blake2b(digest_size=12)
    for name in ("config.json", INDEX_FILE):
        if (folder / name).is_file():
            h.update(name.encode() + (folder / name).read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb", buffering=0) as fh:
            if f in known:
                size, header, offsets = known[f]
                n = len(header)
            else:  # a file the index does not name, or no parsed folder
                size = f.stat().st_size
                (n,) = struct.unpack("<Q", fh.read(8))
                header = fh.read(n)
                offsets = _data_offsets(header)
            h.update(f"{f.name}/{size}/".encode() + header)
            data = size - 8 - n
            spans = [(at, FINGERPRINT_SAMPLE) for at in (0, data // 2, max(0, data - FINGERPRINT_SAMPLE))]
            fd = fh.fileno()
            for at, length in sorted(spans + _tensor_samples(offsets)):  # in file order
                h.update(os.pread(fd, length, 8 + n + at))
    return h.hexdigest()


def _data_offsets(header: bytes) -> list[tuple[int, int]]:
    """(begin, end) in the data of each tensor a safetensors header names (none when it does not
    parse: the load reports that)."""
    try:
        entries = json.loads(header)
        return [
            (int(b), int(e))
            for k, v in entries.items()
            if k != "__metadata__"
            for b, e in [v["data_offsets"]]
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []


def _tensor_samples(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset in the data, length) of the first, middle and last TENSOR_SAMPLE bytes of each tensor."""
    spans = []
    for begin, end in ranges:
        length = min(TENSOR_SAMPLE, max(0, end - begin))
        if length:
            mid = max(begin, (begin + end - length) // 2)
            spans += [(begin, length), (mid, length), (end - length, length)]
    return spans
