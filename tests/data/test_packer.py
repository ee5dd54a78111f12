"""Packer tests against the worked layout of docs/thd_reference.md §2.5 and a naive
per-document reference builder (plain Python loops, written from the packed_batch.py contract)."""

import numpy as np
import pytest
import torch

from titan_thd.data.packed_batch import IGNORE_INDEX
from titan_thd.data.packer import pack_microbatch, packer_throughput
from titan_thd.data.rows import RowRule
from titan_thd.data.sample import Sample


def sample(ids, targets):
    return Sample(np.asarray(ids, dtype=np.int32), np.asarray(targets, dtype=bool))


def random_samples(rng, lengths):
    out = []
    for n in lengths:
        mask = rng.random(n) < 0.6
        mask[0] = False
        out.append(sample(rng.integers(0, 1000, n), mask))
    return out


def naive_pack(samples, T, mult, pad_id):
    """Reference: build every row with explicit loops."""
    tokens, labels, mask, pos, cu, cup = [], [], [], [], [0], [0]
    for s in samples:
        L = len(s.input_ids)
        P = -(-L // mult) * mult
        for t in range(P):
            real = t < L
            tokens.append(int(s.input_ids[t]) if real else pad_id)
            has_next = t + 1 < L
            labels.append(int(s.input_ids[t + 1]) if has_next else IGNORE_INDEX)
            mask.append(bool(s.target_mask[t + 1]) if has_next else False)
            pos.append(t)
        cu.append(cu[-1] + L)
        cup.append(cup[-1] + P)
    if cup[-1] < T:
        tail = T - cup[-1]
        tokens += [pad_id] * tail
        labels += [IGNORE_INDEX] * tail
        mask += [False] * tail
        pos += list(range(tail))
        cu.append(cu[-1])
        cup.append(T)
    return tokens, labels, mask, pos, cu, cup


def test_worked_layout_section_2_5():
    docs = [
        sample(np.arange(1, 6), [0, 1, 1, 1, 1]),
        sample(np.arange(10, 19), [0] + [1] * 8),
        sample([7, 8, 9], [0, 0, 1]),
    ]
    b = pack_microbatch(docs, T=24, pad_to_multiple=4, pad_id=0)
    assert b.cu_seqlens.tolist() == [0, 5, 14, 17]
    assert b.cu_seqlens_padded.tolist() == [0, 8, 20, 24]
    assert b.cu_seqlens.dtype == b.cu_seqlens_padded.dtype == torch.int32
    assert b.max_seqlen == 12 and b.num_docs == 3
    assert torch.nonzero(~b.real_token_mask()).flatten().tolist() == [5, 6, 7, 17, 18, 19, 23]
    # Positions keep counting through a document's own padding.
    assert b.position_ids.tolist() == list(range(8)) + list(range(12)) + list(range(4))
    assert b.labels.tolist()[:8] == [2, 3, 4, 5, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    # loss_mask[t] = target_mask[t + 1]: doc 2's targets are only its last token (row 22 predicts it).
    assert b.loss_mask[20:24].tolist() == [False, True, False, False]
    b.validate(divisor=4)


@pytest.mark.parametrize("seed", range(5))
def test_matches_naive_reference(seed):
    rng = np.random.default_rng(seed)
    T, mult = 256, int(rng.choice([1, 4, 8]))
    lengths, used = [], 0
    while True:
        n = int(rng.integers(1, 60))
        if used + -(-n // mult) * mult > T:
            break
        lengths.append(n)
        used += -(-n // mult) * mult
    samples = random_samples(rng, lengths)
    b = pack_microbatch(samples, T, mult, pad_id=7)
    tokens, labels, mask, pos, cu, cup = naive_pack(samples, T, mult, 7)
    assert b.tokens.tolist() == tokens
    assert b.labels.tolist() == labels
    assert b.loss_mask.tolist() == mask
    assert b.position_ids.tolist() == pos
    assert b.cu_seqlens.tolist() == cu and b.cu_seqlens_padded.tolist() == cup
    assert b.num_docs == len(cu) - 1 and b.max_seqlen == max(np.diff(cup))


def test_no_token_lost_or_duplicated_and_labels_stay_inside_documents():
    rng = np.random.default_rng(11)
    samples = random_samples(rng, [17, 1, 30, 9, 64])
    b = pack_microbatch(samples, T=160, pad_to_multiple=8, pad_id=0)
    for i, s in enumerate(samples):
        start, n = int(b.cu_seqlens_padded[i]), len(s.input_ids)
        assert b.tokens[start : start + n].tolist() == s.input_ids.tolist()
        # Labels of a document are its own next tokens; the last real row has none.
        assert b.labels[start : start + n - 1].tolist() == s.input_ids[1:].tolist()
        assert int(b.labels[start + n - 1]) == IGNORE_INDEX
        assert b.loss_mask[start : start + n].tolist() == s.target_mask[1:].tolist() + [False]
    assert int(b.loss_mask.sum()) == sum(int(s.target_mask.sum()) for s in samples)
    real = b.real_token_mask()
    assert int(real.sum()) == sum(len(s.input_ids) for s in samples)
    assert (b.labels[~real] == IGNORE_INDEX).all() and not b.loss_mask[~real].any()


def test_tail_padding_document_and_exact_fit():
    rng = np.random.default_rng(1)
    b = pack_microbatch(random_samples(rng, [5, 3]), T=32, pad_to_multiple=4, pad_id=0)
    assert b.cu_seqlens_padded.tolist() == [0, 8, 12, 32]
    assert b.cu_seqlens.tolist() == [0, 5, 8, 8]  # the padding document has real length 0
    assert b.num_docs == 3 and b.max_seqlen == 20
    exact = pack_microbatch(random_samples(rng, [8, 8]), T=16, pad_to_multiple=4, pad_id=0)
    assert exact.cu_seqlens_padded.tolist() == [0, 8, 16] and exact.num_docs == 2


def test_empty_microbatch_is_one_padding_document():
    b = pack_microbatch([], T=16, pad_to_multiple=4, pad_id=3)
    assert b.cu_seqlens.tolist() == [0, 0] and b.cu_seqlens_padded.tolist() == [0, 16]
    assert b.tokens.tolist() == [3] * 16 and not b.loss_mask.any()


@pytest.mark.parametrize("seed", range(4))
def test_trimmed_microbatch_is_the_full_one_cut_after_its_documents(seed):
    """A trimming RowRule: the rows are the full pack's first `rule.rows(used)` rows; only the tail
    padding document shrinks (or disappears on an exact multiple)."""
    rng = np.random.default_rng(seed)
    T, mult, rows_mult = 256, int(rng.choice([1, 4])), int(rng.choice([4, 8, 16]))
    samples = random_samples(rng, rng.integers(1, 40, int(rng.integers(1, 6))))
    full = pack_microbatch(samples, T, mult, pad_id=7)
    trim = pack_microbatch(samples, T, mult, pad_id=7, rule=RowRule(T, rows_mult, rows_mult, False))
    used = sum(-(-len(s.input_ids) // mult) * mult for s in samples)
    rows = max(rows_mult, -(-used // rows_mult) * rows_mult)
    assert trim.total_tokens == rows < T
    for f in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(getattr(trim, f), getattr(full, f)[:rows]), f
    docs = len(samples)
    assert trim.cu_seqlens_padded[: docs + 1].tolist() == full.cu_seqlens_padded[: docs + 1].tolist()
    assert trim.cu_seqlens_padded[-1] == rows and trim.num_docs == docs + (rows > used)
    trim.validate(divisor=mult)


def test_trimmed_rows_edges():
    rng = np.random.default_rng(3)
    rule = RowRule(64, 8, 8, False)
    exact = pack_microbatch(random_samples(rng, [8, 8]), T=64, pad_to_multiple=4, pad_id=0, rule=rule)
    assert exact.cu_seqlens_padded.tolist() == [0, 8, 16] and exact.num_docs == 2
    empty = pack_microbatch([], T=64, pad_to_multiple=4, pad_id=0, rule=rule)  # one multiple: a row per rank
    assert empty.cu_seqlens_padded.tolist() == [0, 8] and empty.num_real_tokens == 0
    halo = RowRule(64, 8, 32, False)  # a model that needs 32 rows (e.g. 4 CP ranks x a halo of 8)
    assert (
        pack_microbatch(random_samples(rng, [5]), T=64, pad_to_multiple=1, pad_id=0, rule=halo).total_tokens
        == 32
    )


def test_errors():
    rng = np.random.default_rng(2)
    with pytest.raises(
        ValueError, match=r"take 24 tokens after padding to a multiple of 8, more than T = 16"
    ):
        pack_microbatch(random_samples(rng, [9, 5]), T=16, pad_to_multiple=8, pad_id=0)
    with pytest.raises(ValueError, match="multiple of data.pad_to_multiple"):
        pack_microbatch([], T=10, pad_to_multiple=4, pad_id=0)
    with pytest.raises(ValueError, match="target_mask has 2 entries for 3"):
        pack_microbatch([sample([1, 2, 3], [0, 1])], T=8, pad_to_multiple=1, pad_id=0)


def test_throughput_function_runs():
    assert packer_throughput(num_tokens=8192, T=1024) > 0
