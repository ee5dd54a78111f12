"""LoRA adapters on one process (float64): exact target paths, the bad-input lines, step 0 is the base
model bit for bit, the adapted forward equals the merged weights W + s B A, and the adapters' gradients
equal autograd's through the merged weights (an independent reference: no adapter code runs there)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call

from tests.lora._helpers import adapter_pair, merge_
from tests.models.dsv4._util import build as build_dsv4_random
from tests.models.dsv4._util import meta, micro, packed
from tests.models.test_llama import TINY
from tests.ops.test_varlen_attention import packed_meta
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.export.merge import merged_weight
from titan_thd.lora.targets import attach, init_adapters, is_adapter, resolve_lora
from titan_thd.models.dsv4.lora_targets import LORA as DSV4
from titan_thd.models.llama import build_llama
from titan_thd.models.llama.lora_targets import LORA as LLAMA

ALL_DSV4 = ["attention", "attention.wo_a", "shared_expert", "experts"]


def dsv4_adapted(targets=ALL_DSV4, rank=3, alpha=6.0, rslora=False, b_scale=0.1):
    model = build_dsv4_random(micro())
    plan = resolve_lora(targets, rank, alpha, rslora, DSV4, model, "dsv4/micro")
    base = copy.deepcopy(model)
    attach(model, plan)
    init_adapters(model, seed=7)
    return base, _trained(model, b_scale), plan


def _trained(model, b_scale: float):
    """`model` with its B factors drawn away from zero (a trained adapter), or left at zero."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if b_scale and ".lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * b_scale)
    return model


def llama_adapted(b_scale=0.1):
    torch.manual_seed(0)
    model = build_llama(TINY).double()
    plan = resolve_lora(["attention", "mlp"], 4, 8.0, True, LLAMA, model, "llama")
    base = copy.deepcopy(model)
    attach(model, plan)
    init_adapters(model, seed=3)
    return base, _trained(model, b_scale), plan


def test_targets_are_exact_paths_never_the_indexer_or_compressors():
    _, model, plan = dsv4_adapted()
    adapted = sorted({n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if is_adapter(n)})
    expected = []
    for i in model.layers:
        at = f"layers.{i}"
        expected += [f"{at}.attn.{p}" for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")]
        expected += [f"{at}.ffn.shared_experts.{p}" for p in ("w1", "w2", "w3")] + [f"{at}.ffn.experts"]
    assert adapted == sorted(expected)
    assert any(".indexer.wq_b" in n for n, _ in model.named_parameters())  # the model has one, unadapted
    assert plan.scaling == 2.0
    # Only adapters train; everything else (MTP included) is frozen.
    assert all(p.requires_grad == is_adapter(n) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    ("targets", "rank", "message"),
    [
        (
            ["attention", "mlp"],
            2,
            "lora.targets: unknown target 'mlp' for model dsv4/micro; valid: attention, ",
        ),
        (["attn.wq_b"], 2, "unknown target 'attn.wq_b'"),
        ([], 2, "lora.targets is empty"),
        (["attention"], 0, "lora.rank = 0: expected a positive integer"),
        (["attention.wkv"], 10_000, "lora.rank = 10000 is larger than the smaller side of attention.wkv"),
    ],
)
def test_bad_lora_settings_are_one_line(targets, rank, message):
    model = build_dsv4_random(micro())
    with pytest.raises(ValueError) as e:
        resolve_lora(targets, rank, 1.0, False, DSV4, model, "dsv4/micro")
    assert message in str(e.value) and "\n" not in str(e.value)
    if "unknown" in message:  # the valid choices are listed
        assert "experts.w13" in str(e.value) and "shared_expert" in str(e.value)


@pytest.mark.parametrize("targets", [ALL_DSV4, ["attention"], ["shared_expert", "experts"]])
def test_a_rank_too_large_is_refused_with_the_true_bound(targets):
    """The bound the refusal names is accepted as it is: no second refusal lowers it."""
    model = build_dsv4_random(micro())
    with pytest.raises(ValueError, match=r"use lora\.rank <= (\d+) or drop that target") as e:
        resolve_lora(targets, 10_000, 1.0, False, DSV4, model, "dsv4/micro")
    bound = int(e.value.args[0].split("use lora.rank <= ")[1].split()[0])
    resolve_lora(targets, bound, 1.0, False, DSV4, model, "dsv4/micro")  # accepted
    with pytest.raises(ValueError, match=rf"use lora\.rank <= {bound} or"):
        resolve_lora(targets, bound + 1, 1.0, False, DSV4, model, "dsv4/micro")
    # The bound is the smaller side of the narrowest adapted weight, read off the model here.
    adapted = attach(model, resolve_lora(targets, 1, 1.0, False, DSV4, model, "dsv4/micro"))
    sides = [
        min(p.shape[-2:])
        for n, p in model.named_parameters()
        if not is_adapter(n) and p.dim() >= 2 and n.rsplit(".", 1)[0] in adapted
    ]
    assert bound == min(sides)


def test_a_family_without_targets_and_a_missing_module_are_refused():
    model = build_dsv4_random(micro())
    with pytest.raises(ValueError, match="has no LoRA targets"):
        resolve_lora(["attention"], 2, 1.0, False, None, model, "x")
    del model.layers["0"].ffn.shared_experts
    with pytest.raises(ValueError, match=r"needs layers\.0\.ffn\.shared_experts\.w1, which model dsv4/micro"):
        resolve_lora(["shared_expert"], 2, 1.0, False, DSV4, model, "dsv4/micro")


def test_step_zero_is_the_base_model_bit_for_bit():
    base, model, _ = dsv4_adapted(b_scale=0.0)
    tokens, batch = packed([5, 37, 60], micro().vocab_size, tail=6)
    assert torch.equal(model(tokens, meta(batch)).logits, base(tokens, meta(batch)).logits)
    lbase, lmodel, _ = llama_adapted(b_scale=0.0)
    m = packed_meta([9, 4, 17], pad_to=4, T=40)
    t = torch.randint(0, TINY.vocab_size, (m.total_tokens,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(lmodel(t, m).logits, lbase(t, m).logits)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def test_adapted_forward_equals_merged_weights():
    _, model, _ = dsv4_adapted()
    tokens, batch = packed([5, 37, 60], micro().vocab_size)
    merged = copy.deepcopy(model)
    assert merge_(merged) == 4 * 11  # 4 layers x (5 attention + 3 shared expert + 3 routed stacks)
    out = model(tokens, meta(batch)).logits
    assert _relative(out, merged(tokens, meta(batch)).logits) < 1e-12
    assert _relative(out, build_dsv4_random(micro())(tokens, meta(batch)).logits) > 1e-3  # the adapters act
    _, lmodel, _ = llama_adapted()
    lmerged = copy.deepcopy(lmodel)
    merge_(lmerged)
    m = packed_meta([9, 4, 17], pad_to=4, T=40)
    t = torch.randint(0, TINY.vocab_size, (m.total_tokens,), generator=torch.Generator().manual_seed(1))
    assert _relative(lmodel(t, m).logits, lmerged(t, m).logits) < 1e-12


def test_adapter_gradients_equal_autograd_through_merged_weights():
    """d loss / d (A, B) of the adapted model against the same loss of the base model run with
    W + s B A substituted for every adapted weight (torch.func.functional_call, no adapter code)."""
    base, model, plan = dsv4_adapted()
    tokens, batch = packed([5, 37, 60], micro().vocab_size)
    labels, mask = batch.labels, batch.loss_mask

    def loss_of(logits):
        return cross_entropy_sum(logits, labels, mask)

    loss_of(model(tokens, meta(batch)).logits).backward()
    adapters = {
        n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters() if is_adapter(n)
    }
    weights = dict(base.named_parameters())
    substituted = {}
    for name, W in weights.items():
        pair = adapter_pair(name)
        if pair and pair[0] in adapters:
            substituted[name] = merged_weight(W.detach(), adapters[pair[0]], adapters[pair[1]], plan.scaling)
    assert len(substituted) == 4 * 11
    loss_of(functional_call(base, substituted, (tokens, meta(batch))).logits).backward()
    for name, ref in adapters.items():
        got = model.get_parameter(name).grad
        assert got is not None and _relative(got, ref.grad) < 1e-10, name
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))


def test_help_lists_every_family_target():
    from titan_thd.config.schema import field_docs
    from titan_thd.models import get_model_spec

    doc = field_docs()["lora.targets"]
    for family in ("dsv4", "llama"):
        targets = get_model_spec(family).lora
        section = doc.split(f"{family}:", 1)[1]
        for name in targets.choices():
            # qualified names may be abbreviated after the first of a group (`shared_expert.w1, .w3`)
            assert name in section or f".{name.split('.')[-1]}" in section, (family, name)
