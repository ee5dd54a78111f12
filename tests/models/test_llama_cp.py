"""Llama under zigzag context parallelism (gloo, 2 and 4 processes) equals one process.

One launch of 4 processes runs every check:
- CP = 2 on two sub-groups (ranks 0-1 on batch A, ranks 2-3 on batch B) and CP = 4 on batch B;
- op level, float64: `varlen_attention` (which dispatches to `zigzag_attention`) on each rank's
  rows equals the dense-mask oracle on the full microbatch, output and q/k/v gradients (the K/V
  gradients reach their owners through the all-gather's reduce-scatter), max abs error <= 1e-10;
- model level, float32 (rel 1e-5) and float64 (rel 1e-10): logits, the CE sum and every parameter
  gradient summed over the CP ranks (what FSDP's reduce-scatter does) equal one process;
- cross-document leakage: the gradient of one document's logits w.r.t. the embedding output is
  exactly zero on every row outside the document, on every rank.
Every document is split across all ranks in zigzag; the batches also hold documents of very
different lengths, one of exactly 2*cp tokens, one of a single token, per-document padding, a run
of equal documents (one batched SDPA call) and the tail padding document (`_coverage` checks).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn
from tests.models.dsv4._util import doc_slices, packed
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import partition
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.models.llama import LlamaArgs, build_llama
from titan_thd.ops.varlen_attention import dense_reference_attention, varlen_attention

ARGS = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=48, vocab_size=40)
# A: pad_to 4 (2*cp for cp 2): a 4-token document (one row per chunk), a run of two 3-token ones.
# B: pad_to 8 (2*cp for cp 4): an 8-token document, a 130-token one, a run of two 5-token ones.
BATCHES = {
    "A": {"lengths": [37, 4, 1, 90, 7, 3, 3, 22], "pad_to": 4, "tail": 12, "seed": 1, "trained": 0.8},
    "B": {"lengths": [37, 8, 1, 90, 5, 5, 130, 22], "pad_to": 8, "tail": 24, "seed": 2, "trained": 0.8},
}
LAUNCH = [(2, "A"), (2, "B"), (4, "B")]  # (cp, batch) pairs the 4-process launch computes
DTYPES = {"float32": (torch.float32, 1e-5), "float64": (torch.float64, 1e-10)}
LEAK_DOC = 3  # 90 real tokens: every rank holds two chunks of it
H, K, D = 4, 2, 8


def _batch(name: str) -> PackedBatch:
    return packed(**BATCHES[name], vocab=ARGS.vocab_size)[1]


def _model(dtype: torch.dtype) -> torch.nn.Module:
    """Every parameter perturbed (so the ones-initialised norm weights are tested too)."""
    torch.manual_seed(0)
    model = build_llama(ARGS).to(dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model


def _qkv_grad_out(T: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (H, K, K, H)]


def _op(q, k, v, grad_out, meta, attention) -> dict[str, torch.Tensor]:
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, meta, scale=0.3)
    out.backward(grad_out)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _model_run(dtype: torch.dtype, batch: PackedBatch, meta: BatchMeta) -> dict[str, torch.Tensor]:
    model = _model(dtype)
    logits = model(batch.tokens, meta).logits
    ce = cross_entropy_sum(logits, batch.labels, batch.loss_mask)
    ce.backward()
    return {"logits": logits.detach(), "ce": ce.detach()} | {
        "grad." + n: p.grad for n, p in model.named_parameters()
    }


def _leak_weight_in_doc(batch: PackedBatch) -> torch.Tensor:
    """[T, V] random weights on the LEAK_DOC rows, zero elsewhere."""
    T = batch.total_tokens
    weight_TV = torch.zeros(T, ARGS.vocab_size, dtype=torch.float64)
    leak = doc_slices(batch)[LEAK_DOC]
    g = torch.Generator().manual_seed(4)
    weight_TV[leak] = torch.randn(leak.stop - leak.start, ARGS.vocab_size, generator=g, dtype=torch.float64)
    return weight_TV


def _leak_grad(meta: BatchMeta, tokens: torch.Tensor, weight_TV: torch.Tensor) -> torch.Tensor:
    """Gradient of sum(logits * weight_TV) w.r.t. the embedding output of every row (the weight is
    zero outside LEAK_DOC)."""
    model = _model(torch.float64)
    kept = {}

    def keep(module, inputs, output):
        output.retain_grad()
        kept["out"] = output

    handle = model.tok_embeddings.register_forward_hook(keep)
    logits = model(tokens, meta).logits
    handle.remove()
    (logits * weight_TV).sum().backward()
    return kept["out"].grad


def _cp_body(rank: int, world: int) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {}
    for cp_size, name in LAUNCH:
        if cp_size == 2 and "AB"[rank // 2] != name:
            continue
        group = pairs[rank // 2] if cp_size == 2 else dist.group.WORLD
        cp_rank = rank % cp_size
        batch = _batch(name)
        local = partition(batch, cp_size, cp_rank, "zigzag")
        cp = CPContext(size=cp_size, rank=cp_rank, group=group, mode="zigzag")
        rows = local.row_index
        # A fresh BatchMeta per run: nothing cached leaks from one check into another.
        qkv_grad_out = (x[rows] for x in _qkv_grad_out(batch.total_tokens))
        res = {
            "rows": rows,
            "op": _op(*qkv_grad_out, BatchMeta.from_batch(local, cp, batch), varlen_attention),
        }
        for dtype_name, (dtype, _tol) in DTYPES.items():
            res[dtype_name] = _model_run(dtype, local, BatchMeta.from_batch(local, cp, batch))
        leak_weight = _leak_weight_in_doc(batch)[rows]
        res["leak"] = _leak_grad(BatchMeta.from_batch(local, cp, batch), local.tokens, leak_weight)
        results[cp_size, name] = res
    return results


def _coverage(batch: PackedBatch, cp: int) -> None:
    """The cases the parity claims cover really occur in this batch at this CP degree."""
    lens, plens = batch.seqlens.tolist(), batch.seqlens_padded.tolist()
    if min(plens) == 2 * cp:  # pad_to is 2*cp
        assert any(L == P == 2 * cp for L, P in zip(lens, plens)), "a document of exactly 2*cp tokens"
    assert any(0 < L <= P // (2 * cp) for L, P in zip(lens, plens)), "a document inside its first chunk"
    assert any(L > (2 * cp - 1) * P // (2 * cp) for L, P in zip(lens, plens)), "real rows in the last chunk"
    assert any(0 < L < P for L, P in zip(lens, plens)) and lens[-1] == 0, "per-document and tail padding"
    assert any(a == b and a > 0 for a, b in itertools.pairwise(lens)), "a run of equal documents"
    assert max(lens) >= 10 * min(L for L in lens if L > 0), "documents of very different lengths"


def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300))


def _reference(name: str) -> dict:
    batch = _batch(name)
    meta = BatchMeta.from_batch(batch)
    ref = {"op": _op(*_qkv_grad_out(batch.total_tokens), meta, dense_reference_attention)}
    for dtype_name, (dtype, _tol) in DTYPES.items():
        ref[dtype_name] = _model_run(dtype, batch, BatchMeta.from_batch(batch))
    ref["leak"] = _leak_grad(BatchMeta.from_batch(batch), batch.tokens, _leak_weight_in_doc(batch))
    return ref


@pytest.fixture(scope="module")
def launch() -> dict:
    """{(cp, batch): [per-rank results]} from one 4-process launch."""
    ranks = spawn(_cp_body, 4)
    return {key: [r[key] for r in ranks if key in r] for key in LAUNCH}


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: _reference(name) for name in BATCHES}


def _gather(per_rank: list, values: list[torch.Tensor], T: int) -> torch.Tensor:
    """Each rank's `values` (one per rank) put back at the global rows that rank holds."""
    full = values[0].new_zeros((T, *values[0].shape[1:]))
    for r, value in zip(per_rank, values):
        full[r["rows"]] = value
    return full


@pytest.mark.slow
def test_zigzag_cp_equals_one_process(launch, references):
    for cp, name in LAUNCH:
        batch, per_rank, ref = _batch(name), launch[cp, name], references[name]
        _coverage(batch, cp)
        assert len(per_rank) == cp
        T = batch.total_tokens
        rows = torch.cat([r["rows"] for r in per_rank])
        assert torch.equal(rows.sort().values, torch.arange(T))

        op_err = {
            k: float((_gather(per_rank, [r["op"][k] for r in per_rank], T) - v).abs().max())
            for k, v in ref["op"].items()
        }
        print(
            f"cp {cp} batch {name} op float64 max abs error: "
            + ", ".join(f"{k} {e:.1e}" for k, e in op_err.items())
        )
        assert max(op_err.values()) <= 1e-10, op_err

        for dtype_name, (_dtype, tol) in DTYPES.items():
            r_ref = ref[dtype_name]
            got = {k: sum(r[dtype_name][k] for r in per_rank) for k in r_ref if k != "logits"}
            got["logits"] = _gather(per_rank, [r[dtype_name]["logits"] for r in per_rank], T)
            errors = {k: _max_rel(got[k], r_ref[k]) for k in r_ref}
            grads = [e for k, e in errors.items() if k.startswith("grad.")]
            print(
                f"cp {cp} batch {name} {dtype_name}: loss rel {errors['ce']:.1e}, "
                f"logits {errors['logits']:.1e}, max grad rel {max(grads):.1e} over {len(grads)} parameters"
            )
            assert max(errors.values()) <= tol, (cp, name, dtype_name, errors)


@pytest.mark.slow
def test_no_gradient_crosses_documents_under_cp(launch, references):
    """Exactly zero outside the document, through the K/V all-gather; equal to one process inside."""
    for cp, name in LAUNCH:
        batch, per_rank = _batch(name), launch[cp, name]
        grad = _gather(per_rank, [r["leak"] for r in per_rank], batch.total_tokens)
        leak = doc_slices(batch)[LEAK_DOC]
        outside = torch.ones(batch.total_tokens, dtype=torch.bool)
        outside[leak] = False
        assert all(((r["rows"] >= leak.start) & (r["rows"] < leak.stop)).sum() > 0 for r in per_rank)
        assert torch.count_nonzero(grad[outside]) == 0, (cp, name)
        assert torch.count_nonzero(grad[leak].abs().sum(1)) == leak.stop - leak.start
        assert _max_rel(grad, references[name]["leak"]) <= 1e-10
