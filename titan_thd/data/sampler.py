"""Which samples form the global batch of an optimizer step (docs/design.md §2).

The sample order is a pure function of (dataset size, seed, step): epoch e visits the samples in a
permutation seeded by (seed, e), the epochs are concatenated, and step s takes positions
[s*G, (s+1)*G) of that endless stream (a batch may cross an epoch boundary). Nothing depends on
the number of ranks, so the state needed to resume is tiny and layout-free: the step (or,
equivalently, epoch + cursor) and the seed.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """[num_samples] int64 sample ids in the order epoch `epoch` visits them (read-only)."""
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    else:
        order = np.arange(num_samples, dtype=np.int64)
    order.setflags(write=False)
    return order


def _check(global_batch_size: int, num_samples: int) -> None:
    if global_batch_size <= 0:
        raise ValueError(f"training.global_batch_size: got {global_batch_size}, expected a positive value")
    if num_samples <= 0:
        raise ValueError(f"the dataset has {num_samples} samples; at least one is needed")


def global_batch_indices(
    step: int, global_batch_size: int, num_samples: int, seed: int, shuffle: bool = True
) -> np.ndarray:
    """[G] int64 sample ids of the global batch of `step` (positions [s*G, (s+1)*G) of the stream)."""
    _check(global_batch_size, num_samples)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    start, stop = step * global_batch_size, (step + 1) * global_batch_size
    pieces = []
    for epoch in range(start // num_samples, (stop - 1) // num_samples + 1):
        lo = max(start - epoch * num_samples, 0)
        hi = min(stop - epoch * num_samples, num_samples)
        pieces.append(epoch_order(num_samples, seed, epoch, shuffle)[lo:hi])
    return np.concatenate(pieces).astype(np.int64, copy=False)


def data_state(step: int, global_batch_size: int, num_samples: int, seed: int) -> dict[str, int]:
    """Layout-free resume point before `step`: {"step", "epoch", "cursor", "seed"}.

    `cursor` is the position inside epoch `epoch` where the global batch of `step` starts.
    """
    _check(global_batch_size, num_samples)
    epoch, cursor = divmod(step * global_batch_size, num_samples)
    return {"step": int(step), "epoch": int(epoch), "cursor": int(cursor), "seed": int(seed)}


def step_from_state(state: dict, global_batch_size: int, num_samples: int, seed: int) -> int:
    """The step a `data_state` dict resumes at; ValueError if it belongs to another data order."""
    if int(state["seed"]) != seed:
        raise ValueError(
            f"data state was written with seed {state['seed']}, this run uses training.seed = {seed}"
        )
    step = int(state["step"])
    expected = data_state(step, global_batch_size, num_samples, seed)
    if (int(state["epoch"]), int(state["cursor"])) != (expected["epoch"], expected["cursor"]):
        raise ValueError(
            f"data state (step {step}, epoch {state['epoch']}, cursor {state['cursor']}) does not match this "
            f"run's global_batch_size = {global_batch_size} and {num_samples} samples, which place step {step} at "
            f"epoch {expected['epoch']}, cursor {expected['cursor']}"
        )
    return step
