"""What start-up reads of a Hugging Face folder (model.hf_path) for every family: the vocabulary size
of its config.json, which fixes the embedding's rows (the family's own hooks read the rest)."""

from __future__ import annotations

from pathlib import Path

from titan_thd.config.jsonfile import read_json_object


def hf_vocab_size(path: str, tokenizer_vocab: int) -> int:
    """`vocab_size` of a Hugging Face checkpoint's config.json (it must cover the tokenizer's ids);
    ValueError naming model.hf_path and the file otherwise."""
    if not Path(path).is_dir():
        raise ValueError(f"model.hf_path = {path!r}: the folder does not exist (or is not a folder)")
    cfg_file = Path(path) / "config.json"
    vocab = read_json_object(cfg_file, prefix=f"model.hf_path = {path!r}: ").get("vocab_size")
    if vocab is None:
        raise ValueError(f"model.hf_path: {cfg_file} has no vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"model.hf_path: {cfg_file}: vocab_size = {vocab!r}, expected a positive integer")
    if vocab < tokenizer_vocab:
        raise ValueError(
            f"model.hf_path: {cfg_file} has vocab_size = {vocab}, fewer rows than the tokenizer's "
            f"{tokenizer_vocab} ids (data.tokenizer must be the checkpoint's tokenizer)"
        )
    return vocab
