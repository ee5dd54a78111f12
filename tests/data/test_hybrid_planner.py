"""The planner under hybrid CP (data/planner.py: hybrid_rank_costs, hybrid_refine): rank costs
against the rows `partition` really gives each CP rank, and the refined plan against the plain one
(never slower, strictly better on a batch of lognormal documents, the same samples and K)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titan_thd.data.cp_partition import partition
from titan_thd.data.packer import pack_microbatch
from titan_thd.data.planner import hybrid_rank_costs, make_plan, sample_costs

CP, T, THRESHOLD, B = 2, 256, 64, 1e-3


def _doc(n: int) -> SimpleNamespace:
    return SimpleNamespace(input_ids=np.arange(n) % 50, target_mask=np.arange(n) > 0)


@pytest.mark.parametrize("lens", [[100, 40, 36, 20, 12, 8], [60, 60, 60, 4], [128, 64], [12]])
def test_rank_costs_are_what_partition_gives_each_rank(lens):
    """Independent count: rank r's rows of the packed microbatch (row_index) -> per document, the
    fraction of it the rank holds x its cost; a whole document counts fully, a split one 1/cp."""
    batch = pack_microbatch([_doc(n) for n in lens], T, 2 * CP, 0)
    costs = sample_costs(np.array(lens), B)
    got = hybrid_rank_costs(lens, costs.tolist(), T, CP, THRESHOLD)
    doc_of_row = torch.repeat_interleave(torch.arange(len(lens) + 1), batch.seqlens_padded)
    for r in range(CP):
        rows = partition(batch, CP, r, "hybrid", THRESHOLD).row_index
        held = torch.bincount(doc_of_row[rows], minlength=len(lens) + 1)[: len(lens)].numpy()
        want = float((held / np.array(lens) * costs).sum())
        assert got[r] == pytest.approx(want, rel=1e-12), (r, held)


def _hybrid_cost(plan, lens, costs) -> list[float]:
    return [
        sum(
            max(hybrid_rank_costs([int(lens[i]) for i in mb], [costs[i] for i in mb], T, CP, THRESHOLD))
            for mb in r
        )
        for r in plan.microbatches
    ]


@pytest.mark.parametrize("policy", ["balanced", "dp_balanced"])
def test_hybrid_refined_plan_is_never_slower_and_keeps_the_samples(policy):
    rng = np.random.default_rng(0)
    improved = 0
    for trial in range(8):
        lens = np.clip(rng.lognormal(3.5, 0.9, 24).astype(int) // 4 * 4, 4, T)
        costs = sample_costs(lens, B).tolist()
        plain = make_plan(policy, lens, 2, CP, T, B)
        hybrid = make_plan(policy, lens, 2, CP, T, B, hybrid_threshold=THRESHOLD)
        assert sorted(i for r in hybrid.microbatches for mb in r for i in mb) == list(range(lens.size))
        assert [len(r) for r in hybrid.microbatches] == [len(r) for r in plain.microbatches]
        assert all(lens[mb].sum() <= T for r in hybrid.microbatches for mb in r)
        before, after = _hybrid_cost(plain, lens, costs), _hybrid_cost(hybrid, lens, costs)
        assert hybrid.replica_costs == pytest.approx(after, rel=1e-12)  # what the plan reports
        assert max(after) <= max(before) * (1 + 1e-12), trial
        improved += max(after) < max(before) * 0.99
        again = make_plan(policy, lens, 2, CP, T, B, hybrid_threshold=THRESHOLD)
        assert again.microbatches == hybrid.microbatches  # deterministic
    assert improved >= 1
