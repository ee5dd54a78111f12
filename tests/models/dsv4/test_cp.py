"""dsv4 under contiguous context parallelism (gloo, 2 and 4 processes) equals one process.

One packed microbatch of the micro flavor (sliding, CSA, HCA layers; hash and learned MoE; MTP;
indexer KL on) is split with `partition(..., "contiguous")`; every rank runs the model on its rows
with the left halo and the compressed-entry all-gather. The reference is the same model on the
whole microbatch in this process. Compared: the logits (concatenated over ranks), the CE / MTP /
indexer sums and every parameter gradient (summed over ranks, as FSDP's reduce-scatter does), and
the routers' expert loads, in float64 (rel 1e-10) and in float32, with the sparse and the dense
indexer KL, and on a batch where one rank holds padding only. In float32 CP sums the gradients in
another order than one process, so it is held to the accuracy one process reaches: its error
against the float64 result at most twice the one-process float32 error, plus 1e-6 (a fixed float32
bound, e.g. 1e-5, held on one CPU and failed at 1.007e-5 on another). `_coverage` asserts that the
main batch really has the boundary cases for each CP degree, instead of trusting a comment.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn
from tests.models.dsv4._util import build, doc_slices, micro, packed
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import partition

# Rows: doc 0 [0, 6) real 5 (shorter than the window 8), doc 1 [6, 78) real 71, doc 2 [78, 92),
# doc 3 [92, 114), tail padding [114, 128). Odd lengths + pad_to 2 misalign windows with the ranks.
BATCH = {"lengths": [5, 71, 13, 22], "pad_to": 2, "tail": 14, "seed": 3, "trained": 0.8}
# At cp = 4 the last rank holds tail padding only: no real row, no entry, still in every collective.
IDLE_RANK = {"lengths": [90], "tail": 38, "seed": 4, "trained": 0.8}
# name -> (batch, dtype, relative tolerance, micro() overrides)
CASES = {
    "float64": (BATCH, torch.float64, 1e-10, {}),
    "float32": (BATCH, torch.float32, None, {}),  # as accurate as one process (module docstring)
    "dense-kl": (BATCH, torch.float64, 1e-10, {"indexer_loss_mode": "dense"}),
    "idle-rank": (IDLE_RANK, torch.float64, 1e-10, {}),
}
LEAK_DOC = 1  # spans 3 ranks at cp = 4


def _batch(spec: dict = BATCH):
    return packed(**spec, vocab=micro().vocab_size)


def _run(model, tokens, meta, batch) -> dict[str, torch.Tensor]:
    """Forward + backward of the trainer's loss (CE sum + aux sums); detached results."""
    out = model(tokens, meta)
    ce = cross_entropy_sum(out.logits, batch.labels, batch.loss_mask)
    (ce + sum(out.aux_losses.values())).backward()
    res = {"logits": out.logits.detach(), "ce": ce.detach()} | {
        k: v.detach() for k, v in out.aux_losses.items()
    }
    for name, p in model.named_parameters():
        res["grad." + name] = torch.zeros_like(p) if p.grad is None else p.grad
    for i, gate in enumerate(model.router_gates()):
        res[f"load.{i}"] = gate.load.clone()
    return res


def _embedding_grad(model, tokens, meta, rows: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. the main embedding output of the LEAK_DOC rows' logits (+ the indexer KL,
    whose inputs are detached) — `rows` are this rank's rows inside that document."""
    kept = {}

    def keep(module, inputs, output):
        if "out" not in kept:  # the main embedding (the MTP block embeds the next tokens afterwards)
            output.retain_grad()
            kept["out"] = output

    handle = model.embed.register_forward_hook(keep)
    out = model(tokens, meta)
    handle.remove()
    (out.logits[rows].square().sum() + out.aux_losses["indexer"]).backward()
    return kept["out"].grad


def _cp_body(rank: int, world: int) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Results of CP = 2 (two groups: ranks 0-1 and 2-3, sub-groups like the trainer's mesh) and
    CP = 4 (all ranks), from one launch of 4 processes."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    _tokens, batch = _batch()
    leak = doc_slices(batch)[LEAK_DOC]
    results = {}
    for cp_size, group in ((2, pairs[rank // 2]), (world, dist.group.WORLD)):
        cp_rank = rank % cp_size
        cp = CPContext(size=cp_size, rank=cp_rank, group=group, mode="contiguous")
        res = {}
        for name, (spec, dtype, _tol, overrides) in CASES.items():
            _tokens, full = _batch(spec)
            local = partition(full, cp_size, cp_rank, "contiguous")
            meta = BatchMeta.from_batch(local, cp=cp, full=full)
            res[name] = _run(build(micro(**overrides), dtype=dtype).train(), local.tokens, meta, local)
        local = partition(batch, cp_size, cp_rank, "contiguous")
        in_doc = (local.row_index >= leak.start) & (local.row_index < leak.stop)
        meta = BatchMeta.from_batch(local, cp=cp, full=batch)
        res["leak"] = {"grad": _embedding_grad(build(micro()).train(), local.tokens, meta, in_doc)}
        results[cp_size] = res
    return results


def _coverage(batch, cp: int) -> None:
    """The boundary cases the parity claims cover really occur at this CP degree."""
    args = micro()
    t = batch.total_tokens // cp
    assert t >= args.halo
    docs = [(s.start, s.stop) for s in doc_slices(batch)]
    ranks = [set(range(a // t, (b - 1) // t + 1)) for a, b in docs]
    assert any(len(r) >= 2 for r in ranks), "a document straddles a rank boundary"
    assert cp < 4 or any(len(r) >= 3 for r in ranks), "a document spans 3+ ranks"
    assert any(b - a < args.window for a, b in docs), "a document shorter than the window"
    plens, lens = batch.seqlens_padded.tolist(), batch.seqlens.tolist()
    assert any(0 < L < P for L, P in zip(lens, plens)) and lens[-1] == 0, "per-document and tail padding"

    def straddles(reach: int, m: int) -> bool:
        """Some entry's rows (its window, plus the previous one for CSA) cross a rank boundary."""
        return any(
            (a + (w + 1) * m - 1) // t != max(a, a + (w + 1) * m - reach) // t
            for a, b in docs
            for w in range((b - a) // m)
        )

    assert straddles(2 * args.csa_ratio, args.csa_ratio), "a CSA window pair straddles a boundary"
    assert straddles(args.csa_ratio, args.csa_ratio), "a CSA own window straddles a boundary"
    assert straddles(args.hca_ratio, args.hca_ratio), "an HCA window straddles a boundary"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    ref = {}
    for name, (spec, dtype, _tol, overrides) in CASES.items():
        tokens, batch = _batch(spec)
        ref[name] = _run(
            build(micro(**overrides), dtype=dtype).train(), tokens, BatchMeta.from_batch(batch), batch
        )
    tokens, batch = _batch()
    leak = doc_slices(batch)[LEAK_DOC]
    in_doc = torch.zeros(batch.total_tokens, dtype=torch.bool)
    in_doc[leak] = True
    ref["leak"] = {
        "grad": _embedding_grad(build(micro()).train(), tokens, BatchMeta.from_batch(batch), in_doc)
    }
    return ref


@pytest.mark.slow
def test_contiguous_cp_equals_one_process(reference):
    """CP = 2 and 4 reproduce the one-process logits, losses, gradients and expert loads, and the
    cross-document gradient stays exactly zero."""
    _tokens, batch = _batch()
    launch = spawn(_cp_body, 4)
    for cp in (2, 4):
        _coverage(batch, cp)
        per_rank = [launch[r][cp] for r in range(cp)]
        if cp == 2:  # the second pair computed the same thing on its own sub-group
            for r in (2, 3):
                for name in CASES:
                    assert all(
                        torch.equal(launch[r][2][name][k], launch[r - 2][2][name][k]) for k in reference[name]
                    )
        _check_parity(cp, per_rank, reference)
        _check_leakage(per_rank, reference, batch)


def _check_parity(cp: int, per_rank: list, reference: dict) -> None:
    for name, (_spec, _dtype, tol, _overrides) in CASES.items():
        ref = reference[name]
        got = {k: sum(r[name][k] for r in per_rank) for k in ref if k != "logits"}
        got["logits"] = torch.cat([r[name]["logits"] for r in per_rank])
        assert set(got) == set(ref)
        assert ref["mtp"] > 0 and ref["indexer"] > 0
        errors = {k: _rel(got[k], ref[k]) for k in ref if not k.startswith("load.")}
        worst = max(errors, key=errors.get)
        print(
            f"cp {cp} {name}: max rel error {errors[worst]:.2e} ({worst}); loss terms "
            + ", ".join(f"{k} {errors[k]:.1e}" for k in ("ce", "mtp", "indexer"))
        )
        if tol is not None:
            assert errors[worst] <= tol, (cp, name, worst, errors[worst])
            continue
        exact = reference["float64"]  # the same batch and weights in float64
        for k in errors:
            cp_error, one_error = _rel(got[k], exact[k]), _rel(ref[k], exact[k])
            assert cp_error <= 2 * one_error + 1e-6, (cp, name, k, cp_error, one_error)
        for k in ref:
            if k.startswith("load."):
                assert torch.equal(got[k], ref[k]), (cp, k)


def _check_leakage(per_rank: list, reference: dict, batch) -> None:
    """Exactly zero outside the document, also through halos and gathers; equal to one process inside."""
    grad = torch.cat([r["leak"]["grad"] for r in per_rank])
    leak = doc_slices(batch)[LEAK_DOC]
    outside = torch.ones(batch.total_tokens, dtype=torch.bool)
    outside[leak] = False
    assert torch.count_nonzero(grad[outside]) == 0
    assert torch.count_nonzero(grad[leak].abs().sum(1)) == leak.stop - leak.start
    assert _rel(grad, reference["leak"]["grad"]) <= 1e-10
