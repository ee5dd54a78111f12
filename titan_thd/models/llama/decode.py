"""Cached decoding of the dense llama model: each layer's rotated keys and values of every position.

Legend:  N sequences   C cache slots per sequence (longest prompt + room)   K key/value heads
         H query heads   E head dim   D model width   T rows of the packed prefill

Prefill runs the model's own packed forward over the prompts (its logits are the first step's) and
records, through a pre-hook on every layer's inner attention, the rotated K and V it attends with:
that is the whole state of a causal attention layer. A decode step then computes one row per
sequence: the block of llama/model.py (pre-norm attention and SwiGLU feed-forward, the same modules)
with the new row's query against the cached keys of its own sequence, padded to C slots and masked
past the sequence's length (one batched SDPA call for all sequences). Positions restart per sequence
exactly as in a packed training microbatch, so cached decoding and the full forward of the same
tokens agree to rounding (tests/inference/test_decoders.py: float64, relative 1e-12).

`ModelSpec.decoder` of llama (models/llama/__init__.py); generation drives it through the
`Decoder` protocol (models/decoding.py, inference/generate.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from titan_thd.models.decoding import last_rows, packed_meta
from titan_thd.models.llama.model import Llama
from titan_thd.ops.rope import apply_rope, rope_cos_sin


class LlamaDecoder:
    def __init__(self, model: Llama, device: torch.device):
        assert model.tok_embeddings is not None and model.output is not None, "a whole model, not a stage"
        self.model, self.device = model, device
        self.k_NCKE: list[torch.Tensor] = []
        self.v_NCKE: list[torch.Tensor] = []
        self.lengths_N = torch.zeros(0, dtype=torch.int64)

    def prefill(self, prompts: Sequence[Sequence[int]], room: int) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        tokens_T = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)
        captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        hooks = [
            layer.attention.inner_attention.register_forward_pre_hook(
                lambda _, args: captured.append((args[1], args[2]))
            )
            for layer in self.model.layers.values()
        ]
        try:
            logits_TV = self.model(tokens_T, packed_meta(lengths, tokens_T)).logits
        finally:
            for h in hooks:
                h.remove()
        N, C = len(prompts), max(lengths) + room
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        self.k_NCKE, self.v_NCKE = [], []
        for k_TKE, v_TKE in captured:
            k = k_TKE.new_zeros(N, C, *k_TKE.shape[1:])
            v = v_TKE.new_zeros(N, C, *v_TKE.shape[1:])
            for i, n in enumerate(lengths):
                k[i, :n], v[i, :n] = k_TKE[starts[i] : starts[i] + n], v_TKE[starts[i] : starts[i] + n]
            self.k_NCKE.append(k)
            self.v_NCKE.append(v)
        self.lengths_N = torch.tensor(lengths, dtype=torch.int64, device=self.device)
        return logits_TV[last_rows(lengths).to(self.device)]

    def step(self, tokens_N: torch.Tensor) -> torch.Tensor:
        model, pos_N = self.model, self.lengths_N
        N, C = tokens_N.shape[0], self.k_NCKE[0].shape[1]
        assert int(pos_N.max()) < C, "the cache is full: prefill was given too little room"
        rows_N = torch.arange(N, device=self.device)
        # Slot c of sequence i is visible to its new query iff c <= its position.
        visible_N11C = (torch.arange(C, device=self.device) <= pos_N[:, None])[:, None, None, :]
        h_ND = model.tok_embeddings(tokens_N)
        for layer, k_NCKE, v_NCKE in zip(model.layers.values(), self.k_NCKE, self.v_NCKE, strict=True):
            attn = layer.attention
            x_ND = layer.attention_norm(h_ND)
            q_NHE = attn.wq(x_ND).view(N, -1, attn.head_dim)
            k_NKE = attn.wk(x_ND).view(N, -1, attn.head_dim)
            cos_NR, sin_NR = rope_cos_sin(pos_N, attn.head_dim, attn.rope_theta, x_ND.dtype)
            q_NHE, k_NKE = apply_rope(q_NHE, cos_NR, sin_NR), apply_rope(k_NKE, cos_NR, sin_NR)
            k_NCKE[rows_N, pos_N] = k_NKE
            v_NCKE[rows_N, pos_N] = attn.wv(x_ND).view(N, -1, attn.head_dim)
            q, k, v = q_NHE[:, :, None, :], k_NCKE.transpose(1, 2), v_NCKE.transpose(1, 2)
            o_NH1E = F.scaled_dot_product_attention(
                q, k, v, attn_mask=visible_N11C, enable_gqa=k.shape[1] != q.shape[1]
            )
            h_ND = h_ND + attn.wo(o_NH1E.reshape(N, -1))
            h_ND = h_ND + layer.feed_forward(layer.ffn_norm(h_ND))
        self.lengths_N = pos_N + 1
        return model.output(model.norm(h_ND))

    def keep(self, index: list[int]) -> None:
        idx = torch.tensor(index, dtype=torch.int64, device=self.device)
        self.k_NCKE = [k[idx] for k in self.k_NCKE]
        self.v_NCKE = [v[idx] for v in self.v_NCKE]
        self.lengths_N = self.lengths_N[idx]
