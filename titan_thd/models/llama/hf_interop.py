"""titan_thd llama <-> Hugging Face `LlamaForCausalLM` checkpoints (the only place that knows the names).

    export_hf(model, out_dir, tokenizer=tok)    # config.json + safetensors files (+ tokenizer files)
    model = load_hf(out_dir)                    # back into our model (args from config.json)

The architectures are the same computation: pre-norm RMSNorm blocks, grouped-query attention with
RoPE in the rotate-half layout (dimension i paired with i + E/2, titan_thd/ops/rope.py; the layout of
Hugging Face Llama checkpoints, so no permutation of wq / wk), SwiGLU feed-forward, untied embedding
and head, no biases. Names:

    tok_embeddings.weight                  model.embed_tokens.weight
    layers.<i>.attention.w{q,k,v,o}        model.layers.<i>.self_attn.{q,k,v,o}_proj
    layers.<i>.feed_forward.w1 / w3 / w2   model.layers.<i>.mlp.gate_proj / up_proj / down_proj
    layers.<i>.attention_norm / ffn_norm   model.layers.<i>.input_layernorm / post_attention_layernorm
    norm.weight / output.weight            model.norm.weight / lm_head.weight

tests/models/test_llama_hf.py compares the logits with transformers' LlamaForCausalLM (float32).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from titan_thd.config.jsonfile import read_json_object
from titan_thd.data.tokenizer import Tokenizer
from titan_thd.models.hf.io import LoadStats, Plain, SafetensorsFolder, check_fits, load_sources
from titan_thd.models.hf.tokenizer import special_token_ids, write_tokenizer
from titan_thd.models.hf.write import DEFAULT_MAX_SHARD_SIZE, DcpSource, ModelSource, write_weights
from titan_thd.models.llama.args import LlamaArgs
from titan_thd.models.llama.model import Llama, build_llama

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


def _rename(key: str, rules: list[tuple[str, str]]) -> str:
    for pattern, repl in rules:
        new = re.sub(pattern, repl, key)
        if new != key:
            return new
    return key


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


def export_hf(model: Llama, out_dir: str | Path, dtype: torch.dtype | None = None, **options) -> Path:
    """config.json + safetensors files for `LlamaForCausalLM.from_pretrained` (`export_hf_from` with
    the model's state dict as the source)."""
    return export_hf_from(ModelSource(model), model.args, out_dir, dtype, **options)


def export_hf_from(
    source: ModelSource | DcpSource,
    args: LlamaArgs,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    tokenizer_source: str | Path | None = None,
    context: int = 0,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Stream `source` (models/hf/write.py) into files of at most `max_shard_size` bytes (+ the index
    when there are several) and config.json; with `tokenizer`, also its files, generation_config.json
    and the bos / eos / pad ids (models/hf/tokenizer.py). The spec's `export_hf`."""
    import torch.distributed as dist

    out = Path(out_dir)
    write = not dist.is_initialized() or dist.get_rank() == 0
    if write:
        out.mkdir(parents=True, exist_ok=True)

    def items(key: str, value: torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
        yield _rename(key, _OURS_TO_HF), value.to(cast).contiguous()

    write_weights(source, out, items, max_shard_size, write)
    if not write:
        return out
    token_ids = None
    if tokenizer is not None:
        write_tokenizer(tokenizer, out, tokenizer_source, context)
        token_ids = special_token_ids(tokenizer)
    config = hf_config(args, dtype or next(iter(source.entries().values()))[1], token_ids, context)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def hf_args(path: str | Path) -> LlamaArgs:
    """The LlamaArgs that an HF folder's config.json describes."""
    cfg_file = Path(path) / "config.json"
    return args_from_hf_config(
        read_json_object(cfg_file, missing=" (a Hugging Face folder holds config.json)"), str(cfg_file)
    )


def check_hf(args: LlamaArgs, path: str | Path, name: str = "the given args") -> None:
    """ValueError unless the HF folder's config.json describes `args`' shapes."""
    have = hf_args(path)
    fields = (
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "ffn_hidden_dim",
        "vocab_size",
        "norm_eps",
        "rope_theta",
    )
    diffs = [
        f"{f}: checkpoint {getattr(have, f)!r} vs {getattr(args, f)!r}"
        for f in fields
        if getattr(have, f) != getattr(args, f)
    ]
    if diffs:
        raise ValueError(f"{Path(path) / 'config.json'} does not match {name}: " + "; ".join(diffs))


def load_hf_into(model: Llama, path: str | Path) -> LoadStats:
    """Copy an HF LlamaForCausalLM folder's weights into `model` (plain or sharded tensors, or a
    pipeline stage of it: each rank reads only its slices, models/hf/io.py); ValueError naming what
    does not fit, before anything is written."""
    check_hf(model.args, path)
    folder = SafetensorsFolder(path)
    sources = {
        _rename(k, _HF_TO_OURS): Plain(s)
        for k, s in folder.tensors.items()
        if not k.endswith("rotary_emb.inv_freq")
    }
    with torch.device("meta"):  # the full model's names and shapes, no memory
        expected = {k: tuple(v.shape) for k, v in build_llama(model.args).state_dict().items()}
    check_fits(sources, expected, str(path), "llama")
    return load_sources(model, sources, folder)


def load_hf(path: str | Path) -> Llama:
    """Our llama with an HF folder's architecture (config.json) and weights, float32 on CPU."""
    model = build_llama(hf_args(path))
    load_hf_into(model, path)
    return model
