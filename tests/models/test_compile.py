"""training.compile: the regionally compiled models equal their eager selves (docs/dsv4.md §18).

float64, dsv4 `micro` in training mode (LM + MTP + indexer KL) and a tiny llama: the loss, the
aux losses and every parameter gradient of the compiled model against the same weights run eager,
on two microbatches of different T (the compiled functions take dynamic shapes, so the second
T must not compile anything new). Bound: the compiled kernels only reorder float64 sums and fuse
element-wise ops (no reduced precision, no algebraic rewrites beyond inductor's exact ones), so
each differs from eager by a few ulps (u = 1.1e-16) times the terms summed (<= 256 per reduction
here); through the ~12 compiled layers and the backward that stays below 1e-12 relative, which is
what we assert (observed: ~1e-16 on the losses, ~2e-14 of the largest entry on the gradients).
Cold inductor cache, idle 2-core EPYC: the dsv4 case 31 s (seven graphs then, six now), the llama case 4 s.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.models.dsv4._util import build, meta, micro, packed
from titan_thd.data.packed_batch import IGNORE_INDEX
from titan_thd.models import get_model_spec
from titan_thd.models.compile import compiled
from titan_thd.models.dsv4.mhc import hc_post, hc_post_formula
from titan_thd.models.dsv4.moe import swiglu
from titan_thd.models.llama import LlamaArgs, build_llama
from titan_thd.models.llama import model as llama_model

REL = 1e-12

# Inductor's CPU backend builds C++ kernels; without a compiler the trainer refuses training.compile
# with one line (tests/e2e/test_bad_input.py), and there is nothing to compile here.
pytestmark = pytest.mark.skipif(
    not any(map(shutil.which, ("g++", "c++", "clang++"))), reason="torch.compile on CPU needs a C++ compiler"
)


def _loss_and_grads(model, tokens, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(tokens, meta(batch), **kwargs)
    labels = batch.labels.masked_fill(~batch.loss_mask, IGNORE_INDEX)
    total = F.cross_entropy(out.logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    total = total + sum(out.aux_losses.values())
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total.detach(), {k: v.detach() for k, v in out.aux_losses.items()}, grads


def _assert_close(eager, comp):
    (loss_e, aux_e, grads_e), (loss_c, aux_c, grads_c) = eager, comp
    torch.testing.assert_close(loss_c, loss_e, rtol=REL, atol=0)
    assert sorted(aux_c) == sorted(aux_e)
    for k in aux_e:
        torch.testing.assert_close(aux_c[k], aux_e[k], rtol=REL, atol=0, msg=k)
    assert sorted(grads_c) == sorted(grads_e)
    for n, g in grads_e.items():
        # Relative to the tensor's scale: an entry that cancels to ~0 has no relative precision.
        torch.testing.assert_close(grads_c[n], g, rtol=0, atol=REL * float(g.abs().max()), msg=n)


def test_compiled_dsv4_equals_eager_float64_over_two_lengths():
    args = micro()
    eager, comp = build(args).train(), build(args).train()  # the same seed: the same weights
    get_model_spec("dsv4").compile.apply(comp)
    block = comp.layers["0"]
    assert block.hc_post is compiled(hc_post_formula) and comp.layers["1"].ffn.experts.act is compiled(swiglu)
    assert block.ffn.shared_experts.act is compiled(swiglu) and comp.norm.fn is block.attn_norm.fn
    assert eager.layers["0"].hc_post is hc_post  # the eager default is untouched
    batches = [
        packed([37, 20, 43], vocab=args.vocab_size, pad_to=4, tail=8, seed=1, trained=0.8),
        packed([61, 29, 17], vocab=args.vocab_size, pad_to=4, seed=2, trained=0.8),
    ]
    assert batches[0][0].shape != batches[1][0].shape
    for i, (tokens, batch) in enumerate(batches):
        ref = _loss_and_grads(eager, tokens, batch)
        got = _loss_and_grads(comp, tokens, batch)
        assert set(ref[1]) == {"mtp", "indexer"}
        _assert_close(ref, got)
        if i == 0:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0, "nothing was compiled"
        else:  # dynamic shapes: a new T reuses the compiled code
            assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_llama_equals_eager_float64():
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=48, vocab_size=40)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_llama(args).double().train())
    eager, comp = models
    get_model_spec("llama").compile.apply(comp)
    assert comp.layers["0"].feed_forward.act is compiled(llama_model.swiglu)
    tokens, batch = packed([13, 30, 9], vocab=args.vocab_size, pad_to=4, tail=4, seed=3)
    _assert_close(_loss_and_grads(eager, tokens, batch), _loss_and_grads(comp, tokens, batch))


def _vocab_parallel_embedding_into_compiled_norm(rank, world_size):
    """Rank's embedding gradient with a compiled / eager norm on a vocabulary-parallel embedding's
    output (what dsv4's MTP does under TP: an AsyncCollectiveTensor reaches `compiled`)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from titan_thd.models.dsv4.norm import weighted_rms_norm_formula

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    embed = torch.nn.Embedding(16, 8, dtype=torch.float64)
    parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)))
    weight = torch.linspace(0.5, 1.5, 8, dtype=torch.float64)
    grads = []
    for fn in (weighted_rms_norm_formula, compiled(weighted_rms_norm_formula)):
        embed.weight.grad = None
        x = embed(torch.arange(12) % 16)
        assert isinstance(x, AsyncCollectiveTensor)  # the case under test
        y = fn(x, weight, 1e-6)
        (y * torch.arange(y.numel(), dtype=torch.float64).view_as(y)).sum().backward()
        grads.append(embed.weight.grad.to_local().clone())
    return grads


def test_compiled_function_takes_a_tensor_parallel_activation():
    """Regression: torch 2.13's compiled backward of an AsyncCollectiveTensor input returned a plain
    gradient to a DTensor redistribute ('Tensor' object has no attribute '_local_tensor'), so dsv4
    could not train with training.compile under tensor parallelism."""
    from tests._dist import spawn

    for eager, comp in spawn(_vocab_parallel_embedding_into_compiled_norm, 2):
        assert eager.abs().max() > 0
        torch.testing.assert_close(comp, eager, rtol=0, atol=REL * float(eager.abs().max()))
