"""Each family's HFAdapter against transformers' own model of an exported folder: `hf_module` names a
module (or, for dsv4's expert stacks, a parameter) that transformers' model has, for every module of
ours that holds parameters, and the same tensor the loader maps (models/hf/)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models.dsv4._util import micro
from titan_thd.models import get_model_spec
from titan_thd.models.dsv4.hf_names import stored_to_ours
from titan_thd.models.hf import export

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _transformers_model(name, args, tmp_path):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build(args)
    out = export(spec, model, args, tmp_path / name)
    return spec, model, transformers.AutoModelForCausalLM.from_pretrained(out)


def _owners(model, skip=()):
    """(module path, its own parameter names) of every module that holds parameters directly."""
    return [
        (name, [p for p, _ in m.named_parameters(recurse=False)])
        for name, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False)) and not name.startswith(skip)
    ]


def test_dsv4_modules_are_transformers_modules(tmp_path):
    spec, model, hf = _transformers_model("dsv4", micro(vocab_size=320), tmp_path)
    modules, params = dict(hf.named_modules()), dict(hf.named_parameters())
    assert spec.hf.hf_module("layers.3.attn.wq_a") == "model.layers.3.self_attn.q_a_proj"
    assert spec.hf.hf_module("layers.3.ffn.experts.w1") == "model.layers.3.mlp.experts.gate_up_proj"
    assert spec.hf.hf_module("layers.3.ffn.experts.w3") == "model.layers.3.mlp.experts.gate_up_proj"
    assert spec.hf.hf_module("layers.3.ffn.experts.w2") == "model.layers.3.mlp.experts.down_proj"
    owners = _owners(model, skip=("mtp",))
    assert len(owners) > 40
    for ours, own in owners:
        hf_name = spec.hf.hf_module(ours)
        assert hf_name in modules, (ours, hf_name)
        if own == ["weight"]:  # a linear / norm / embedding: the loader maps its weight the same way
            assert stored_to_ours(f"{hf_name}.weight") == (f"{ours}.weight", None, None), ours
        if own == ["w1", "w2", "w3"]:  # an expert stack: transformers' fused parameters
            for p in own:
                assert spec.hf.hf_module(f"{ours}.{p}") in params, (ours, p)
    with pytest.raises(ValueError, match="no transformers module"):
        spec.hf.hf_module("mtp.0.attn.wq_a")


def test_llama_modules_are_transformers_modules(tmp_path):
    args = dataclasses.replace(get_model_spec("llama").flavors["debug"], n_layers=2, vocab_size=320)
    spec, model, hf = _transformers_model("llama", args, tmp_path)
    modules = dict(hf.named_modules())
    assert spec.hf.hf_module("layers.0.attention.wq") == "model.layers.0.self_attn.q_proj"
    assert spec.hf.hf_module("layers.1.feed_forward.w3") == "model.layers.1.mlp.up_proj"
    owners = _owners(model)
    assert len(owners) == 2 + 2 * 9 + 1  # embedding, head, per layer 4 + 3 linears and 2 norms, norm
    for ours, own in owners:
        hf_name = spec.hf.hf_module(ours)
        assert hf_name in modules, (ours, hf_name)
        assert dict(modules[hf_name].named_parameters(recurse=False)).keys() == set(own), ours
    with pytest.raises(ValueError, match="no transformers module"):
        spec.hf.hf_module("layers.0.attention.inner_attention")
