"""Llama model arguments, flavors and the FLOPs of a step of packed documents."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

AttentionBackend = Literal["native", "te"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)


@dataclass
class LlamaArgs:
    dim: int = 256
    """Model (residual stream) width."""
    n_layers: int = 8
    n_heads: int = 4
    """Query heads; head_dim = dim // n_heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention when < n_heads); must divide n_heads."""
    ffn_hidden_dim: int = 768
    """Hidden width of the SwiGLU feed-forward."""
    vocab_size: int = 512
    """Set from the tokenizer by the trainer."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_backend: AttentionBackend = "native"
    """`native` (titan_thd.ops.varlen_attention) or `te` (Transformer Engine, CUDA only)."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"llama: dim {self.dim} must split into n_heads {self.n_heads} heads of even size (RoPE)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"llama: n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"model.args.attention_backend: got {self.attention_backend!r}, "
                f"expected one of {', '.join(ATTENTION_BACKENDS)}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


flavors: dict[str, LlamaArgs] = {
    # 6,557,952 parameters at vocab 512 (6,295,552 in the blocks).
    "debug": LlamaArgs(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden_dim=768),
    # 31,992,320 parameters at vocab 512; used by benchmarks/bench_thd_vs_padded.py.
    "bench": LlamaArgs(dim=512, n_layers=10, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1536),
}


def flops_per_token_linear(args: LlamaArgs) -> int:
    """Forward+backward FLOPs of every token-linear matmul for one token (all layers + LM head).

    6 = 2 (multiply-add) x 3 (forward, input gradient, weight gradient). Norms, RoPE and the
    embedding lookup are not matmuls and are not counted (the Megatron convention).
    """
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attn_proj = args.dim * (q + 2 * kv) + q * args.dim
    mlp = 3 * args.dim * args.ffn_hidden_dim
    return 6 * (args.n_layers * (attn_proj + mlp) + args.dim * args.vocab_size)


def flops_per_token_pair(args: LlamaArgs) -> int:
    """Forward+backward attention-core FLOPs per unit of len^2 of a causal document, all layers.

    Q K^T and P V each cost 2 * q_dim FLOPs per (query, key) pair; causality halves the len^2 pairs;
    backward is twice forward: 3 * 2 * 2 * q_dim / 2 = 6 * q_dim per layer.
    """
    return 6 * args.n_heads * args.head_dim * args.n_layers


def flops_per_step(args: LlamaArgs, doc_lengths: Sequence[int]) -> float:
    """Forward+backward FLOPs of a step over documents of these real lengths (Megatron THD formula)."""
    tokens = sum(doc_lengths)
    sum_sq = sum(n * n for n in doc_lengths)
    return float(tokens * flops_per_token_linear(args) + sum_sq * flops_per_token_pair(args))
