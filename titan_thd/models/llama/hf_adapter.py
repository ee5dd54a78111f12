"""llama's Hugging Face format (`HF`, the spec's `hf`): `LlamaForCausalLM` folders <-> our llama.

The architectures are the same computation: pre-norm RMSNorm blocks, grouped-query attention with
RoPE in the rotate-half layout (dimension i paired with i + E/2, titan_thd/ops/rope.py; the layout of
Hugging Face Llama checkpoints, so no permutation of wq / wk), SwiGLU feed-forward, untied embedding
and head, no biases. Names (one stored tensor per tensor of ours; transformers' module names are the
stored names without `.weight`):

    tok_embeddings.weight                  model.embed_tokens.weight
    layers.<i>.attention.w{q,k,v,o}        model.layers.<i>.self_attn.{q,k,v,o}_proj
    layers.<i>.feed_forward.w1 / w3 / w2   model.layers.<i>.mlp.gate_proj / up_proj / down_proj
    layers.<i>.attention_norm / ffn_norm   model.layers.<i>.input_layernorm / post_attention_layernorm
    norm.weight / output.weight            model.norm.weight / lm_head.weight

The load and the export are every family's (models/hf/); `model.hf_path` is not offered for llama
(`initialises=False`). tests/inference/test_hf_generate.py compares the logits and greedy generations
with transformers' LlamaForCausalLM (float32); tests/models/test_llama_hf_sharded.py loads sharded.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_thd.models.hf.adapter import HFAdapter, module_name, plain_sources, rename
from titan_thd.models.llama.args import LlamaArgs

_OURS_TO_HF = [
    (r"^tok_embeddings\.", "model.embed_tokens."),
    (r"^layers\.(\d+)\.attention\.w([qkvo])\.", r"model.layers.\1.self_attn.\2_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w1\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w3\.", r"model.layers.\1.mlp.up_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w2\.", r"model.layers.\1.mlp.down_proj."),
    (r"^layers\.(\d+)\.attention_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
]
_HF_TO_OURS = [
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.", r"layers.\1.attention.w\2."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.feed_forward.w1."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.feed_forward.w3."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
]


def hf_config(args: LlamaArgs, dtype: torch.dtype, token_ids: dict | None = None, context: int = 0) -> dict:
    """A transformers LlamaConfig dict describing `args` (`token_ids`: bos / eos / pad ids)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": context or 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **(token_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}),
    }


def args_from_hf_config(cfg: dict, where: str = "config.json") -> LlamaArgs:
    """LlamaArgs of a transformers LlamaConfig dict; ValueError for what our llama cannot compute."""
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type is {cfg.get('model_type')!r}, expected 'llama'")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    for key, want in (("attention_bias", False), ("mlp_bias", False), ("tie_word_embeddings", False)):
        if cfg.get(key, want) != want:
            raise ValueError(f"{where}: {key} = {cfg[key]!r} is not supported by llama (expected {want!r})")
    if cfg.get("hidden_act", "silu") != "silu" or rope.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: only hidden_act silu and the default RoPE are supported")
    try:
        args = LlamaArgs(
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            ffn_hidden_dim=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing key {e.args[0]!r}") from None
    if cfg.get("head_dim") not in (None, args.head_dim):
        raise ValueError(
            f"{where}: head_dim {cfg['head_dim']} != hidden_size / num_attention_heads ({args.head_dim})"
        )
    return args


_ARCHITECTURE = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden_dim",
    "vocab_size",
    "norm_eps",
    "rope_theta",
)


def architecture(args: LlamaArgs) -> dict[str, Any]:
    """The fields config.json fixes (attention_backend is how, not what, the model computes)."""
    return {f: getattr(args, f) for f in _ARCHITECTURE}


HF = HFAdapter(
    to_hf=lambda key, value: [(rename(key, _OURS_TO_HF), value)],
    sources=lambda folder, config, where: plain_sources(
        folder, _HF_TO_OURS, where, skip=("rotary_emb.inv_freq",)
    ),
    config_from_args=hf_config,
    args_from_config=args_from_hf_config,
    architecture=architecture,
    hf_module=lambda ours: module_name(ours, _OURS_TO_HF, "llama"),
    initialises=False,
)
