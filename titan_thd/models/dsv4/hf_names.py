"""The three spellings of DeepSeek-V4 tensor names and the mapping between them (docs/dsv4.md §17).

  ours         layers.3.attn.wq_a.weight  layers.3.hc_attn.fn  layers.3.ffn.experts.w1 [E, F, d]  hc_head.fn
  reference    DeepSeek's release (and what transformers' save_pretrained writes back, partly under a
               `model.` prefix): the same but hc_attn_fn, hc_head_fn, one tensor per routed expert
               (layers.3.ffn.experts.5.w1.weight [F, d] = our w1[5]), plus mtp.0.*
  transformers the module names of DeepseekV4ForCausalLM: model.layers.3.self_attn.q_a_proj.weight,
               ...mlp.experts.gate_up_proj (experts fused [E, 2F, d]: w1 then w3 on dim 1),
               ...mlp.experts.down_proj [E, d, F] (= our w2); it never instantiates MTP.

Whole state dicts map with `to_ours` / `to_reference`; one stored name at a time with `stored_to_ours`
(the sharded load, hf_adapter.py), one of our tensors at a time with `reference_items` (the export)
and one of our modules with `hf_module` (transformers' module: PEFT's names).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from titan_thd.models.hf.adapter import rename

_TRANSFORMERS_TO_REFERENCE = [
    (r"^model\.", ""),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    # transformers' save_pretrained reverses its `.norm.` -> `.kv_norm.` rename for every kv_norm,
    # so the attention's own kv_norm comes back as `attn.norm` (the release calls it `attn.kv_norm`).
    (r"\.attn\.norm\.", ".attn.kv_norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
]
_REFERENCE_TO_OURS = [
    (r"(^|\.)hc_head_(fn|base|scale)$", r"\1hc_head.\2"),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2"),
]
_OURS_TO_REFERENCE = [
    (r"(^|\.)hc_head\.(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.hc_(attn|ffn)\.(fn|base|scale)$", r".hc_\1_\2"),
]
_FUSED_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")
# Our module paths (a dot appended) -> transformers' module paths: the indexer's compressor is
# transformers' indexer itself, which sits inside the attention's compressor.
_OURS_TO_TRANSFORMERS = [
    (r"^embed\.$", "model.embed_tokens."),
    (r"^head\.$", "lm_head."),
    (r"^(norm|hc_head|layers)\.", r"model.\1."),
    (r"\.attn_norm\.$", ".input_layernorm."),
    (r"\.ffn_norm\.$", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)\.$", r".\1_hc."),
    (r"\.attn\.indexer\.compressor\.", ".attn.indexer."),
    (r"\.attn\.indexer\.wq_b\.$", ".attn.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.$", ".attn.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.", ".attn.compressor.indexer."),
    (r"\.wkv\.$", ".kv_proj."),
    (r"\.wgate\.$", ".gate_proj."),
    (r"\.(compressor|indexer)\.norm\.$", r".\1.kv_norm."),
    (r"\.attn\.wq_a\.$", ".attn.q_a_proj."),
    (r"\.attn\.q_norm\.$", ".attn.q_a_norm."),
    (r"\.attn\.wq_b\.$", ".attn.q_b_proj."),
    (r"\.attn\.wo_a\.$", ".attn.o_a_proj."),
    (r"\.attn\.wo_b\.$", ".attn.o_b_proj."),
    (r"\.shared_experts\.w1\.$", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.$", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.$", ".shared_experts.down_proj."),
    (r"\.experts\.w[13]\.$", ".experts.gate_up_proj."),
    (r"\.experts\.w2\.$", ".experts.down_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
]


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert routed-expert tensors (`<layer>.ffn.experts.<e>.w1.weight` [F, d]) -> our stacks
    (`<layer>.ffn.experts.w1` [E, F, d]); other keys pass unchanged. ValueError if an id is missing."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        single = _PER_EXPERT.match(key)
        if single:
            prefix, e, name = single.groups()
            per_expert.setdefault(f"{prefix}.{name}", {})[int(e)] = value
        else:
            out[key] = value
    for key, by_id in per_expert.items():
        ids = sorted(by_id)
        if ids != list(range(len(ids))):
            absent = sorted(set(range(ids[-1] + 1)) - set(ids))
            raise ValueError(
                f"{key}: experts {absent} are missing (the checkpoint has experts {ids[0]}..{ids[-1]})"
            )
        out[key] = torch.stack([by_id[e] for e in ids])
    return out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our stacks -> one tensor per routed expert (the inverse of `stack_experts`; a copy each:
    safetensors refuses tensors that share storage)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        stacked = _STACKED.match(key)
        if stacked:
            prefix, name = stacked.groups()
            out |= {f"{prefix}.{e}.{name}.weight": value[e].clone() for e in range(value.shape[0])}
        else:
            out[key] = value
    return out


def to_ours(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Any HF spelling (transformers modules, reference, or transformers' saved mix) -> our names,
    the per-expert (or fused) routed experts stacked to [E, out, in]."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        key = rename(key, _TRANSFORMERS_TO_REFERENCE)
        fused = _FUSED_EXPERTS.match(key)
        if fused:
            prefix, kind = fused.groups()
            if kind == "down_proj":
                out[f"{prefix}.w2"] = value
            else:
                out[f"{prefix}.w1"], out[f"{prefix}.w3"] = value.chunk(2, dim=1)
            continue
        out[rename(key, _REFERENCE_TO_OURS)] = value
    return stack_experts(out)


def to_reference(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> the reference (DeepSeek release) names: one tensor per routed expert."""
    return {rename(k, _OURS_TO_REFERENCE): v for k, v in split_experts(state).items()}


def stored_to_ours(name: str) -> tuple[str, int | None, int | None]:
    """(our name, expert id or None, part or None) of one stored tensor name: a per-expert tensor is
    expert `e` of our stack; transformers' fused `gate_up_proj` is our w1 (part 0) and w3 (part 1),
    halves of its dim 1, and returned as `<prefix>.w1` with part None (the caller splits it)."""
    key = rename(name, _TRANSFORMERS_TO_REFERENCE)
    fused = _FUSED_EXPERTS.match(key)
    if fused:
        prefix, kind = fused.groups()
        return (f"{prefix}.w2", None, None) if kind == "down_proj" else (f"{prefix}.w1", None, 0)
    single = _PER_EXPERT.match(key)
    if single:
        prefix, e, w = single.groups()
        return f"{prefix}.{w}", int(e), None
    return rename(key, _REFERENCE_TO_OURS), None, None


def reference_items(key: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(reference name, tensor) of one of our tensors, an expert stack one expert at a time (views:
    the export copies each)."""
    stacked = _STACKED.match(key)
    if stacked:
        prefix, name = stacked.groups()
        for e in range(value.shape[0]):
            yield f"{prefix}.{e}.{name}.weight", value[e]
    else:
        yield rename(key, _OURS_TO_REFERENCE), value


def hf_module(ours: str) -> str:
    """transformers' module path of one of our modules (`layers.3.attn.wq_a` ->
    `model.layers.3.self_attn.q_a_proj`); an expert stack by parameter, as transformers' fused
    parameters (`layers.3.ffn.experts.w1` and `.w3` -> `model.layers.3.mlp.experts.gate_up_proj`,
    `.w2` -> `...down_proj`). ValueError for the MTP block (transformers has none)."""
    if ours.split(".")[0] not in ("embed", "head", "norm", "hc_head", "layers"):
        raise ValueError(f"dsv4: {ours!r} has no transformers module (DeepseekV4ForCausalLM has no MTP)")
    return rename(ours + ".", _OURS_TO_TRANSFORMERS)[:-1]
