"""Adapters exported in PEFT's format give, through `peft` on transformers' model of the same base
folder, the logits our adapted model gives (float32, <= 1e-5 per document, as the base parity test);
the key set and shapes are exactly those `peft.get_peft_model` creates from the written config; the
per-expert layout is PEFT's (a scrambled expert would move the logits); the indexer's `q_b_proj` and
the compressors' `kv_proj` are never targeted; `attention.wo_a` is refused in one line."""

from __future__ import annotations

import copy
import json

import peft  # the test extra installs it: a missing peft fails, never skips
import pytest
import torch

from tests.lora._helpers import write_peft
from tests.models.dsv4._util import doc_slices, packed
from tests.models.dsv4.test_hf_parity import LENGTHS, TOL, hf_dir, hf_logits, our_logits, ours  # noqa: F401
from titan_thd.lora.peft import NotExportable, adapter_config, peft_tensors
from titan_thd.lora.targets import attach, init_adapters, is_adapter, resolve_lora
from titan_thd.models import get_model_spec
from titan_thd.models.dsv4.lora_targets import LORA as DSV4

transformers = pytest.importorskip("transformers")


def adapted(model, targets, rank=2, alpha=6.0, rslora=False):
    model = copy.deepcopy(model)
    plan = resolve_lora(targets, rank, alpha, rslora, DSV4, model, "dsv4")
    attach(model, plan)
    init_adapters(model, seed=11)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B" in name:  # B = 0 would hide any mistake in B's layout
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model, plan


def export(model, plan, out):
    hf = get_model_spec("dsv4").hf
    adapters = {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}
    blocks = [f"layers.{i}" for i in model.layers]
    return write_peft(
        out, peft_tensors(adapters, plan, blocks, hf.hf_module), adapter_config(plan, hf.hf_module), None
    )


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_reads_our_adapters_as_we_compute_them(hf_dir, ours, tmp_path, rslora):  # noqa: F811
    (path, _), (base, args) = hf_dir, ours
    model, plan = adapted(base, ["attention", "shared_expert", "experts"], rslora=rslora)
    out = export(model, plan, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path).eval()
    served = peft.PeftModel.from_pretrained(hf, out).eval()
    # Every key we wrote is one PEFT creates from the config, with its shape, and none is missing.
    fresh = peft.get_peft_model(
        transformers.DeepseekV4ForCausalLM.from_pretrained(path), peft.LoraConfig(**_lora_kwargs(config))
    )
    expected = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(fresh).items()}
    from safetensors.torch import load_file

    written = {k: tuple(v.shape) for k, v in load_file(out / "adapter_model.safetensors").items()}
    assert written == expected
    assert not any("indexer" in k or "compressor" in k for k in written)

    tokens, batch = packed(list(LENGTHS), args.vocab_size, pad_to=8, tail=21, seed=7)
    logits = our_logits(model.eval(), tokens, batch)
    moved = 0.0
    for rows in doc_slices(batch):
        err = (logits[rows] - hf_logits(served, tokens[rows])).abs().max().item()
        assert err <= TOL, (rows, err)
        moved = max(
            moved, (logits[rows] - our_logits(base, tokens[rows], _alone(batch, rows))).abs().max().item()
        )
    assert moved > 1e-2  # the adapters change the logits: a dropped adapter could not pass


def _alone(batch, rows):
    return packed([rows.stop - rows.start], 2, seed=0)[1]


def _lora_kwargs(config: dict) -> dict:
    keys = ("r", "lora_alpha", "use_rslora", "target_modules", "target_parameters", "lora_dropout", "bias")
    return {k: config[k] for k in keys}


def test_wo_a_is_refused_in_one_line(ours, tmp_path):  # noqa: F811
    model, plan = adapted(ours[0], ["attention", "attention.wo_a"])
    with pytest.raises(NotExportable) as e:
        export(model, plan, tmp_path / "x")
    assert "attention.wo_a" in str(e.value) and "not exportable" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()
