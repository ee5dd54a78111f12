"""Offline packing (docs/thd_reference.md §7): documents -> rows of T tokens, in Parquet.

Written by `scripts/prepare_packed_data.py`, read for `data.source = "packed"`. A pack is a folder:

    rows.parquet   one row per microbatch, columns (every list holds the row's documents back to back,
                   without padding):
                     input_ids     list<int32>  token ids
                     target_mask   list<bool>   True where the token is a trained target (the
                                                Sample.target_mask convention: never a document's first)
                     doc_lengths   list<int32>  real length of each document, in order
                     sample_index  list<int64>  index of each document in the tokenised source
    metadata.json  tokens_per_microbatch, pad_to_multiple, algorithm, seed, packing_efficiency,
                   docs_per_row {mean, max}, max_doc_len, num_rows, num_docs, tokenizer, ...

Rows are filled with padded lengths (each document rounded up to `pad_to_multiple`), so a row
packs into exactly T tokens with the same padding at training time. Algorithms:
`first_fit_decreasing` (longest first) and `first_fit_shuffle` (seeded random order); both put a
document into the earliest row with room (a max segment tree, O(n log n)).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from titan_thd.data.packer import padded_lengths
from titan_thd.data.sample import Sample
from titan_thd.data.sources import resolve_data_path

FORMAT = "titan_thd-packed-v1"
ALGORITHMS = ("first_fit_decreasing", "first_fit_shuffle")
ROWS_FILE, METADATA_FILE = "rows.parquet", "metadata.json"
_ROWS_PER_GROUP = 512


# ============================================================================ packing
def first_fit(sizes: np.ndarray, capacity: int, order: np.ndarray) -> list[list[int]]:
    """Visit items in `order`; each goes to the earliest bin whose free space holds it."""
    if sizes.size and int(sizes.max()) > capacity:
        raise ValueError(f"an item of size {int(sizes.max())} exceeds the bin capacity {capacity}")
    leaves = 1 << max(1, (len(order) - 1).bit_length())
    tree = [0] * leaves + [capacity] * len(order) + [0] * (leaves - len(order))  # max free per subtree
    for node in range(leaves - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    bins: list[list[int]] = []
    for i, size in zip(order.tolist(), sizes[order].tolist()):
        node = 1
        while node < leaves:  # leftmost leaf with room
            node = 2 * node if tree[2 * node] >= size else 2 * node + 1
        b = node - leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        tree[node] -= size
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def pack_rows(
    lengths: np.ndarray, T: int, pad_to_multiple: int, algorithm: str, seed: int
) -> list[list[int]]:
    """Rows of sample indices whose padded lengths fit T (deterministic for a given seed)."""
    sizes = padded_lengths(lengths, pad_to_multiple)
    if algorithm == "first_fit_decreasing":
        order = np.lexsort((np.arange(sizes.size), -sizes))
    elif algorithm == "first_fit_shuffle":
        order = np.random.default_rng(seed).permutation(sizes.size)
    else:
        raise ValueError(f"packing algorithm: got {algorithm!r}, expected one of {', '.join(ALGORITHMS)}")
    return first_fit(sizes, T, order)


def write_packed(
    out_dir: str | Path, store, rows: list[list[int]], metadata: dict, progress: bool = True
) -> dict:
    """Write `rows` of `store` samples to out_dir/rows.parquet and the metadata (with statistics) to
    out_dir/metadata.json; returns the full metadata."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    T, mult = metadata["tokens_per_microbatch"], metadata["pad_to_multiple"]
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("target_mask", pa.list_(pa.bool_())),
            ("doc_lengths", pa.list_(pa.int32())),
            ("sample_index", pa.list_(pa.int64())),
        ]
    )
    with pq.ParquetWriter(out / ROWS_FILE, schema) as writer:
        for start in tqdm(
            range(0, len(rows), _ROWS_PER_GROUP), desc="write rows", unit="group", disable=not progress
        ):
            group = rows[start : start + _ROWS_PER_GROUP]
            docs = [i for row in group for i in row]
            samples = [store[i] for i in docs]
            doc_len = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
            row_docs = np.array([len(row) for row in group], dtype=np.int64)
            doc_off = np.concatenate([[0], np.cumsum(row_docs)])
            tok_off = np.concatenate([[0], np.cumsum(doc_len)])[doc_off]

            def lists(values, offsets, typ):
                return pa.ListArray.from_arrays(
                    pa.array(offsets.astype(np.int32)), pa.array(values, type=typ)
                )

            ids = np.concatenate([s.input_ids for s in samples]).astype(np.int32)
            mask = np.concatenate([np.asarray(s.target_mask, dtype=bool) for s in samples])
            writer.write_table(
                pa.table(
                    {
                        "input_ids": lists(ids, tok_off, pa.int32()),
                        "target_mask": lists(mask, tok_off, pa.bool_()),
                        "doc_lengths": lists(doc_len.astype(np.int32), doc_off, pa.int32()),
                        "sample_index": lists(np.array(docs, dtype=np.int64), doc_off, pa.int64()),
                    },
                    schema=schema,
                )
            )
    lengths = (
        store.lengths[np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])] if rows else np.zeros(0)
    )
    per_row = np.array([len(r) for r in rows])
    meta = {
        "format": FORMAT,
        **metadata,
        "num_rows": len(rows),
        "num_docs": int(per_row.sum()),
        "packing_efficiency": float(lengths.sum() / (len(rows) * T)) if rows else 0.0,
        "padded_efficiency": float(padded_lengths(lengths, mult).sum() / (len(rows) * T)) if rows else 0.0,
        "docs_per_row": {
            "mean": float(per_row.mean()) if rows else 0.0,
            "max": int(per_row.max()) if rows else 0,
        },
        "max_doc_len": int(lengths.max()) if rows else 0,
    }
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# ============================================================================ reading
def flat_list_column(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, int64 offsets [rows + 1]) of a list column, across its chunks."""
    values, offsets, base = [], [np.zeros(1, np.int64)], 0
    for chunk in column.chunks:
        off = chunk.offsets.to_numpy().astype(np.int64)
        values.append(chunk.values.slice(int(off[0]), int(off[-1] - off[0])).to_numpy(zero_copy_only=False))
        offsets.append(off[1:] - off[0] + base)
        base += int(off[-1] - off[0])
    return (np.concatenate(values) if values else np.zeros(0)), np.concatenate(offsets)


def read_list_table(path: Path, columns: tuple[str, ...], expected: str) -> pa.Table:
    """The parquet table at `path`, refused in one ValueError unless each of `columns` is in it and is
    a list of integers or booleans (`expected`: what the missing-columns message says is wanted)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: cannot read parquet: {e}") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing (found {table.column_names}); {expected}")
    for c in columns:
        typ = table.schema.field(c).type
        if not pa.types.is_list(typ) or not (
            pa.types.is_integer(typ.value_type) or pa.types.is_boolean(typ.value_type)
        ):
            raise ValueError(f"{path}: column {c!r} has type {typ}, expected a list of integers / booleans")
    return table


class PackedRows:
    """The rows of one pack, in memory, as flat arrays: `samples(i)` are row i's documents, `doc(j)`
    is document j of all rows (rows hold consecutive documents, in order)."""

    def __init__(
        self,
        folder: Path,
        metadata: dict,
        ids: np.ndarray,
        mask: np.ndarray,
        tok_off: np.ndarray,
        doc_len: np.ndarray,
        doc_off: np.ndarray,
        mask_off: np.ndarray | None = None,
    ):
        self.path, self.metadata = folder, metadata
        self.T = int(metadata["tokens_per_microbatch"])
        self.pad_to_multiple = int(metadata["pad_to_multiple"])
        self.pad_id, self.vocab_size = int(metadata["pad_id"]), int(metadata["vocab_size"])
        self._ids, self._tok_off, self._mask = ids, tok_off, mask.astype(bool)
        self._mask_off = tok_off if mask_off is None else mask_off
        self._doc_len, self._doc_off = doc_len.astype(np.int64), doc_off
        self._doc_start = np.cumsum(self._doc_len) - self._doc_len
        cum = np.concatenate([[0], np.cumsum(self._mask, dtype=np.int64)])
        self.num_targets = cum[self._tok_off[1:]] - cum[self._tok_off[:-1]]
        """[rows] int64 trained targets per row."""
        self._target_cum = cum

    @classmethod
    def from_table(cls, folder: Path, metadata: dict, table: pa.Table) -> PackedRows:
        ids, tok_off = flat_list_column(table.column("input_ids"))
        mask, mask_off = flat_list_column(table.column("target_mask"))
        doc_len, doc_off = flat_list_column(table.column("doc_lengths"))
        return cls(folder, metadata, ids, mask, tok_off, doc_len, doc_off, mask_off)

    @property
    def doc_lengths_all(self) -> np.ndarray:
        """[documents] int64 length of every document, rows in order."""
        return self._doc_len

    def row_docs(self, rows: np.ndarray) -> np.ndarray:
        """Document indices (into `doc_lengths_all`) of `rows`, row after row."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = self._doc_off[rows + 1] - self._doc_off[rows]
        first = np.repeat(self._doc_off[rows] - np.cumsum(counts) + counts, counts)
        return (first + np.arange(int(counts.sum()))).astype(np.int64)

    def doc_targets(self, docs: np.ndarray, max_len: int | None = None) -> np.ndarray:
        """Trained targets of documents `docs` (among their first `max_len` tokens)."""
        start = self._doc_start[docs]
        length = self._doc_len[docs] if max_len is None else np.minimum(self._doc_len[docs], max_len)
        return self._target_cum[start + length] - self._target_cum[start]

    def doc(self, j: int, max_len: int | None = None) -> Sample:
        """Document j (its first `max_len` tokens)."""
        a = int(self._doc_start[j])
        b = a + int(self._doc_len[j] if max_len is None else min(self._doc_len[j], max_len))
        return Sample(self._ids[a:b].astype(np.int32), self._mask[a:b].copy())

    def __len__(self) -> int:
        return self._tok_off.size - 1

    def check(self, where: Path) -> None:
        """ValueError naming the first inconsistent row of a damaged pack, or a pack with no trained token."""
        row_tokens = np.diff(self._tok_off)
        doc_cum = np.concatenate([[0], np.cumsum(self._doc_len)])
        doc_tokens = doc_cum[self._doc_off[1:]] - doc_cum[self._doc_off[:-1]]
        bad = np.flatnonzero(
            (row_tokens != doc_tokens) | (row_tokens > self.T) | (np.diff(self._mask_off) != row_tokens)
        )
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{where}: row {i} is inconsistent: {int(row_tokens[i])} input_ids, "
                f"{int(self._mask_off[i + 1] - self._mask_off[i])} target_mask entries, doc_lengths summing to "
                f"{int(doc_tokens[i])}, T = {self.T} (a damaged pack; repack it)"
            )
        if self._ids.size and (int(self._ids.min()) < 0 or int(self._ids.max()) >= self.vocab_size):
            raise ValueError(
                f"{where}: token ids span {int(self._ids.min())}..{int(self._ids.max())}, outside the pack's "
                f"vocab_size = {self.vocab_size} (a damaged pack; repack it)"
            )
        if len(self) == 0 or int(self.num_targets.sum()) == 0:
            raise ValueError(
                f"{where}: nothing to train: none of its {len(self)} rows holds a trained target token "
                "(chat records train only assistant turns)"
            )

    def doc_lengths(self, i: int) -> np.ndarray:
        return self._doc_len[self._doc_off[i] : self._doc_off[i + 1]]

    def samples(self, i: int) -> list[Sample]:
        a = int(self._tok_off[i])
        out = []
        for length in self.doc_lengths(i).tolist():
            out.append(Sample(self._ids[a : a + length].astype(np.int32), self._mask[a : a + length].copy()))
            a += length
        return out


def open_packed(path: str | Path, pad_to_multiple: int = 1) -> PackedRows:
    """Read a pack folder (or its rows.parquet); `pad_to_multiple` is `data.pad_to_multiple`, which the
    pack's own padding must be a multiple of (zigzag CP relies on it)."""
    folder = resolve_data_path(path)
    if folder.is_file():
        folder = folder.parent
    meta_path, rows_path = folder / METADATA_FILE, folder / ROWS_FILE
    if not meta_path.is_file() or not rows_path.is_file():
        raise ValueError(
            f"data.path = {path}: expected a folder with {ROWS_FILE} and {METADATA_FILE} "
            "(written by scripts/prepare_packed_data.py)"
        )
    metadata = _read_metadata(meta_path)
    if int(metadata["pad_to_multiple"]) % pad_to_multiple:
        raise ValueError(
            f"{meta_path}: documents were padded to a multiple of {metadata['pad_to_multiple']}, which is not a "
            f"multiple of data.pad_to_multiple = {pad_to_multiple}; repack with --pad-to-multiple {pad_to_multiple}"
        )
    table = read_list_table(rows_path, _ROW_COLUMNS, f"expected {list(_ROW_COLUMNS)}")
    rows = PackedRows.from_table(folder, metadata, table)
    rows.check(rows_path)
    return rows


# Metadata keys the reader uses, with their types.
_METADATA_KEYS = {
    "tokens_per_microbatch": int,
    "pad_to_multiple": int,
    "pad_id": int,
    "vocab_size": int,
    "num_truncated": int,
    "num_dropped": int,
}
_ROW_COLUMNS = ("input_ids", "target_mask", "doc_lengths")


def _read_metadata(meta_path: Path) -> dict:
    try:
        metadata = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path}: invalid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{meta_path}: not UTF-8 text: {e}") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{meta_path}: expected a JSON object, got {type(metadata).__name__}")
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    for key, typ in _METADATA_KEYS.items():
        value = metadata.get(key)
        if not isinstance(value, typ) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"{meta_path}: {key} = {value!r}, expected a non-negative integer "
                "(written by scripts/prepare_packed_data.py)"
            )
    return metadata
