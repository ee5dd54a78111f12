"""benchmarks/bench_llama_vs_torchtitan.py without torchtitan: a message and exit code 0, nothing run
(torchtitan is not a dependency; the comparison itself is a measurement, never a test)."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_llama_vs_torchtitan.py"


def test_without_torchtitan_it_says_so_and_exits_0(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_llama_vs_torchtitan", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # `import torchtitan` raises ImportError
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    assert bench.main() == 0
    assert "torchtitan is not installed" in capsys.readouterr().out


def _load():
    spec = importlib.util.spec_from_file_location("bench_llama_vs_torchtitan", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_documents_mode_gives_both_sides_the_same_work():
    """`--docs`: titan_thd's packed microbatches and torchtitan's padded length buckets hold the same
    documents within the token budget, and the step's loss is the same on both batchings (float64,
    one model: the padded side runs each row as one causal sequence, as torchtitan's [B, L] does)."""
    import copy

    import torch

    from titan_thd.data.batch_meta import BatchMeta

    bench = _load()
    budget = 160
    docs = bench.make_docs(9, 50, budget, seed=3)
    assert len({d.numel() for d in docs}) > 3 and max(d.numel() for d in docs) <= budget
    packed, buckets = bench.first_fit(docs, budget), bench.length_buckets(docs, budget)
    for groups in (packed, buckets):
        assert sorted(id(d) for g in groups for d in g) == sorted(id(d) for d in docs)
    assert all(sum(d.numel() for d in g) <= budget for g in packed)
    assert all(len(g) * g[0].numel() <= budget for g in buckets)
    assert all(g[0].numel() == max(d.numel() for d in g) for g in buckets)

    class RowsAsSequences(torch.nn.Module):
        """torchtitan's call signature on titan_thd's model: each [L] row one causal sequence."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, tokens_BL, positions_BL, _masks):
            L = tokens_BL.shape[1]
            cu = torch.tensor([0, L], dtype=torch.int32)
            return torch.stack(
                [
                    self.inner(row, BatchMeta(cu, cu, L, 1, pos, None)).logits
                    for row, pos in zip(tokens_BL, positions_BL)
                ]
            )

    torch.manual_seed(0)
    ours = bench.build_ours(torch.float64, False)
    padded = RowsAsSequences(copy.deepcopy(ours))
    step_ours = bench.doc_steps("titan_thd", ours, docs, budget)
    step_padded = bench.doc_steps("torchtitan", padded, docs, budget)
    assert step_ours.shape["tokens_computed"] == sum(d.numel() for d in docs)
    assert step_padded.shape["tokens_computed"] > step_ours.shape["tokens_computed"]
    loss_ours, loss_padded = step_ours(), step_padded()
    assert abs(loss_ours - loss_padded) <= 1e-12 * abs(loss_ours)
