"""The held-out validation split (data/split.py): a deterministic per-document function of (index,
seed, fraction), and a training loader over the split that never yields a held-out document."""

from __future__ import annotations

import numpy as np
import pytest

from titan_thd.data.dataloader import DataLayout, build_dataloader
from titan_thd.data.rows import full_rows
from titan_thd.data.split import heldout_mask, split_store, unit_hash
from titan_thd.data.token_store import MockTokenStore
from titan_thd.data.tokenizer import ByteTokenizer


def test_split_is_a_per_document_function_of_index_seed_and_fraction():
    n, f = 100_000, 0.1
    held = heldout_mask(n, f, seed=42)
    assert np.array_equal(held, heldout_mask(n, f, seed=42))  # deterministic
    # Binomial(n, f): 5 standard deviations (~47 documents) around n f.
    assert abs(int(held.sum()) - n * f) <= 5 * (n * f * (1 - f)) ** 0.5
    # Per document: the decision for document i does not depend on how many documents exist.
    assert np.array_equal(heldout_mask(1234, f, seed=42), held[:1234])
    # A larger fraction only moves documents from training to validation.
    assert not (held & ~heldout_mask(n, 0.2, seed=42)).any()
    # Another seed, another split (two independent 10% sets overlap in ~1% of the documents).
    other = heldout_mask(n, f, seed=43)
    assert abs(int((held & other).sum()) - n * f * f) <= 5 * (n * f * f) ** 0.5
    u = unit_hash(np.arange(n), 7)
    assert u.min() >= 0.0 and u.max() < 1.0
    # Roughly uniform: every tenth of [0, 1) gets n / 10 +- 5 sigma.
    counts = np.histogram(u, bins=10, range=(0.0, 1.0))[0]
    assert (abs(counts - n / 10) <= 5 * (n * 0.09) ** 0.5).all(), counts


def test_training_loader_never_yields_a_held_out_document():
    """Two epochs of the training part, packed by the real loader, against the held-out documents'
    token ids (mock tokens are random per document, so equal ids mean the same document)."""
    tok = ByteTokenizer()
    lengths = np.random.default_rng(0).integers(8, 120, size=200)
    store = MockTokenStore(lengths, tok, seed=3)
    train, held = split_store(store, 0.25, seed=3)
    assert len(train) + len(held) == 200 and 30 <= len(held) <= 70
    assert sorted(np.concatenate([train.index, held.index]).tolist()) == list(range(200))
    held_docs = {tuple(store[int(i)].input_ids.tolist()) for i in held.index}
    train_docs = {tuple(store[int(i)].input_ids.tolist()) for i in train.index}
    assert len(held_docs) == len(held) and not held_docs & train_docs

    class Data:
        source, pad_to_multiple, overlong, shuffle, num_workers = "mock", 1, "truncate", True, 0

    loader = build_dataloader(
        Data,
        train,
        DataLayout(
            dp_rank=0,
            dp=1,
            cp=1,
            rule=full_rows(256),
            global_batch_size=16,
            seed=3,
            planner="balanced",
            cost_attention=0.0,
        ),
    )
    seen = []
    for _ in range(-(-2 * len(train) // 16)):
        for mb in next(loader).microbatches:
            cu, cup = mb.cu_seqlens.tolist(), mb.cu_seqlens_padded.tolist()
            for d in range(mb.num_docs):
                if cu[d + 1] > cu[d]:
                    seen.append(tuple(mb.tokens[cup[d] : cup[d] + cu[d + 1] - cu[d]].tolist()))
    assert set(seen) == train_docs  # every training document, twice over two epochs
    assert len(seen) >= 2 * len(train) - 16
    assert not set(seen) & held_docs


def test_a_split_with_an_empty_side_is_refused():
    store = MockTokenStore(np.full(16, 20), ByteTokenizer(), seed=0)
    with pytest.raises(ValueError, match=r"validation.fraction = 0.001 of the 16 documents .* holds out 0"):
        split_store(store, 0.001, seed=0)
