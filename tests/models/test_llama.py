"""Llama on packed microbatches: per-document parity, padding invariance, gradient isolation (float64),
deterministic init, parameter counts, parallel plan shape."""

from __future__ import annotations

import pytest
import torch

from tests._dist import spawn
from tests.ops.test_varlen_attention import doc_rows, packed_meta
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import ActivationCheckpoint
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packed_batch import IGNORE_INDEX
from titan_thd.models import get_model_spec
from titan_thd.models.llama import LlamaArgs, build_llama
from titan_thd.models.llama.parallelize import parallelize_llama, tp_plan
from titan_thd.models.spec import count_params
from titan_thd.parallel.parallel_dims import ParallelDims

TOL = 1e-10
TINY = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=48, vocab_size=40)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_llama(TINY).double()


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_packed_forward_equals_each_document_alone(model):
    lens = [9, 4, 17, 1, 12]
    meta = packed_meta(lens, pad_to=4, T=64)
    tokens = random_tokens(meta.total_tokens, seed=1)
    out = model(tokens, meta)
    assert out.logits.shape == (64, TINY.vocab_size) and out.aux_losses == {}
    for n, rows in zip(lens, doc_rows(meta)):
        alone = model(tokens[rows], packed_meta([n])).logits
        torch.testing.assert_close(out.logits[rows], alone, rtol=0, atol=TOL)


def test_padding_content_does_not_change_real_logits(model):
    lens = [9, 4, 17]
    meta_a, meta_b = packed_meta(lens), packed_meta(lens, pad_to=8, T=72)
    tokens_a = random_tokens(meta_a.total_tokens, seed=2)
    tokens_b = random_tokens(meta_b.total_tokens, seed=3)  # padding rows hold arbitrary ids
    for src, dst in zip(doc_rows(meta_a), doc_rows(meta_b)):
        tokens_b[dst] = tokens_a[src]
    logits_a, logits_b = model(tokens_a, meta_a).logits, model(tokens_b, meta_b).logits
    for src, dst in zip(doc_rows(meta_a), doc_rows(meta_b)):
        torch.testing.assert_close(logits_b[dst], logits_a[src], rtol=0, atol=TOL)


def test_no_gradient_crosses_documents(model):
    meta = packed_meta([7, 10, 5], pad_to=4, T=40)
    tokens = random_tokens(meta.total_tokens, seed=4)
    embeddings = model.tok_embeddings(tokens).detach().requires_grad_()
    handle = model.tok_embeddings.register_forward_hook(lambda *_: embeddings)  # embedding-level input
    try:
        logits = model(tokens, meta).logits
    finally:
        handle.remove()
    for i, rows in enumerate(doc_rows(meta)[:3]):
        weight = torch.randn(logits[rows].shape, dtype=torch.float64)
        (grad,) = torch.autograd.grad((logits[rows] * weight).sum(), embeddings, retain_graph=True)
        own = torch.zeros(meta.total_tokens, dtype=torch.bool)
        own[rows] = True
        assert torch.equal(grad[~own], torch.zeros_like(grad[~own])), f"document {i} leaks gradient"
        assert grad[own].abs().min() > 0


def expected_params(a: LlamaArgs) -> int:
    """Independent count: q/k/v/o, SwiGLU, two norms per block; embedding, final norm, LM head."""
    hd = a.dim // a.n_heads
    block = a.dim * hd * (2 * a.n_heads + 2 * a.n_kv_heads) + 3 * a.dim * a.ffn_hidden_dim + 2 * a.dim
    return a.n_layers * block + 2 * a.vocab_size * a.dim + a.dim


@pytest.mark.parametrize("flavor,low,high", [("debug", 5e6, 10e6), ("bench", 30e6, 60e6)])
def test_flavor_param_counts(flavor, low, high):
    args = get_model_spec("llama").flavors[flavor]
    assert args.vocab_size == 512
    with torch.device("meta"):  # shapes only: counting needs no memory
        model = build_llama(args)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    n = count_params(model)
    assert n == expected_params(args)
    assert low <= n <= high, n


def test_init_is_a_function_of_the_seed_only():
    torch.manual_seed(7)
    a = build_llama(TINY)
    torch.manual_seed(7)
    b = build_llama(TINY)
    torch.manual_seed(8)
    c = build_llama(TINY)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:  # norms start at ones for every seed
            assert not torch.equal(pa, pc), name
    with torch.no_grad():  # init_weights re-draws everything, in the same order
        for p in a.parameters():
            p.fill_(float("nan"))
    torch.manual_seed(7)
    a.init_weights()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_stable_fqns():
    torch.manual_seed(0)
    model = build_llama(TINY)
    assert list(model.layers.keys()) == ["0", "1"]
    names = dict(model.named_parameters())
    for fqn in (
        "tok_embeddings.weight",
        "layers.1.attention.wq.weight",
        "layers.0.feed_forward.w3.weight",
        "output.weight",
    ):
        assert fqn in names
    assert model.output.weight is not model.tok_embeddings.weight  # untied


def test_tp_plan_names_real_modules():
    torch.manual_seed(0)
    model = build_llama(TINY)
    plan = tp_plan(model)
    assert len(plan) == 3 + 11 * TINY.n_layers
    for fqn in plan:
        model.get_submodule(fqn)  # raises if the plan names a module that does not exist
    dims = ParallelDims(pp=1, dp_shard=1, cp=1, tp=1, world_size=1)
    assert (
        parallelize_llama(
            model,
            dims,
            ac=ActivationCheckpoint(),
        )
        is model
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_te_backend_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend"):
        build_llama(LlamaArgs(**{**TINY.__dict__, "attention_backend": "te"}))


def test_invalid_args_are_value_errors():
    with pytest.raises(ValueError, match="n_kv_heads 3"):
        LlamaArgs(dim=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="attention_backend"):
        LlamaArgs(attention_backend="flash")


def _fsdp_vs_one_process(rank: int, world_size: int) -> float:
    """Rank r runs microbatch r through the FSDP-sharded model; the reference runs both microbatches
    in one unsharded model. Returns the largest gradient difference relative to the gradient's size
    (summed CE, float32)."""
    torch.manual_seed(0)
    reference = build_llama(TINY).double()
    for tokens, meta in _microbatches():
        cross_entropy_sum(reference(tokens, meta).logits, _labels(tokens, meta)).backward()
    dims = ParallelDims(pp=1, dp_shard=-1, cp=1, tp=1, world_size=world_size)
    dims.build_meshes("cpu")
    torch.manual_seed(0)
    model = parallelize_llama(
        build_llama(TINY).double(),
        dims,
        ac=ActivationCheckpoint(),
    )
    tokens, meta = _microbatches()[rank]
    cross_entropy_sum(model(tokens, meta).logits, _labels(tokens, meta)).backward()
    ref_grads = dict(reference.named_parameters())
    return max(
        ((p.grad.full_tensor() - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item()
        for n, p in model.named_parameters()
    )


def _microbatches() -> list[tuple[torch.Tensor, BatchMeta]]:
    metas = [packed_meta([11, 3, 20], pad_to=2, T=40), packed_meta([25, 9], T=40)]
    return [(random_tokens(40, seed=10 + i), m) for i, m in enumerate(metas)]


def _labels(tokens: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
    labels = torch.full_like(tokens, IGNORE_INDEX)
    for rows in doc_rows(meta):
        labels[rows.start : rows.stop - 1] = tokens[rows.start + 1 : rows.stop]
    return labels


@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process():
    """Each rank packs different documents; summed FSDP gradients equal the one-process gradients
    (float64: rel <= 1e-12 of each gradient's largest entry)."""
    assert max(spawn(_fsdp_vs_one_process, 2)) <= 1e-12
