"""Hybrid context parallelism (docs/data.md §4): short documents whole on one CP rank, long ones
zigzagged. The layout rules on their own, then one 2-process gloo launch that checks, for a mixed
layout (long documents split, short ones whole), an all-whole layout (no collective at all) and
a layout where a short document fits no rank and is zigzagged instead:
- op level, float64: each rank's attention output and q/k/v gradients equal the dense-mask oracle
  of the full microbatch (max abs error <= 1e-10);
- model level, float64: logits, CE sum and every parameter gradient summed over the ranks equal one
  process (rel <= 1e-10, the house bound of tests/models/test_llama_cp.py);
- no cross-document leakage: the gradient of one document's logits is exactly zero on every row
  outside it, for zigzagged and for whole documents;
- the all-gather moves only the long documents' K/V rows (counted at the gloo call)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn
from tests.models.dsv4._util import doc_slices, packed
from tests.models.test_llama_cp import ARGS, _max_rel, _model, _model_run, _op, _qkv_grad_out
from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import HybridLayout, hybrid_indices, hybrid_layout, partition
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.ops.varlen_attention import dense_reference_attention, varlen_attention

CP = 2
BATCHES = {
    # Padded lengths 40, 4, 4, 92, 8, 4, 4, 24 and a 12-row tail: T = 192, 96 rows per rank.
    "A": {"lengths": [37, 4, 1, 90, 7, 3, 3, 22], "pad_to": 4, "tail": 12, "seed": 1, "trained": 0.8},
    # No tail, 48 rows per rank: the 40s take one rank each, the 16 then fits nowhere -> zigzagged.
    "B": {"lengths": [40, 38, 16], "pad_to": 4, "tail": 0, "seed": 2, "trained": 0.8},
}
# (batch, threshold, documents zigzagged, K/V rows each rank all-gathers per layer, leak documents)
CASES = [
    ("A", 32, [0, 3], 66, (3, 7)),  # long documents split, short ones whole
    ("A", 10**6, [], 0, (3,)),  # every document whole: no collective at all
    ("B", 10**6, [2], 8, (2,)),  # the fallback: a short document zigzagged
]


def _batch(name: str) -> PackedBatch:
    return packed(**BATCHES[name], vocab=ARGS.vocab_size)[1]


def test_layout_rules():
    # Three short documents on 2 ranks of 16 rows: the two 12s take a rank each, the 8 then fits
    # nowhere, so it is zigzagged (4 rows per rank) and the 12s still fit beside it.
    assert hybrid_layout([12, 12, 8], [12, 12, 8], 2, 16) == HybridLayout([2], [[0], [1]], [0, 0])
    g = torch.Generator().manual_seed(0)
    for trial in range(24):
        cp = (2, 4)[trial % 2]
        n = int(torch.randint(1, 12, (1,), generator=g))
        real = torch.randint(1, 60, (n,), generator=g).tolist()
        padded = [-(-x // (2 * cp)) * 2 * cp for x in real]
        tail = (-sum(padded)) % 64 + 2 * cp * int(torch.randint(0, 3, (1,), generator=g))
        real, padded = real + [0], padded + [tail]
        threshold = int(torch.randint(1, 80, (1,), generator=g))
        lay = hybrid_layout(real, padded, cp, threshold)
        T = sum(padded)
        held = sorted(lay.split + [i for w in lay.whole for i in w])
        assert held == [i for i, x in enumerate(real) if x > 0]  # every document exactly once
        assert all(padded[i] < threshold for w in lay.whole for i in w)  # only short ones whole
        assert all(i in lay.split for i in range(n) if padded[i] >= threshold)  # long ones split
        cup = torch.tensor([0, *padded]).cumsum(0)
        rows = [hybrid_indices(cup, lay, r) for r in range(cp)]
        assert all(r.numel() == T // cp for r in rows)
        assert torch.equal(torch.cat(rows).sort().values, torch.arange(T))


def _count_gathers(counts: dict) -> None:
    original = dist.all_gather_single

    def counted(out, inp, group=None, async_op=False):
        counts["rows"] = counts.get("rows", 0) + inp.shape[0]
        counts["calls"] = counts.get("calls", 0) + 1
        return original(out, inp, group=group, async_op=async_op)

    dist.all_gather_single = counted


def _leak_grad(meta: BatchMeta, tokens: torch.Tensor, weight_TV: torch.Tensor) -> torch.Tensor:
    model = _model(torch.float64)
    kept = {}

    def keep(module, inputs, output):
        output.retain_grad()
        kept["out"] = output

    handle = model.tok_embeddings.register_forward_hook(keep)
    (model(tokens, meta).logits * weight_TV).sum().backward()
    handle.remove()
    return kept["out"].grad


def _leak_weight(batch: PackedBatch, doc: int) -> torch.Tensor:
    weight_TV = torch.zeros(batch.total_tokens, ARGS.vocab_size, dtype=torch.float64)
    rows = doc_slices(batch)[doc]
    g = torch.Generator().manual_seed(4 + doc)
    weight_TV[rows] = torch.randn(rows.stop - rows.start, ARGS.vocab_size, generator=g, dtype=torch.float64)
    return weight_TV


def _body(rank: int, world: int) -> dict:
    counts: dict = {}
    _count_gathers(counts)
    out = {}
    for name, threshold, _split, _rows, leak_docs in CASES:
        batch = _batch(name)
        cp = CPContext(
            size=world, rank=rank, group=dist.group.WORLD, mode="hybrid", hybrid_threshold=threshold
        )
        local = partition(batch, world, rank, "hybrid", threshold)
        rows = local.row_index
        res = {"rows": rows}
        qkv_grad_out = (x[rows] for x in _qkv_grad_out(batch.total_tokens))
        counts.clear()
        res["op"] = _op(*qkv_grad_out, BatchMeta.from_batch(local, cp, batch), varlen_attention)
        res["gathered"] = dict(counts)  # one attention call
        res["model"] = _model_run(torch.float64, local, BatchMeta.from_batch(local, cp, batch))
        res["leak"] = {
            d: _leak_grad(BatchMeta.from_batch(local, cp, batch), local.tokens, _leak_weight(batch, d)[rows])
            for d in leak_docs
        }
        out[name, threshold] = res
    return out


@pytest.fixture(scope="module")
def launch() -> list[dict]:
    return spawn(_body, CP)


def _gather(per_rank: list, values: list[torch.Tensor], T: int) -> torch.Tensor:
    """Each rank's `values` put back at the global rows that rank holds."""
    full = values[0].new_zeros((T, *values[0].shape[1:]))
    for r, value in zip(per_rank, values):
        full[r["rows"]] = value
    return full


@pytest.mark.slow
def test_hybrid_cp_equals_one_process_without_leakage(launch):
    for name, threshold, split, gathered_rows, leak_docs in CASES:
        batch = _batch(name)
        T = batch.total_tokens
        per_rank = [r[name, threshold] for r in launch]
        layout = hybrid_layout(batch.seqlens.tolist(), batch.seqlens_padded.tolist(), CP, threshold)
        assert layout.split == split
        assert torch.equal(torch.cat([r["rows"] for r in per_rank]).sort().values, torch.arange(T))
        for r in per_rank:  # the long documents' rows only, in one all-gather; none without them
            assert r["gathered"] == ({"rows": gathered_rows, "calls": 1} if split else {})

        ref_op = _op(*_qkv_grad_out(T), BatchMeta.from_batch(batch), dense_reference_attention)
        op_err = {
            k: float((_gather(per_rank, [r["op"][k] for r in per_rank], T) - v).abs().max())
            for k, v in ref_op.items()
        }
        assert max(op_err.values()) <= 1e-10, (name, threshold, op_err)
        ref_model = _model_run(torch.float64, batch, BatchMeta.from_batch(batch))
        got = {k: sum(r["model"][k] for r in per_rank) for k in ref_model if k != "logits"}
        got["logits"] = _gather(per_rank, [r["model"]["logits"] for r in per_rank], T)
        errors = {k: _max_rel(got[k], ref_model[k]) for k in ref_model}
        print(f"{name} threshold {threshold}: op max abs {max(op_err.values()):.1e}, model max rel "
              f"{max(errors.values()):.1e}")  # fmt: skip
        assert max(errors.values()) <= 1e-10, (name, threshold, errors)

        slices = doc_slices(batch)
        for d in leak_docs:
            grad = _gather(per_rank, [r["leak"][d] for r in per_rank], T)
            outside = torch.ones(T, dtype=torch.bool)
            outside[slices[d]] = False
            assert torch.count_nonzero(grad[outside]) == 0, (name, threshold, d)
            assert torch.count_nonzero(grad[slices[d]].abs().sum(1)) == slices[d].stop - slices[d].start
