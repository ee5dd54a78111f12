"""StatefulDataLoader assembly: step contents against the sampler, exact resume (0 and 2 workers),
and the layout-free state (identical on every rank; a DP=1 step and the union of the DP=2 steps
cover the same documents)."""

from collections import Counter

import numpy as np
import pytest
import torch

from titan_thd.config import Data
from titan_thd.data.dataloader import DataLayout, build_dataloader
from titan_thd.data.rows import RowRule, full_rows
from titan_thd.data.sampler import global_batch_indices
from titan_thd.data.token_store import ArrayTokenStore

T, G, SEED = 256, 12, 3


def make_store(lengths, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = rng.integers(0, 500, int(lengths.sum())).astype(np.int32)
    mask = rng.random(ids.size) < 0.7
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    mask[offsets[:-1]] = False
    num_targets = np.add.reduceat(mask, offsets[:-1]).astype(np.int64)
    return ArrayTokenStore(
        {"ids": ids, "target_mask": mask, "offsets": offsets, "num_targets": num_targets}, 500, 0
    )


STORE = make_store(np.random.default_rng(0).integers(4, 120, 50))


def loader(dp_rank=0, dp_size=2, num_workers=0, start_step=0, store=STORE, rule=None, **data):
    cfg = Data(pad_to_multiple=4, num_workers=num_workers, **data)
    return build_dataloader(
        cfg,
        store,
        DataLayout(
            dp_rank=dp_rank,
            dp=dp_size,
            cp=2,
            rule=rule or full_rows(T),
            global_batch_size=G,
            seed=SEED,
            planner="balanced",
            cost_attention=1e-3,
            pad_to_multiple=cfg.pad_to_multiple,
        ),
        start_step=start_step,
    )


def documents(batch):
    """Multiset of (tokens, loss mask) of the real documents of a step's microbatches."""
    docs = Counter()
    for mb in batch.microbatches:
        for start, n in zip(mb.cu_seqlens_padded[:-1].tolist(), mb.seqlens.tolist()):
            if n:
                docs[
                    (
                        tuple(mb.tokens[start : start + n].tolist()),
                        tuple(mb.loss_mask[start : start + n].tolist()),
                    )
                ] += 1
    return docs


def store_documents(store, ids):
    docs = Counter()
    for i in ids:
        s = store[int(i)]
        docs[(tuple(s.input_ids.tolist()), tuple(s.target_mask[1:].tolist()) + (False,))] += 1
    return docs


def same_batch(a, b):
    assert a.step == b.step and a.num_microbatches == b.num_microbatches
    assert (a.trained_tokens, a.real_tokens, a.slot_tokens, a.doc_lengths) == (
        b.trained_tokens,
        b.real_tokens,
        b.slot_tokens,
        b.doc_lengths,
    )
    for x, y in zip(a.microbatches, b.microbatches, strict=True):
        for f in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f


def test_step_covers_the_global_batch_across_replicas():
    loaders = [loader(dp_rank=r) for r in range(2)]
    for step in range(3):
        batches = [next(ld) for ld in loaders]
        ids = global_batch_indices(step, G, len(STORE), SEED)
        assert documents(batches[0]) + documents(batches[1]) == store_documents(STORE, ids)
        for b in batches:
            assert b.step == step and len(b.microbatches) == b.num_microbatches == batches[0].num_microbatches
            for mb in b.microbatches:
                assert mb.total_tokens == T
                mb.validate(divisor=4)
        b = batches[0]
        assert b.trained_tokens == sum(int(mb.loss_mask.sum()) for x in batches for mb in x.microbatches)
        assert b.real_tokens == int(STORE.lengths[ids].sum()) == sum(b.doc_lengths)
        assert sorted(b.doc_lengths) == sorted(STORE.lengths[ids].tolist())
        assert b.slot_tokens == 2 * b.num_microbatches * T
        assert b.imbalance >= 1.0


def test_trimmed_steps_hold_the_same_documents_in_fewer_rows():
    """A trimming RowRule: the same plan, every microbatch cut after its documents (a multiple of 8
    rows); slot_tokens counts the rows of both replicas."""
    for step in range(3):
        full = [loader(dp_rank=r, start_step=step) for r in range(2)]
        trim = [loader(dp_rank=r, start_step=step, rule=RowRule(T, 8, 8, False)) for r in range(2)]
        fb, tb = [next(ld) for ld in full], [next(ld) for ld in trim]
        rows = 0
        for f, t in zip(fb, tb, strict=True):
            assert documents(f) == documents(t)
            assert (f.num_microbatches, f.trained_tokens, f.real_tokens) == (
                t.num_microbatches,
                t.trained_tokens,
                t.real_tokens,
            )
            for a, b in zip(f.microbatches, t.microbatches, strict=True):
                n = b.total_tokens
                used = int(a.seqlens_padded[a.seqlens > 0].sum())
                assert n % 8 == 0 and max(8, used) <= n < used + 8 and n <= T
                assert torch.equal(b.tokens, a.tokens[:n]) and torch.equal(b.labels, a.labels[:n])
                rows += n
        assert tb[0].slot_tokens == tb[1].slot_tokens == rows < fb[0].slot_tokens


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_is_exact(num_workers):
    first = loader(num_workers=num_workers)
    for _ in range(5):  # 5 steps x 12 samples: into the second epoch of 50 samples
        next(first)
    state = first.state_dict()
    expected = [next(first) for _ in range(3)]
    resumed = loader(num_workers=num_workers)
    resumed.load_state_dict(state)
    for want in expected:
        same_batch(next(resumed), want)
    assert resumed.data_state() == {"step": 8, "epoch": 1, "cursor": 46, "seed": SEED}


def test_other_dp_degree_resumes_from_the_layout_free_state():
    single = loader(dp_size=1)
    for _ in range(4):
        next(single)
    state = single.state_dict()
    assert state == {"step": 4, "epoch": 0, "cursor": 48, "seed": SEED}  # 4 x 12 samples of 50
    want = next(single)
    halves = [loader(dp_rank=r, dp_size=2, num_workers=r * 2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    got = [next(h) for h in halves]
    assert [g.step for g in got] == [4, 4]
    assert documents(got[0]) + documents(got[1]) == documents(want)
    assert got[0].trained_tokens == want.trained_tokens and got[0].real_tokens == want.real_tokens
    # Every rank holds the same state, whatever its dp_rank or workers (a checkpoint keeps one copy).
    assert halves[0].state_dict() == halves[1].state_dict() == single.state_dict()
    # Building at the step directly gives the same batches.
    same_batch(next(loader(dp_rank=1, dp_size=2, start_step=4)), got[1])


def test_state_of_another_data_order_is_refused():
    state = loader().state_dict()
    with pytest.raises(ValueError, match=r"seed 3, this run uses training.seed = 4"):
        build_dataloader(
            Data(),
            STORE,
            DataLayout(
                dp_rank=0,
                dp=1,
                cp=1,
                rule=full_rows(T),
                global_batch_size=G,
                seed=4,
                planner="balanced",
                cost_attention=0.0,
            ),
        ).load_state_dict(state)
    with pytest.raises(ValueError, match=r"step 0 at epoch 0, cursor 0"):
        loader().load_state_dict({**state, "cursor": 5})


def test_overlong_samples_are_truncated_or_dropped():
    store = make_store([10, 300, 20, 40])
    trunc = loader(store=store, dp_size=1, overlong="truncate")
    assert trunc.overlong_counts == {"truncated": 1, "dropped": 0} and max(trunc.steps.store.lengths) == T
    batch = next(trunc)
    assert max(batch.doc_lengths) <= T
    drop = loader(store=store, dp_size=1, overlong="drop")
    assert drop.overlong_counts == {"truncated": 0, "dropped": 1} and len(drop.steps.store) == 3
    assert 300 not in next(drop).doc_lengths


def test_dp_balanced_planner_and_bad_rank():
    cfg = Data(pad_to_multiple=4)
    ld = build_dataloader(
        cfg,
        STORE,
        DataLayout(
            dp_rank=1,
            dp=2,
            cp=1,
            rule=full_rows(T),
            global_batch_size=G,
            seed=SEED,
            planner="dp_balanced",
            cost_attention=0.0,
            pad_to_multiple=cfg.pad_to_multiple,
        ),
    )
    assert next(ld).num_microbatches >= 1
    with pytest.raises(ValueError, match="dp_rank 2 is outside 0..1"):
        loader(dp_rank=2)
