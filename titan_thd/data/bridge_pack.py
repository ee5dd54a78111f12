"""Packs made by Megatron-Bridge's offline packing, read as `PackedRows` (docs/data.md §2).

Bridge (`prepare_gpt_sft_packed_data.py`) writes one row per packed bin:

    *.idx.parquet  columns input_ids list<int32>, loss_mask list<int8>, seq_start_id list<int32>
    *.npy          (legacy) an object array of dicts with the same three keys, one per row

A row holds its stored sequences back to back; `seq_start_id[k]` is where stored sequence k starts
(it ends where the next one starts, the last at the row's end). A stored sequence is the runtime
sequence plus one token (Bridge trains `input = seq[:-1]`, `label = seq[1:]`), and its `loss_mask` is
already rolled left by one: `loss_mask[j]` says whether label j, i.e. token j + 1, is trained. With
Bridge's `pad_seq_to_mult` a sequence is padded with EOS tokens under a 0 mask.

Conversion to this project's documents (`Sample`: a token is trained where `target_mask` is True,
predicted from the tokens before it in its document): one stored sequence -> one document whose
target_mask is the loss_mask rolled back right by one. The document ends at its last trained token:
what follows cannot change any trained prediction (attention is causal), so this drops Bridge's
alignment padding without changing the loss. A sequence with no trained token is kept whole.
Because a document here carries its last target as a token, a Bridge sequence of n runtime tokens
takes n + 1 rows; documents longer than T are handled by `data.overlong`.

The files record neither the vocabulary nor the pad id: both come from `data.tokenizer`, and every
token id must lie below its vocab_size. Rows are planned again by the trainer (data.packed_replan).
A `.npy` pack is unpickled (`allow_pickle`): open only files you trust.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

BRIDGE_FORMAT = "megatron-bridge"
BRIDGE_COLUMNS = ("input_ids", "loss_mask", "seq_start_id")


def is_bridge_pack(path: Path) -> bool:
    """True for a Megatron-Bridge pack file (`*.idx.parquet`, or a `.npy` file)."""
    return path.is_file() and (path.name.endswith(".idx.parquet") or path.suffix == ".npy")


def _read_parquet(path: Path) -> tuple[np.ndarray, ...]:
    from titan_thd.data.packed_dataset import flat_list_column, read_list_table

    table = read_list_table(path, BRIDGE_COLUMNS, f"a Megatron-Bridge pack has {list(BRIDGE_COLUMNS)}")
    return tuple(x for c in BRIDGE_COLUMNS for x in flat_list_column(table.column(c)))


def _read_npy(path: Path) -> tuple[np.ndarray, ...]:
    try:
        data = np.load(path, allow_pickle=True)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path}: cannot read .npy: {e}") from None
    if data.dtype != object or data.ndim != 1:
        raise ValueError(
            f"{path}: expected a 1-D object array of dicts with keys {list(BRIDGE_COLUMNS)} (Megatron-Bridge's "
            f"legacy .npy pack), got dtype {data.dtype}, shape {data.shape}"
        )
    out = []
    for key in BRIDGE_COLUMNS:
        values, offsets = [], [0]
        for i, row in enumerate(data.tolist()):
            if not isinstance(row, dict) or key not in row:
                got = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(
                    f"{path}: row {i}: expected a dict with keys {list(BRIDGE_COLUMNS)}, got {got}"
                )
            v = np.asarray(row[key])
            if v.ndim != 1 or not (np.issubdtype(v.dtype, np.integer) or v.dtype == bool or v.size == 0):
                raise ValueError(
                    f"{path}: row {i}: {key!r} must be a list of integers, got {v.dtype} {v.shape}"
                )
            values.append(v.astype(np.int64))
            offsets.append(offsets[-1] + v.size)
        out += [np.concatenate(values) if values else np.zeros(0, np.int64), np.asarray(offsets, np.int64)]
    return tuple(out)


def open_bridge_pack(path: Path, tokenizer):
    """`PackedRows` of a Megatron-Bridge pack file (module docstring); ValueError naming the row of
    anything inconsistent."""
    from titan_thd.data.packed_dataset import PackedRows

    if tokenizer is None:
        raise ValueError(f"{path}: a Megatron-Bridge pack needs data.tokenizer (its pad id and vocabulary)")
    if path.suffix == ".npy":
        ids, tok_off, mask, mask_off, starts, start_off = _read_npy(path)
    else:
        ids, tok_off, mask, mask_off, starts, start_off = _read_parquet(path)
    rows = tok_off.size - 1
    if rows == 0:
        raise ValueError(f"{path}: empty pack (no rows)")
    row_len = np.diff(tok_off)
    bad = np.flatnonzero(np.diff(mask_off) != row_len)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{path}: row {i}: {int(mask_off[i + 1] - mask_off[i])} loss_mask entries for {int(row_len[i])} input_ids"
        )
    starts = starts.astype(np.int64)
    n_seq = np.diff(start_off)
    row_of_seq = np.repeat(np.arange(rows), n_seq)
    first = np.zeros(starts.size, dtype=bool)
    first[start_off[:-1][n_seq > 0]] = True
    # Every row: seq_start_id starts at 0, strictly increases, stays inside the row.
    prev = np.concatenate([[-1], starts[:-1]])
    wrong = (first & (starts != 0)) | (~first & (starts <= prev)) | (starts >= row_len[row_of_seq])
    wrong_rows = np.union1d(np.flatnonzero(n_seq == 0), row_of_seq[wrong])
    if wrong_rows.size:
        i = int(wrong_rows[0])
        seq = starts[start_off[i] : start_off[i + 1]].tolist()
        raise ValueError(
            f"{path}: row {i}: seq_start_id {seq[:16]}{' ...' if len(seq) > 16 else ''} must start at 0 and "
            f"increase strictly below the row's {int(row_len[i])} tokens (a damaged pack; repack it)"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
        raise ValueError(
            f"{path}: token ids span {int(ids.min())}..{int(ids.max())}, outside data.tokenizer's vocab_size = "
            f"{tokenizer.vocab_size} (was the pack made with another tokenizer?)"
        )
    if not np.isin(np.unique(mask), (0, 1)).all():
        raise ValueError(f"{path}: loss_mask holds values {np.unique(mask)[:8].tolist()}, expected 0 / 1")

    # Stored sequence k spans [seq_a[k], seq_b[k]) of the flat token array.
    seq_a = tok_off[row_of_seq] + starts
    seq_b = np.append(seq_a[1:], 0)
    last_of_row = np.zeros(starts.size, dtype=bool)
    last_of_row[start_off[1:] - 1] = True
    seq_b[last_of_row] = tok_off[1:][n_seq > 0]
    # Rolled back right by one: token t is trained where label t - 1 was.
    target = np.zeros(ids.size, dtype=bool)
    target[1:] = mask[:-1].astype(bool)
    target[seq_a] = False
    # Each document ends at its last trained token (a sequence without one is kept whole).
    pos = np.where(target, np.arange(ids.size), -1)
    last = np.maximum.reduceat(pos, seq_a) if seq_a.size else np.zeros(0, np.int64)
    doc_len = np.where(last >= seq_a, last - seq_a + 1, seq_b - seq_a)
    seq_of_token = np.repeat(np.arange(seq_a.size), seq_b - seq_a)
    keep = np.arange(ids.size) - seq_a[seq_of_token] < doc_len[seq_of_token]
    row_tokens = np.bincount(row_of_seq, weights=doc_len, minlength=rows).astype(np.int64)
    tok_off = np.concatenate([[0], np.cumsum(row_tokens)])
    metadata = {
        "format": BRIDGE_FORMAT,
        "tokens_per_microbatch": int(row_tokens.max()),
        "pad_to_multiple": 1,
        "pad_id": tokenizer.pad_id,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": getattr(tokenizer, "identity", None),
        "num_truncated": 0,
        "num_dropped": 0,
    }
    packed = PackedRows(
        path, metadata, ids[keep].astype(np.int32), target[keep], tok_off, doc_len, start_off.astype(np.int64)
    )
    if int(packed.num_targets.sum()) == 0:
        raise ValueError(f"{path}: nothing to train: no row has a trained label (loss_mask is all 0)")
    return packed
