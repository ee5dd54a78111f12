"""Dense Llama-style transformer over packed THD microbatches.

Pre-norm blocks of grouped-query attention (RoPE from per-document positions, causal inside each
document) and a SwiGLU feed-forward; RMSNorm; untied embedding and LM head.

Legend (token-major, no batch dimension):
    T  rows of the microbatch (this rank's rows)    V  vocabulary
    D  model width                                   F  feed-forward hidden width
    H  query heads    K  key/value heads             E  head dim
    R  E // 2 RoPE frequencies

Module names follow torchtitan (`tok_embeddings`, `layers.<i>.attention.wq`, ..., `norm`, `output`)
so that checkpoints and parallel plans read the same; blocks live in an `nn.ModuleDict` keyed
"0".."n-1" so their FQNs survive pipeline splitting (a stage deletes the modules it does not own
and sets `tok_embeddings` / `norm` / `output` to None).
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from titan_thd.components.chunked_loss import HeadInput
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.models.llama.args import LlamaArgs
from titan_thd.models.projection import Linear
from titan_thd.models.spec import ModelOutput, build_initialised
from titan_thd.ops.rope import apply_rope, rope_cos_sin, rope_tables
from titan_thd.ops.varlen_attention import VarlenAttention
from titan_thd.parallel.seeded_init import InitRule, init_seeded


def build_inner_attention(args: LlamaArgs) -> nn.Module:
    if args.attention_backend == "te":
        from titan_thd.ops.te_attention import TEAttention  # imports Transformer Engine: CUDA only

        return TEAttention(args.n_heads, args.n_kv_heads, args.head_dim)
    return VarlenAttention()


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.rope_theta = args.rope_theta
        self.wq = Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.inner_attention = build_inner_attention(args)

    def forward(self, x_TD: torch.Tensor, meta: BatchMeta | None) -> torch.Tensor:
        if meta is None:  # a padded batch [B, S, D] (Llama.forward)
            return self._forward_padded(x_TD)
        T = x_TD.shape[0]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q_THE = self.wq(x_TD).view(T, -1, self.head_dim)
        k_TKE = self.wk(x_TD).view(T, -1, self.head_dim)
        v_TKE = self.wv(x_TD).view(T, -1, self.head_dim)
        cos_TR, sin_TR = rope_tables(meta, self.head_dim, self.rope_theta, x_TD.dtype)
        q_THE, k_TKE = apply_rope(q_THE, cos_TR, sin_TR), apply_rope(k_TKE, cos_TR, sin_TR)
        o_THE = self.inner_attention(q_THE, k_TKE, v_TKE, meta)
        return self.wo(o_THE.reshape(T, -1))

    def _forward_padded(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """Every row one document from column 0: positions 0..S-1 and one causal SDPA over [B, H, S, E]
        (a real token never sees the padding after its document)."""
        B, S, _ = x_BSD.shape
        q_BSHE = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k_BSKE = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v_BSKE = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        positions_S = torch.arange(S, device=x_BSD.device)
        cos_SR, sin_SR = rope_cos_sin(positions_S, self.head_dim, self.rope_theta, x_BSD.dtype)
        q_BSHE, k_BSKE = apply_rope(q_BSHE, cos_SR, sin_SR), apply_rope(k_BSKE, cos_SR, sin_SR)
        q, k, v = (x.transpose(1, 2) for x in (q_BSHE, k_BSKE, v_BSKE))
        o_BHSE = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(o_BHSE.transpose(1, 2).reshape(B, S, -1))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, bias=False)
        self.w2 = Linear(hidden_dim, dim, bias=False)
        self.w3 = Linear(dim, hidden_dim, bias=False)
        self.act = swiglu
        """`apply_compile` swaps in its compiled form (titan_thd/models/compile.py)."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x_TD), self.w3(x_TD)))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x_TD: torch.Tensor, meta: BatchMeta | None) -> torch.Tensor:
        h_TD = x_TD + self.attention(self.attention_norm(x_TD), meta)
        return h_TD + self.feed_forward(self.ffn_norm(h_TD))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens_T: torch.Tensor, meta: BatchMeta | None, loss_chunk: int = 0) -> ModelOutput:
        """tokens_T: [T] ids (or [T, D] hidden states on a pipeline stage without embeddings); with
        meta None a padded batch [B, S] of ids, one document per row from column 0 (padded_logits).
        `loss_chunk` > 0 (loss.chunked): the head's input in place of the logits (a `HeadInput`,
        components/chunked_loss.py, whose loss is computed in chunks of that many rows)."""
        h_TD = self.tok_embeddings(tokens_T) if self.tok_embeddings is not None else tokens_T
        for layer in self.layers.values():
            h_TD = layer(h_TD, meta)
        if self.norm is not None:
            h_TD = self.norm(h_TD)
        if self.output is None:
            return ModelOutput(h_TD, {})
        if loss_chunk:
            return ModelOutput(HeadInput.of(h_TD, self.output, loss_chunk), {})
        return ModelOutput(self.output(h_TD), {})

    def init_weights(self, seed: int | None = None, skip: Collection[str] = ()) -> None:
        """Fill every parameter (whole, or this rank's shards) from `seed` alone, a value per (tensor,
        block of rows): the same weights on every parallel layout (parallel/seeded_init.py). `seed`
        None: drawn from the global RNG (a model built under `torch.manual_seed(s)`). `skip`: names of
        tensors left as they are (a checkpoint read next fills them)."""
        if seed is None:
            seed = int(torch.randint(2**62, ()))
        init_seeded(self, seed, self.init_rules(), skip)

    def init_rules(self) -> dict[str, InitRule]:
        """{fqn: rule} of every parameter: embeddings N(0, 1), norms 1, the projections into a block
        truncated N(0, 0.02) and those back into the residual stream N(0, 0.02 / sqrt(2 n_layers))
        (keeps the residual stream O(1) in depth), the output truncated N(0, dim^-1/2)."""
        std = 0.02
        residual_std = std / math.sqrt(2 * self.args.n_layers)
        rules: dict[str, InitRule] = {}
        if self.tok_embeddings is not None:
            rules["tok_embeddings.weight"] = _normal(1.0)
        for i, layer in self.layers.items():
            at = f"layers.{i}."
            rules |= {at + "attention_norm.weight": _ones, at + "ffn_norm.weight": _ones}
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
                rules[f"{at}{name}.weight"] = _trunc_normal(std)
            for name in ("attention.wo", "feed_forward.w2", "feed_forward.w3"):
                rules[f"{at}{name}.weight"] = _trunc_normal(residual_std)
        if self.norm is not None:
            rules["norm.weight"] = _ones
        if self.output is not None:
            rules["output.weight"] = _trunc_normal(self.args.dim**-0.5)
        return rules


def padded_logits(model: nn.Module, tokens_BS: torch.Tensor, lengths_B: list[int]) -> torch.Tensor:
    """ModelSpec.padded_forward: logits_BSV of a padded batch, through the model's padded path
    (batched causal SDPA over [B, H, S, E] instead of the per-document varlen kernel). The lengths
    are not needed: causal attention keeps each row's padding behind its document."""
    return model(tokens_BS, None).logits


def _normal(std: float) -> InitRule:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def _trunc_normal(std: float) -> InitRule:
    return lambda t, g: nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)


def _ones(t: torch.Tensor, g: torch.Generator) -> None:
    t.fill_(1)


def build_llama(args: LlamaArgs) -> Llama:
    """Full model on CPU, initialised from the current RNG state (call under a seeded RNG)."""
    return build_initialised(lambda: Llama(args))
