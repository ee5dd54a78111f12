"""Hugging Face DeepSeek-V4 checkpoints <-> titan_thd dsv4 (the only place that knows the names).

Three spellings of the same tensors exist:
  ours         layers.3.attn.wq_a.weight  layers.3.hc_attn.fn  layers.3.ffn.experts.w1 [E, F, d]  hc_head.fn
  reference    DeepSeek's release (and what transformers' save_pretrained writes back, partly under a
               `model.` prefix): the same but hc_attn_fn, hc_head_fn, one tensor per routed expert
               (layers.3.ffn.experts.5.w1.weight [F, d] = our w1[5]), plus mtp.0.*
  transformers the module names of DeepseekV4ForCausalLM: model.layers.3.self_attn.q_a_proj.weight,
               ...mlp.experts.gate_up_proj (experts fused [E, 2F, d]: w1 then w3 on dim 1),
               ...mlp.experts.down_proj [E, d, F] (= our w2); it never instantiates MTP.
`load_hf` accepts any mix of them, and DeepSeek's published block-quantised FP8 / FP4 weights
(dequantised on load, hf_dequant.py); `export_hf` writes the reference spelling (config.json in the
transformers format), which `DeepseekV4ForCausalLM.from_pretrained` loads.

    model, args = load_hf("ckpt_dir")             # args from config.json
    model, args = load_hf("ckpt_dir", "tiny")     # ValueError unless config.json matches the flavor
    export_hf(model, args, "out_dir", tokenizer=tok)   # + tokenizer files, bos / eos / pad ids
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import torch

from titan_thd.data.tokenizer import Tokenizer
from titan_thd.jsonfile import read_json_object
from titan_thd.models.dsv4.args import DSv4Args, flavors
from titan_thd.models.dsv4.hf_dequant import check_quantization_config, dequantize_state
from titan_thd.models.dsv4.model import DSv4Model, build_dsv4
from titan_thd.models.hf_tokenizer import special_token_ids, write_tokenizer

logger = logging.getLogger(__name__)

_HF_LAYER_TYPES = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_OUR_LAYER_TYPES = {v: k for k, v in _HF_LAYER_TYPES.items()}

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


def _rename(key: str, rules: list[tuple[str, str]]) -> str:
    for pattern, repl in rules:
        key = re.sub(pattern, repl, key)
    return key


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
        key = _rename(key, _TRANSFORMERS_TO_REFERENCE)
        fused = _FUSED_EXPERTS.match(key)
        if fused:
            prefix, kind = fused.groups()
            if kind == "down_proj":
                out[f"{prefix}.w2"] = value
            else:
                out[f"{prefix}.w1"], out[f"{prefix}.w3"] = value.chunk(2, dim=1)
            continue
        out[_rename(key, _REFERENCE_TO_OURS)] = value
    return stack_experts(out)


def to_reference(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> the reference (DeepSeek release) names: one tensor per routed expert."""
    return {_rename(k, _OURS_TO_REFERENCE): v for k, v in split_experts(state).items()}


# ---------------------------------------------------------------------------------------- config
_HF_DEFAULTS = {  # transformers' DeepseekV4Config defaults, for keys a config.json may omit
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "num_nextn_predict_layers": 1,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "q_lora_rank": 1024,
}


def args_from_hf_config(cfg: dict, where: str = "config.json") -> DSv4Args:
    """DSv4Args of a transformers DeepseekV4 config (modern or legacy keys); ValueError if unsupported."""

    def get(key: str):
        if key in cfg and cfg[key] is not None:
            return cfg[key]
        if key in _HF_DEFAULTS:
            return _HF_DEFAULTS[key]
        raise ValueError(f"{where}: missing key {key!r}")

    if cfg.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ValueError(f"{where}: model_type is {cfg.get('model_type')!r}, expected 'deepseek_v4'")
    for key, want in (
        ("num_key_value_heads", 1),
        ("n_shared_experts", 1),
        ("scoring_func", "sqrtsoftplus"),
        ("norm_topk_prob", True),
        ("tie_word_embeddings", False),
        ("hidden_act", "silu"),
    ):
        if get(key) != want:
            raise ValueError(f"{where}: {key} = {get(key)!r} is not supported by dsv4 (expected {want!r})")
    n = get("num_hidden_layers")
    rates = cfg.get("compress_rates") or {}
    csa = rates.get("compressed_sparse_attention", cfg.get("compress_rate_csa", 4))
    hca = rates.get("heavily_compressed_attention", cfg.get("compress_rate_hca", 128))
    mtp_type = "sliding"
    if cfg.get("layer_types") is not None:
        bad = [(i, t) for i, t in enumerate(cfg["layer_types"]) if t not in _HF_LAYER_TYPES]
        if bad:
            raise ValueError(f"{where}: unknown layer_types {bad}; expected one of {list(_HF_LAYER_TYPES)}")
        layer_types = tuple(_HF_LAYER_TYPES[t] for t in cfg["layer_types"][:n])
    elif cfg.get("compress_ratios") is not None:
        by_ratio = {0: "sliding", csa: "csa", hca: "hca"}
        bad = [(i, r) for i, r in enumerate(cfg["compress_ratios"]) if r not in by_ratio]
        if bad:
            raise ValueError(
                f"{where}: unknown compress_ratios {bad}; expected 0, {csa} (CSA) or {hca} (HCA)"
            )
        layer_types = tuple(by_ratio[r] for r in cfg["compress_ratios"][:n])
        mtp_type = by_ratio[cfg["compress_ratios"][n]] if len(cfg["compress_ratios"]) > n else "sliding"
    else:
        raise ValueError(f"{where}: needs layer_types (or legacy compress_ratios)")
    if len(layer_types) != n:
        raise ValueError(f"{where}: {len(layer_types)} layer types for num_hidden_layers = {n}")
    if mtp_type != "sliding":
        raise ValueError(f"{where}: the MTP layer must be sliding-window (compress ratio 0), got {mtp_type}")
    if cfg.get("mlp_layer_types") is not None:
        mlp = list(cfg["mlp_layer_types"][:n])
        n_hash = mlp.count("hash_moe")
        if mlp != ["hash_moe"] * n_hash + ["moe"] * (n - n_hash):
            raise ValueError(f"{where}: mlp_layer_types must be hash_moe layers first, then moe; got {mlp}")
    else:
        n_hash = min(n, cfg.get("num_hash_layers", 3))
    if cfg.get("qk_rope_head_dim") is not None and cfg.get("partial_rotary_factor") is None:
        rope_dim = int(cfg["qk_rope_head_dim"])
    else:
        rope_dim = int(get("head_dim") * (cfg.get("partial_rotary_factor") or 64 / 512))
    rope = cfg.get("rope_parameters") or {}
    comp = (
        rope.get("compress") if isinstance(rope.get("compress"), dict) else (cfg.get("rope_scaling") or rope)
    )
    yarn = comp.get("rope_type", comp.get("type", "default")) == "yarn"
    if comp.get("rope_type", comp.get("type", "default")) not in ("default", "yarn"):
        raise ValueError(f"{where}: compressed-layer rope_type {comp.get('rope_type')!r} is not supported")
    if yarn and comp.get("attention_factor", 1.0) != 1.0:
        raise ValueError(
            f"{where}: YaRN attention_factor {comp['attention_factor']} != 1 (DSv4 never scales)"
        )
    main = rope.get("main") if isinstance(rope.get("main"), dict) else {}
    return DSv4Args(
        vocab_size=get("vocab_size"),
        dim=get("hidden_size"),
        layer_types=layer_types,
        n_heads=get("num_attention_heads"),
        head_dim=get("head_dim"),
        rope_dim=rope_dim,
        q_lora_rank=get("q_lora_rank"),
        o_groups=get("o_groups"),
        o_lora_rank=get("o_lora_rank"),
        window=get("sliding_window"),
        csa_ratio=csa,
        hca_ratio=hca,
        index_n_heads=get("index_n_heads"),
        index_head_dim=get("index_head_dim"),
        index_topk=get("index_topk"),
        n_experts=get("n_routed_experts"),
        n_activated_experts=get("num_experts_per_tok"),
        moe_inter_dim=get("moe_intermediate_size"),
        n_hash_layers=n_hash,
        route_scale=float(get("routed_scaling_factor")),
        swiglu_limit=float(get("swiglu_limit")),
        hc_mult=get("hc_mult"),
        hc_sinkhorn_iters=get("hc_sinkhorn_iters"),
        hc_eps=float(get("hc_eps")),
        norm_eps=float(get("rms_norm_eps")),
        rope_theta=float(main.get("rope_theta", get("rope_theta"))),
        compress_rope_theta=float(comp.get("rope_theta", get("compress_rope_theta"))),
        rope_factor=float(comp.get("factor", 1.0)) if yarn else 1.0,
        rope_original_max_pos=int(comp.get("original_max_position_embeddings", 65536)),
        rope_beta_fast=float(comp.get("beta_fast") or 32),
        rope_beta_slow=float(comp.get("beta_slow") or 1),
        mtp_layers=min(1, int(get("num_nextn_predict_layers"))),
    )


def hf_config_from_args(
    args: DSv4Args, dtype: torch.dtype = torch.float32, token_ids: dict | None = None
) -> dict:
    """A transformers DeepseekV4Config dict describing `args`; `token_ids`: bos / eos / pad ids of the
    tokenizer (models/hf_tokenizer.py; None = not known, written as null). max_position_embeddings
    stays transformers' default: its YaRN code may read it, and our RoPE has no such limit."""
    compress = {
        "rope_type": "default",
        "rope_theta": args.compress_rope_theta,
        "partial_rotary_factor": args.rope_dim / args.head_dim,
    }
    if args.rope_factor != 1.0:
        compress.update(
            rope_type="yarn",
            factor=args.rope_factor,
            attention_factor=1.0,
            original_max_position_embeddings=args.rope_original_max_pos,
            beta_fast=args.rope_beta_fast,
            beta_slow=args.rope_beta_slow,
        )
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "layer_types": [_OUR_LAYER_TYPES[t] for t in args.layer_types],
        "compress_rates": {
            "compressed_sparse_attention": args.csa_ratio,
            "heavily_compressed_attention": args.hca_ratio,
        },
        "mlp_layer_types": ["hash_moe"] * args.n_hash_layers + ["moe"] * (args.n_layers - args.n_hash_layers),
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": 1,
        "head_dim": args.head_dim,
        "partial_rotary_factor": args.rope_dim / args.head_dim,
        "q_lora_rank": args.q_lora_rank,
        "o_groups": args.o_groups,
        "o_lora_rank": args.o_lora_rank,
        "sliding_window": args.window,
        "index_n_heads": args.index_n_heads,
        "index_head_dim": args.index_head_dim,
        "index_topk": args.index_topk,
        "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.n_activated_experts,
        "n_shared_experts": 1,
        "moe_intermediate_size": args.moe_inter_dim,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": args.route_scale,
        "swiglu_limit": args.swiglu_limit,
        "hc_mult": args.hc_mult,
        "hc_sinkhorn_iters": args.hc_sinkhorn_iters,
        "hc_eps": args.hc_eps,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "compress_rope_theta": args.compress_rope_theta,
        "rope_parameters": {
            "main": {
                "rope_type": "default",
                "rope_theta": args.rope_theta,
                "partial_rotary_factor": args.rope_dim / args.head_dim,
            },
            "compress": compress,
        },
        "num_nextn_predict_layers": args.mtp_layers,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        **(token_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}),
    }


# ---------------------------------------------------------------------------------------- load / export
def _resolve_args(
    ckpt: DSv4Args, flavor_or_args: str | DSv4Args | None, where: str, name: str = "the given args"
) -> DSv4Args:
    if flavor_or_args is None:
        return ckpt
    if isinstance(flavor_or_args, str):
        if flavor_or_args not in flavors:
            raise ValueError(f"dsv4 flavor {flavor_or_args!r} is unknown; expected one of {list(flavors)}")
        wanted, name = flavors[flavor_or_args], f"flavor {flavor_or_args!r}"
    else:
        wanted = flavor_or_args
    have, want = ckpt.architecture(), wanted.architecture()
    diffs = [f"{k}: checkpoint {have[k]!r} vs {want[k]!r}" for k in want if have[k] != want[k]]
    if diffs:
        raise ValueError(f"{where} does not match {name}: " + "; ".join(diffs))
    return replace(wanted)


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{path}: no *.safetensors files (a Hugging Face folder holds config.json + *.safetensors)"
        )
    return files


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files; DeepSeek's block-quantised FP8 / FP4 weights come
    back dequantised to float32 (hf_dequant.py), their scales consumed."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: cannot read safetensors: {e}") from None
    cfg_file = path / "config.json"
    block = check_quantization_config(read_hf_config(path), str(cfg_file))
    return dequantize_state(state, block, str(path))


def load_state_dict_hf(
    model: DSv4Model, hf_state: dict[str, torch.Tensor], where: str = "checkpoint"
) -> None:
    """Copy an HF-named state dict into `model`; ValueError naming missing / unexpected / misshaped tensors.

    Checkpoints written by transformers carry no MTP weights (it never instantiates MTP): when every
    `mtp.*` tensor is absent the MTP block keeps its initialisation and a warning says so.
    """
    ours = to_ours(hf_state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    mtp_expected = [k for k in expected if k.startswith("mtp.")]
    if mtp_expected and set(mtp_expected) <= set(missing):
        logger.warning("%s has no MTP weights; the MTP block keeps its initialisation", where)
        missing = [k for k in missing if not k.startswith("mtp.")]
    if missing or unexpected:
        raise ValueError(
            f"{where} does not fit the dsv4 model: {len(missing)} missing tensors {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; {len(unexpected)} unexpected tensors {unexpected[:20]}"
        )
    shapes = [
        f"{k}: {tuple(ours[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in ours and ours[k].shape != v.shape
    ]
    if shapes:
        raise ValueError(f"{where}: tensors with the wrong shape: " + "; ".join(shapes[:20]))
    with torch.no_grad():
        for k, v in expected.items():
            if k in ours:
                v.copy_(ours[k].to(v.dtype))


def load_hf(path: str | Path, flavor_or_args: str | DSv4Args | None = None) -> tuple[DSv4Model, DSv4Args]:
    """(model, args) from an HF DeepseekV4 folder (config.json + *.safetensors), fp32 on CPU.

    `flavor_or_args`: a flavor name or DSv4Args the checkpoint must match (its training knobs such
    as loss weights are kept); None takes everything from config.json.
    """
    path = Path(path)
    model = build_dsv4(_resolve_args(_ckpt_args(path), flavor_or_args, str(path / "config.json")))
    load_state_dict_hf(model, _read_safetensors(path), str(path))
    return model, model.args


def read_hf_config(path: str | Path) -> dict:
    """config.json of an HF folder; ValueError naming the file (and line) when it is missing or not JSON."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise ValueError(
            f"{path}: not a folder (expected a Hugging Face folder with config.json + *.safetensors)"
        )
    return read_json_object(cfg_file, missing=" (a Hugging Face folder holds config.json)")


def hf_args(path: str | Path) -> DSv4Args:
    """The DSv4Args that the folder's config.json describes (training knobs at their defaults)."""
    return _ckpt_args(Path(path))


def _ckpt_args(path: Path) -> DSv4Args:
    cfg_file = path / "config.json"
    cfg = read_hf_config(path)
    check_quantization_config(cfg, str(cfg_file))
    try:
        return args_from_hf_config(cfg, str(cfg_file))
    except (TypeError, AttributeError) as e:  # e.g. a string where a number or a table belongs
        raise ValueError(f"{cfg_file}: a value of the wrong type ({e})") from None


def check_hf(args: DSv4Args, path: str | Path, name: str = "the given args") -> None:
    """ValueError unless the HF folder describes `args`' architecture (`name` says where they come from)
    and has readable safetensors files; cheap (config.json and the safetensors headers), so the trainer
    calls it before building anything."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    _resolve_args(_ckpt_args(path), args, str(path / "config.json"), name)
    for f in _safetensors_files(path):
        try:
            with safe_open(str(f), "pt") as st:  # the header only
                st.keys()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: cannot read safetensors: {e}") from None


def load_hf_into(model: DSv4Model, path: str | Path) -> None:
    """Load an HF checkpoint into an already built model (e.g. the trainer's); its config.json must
    describe the model's architecture (ValueError naming the differing fields otherwise)."""
    check_hf(model.args, path)
    load_state_dict_hf(model, _read_safetensors(Path(path)), str(path))


def export_hf(
    model: DSv4Model,
    args: DSv4Args,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    tokenizer_source: str | Path | None = None,
    context: int = 0,
) -> Path:
    """Write config.json + model.safetensors (reference names) that transformers can load.

    With `tokenizer` (the run's; `tokenizer_source` its tokenizer.json path, if any) the folder also
    gets the tokenizer files and generation_config.json, and config.json its bos / eos / pad ids, so
    that `generate` stops at the end of a turn (models/hf_tokenizer.py). `context`: the longest
    sequence trained (the tokenizer's model_max_length)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.detach().cpu().contiguous()
    save_file(to_reference(state), str(out / "model.safetensors"), metadata={"format": "pt"})
    params_dtype = dtype or next(model.parameters()).dtype
    token_ids = None
    if tokenizer is not None:
        write_tokenizer(tokenizer, out, tokenizer_source, context)
        token_ids = special_token_ids(tokenizer)
    config = hf_config_from_args(args, params_dtype, token_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
