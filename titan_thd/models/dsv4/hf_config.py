"""transformers' DeepseekV4Config <-> DSv4Args (modern and legacy keys, both release layouts): the
adapter's config.json both ways (hf_adapter.py; models/hf/load.py reads the file and checks a flavor
against it).

The released config.json of DeepSeek-V4-Flash lists 44 `compress_ratios` and that of
DeepSeek-V4-Flash-0731 46 (with `dspark_*` keys for its speculative-draft head): entries past
`num_hidden_layers` describe the MTP / draft layers, and like transformers only the first
`num_hidden_layers` give the layer types (the next one the MTP layer's, which must be sliding).
"""

from __future__ import annotations

import torch

from titan_thd.models.dsv4.args import DSv4Args

_HF_LAYER_TYPES = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_OUR_LAYER_TYPES = {v: k for k, v in _HF_LAYER_TYPES.items()}

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
    tokenizer (models/hf/tokenizer.py; None = not known, written as null). max_position_embeddings
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
