"""Open an offline pack of either kind: this project's folder or a Megatron-Bridge file."""

from __future__ import annotations

from pathlib import Path

from titan_thd.data.bridge_pack import is_bridge_pack, open_bridge_pack
from titan_thd.data.packed_dataset import PackedRows, open_packed
from titan_thd.data.sources import resolve_data_path


def open_pack(path: str | Path, pad_to_multiple: int = 1, tokenizer=None) -> PackedRows:
    """A pack of either kind: a folder written by scripts/prepare_packed_data.py (`open_packed`) or a
    Megatron-Bridge `*.idx.parquet` / `.npy` file (bridge_pack.py, which needs `tokenizer`)."""
    resolved = resolve_data_path(path)
    if is_bridge_pack(resolved):
        return open_bridge_pack(resolved, tokenizer)
    return open_packed(resolved, pad_to_multiple)
