"""DeepSeek-V4 model arguments and flavors (docs/dsv4.md §1, §14.3).

Layer types: `sliding` (window only, compress ratio 0), `csa` (compressed sparse attention: ratio
`csa_ratio` with overlapping windows and a lightning indexer) and `hca` (heavily compressed
attention: ratio `hca_ratio`, no overlap, every visible entry). Every layer also attends its sliding
window and is followed by a MoE; the first `n_hash_layers` route by a frozen token-id table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

from titan_thd.parallel.context_parallel import CPMode

LAYER_TYPES = ("sliding", "csa", "hca")
IndexerLossMode = Literal["dense", "sparse"]
INDEXER_LOSS_MODES: tuple[str, ...] = get_args(IndexerLossMode)
CP_MODE: CPMode = "contiguous"
"""Windows and compressors need a contiguous left context from one neighbour (docs/dsv4.md §9.1)."""


@dataclass
class DSv4Args:
    vocab_size: int = 4096
    """Set from the tokenizer by the trainer."""
    dim: int = 256
    """Model width d."""
    layer_types: tuple[str, ...] = ("sliding", "sliding", "csa", "hca", "csa", "hca", "csa")
    """Attention type of every main layer: sliding, csa or hca."""
    n_heads: int = 8
    head_dim: int = 64
    """D: query, key and value head size (one shared K=V head)."""
    rope_dim: int = 16
    """r: RoPE is applied to the last r dims of every head (interleaved pairs)."""
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 64
    window: int = 32
    """n_win: each query sees itself and the n_win - 1 previous tokens of its document."""
    csa_ratio: int = 4
    hca_ratio: int = 32
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 16
    n_experts: int = 8
    n_activated_experts: int = 2
    moe_inter_dim: int = 256
    """Width of every routed expert and of the one shared expert."""
    n_hash_layers: int = 2
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    """RoPE base of sliding-only layers (no YaRN)."""
    compress_rope_theta: float = 40000.0
    """RoPE base of CSA / HCA layers (queries, window keys, compressed entries, indexer)."""
    rope_factor: float = 1.0
    """YaRN factor of the compressed layers' RoPE (1 = plain RoPE); magnitude factor is always 1."""
    rope_original_max_pos: int = 65536
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    mtp_layers: int = 1
    """Multi-token-prediction depth (0 or 1); the MTP block is a sliding-window layer."""
    mtp_loss_weight: float = 0.1
    """Weight of the multi-token-prediction loss."""
    indexer_loss_coeff: float = 0.01
    """Coefficient of the lightning-indexer KL loss (0 disables it)."""
    indexer_loss_mode: IndexerLossMode = "sparse"
    """`dense` (KL over every visible compressed entry) or `sparse` (over the selected top-k)."""
    router_bias_update_rate: float = 1e-3
    """Step size of the aux-loss-free expert bias update (0 freezes the bias)."""
    init_std: float = 0.02
    attn_chunk: int = 2048
    """Queries per chunk of the attention core (bounds temporaries, not results)."""

    def __post_init__(self) -> None:
        self.layer_types = tuple(self.layer_types)
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ValueError(
                    f"dsv4: layer_types[{i}] = {t!r} is not a layer type; expected one of {LAYER_TYPES}"
                )
        if not self.layer_types:
            raise ValueError("dsv4: layer_types is empty; a model needs at least one layer")
        for name in ("csa_ratio", "hca_ratio"):
            if getattr(self, name) < 2:
                raise ValueError(
                    f"dsv4: {name} = {getattr(self, name)} must be >= 2 (tokens per compressed entry)"
                )
        if self.csa_ratio == self.hca_ratio:
            raise ValueError(
                f"dsv4: csa_ratio and hca_ratio are both {self.csa_ratio}; the two types need distinct ratios"
            )
        for name in (
            "dim",
            "n_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "window",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "n_experts",
            "n_activated_experts",
            "moe_inter_dim",
            "hc_mult",
            "hc_sinkhorn_iters",
            "vocab_size",
            "attn_chunk",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"dsv4: {name} = {getattr(self, name)} must be >= 1")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"dsv4: rope_dim = {self.rope_dim} must be even and <= head_dim {self.head_dim} and "
                f"index_head_dim {self.index_head_dim}"
            )
        if self.n_heads % self.o_groups:
            raise ValueError(f"dsv4: o_groups = {self.o_groups} must divide n_heads = {self.n_heads}")
        if self.n_activated_experts > self.n_experts:
            raise ValueError(
                f"dsv4: n_activated_experts = {self.n_activated_experts} exceeds n_experts = {self.n_experts}"
            )
        if not 0 <= self.n_hash_layers <= len(self.layer_types):
            raise ValueError(
                f"dsv4: n_hash_layers = {self.n_hash_layers} must be in 0..{len(self.layer_types)}"
            )
        if self.mtp_layers not in (0, 1):
            raise ValueError(f"dsv4: mtp_layers = {self.mtp_layers}; only depth 0 or 1 is supported")
        if self.indexer_loss_mode not in INDEXER_LOSS_MODES:
            raise ValueError(
                f"dsv4: indexer_loss_mode = {self.indexer_loss_mode!r}, expected one of {INDEXER_LOSS_MODES}"
            )
        if self.rope_factor < 1.0:
            raise ValueError(f"dsv4: rope_factor = {self.rope_factor} must be >= 1 (1 disables YaRN)")

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def ratios(self) -> dict[str, int]:
        return {"csa": self.csa_ratio, "hca": self.hca_ratio}

    @property
    def halo(self) -> int:
        """Left context rows a query block needs (the CP halo, docs/dsv4.md §9.2): window, CSA 2m, HCA m'."""
        need = [self.window]
        if "csa" in self.layer_types:
            need.append(2 * self.csa_ratio)
        if "hca" in self.layer_types:
            need.append(self.hca_ratio)
        return max(need)

    def architecture(self) -> dict:
        """Fields that fix the weights' shapes and the forward math (training knobs excluded)."""
        skip = {
            "mtp_loss_weight",
            "indexer_loss_coeff",
            "indexer_loss_mode",
            "router_bias_update_rate",
            "init_std",
            "attn_chunk",
        }
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


flavors: dict[str, DSv4Args] = {
    # Unit tests: every mechanism, ~1M parameters.
    "micro": DSv4Args(
        vocab_size=1024,
        dim=128,
        layer_types=("sliding", "csa", "hca", "csa"),
        n_heads=4,
        head_dim=32,
        rope_dim=8,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        window=8,
        csa_ratio=4,
        hca_ratio=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        n_experts=4,
        n_activated_experts=2,
        moe_inter_dim=64,
        n_hash_layers=1,
    ),
    # The CPU default (docs/dsv4.md §14.3): 2 sliding layers, then CSA / HCA alternating, ending on CSA.
    "tiny": DSv4Args(),
    # Official DeepSeek-V4-Flash dimensions (build it on the meta device).
    "flash": DSv4Args(
        vocab_size=129280,
        dim=4096,
        layer_types=("sliding", "sliding") + ("csa", "hca") * 20 + ("csa",),
        n_heads=64,
        head_dim=512,
        rope_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        window=128,
        csa_ratio=4,
        hca_ratio=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        n_experts=256,
        n_activated_experts=6,
        moe_inter_dim=2048,
        n_hash_layers=3,
        compress_rope_theta=160000.0,
        rope_factor=16.0,
        rope_original_max_pos=65536,
        attn_chunk=256,
    ),
}
