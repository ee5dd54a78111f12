"""Held-out validation split by document (validation.fraction; docs/design.md §3.9).

Document i of the dataset is held out iff u(i) < fraction, where u(i) in [0, 1) is a 64-bit mix
(splitmix64's finaliser) of i and training.seed. So the split
- depends on (document index, seed, fraction) only: every rank and every parallel layout computes
  the same one without communication, and a resumed run gets it back without storing it;
- is per document: a document's side does not change when the dataset grows or shrinks around
  it, and raising the fraction only moves documents from training to validation;
- is taken on the source's document indices, before the overlong filter, so a held-out document
  is never trained on, whole or truncated.
"""

from __future__ import annotations

import numpy as np

from titan_thd.data.sample import Sample
from titan_thd.data.token_store import TokenStore

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def unit_hash(index: np.ndarray, seed: int) -> np.ndarray:
    """[n] float64 in [0, 1): a uniform-looking, deterministic function of (index, seed)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2**64 by design
        z = np.asarray(index, dtype=np.uint64) * _GOLDEN + np.uint64(seed % 2**64) * _MIX2 + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


def heldout_mask(num_docs: int, fraction: float, seed: int) -> np.ndarray:
    """[num_docs] bool: True for the documents held out for validation."""
    assert 0.0 <= fraction < 1.0, fraction
    return unit_hash(np.arange(num_docs), seed) < fraction


class SubsetStore(TokenStore):
    """The samples `index` of a base store, in that order."""

    def __init__(self, base: TokenStore, index: np.ndarray, what: str):
        self._base, self.index = base, np.asarray(index, dtype=np.int64)
        """Base-store ids of this store's samples."""
        self.lengths = base.lengths[self.index]
        self.num_targets = base.num_targets[self.index]
        self.vocab_size, self.pad_id = base.vocab_size, base.pad_id
        self.source = f"{base.source} ({what})"

    def _get(self, i: int) -> Sample:
        return self._base[int(self.index[i])]

    def prefix_targets(self, i: int, n: int) -> int:
        return self._base.prefix_targets(int(self.index[i]), n)


def split_store(store: TokenStore, fraction: float, seed: int) -> tuple[TokenStore, TokenStore]:
    """(training part, held-out part) of `store`; ValueError when either would be empty."""
    held = heldout_mask(len(store), fraction, seed)
    n_held = int(held.sum())
    if n_held == 0 or n_held == len(store):
        raise ValueError(
            f"validation.fraction = {fraction} of the {len(store)} documents of {store.source} holds out "
            f"{n_held}: {'no' if n_held == 0 else 'every'} document; choose a fraction that leaves both "
            "parts non-empty"
        )
    return (
        SubsetStore(store, np.flatnonzero(~held), "training part"),
        SubsetStore(store, np.flatnonzero(held), f"validation part, fraction {fraction}"),
    )
