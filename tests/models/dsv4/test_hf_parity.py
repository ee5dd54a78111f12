"""dsv4 against transformers' independent DeepseekV4ForCausalLM (fp32, max abs logits error <= 1e-5).

transformers is not document-aware, so it runs one document at a time; our packed THD batch of the
same documents (per-document padding, a tail padding document) must match each document alone.
It does not instantiate MTP, so MTP is not part of this comparison (tests/models/dsv4/test_model.py
checks MTP's THD behaviour).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.models.dsv4._util import doc_slices, meta, packed
from titan_thd.models import hf
from titan_thd.models.dsv4 import export_hf, load_hf
from titan_thd.models.dsv4.hf_config import args_from_hf_config
from titan_thd.models.dsv4.hf_names import to_ours

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

LENGTHS = (5, 37, 203)  # shorter than the window (8), not a multiple of 4, longer than 128
TOL = 1e-5


def hf_config(**overrides):
    kwargs = {
        "vocab_size": 97,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 32,
        "q_lora_rank": 32,
        "num_experts_per_tok": 2,
        "n_routed_experts": 4,
        "o_groups": 2,
        "o_lora_rank": 16,
        # Exact indexer score ties happen when every head's ReLU is 0 (probability 2^-heads per entry).
        # On a tie transformers' plain topk picks an arbitrary entry, ours the lower index (so that the
        # choice cannot depend on what else is packed); 32 heads make ties practically impossible so
        # both pick the same set and the comparison is like with like.
        "index_n_heads": 32,
        "index_head_dim": 16,
        "index_topk": 4,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "compress_rope_theta": 40000.0,
        "max_position_embeddings": 256,
        "dtype": "float32",
    }
    kwargs.update(overrides)
    return transformers.DeepseekV4Config(**kwargs)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random transformers model (all parameters and buffers perturbed, random hash tables), saved."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(hf_config()).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], 4, generator=g).argsort(-1)[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def ours(hf_dir):
    model, args = load_hf(hf_dir[0])
    return model.eval(), args


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(tokens[None]).logits[0]


def our_logits(model, tokens, batch):
    with torch.no_grad():
        return model(tokens, meta(batch)).logits


def test_single_documents_match_transformers(hf_dir, ours):
    hf, (model, args) = hf_dir[1], ours
    assert args.layer_types == ("sliding", "csa", "hca", "csa") and args.n_hash_layers == 1
    errors = {}
    for L in LENGTHS:
        tokens, batch = packed([L], args.vocab_size, seed=L)
        errors[L] = (our_logits(model, tokens, batch) - hf_logits(hf, tokens)).abs().max().item()
    print("max abs logits error per document length:", errors)
    assert max(errors.values()) <= TOL, errors


def test_packed_batch_matches_each_document_alone(hf_dir, ours):
    hf, (model, args) = hf_dir[1], ours
    tokens, batch = packed(list(LENGTHS), args.vocab_size, pad_to=8, tail=21, seed=7)
    logits = our_logits(model, tokens, batch)
    for rows in doc_slices(batch):
        err = (logits[rows] - hf_logits(hf, tokens[rows])).abs().max().item()
        assert err <= TOL, (rows, err)


def test_export_loads_in_transformers_and_back(hf_dir, ours, tmp_path):
    model, args = ours
    out = export_hf(model, args, tmp_path / "export", max_shard_size=300_000)  # several files + index
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 3
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    hf2 = transformers.DeepseekV4ForCausalLM.from_pretrained(out).eval()
    tokens, batch = packed([150], args.vocab_size, seed=3)
    assert (our_logits(model, tokens, batch) - hf_logits(hf2, tokens)).abs().max().item() <= TOL
    again, args2 = load_hf(out)  # the export carries MTP weights too: an exact round trip
    assert args2 == args
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_name_mapping_covers_transformers_module_names(hf_dir, ours):
    """The in-memory transformers state dict (module names, fused experts) maps onto ours exactly."""
    hf, (model, _) = hf_dir[1], ours
    mapped = to_ours(hf.state_dict())
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    assert sorted(mapped) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(mapped[k], v), k


def test_flavor_mismatch_names_the_fields(hf_dir):
    with pytest.raises(ValueError, match=r"does not match flavor 'micro'.*dim: checkpoint 64 vs 128"):
        load_hf(hf_dir[0], "micro")


def test_missing_and_misshaped_tensors_are_named(hf_dir, tmp_path):
    path = hf_dir[0]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    state = safetensors.load_file(path / "model.safetensors")
    del state["model.layers.2.attn.compressor.ape"]
    safetensors.save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 missing tensors \['layers.2.attn.compressor.ape'\]"):
        load_hf(tmp_path)
    state["model.layers.2.attn.compressor.ape"] = torch.zeros(3, 3)
    safetensors.save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"wrong shape: layers.2.attn.compressor.ape: \(3, 3\) vs model \(16, 32\)"
    ):
        load_hf(tmp_path)


def test_bad_configs_are_rejected(hf_dir):
    cfg = json.loads((hf_dir[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="unknown layer_types"):
        args_from_hf_config(
            {**cfg, "layer_types": ["sliding_attention", "dense", "sliding_attention", "sliding_attention"]}
        )
    legacy = {k: v for k, v in cfg.items() if k not in ("layer_types", "compress_rates")}
    assert args_from_hf_config({**legacy, "compress_ratios": [0, 4, 128, 4, 0]}).layer_types == (
        "sliding",
        "csa",
        "hca",
        "csa",
    )
    with pytest.raises(ValueError, match=r"unknown compress_ratios \[\(2, 8\)\]"):
        args_from_hf_config({**legacy, "compress_ratios": [0, 4, 8, 4]})
    with pytest.raises(ValueError, match="num_key_value_heads = 2"):
        args_from_hf_config({**cfg, "num_key_value_heads": 2})


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
def test_convert_hf_dcp_round_trip(hf_dir, ours, tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "scripts" / "convert_hf.py"
    spec = importlib.util.spec_from_file_location("convert_hf", script)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    model, _ = ours
    assert convert.main(["to-dcp", str(hf_dir[0]), str(tmp_path / "dcp")]) == 0
    assert (
        convert.main(
            [
                "to-hf",
                str(tmp_path / "dcp"),
                str(tmp_path / "hf"),
                "--hf-config",
                str(tmp_path / "dcp" / "config.json"),
                "--max-shard-size",
                "200KB",
            ]
        )
        == 0
    )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    sizes = [f.stat().st_size for f in (tmp_path / "hf").glob("model-*.safetensors")]
    assert len(set(index.values())) == len(sizes) > 3
    # bounded: a file holds at most 200 kB of tensors unless one tensor alone is larger
    largest = max(v.numel() * 4 for v in model.state_dict().values())
    assert max(sizes) <= max(200_000, largest) + 20_000, sizes
    back, _ = load_hf(tmp_path / "hf")
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        if not k.startswith("mtp."):  # the source has no MTP weights: those are freshly initialised
            assert k == k2 and torch.equal(a, b), k
    # to-dcp drew what the folder lacks by the model's init rules (norms 1, matrices N(0, init_std))
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    drawn = _load_state_dict_from_keys(
        keys={"model.mtp.0.norm.weight", "model.mtp.0.e_proj.weight"},
        storage_reader=FileSystemReader(tmp_path / "dcp"),
    )["model"]
    assert torch.equal(drawn["mtp.0.norm.weight"], torch.ones_like(drawn["mtp.0.norm.weight"]))
    assert abs(drawn["mtp.0.e_proj.weight"].std().item() / model.args.init_std - 1) < 0.1
    assert convert.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "x"), "--flavor", "micro"]) == 2


def test_the_hf_load_fills_a_built_model(hf_dir, ours):
    from titan_thd.models.dsv4 import build_dsv4, spec

    model, args = ours
    fresh = build_dsv4(args)
    hf.load_into(fresh, hf.HFFolder(spec, hf_dir[0]))
    for k, v in model.state_dict().items():
        if not k.startswith("mtp."):
            assert torch.equal(fresh.state_dict()[k], v), k
    with pytest.raises(ValueError, match="does not match the given args: dim: checkpoint 64 vs 128"):
        hf.load_into(build_dsv4(dataclasses.replace(args, dim=128)), hf.HFFolder(spec, hf_dir[0]))
