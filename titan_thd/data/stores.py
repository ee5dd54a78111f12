"""The token stores of a run: the training documents and, with validation, the held-out ones.

    train, val = build_stores(cfg.data, cfg.validation, tokenizer, seed, cache_dir)

`validation.fraction` holds documents of the training set out (data/split.py: by a hash of the
document index and the seed, the same on every layout); `validation.path` is a file of its own, read
like `data.path`. Without validation `val` is None.
"""

from __future__ import annotations

import dataclasses

from titan_thd.config import Data, Validation
from titan_thd.data.sources import resolve_data_path
from titan_thd.data.split import split_store
from titan_thd.data.token_store import TokenStore, build_token_store
from titan_thd.data.tokenizer import Tokenizer


def check_validation_path(validation: Validation, source: str) -> None:
    """ValueError naming validation.path when it is set and is not a file (before any process group)."""
    if validation.enable and validation.path:
        path = resolve_data_path(validation.path, "validation.path")
        if not path.is_file():
            raise ValueError(f"validation.path: {path} is not a file (data.source = {source})")


def build_stores(
    data: Data, validation: Validation, tokenizer: Tokenizer, seed: int, cache_dir: str, progress: bool
) -> tuple[TokenStore, TokenStore | None]:
    """(training store, validation store or None) of a source planned every step (not `packed`)."""
    store = build_token_store(data, tokenizer, seed, cache_dir, progress=progress)
    if not validation.enable:
        return store, None
    if validation.fraction:
        return split_store(store, validation.fraction, seed)
    check_validation_path(validation, data.source)
    held_out = dataclasses.replace(data, path=validation.path)
    return store, build_token_store(held_out, tokenizer, seed, cache_dir, progress=progress)
