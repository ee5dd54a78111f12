import math

import torch

from titan_thd.components.loss import cross_entropy_sum, num_trained_tokens
from titan_thd.data.packed_batch import IGNORE_INDEX


def _naive_ce_sum(logits, labels, mask):
    """Per-row -log softmax in float64 with a Python loop over trained rows."""
    total = 0.0
    for t in range(labels.numel()):
        if labels[t] == IGNORE_INDEX or not mask[t]:
            continue
        row = logits[t].double()
        total += float(torch.logsumexp(row, 0) - row[labels[t]])
    return total


def _batch(T=12, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[[3, 7]] = IGNORE_INDEX
    mask = torch.ones(T, dtype=torch.bool)
    mask[[0, 1, 5]] = False
    return logits, labels, mask


def test_ce_sum_matches_naive_float64():
    logits, labels, mask = _batch()
    got = cross_entropy_sum(logits, labels, mask)
    assert got.dtype == torch.float64
    assert math.isclose(float(got), _naive_ce_sum(logits, labels, mask), rel_tol=1e-12)
    # 12 rows - 2 ignored labels - 3 untrained rows
    assert num_trained_tokens(labels, mask) == 7


def test_ce_sum_without_mask_uses_every_label():
    logits, labels, _ = _batch()
    all_rows = torch.ones_like(labels, dtype=torch.bool)
    assert math.isclose(
        float(cross_entropy_sum(logits, labels)), _naive_ce_sum(logits, labels, all_rows), rel_tol=1e-12
    )
    assert num_trained_tokens(labels) == 10


def test_bf16_logits_are_upcast():
    logits, labels, mask = _batch()
    bf = logits.to(torch.bfloat16)
    got = cross_entropy_sum(bf, labels, mask)
    assert got.dtype == torch.float32
    # Same value as the fp64 loss of the (rounded) bf16 logits, to fp32 precision.
    assert math.isclose(float(got), _naive_ce_sum(bf.double(), labels, mask), rel_tol=1e-6)


def test_gradient_reaches_only_trained_rows():
    logits, labels, mask = _batch()
    logits.requires_grad_(True)
    cross_entropy_sum(logits, labels, mask).backward()
    untrained = (labels == IGNORE_INDEX) | ~mask
    assert torch.all(logits.grad[untrained] == 0)
    assert torch.all(logits.grad[~untrained].abs().sum(-1) > 0)
