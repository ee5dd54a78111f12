"""Token store: every sample of the dataset as token ids + target mask, with its length known up front.

The planner needs all sample lengths before it reads any tokens (every rank plans the same
global batch from `lengths`, then reads only its own samples), so a store exposes
`lengths` / `num_targets` as arrays and materialises a sample only on `store[i]`.

Sources:
- `mock`: lengths from `mock.mock_lengths`, tokens generated on the fly per (seed, index);
  every token except the first is a target.
- `jsonl` / `parquet`: every record is tokenised once (chat template or pre-training text) into
  flat arrays `ids.npy` (int32), `target_mask.npy` (bool), `offsets.npy` (int64 [n+1]) and
  `num_targets.npy`, cached under `cache_dir/<name>-<key>/`. The key hashes the absolute path,
  size and mtime of the file, the tokenizer identity, the schema, the reader and CACHE_VERSION,
  so changing any of them re-tokenises. The cache folder is written under a temporary name and
  renamed into place, so a crash never leaves a half cache; on reuse the arrays are
  memory-mapped. Ranks that build at the same time race harmlessly: the first rename wins and the
  others discard their copy. `cache_dir=""` keeps everything in memory.

Overlong samples (`view(max_len, overlong)`): `truncate` keeps the first `max_len` tokens (a
truncated conversation loses its tail, including the final eos); `drop` removes the sample.
Both are counted (`num_truncated`, `num_dropped`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from titan_thd.data.mock import mock_lengths, mock_tokens
from titan_thd.data.sources import Record, read_records, resolve_data_path
from titan_thd.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_VERSION = "titan_thd-tokens-v1"
_ARRAYS = ("ids", "target_mask", "offsets", "num_targets")
_CHUNK = 512  # records per tokenisation task
_PARALLEL_MIN_BYTES = 16 << 20  # below this a worker pool costs more than it saves


@dataclass
class Sample:
    input_ids: np.ndarray
    """[L] int32 token ids."""
    target_mask: np.ndarray
    """[L] bool: True where token i is a trained target (predicting it from ids[:i] is trained);
    target_mask[0] is always False."""


class TokenStore:
    """Samples by index; `lengths` and `num_targets` are known without reading any tokens."""

    lengths: np.ndarray
    """[n] int64 tokens per sample."""
    num_targets: np.ndarray
    """[n] int64 trained targets per sample (target_mask.sum())."""
    vocab_size: int
    pad_id: int
    num_truncated: int = 0
    num_dropped: int = 0
    source: str = "dataset"
    """What the samples come from (the data file), for error messages."""

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Sample:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        return self._get(i)

    def _get(self, i: int) -> Sample:
        raise NotImplementedError

    def prefix_targets(self, i: int, n: int) -> int:
        """Trained targets among the first `n` tokens of sample i."""
        return int(self[i].target_mask[:n].sum())

    def view(self, max_len: int, overlong: str) -> TokenStore:
        """This store with samples longer than `max_len` truncated or dropped (module docstring)."""
        return _FilteredStore(self, max_len, overlong)


class ArrayTokenStore(TokenStore):
    """Samples stored as flat arrays (in memory or memory-mapped from the cache)."""

    def __init__(
        self, arrays: dict[str, np.ndarray], vocab_size: int, pad_id: int, cache_path: Path | None = None
    ):
        self._ids, self._mask, self._offsets = arrays["ids"], arrays["target_mask"], arrays["offsets"]
        self.lengths = np.diff(self._offsets).astype(np.int64)
        self.num_targets = np.asarray(arrays["num_targets"], dtype=np.int64)
        self.vocab_size, self.pad_id = vocab_size, pad_id
        self.cache_path = cache_path
        """Cache folder the arrays live in (None when kept in memory)."""
        self.loaded_from_cache = False
        """True when this store reused an existing cache instead of tokenising."""

    def _get(self, i: int) -> Sample:
        a, b = self._offsets[i], self._offsets[i + 1]
        # Copy out of the memory map: callers may hand the arrays to torch, which wants them writable.
        return Sample(np.array(self._ids[a:b]), np.array(self._mask[a:b]))

    def prefix_targets(self, i: int, n: int) -> int:
        a, b = self._offsets[i], self._offsets[i + 1]
        return int(self._mask[a : min(b, a + n)].sum())


class MockTokenStore(TokenStore):
    """Random tokens (special ids excluded) with lengths from `mock_lengths`."""

    def __init__(self, lengths: np.ndarray, tokenizer: Tokenizer, seed: int):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.num_targets = np.maximum(self.lengths - 1, 0)
        self.vocab_size, self.pad_id = tokenizer.vocab_size, tokenizer.pad_id
        self._exclude = tokenizer.special_ids
        self._seed = seed

    def _get(self, i: int) -> Sample:
        n = int(self.lengths[i])
        ids = mock_tokens(i, n, 0, self.vocab_size, self._seed, exclude=self._exclude)
        mask = np.ones(n, dtype=bool)
        mask[:1] = False
        return Sample(ids, mask)

    def prefix_targets(self, i: int, n: int) -> int:
        return max(min(n, int(self.lengths[i])) - 1, 0)


class _FilteredStore(TokenStore):
    """A base store with overlong samples truncated or dropped."""

    def __init__(self, base: TokenStore, max_len: int, overlong: str):
        if max_len < 1:
            raise ValueError(f"max_len: got {max_len}, expected >= 1")
        if overlong not in ("truncate", "drop"):
            raise ValueError(f"data.overlong: got {overlong!r}, expected 'truncate' or 'drop'")
        too_long = base.lengths > max_len
        self._base, self._max_len = base, max_len
        self.vocab_size, self.pad_id, self.source = base.vocab_size, base.pad_id, base.source
        if overlong == "drop":
            self._index = np.flatnonzero(~too_long)
            self.num_dropped = int(too_long.sum())
            if self._index.size == 0:
                raise ValueError(
                    f"{self.source}: empty dataset after filtering: all {len(base)} samples are longer than "
                    f"max_len={max_len} (training.tokens_per_microbatch; shortest sample "
                    f"{int(base.lengths.min())}) and data.overlong = drop; raise training.tokens_per_microbatch "
                    "or set data.overlong = truncate"
                )
            self.lengths = base.lengths[self._index]
            self.num_targets = base.num_targets[self._index]
        else:
            self._index = np.arange(len(base))
            self.num_truncated = int(too_long.sum())
            self.lengths = np.minimum(base.lengths, max_len)
            self.num_targets = base.num_targets.copy()
            for i in np.flatnonzero(too_long):
                self.num_targets[i] = base.prefix_targets(int(i), max_len)
        if int(self.num_targets.sum()) == 0 and int(base.num_targets.sum()) > 0:
            raise ValueError(
                f"{self.source}: nothing to train within max_len={max_len} (training.tokens_per_microbatch): "
                f"every trained token of the {len(base)} samples lies beyond it (data.overlong = {overlong}); "
                "raise training.tokens_per_microbatch"
            )

    def _get(self, i: int) -> Sample:
        s = self._base[int(self._index[i])]
        return Sample(s.input_ids[: self._max_len], s.target_mask[: self._max_len])


# ============================================================================ building
def build_token_store(
    data_cfg, tokenizer: Tokenizer, seed: int, cache_dir: str, progress: bool = True
) -> TokenStore:
    """The token store of `data_cfg` (a `titan_thd.config.Data`); see the module docstring."""
    if data_cfg.source == "mock":
        return MockTokenStore(mock_lengths(data_cfg.mock_config, data_cfg.num_samples, seed), tokenizer, seed)
    if data_cfg.source not in ("jsonl", "parquet"):
        raise ValueError(
            f"data.source = {data_cfg.source!r} has no token store; expected mock, jsonl or parquet"
        )
    path = resolve_data_path(data_cfg.path)
    if not path.is_file():
        raise ValueError(f"data.path: {path} is not a file (data.source = {data_cfg.source})")
    if not cache_dir:
        arrays = _tokenise(path, data_cfg, tokenizer, progress)
        return _trainable(ArrayTokenStore(arrays, tokenizer.vocab_size, tokenizer.pad_id), path)

    final = Path(cache_dir) / f"{path.name.split('.')[0]}-{_cache_key(path, data_cfg, tokenizer)}"
    reused = final.is_dir()
    if not reused:
        arrays = _tokenise(path, data_cfg, tokenizer, progress)
        _write_cache(
            final, arrays, {"source": str(path), "tokenizer": tokenizer.identity, "version": CACHE_VERSION}
        )
        logger.info(
            "tokenised %s: %d samples, %d tokens -> %s",
            path,
            len(arrays["num_targets"]),
            len(arrays["ids"]),
            final,
        )
    store = ArrayTokenStore(
        {name: np.load(final / f"{name}.npy", mmap_mode="r") for name in _ARRAYS},
        tokenizer.vocab_size,
        tokenizer.pad_id,
        cache_path=final,
    )
    store.loaded_from_cache = reused
    return _trainable(store, path)


def _trainable(store: ArrayTokenStore, path: Path) -> ArrayTokenStore:
    """`store`, named after its file; ValueError when none of its tokens is trained."""
    store.source = str(path)
    if int(store.num_targets.sum()) == 0:
        raise ValueError(
            f"{path}: nothing to train: none of its {len(store)} samples has a trained token (chat records "
            "train only the content of assistant turns; these have none)"
        )
    return store


def _cache_key(path: Path, data_cfg, tokenizer: Tokenizer) -> str:
    st = path.stat()
    ident = {
        "path": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "tokenizer": tokenizer.identity,
        "format": data_cfg.format,
        "reader": data_cfg.source,
        "version": CACHE_VERSION,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def _write_cache(final: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name in _ARRAYS:
            np.save(tmp / f"{name}.npy", arrays[name])
        (tmp / "meta.json").write_text(json.dumps({**meta, "num_samples": len(arrays["num_targets"])}))
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not the benign "another rank got there first"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenise(path: Path, data_cfg, tokenizer: Tokenizer, progress: bool) -> dict[str, np.ndarray]:
    from tqdm import tqdm

    chunks = _chunks(read_records(path, data_cfg.format, reader=data_cfg.source), _CHUNK)
    workers = max(1, data_cfg.num_workers)
    pool = None
    if workers > 1 and path.stat().st_size >= _PARALLEL_MIN_BYTES:
        # spawn, not fork: the caller may already hold torch / process-group threads.
        pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(tokenizer,)
        )
        results: Iterable = pool.imap(_encode_chunk, chunks)
    else:
        _init_worker(tokenizer)
        results = map(_encode_chunk, chunks)
    ids, masks, lengths, targets = [], [], [], []
    try:
        with tqdm(
            desc=f"tokenising {path.name}", unit=" samples", file=sys.stderr, disable=not progress
        ) as bar:
            for chunk_ids, chunk_mask, chunk_lengths, chunk_targets in results:
                ids.append(chunk_ids)
                masks.append(chunk_mask)
                lengths.append(chunk_lengths)
                targets.append(chunk_targets)
                bar.update(len(chunk_lengths))
    finally:
        if pool is not None:
            pool.terminate()
    all_lengths = np.concatenate(lengths)
    return {
        "ids": np.concatenate(ids),
        "target_mask": np.concatenate(masks),
        "offsets": np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64),
        "num_targets": np.concatenate(targets),
    }


def _chunks(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    while chunk := list(islice(records, size)):
        yield chunk


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_chunk(chunk: list[Record]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # chat_template imports Sample from this module, hence the late import.
    from titan_thd.data.chat_template import encode_conversation, encode_text

    tok = _worker_tokenizer
    assert tok is not None
    samples = []
    for rec in chunk:
        try:
            if "text" in rec.data:
                samples.append(encode_text(tok, rec.data["text"]))
            else:
                samples.append(encode_conversation(tok, rec.data["messages"]))
        except ValueError as e:
            raise ValueError(f"{rec.where}: {e}") from None
    return (
        np.concatenate([s.input_ids for s in samples]),
        np.concatenate([s.target_mask for s in samples]),
        np.array([len(s.input_ids) for s in samples], dtype=np.int64),
        np.array([int(s.target_mask.sum()) for s in samples], dtype=np.int64),
    )
