"""DeepSeek-V4(-Flash) hybrid model over packed THD microbatches.

Legend:  T rows   N mHC streams (hc_mult)   d model width   V vocabulary

    embed -> copy into N streams -> blocks (mHC + sliding / CSA / HCA attention, mHC + MoE)
          -> hc_head -> norm -> head                                    (+ MTP block, depth 1)

`model(tokens_T, meta) -> ModelOutput(logits_TV, aux_losses)`. Under contiguous context
parallelism tokens_T and the logits are this rank's rows (meta.row_index); the attention layers
exchange what they need with the neighbouring ranks (context_parallel.py). The aux losses are
SUMS over this rank's rows with their coefficients applied (the trainer divides them by the global
trained-token count like the main cross-entropy):
    "mtp":     mtp_loss_weight * sum of MTP cross-entropy over trained MTP targets,
    "indexer": indexer_loss_coeff * sum over CSA layers and valid rows of the indexer KL
               (training mode only; it is the indexer's only gradient source).
Module and parameter names follow the reference checkpoint (`embed`, `layers.<i>.attn.wq_a`,
`hc_head`, `head`, `mtp.0`), so hf_names.py renames little; the routed experts are stacked per layer
(`layers.<i>.ffn.experts.w1` [E, F, d]), which hf_names.py splits into the checkpoint's per-expert
`layers.<i>.ffn.experts.<e>.w1.weight`.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_thd.components.chunked_loss import HeadInput
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.attention import Attention
from titan_thd.models.dsv4.block import Block
from titan_thd.models.dsv4.compressor import Compressor
from titan_thd.models.dsv4.mhc import HyperConnection, HyperHead
from titan_thd.models.dsv4.moe import Experts, Gate
from titan_thd.models.dsv4.mtp import MTPBlock, mtp_inputs_targets
from titan_thd.models.dsv4.norm import RMSNorm
from titan_thd.models.dsv4.plans import get_plan
from titan_thd.models.spec import ModelOutput, build_initialised
from titan_thd.parallel.seeded_init import InitRule, init_seeded


class DSv4Model(nn.Module):
    def __init__(self, args: DSv4Args):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): Block(args, t, hash_routed=i < args.n_hash_layers)
                for i, t in enumerate(args.layer_types)
            }
        )
        self.hc_head = HyperHead(args.hc_mult, args.dim, args.hc_eps, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPBlock(args) for _ in range(args.mtp_layers))

    def forward(self, x: torch.Tensor, meta: BatchMeta, loss_chunk: int = 0) -> ModelOutput:
        """x: [T] token ids, or on a later pipeline stage the [T, N, d] streams of the previous one
        (the token ids of hash-routed layers then come from meta.tokens). A stage without the
        head returns its output streams in place of the logits. `loss_chunk` > 0 (loss.chunked): the
        head's input in place of the logits (a `HeadInput`, components/chunked_loss.py), and the MTP
        loss computed in chunks of that many rows too."""
        args = self.args
        if x.dim() == 1:
            tokens_T = x
            # Materialised: on a stride-0 expand aten's bmm (mHC) runs one GEMM per token.
            h_TND = self.embed(tokens_T)[:, None, :].expand(-1, args.hc_mult, -1).contiguous()
        else:
            tokens_T, h_TND = meta.tokens, x
        plan = get_plan(meta, args, h_TND.dtype)
        with_kl = self.training and args.indexer_loss_coeff > 0
        kl_sum = torch.zeros((), dtype=torch.promote_types(h_TND.dtype, torch.float32), device=h_TND.device)
        for layer in self.layers.values():
            h_TND, kl = layer(h_TND, tokens_T, plan, with_kl)
            if kl is not None:
                kl_sum = kl_sum + kl
        aux: dict[str, torch.Tensor] = {}
        if with_kl:
            aux["indexer"] = args.indexer_loss_coeff * kl_sum
        if self.head is None:
            return ModelOutput(h_TND, aux)
        x_TD = self.norm(self.hc_head(h_TND))
        logits_TV = HeadInput.of(x_TD, self.head, loss_chunk) if loss_chunk else self.head(x_TD)
        if self.mtp and meta.labels_full is not None and args.mtp_loss_weight > 0:
            vocab_parallel = isinstance(logits_TV, DTensor)  # tensor parallelism: Shard(-1) logits
            mtp = self._mtp_loss_sum(h_TND, meta, plan, vocab_parallel, loss_chunk)
            aux["mtp"] = args.mtp_loss_weight * mtp
        return ModelOutput(logits_TV, aux)

    def _mtp_loss_sum(
        self, h_TND: torch.Tensor, meta: BatchMeta, plan, vocab_parallel: bool, loss_chunk: int
    ) -> torch.Tensor:
        assert meta.loss_mask_full is not None, "MTP needs the loss mask with the labels"
        # Over the whole microbatch, then this rank's rows: a row's MTP target is the next row's label,
        # which may live on the next CP rank (labels_full is global, so no communication).
        next_T, target_T, trained_T = (
            v[plan.rows] for v in mtp_inputs_targets(meta.labels_full, meta.loss_mask_full, plan.doc_full)
        )
        x_TD = self.mtp[0](h_TND, self.embed(next_T), next_T, plan)
        if loss_chunk:  # the trained rows only, chunk by chunk, on every layout
            return cross_entropy_sum(HeadInput.of(x_TD, self.head, loss_chunk), target_T, trained_T)
        if vocab_parallel:
            # Vocabulary-parallel head (tensor parallelism): x_TD is this rank's sequence-parallel
            # rows, the head gathers all of them, the untrained ones are masked in the loss.
            return cross_entropy_sum(self.head(x_TD), target_T, trained_T)
        rows_r = trained_T.nonzero().squeeze(1)  # index_select's backward is an index_add_ (moe.py)
        logits_rV = self.head(x_TD.index_select(0, rows_r))
        acc = torch.promote_types(logits_rV.dtype, torch.float32)
        return F.cross_entropy(logits_rV.to(acc), target_T[rows_r], reduction="sum")

    def init_weights(self, seed: int | None = None, skip: Collection[str] = ()) -> None:
        """Fill every parameter and buffer (whole, or this rank's shards) from `seed` alone, a value
        per (tensor, block of rows): the same weights on every parallel layout (parallel/seeded_init.py).
        `seed` None: drawn from the global RNG (a model built under `torch.manual_seed(s)`). `skip`: names
        of tensors left as they are (a checkpoint read next fills them)."""
        if seed is None:
            seed = int(torch.randint(2**62, ()))
        init_seeded(self, seed, self.init_rules(), skip)

    def init_rules(self) -> dict[str, InitRule]:
        """{fqn: rule} of every parameter and buffer. Matrices N(0, init_std); norms 1; mHC base 0
        and scales 1; sinks and slot biases 0; balancing biases and loads 0; each hash layer gets a
        random table of distinct experts per token id."""
        std = self.args.init_std
        rules: dict[str, InitRule] = {}

        def normal(t: torch.Tensor, g: torch.Generator) -> None:
            t.normal_(0.0, std, generator=g)

        def zeros(t: torch.Tensor, g: torch.Generator) -> None:
            t.zero_()

        def ones(t: torch.Tensor, g: torch.Generator) -> None:
            t.fill_(1)

        for prefix, module in self.named_modules():
            at = f"{prefix}." if prefix else ""
            if isinstance(module, (nn.Linear, nn.Embedding)):
                rules[at + "weight"] = normal
            elif isinstance(module, Experts):
                rules |= {at + "w1": normal, at + "w2": normal, at + "w3": normal}
            elif isinstance(module, RMSNorm):
                rules[at + "weight"] = ones
            elif isinstance(module, (HyperConnection, HyperHead)):
                rules |= {at + "fn": normal, at + "base": zeros, at + "scale": ones}
            elif isinstance(module, Compressor):
                rules[at + "ape"] = zeros
            elif isinstance(module, Attention):
                rules[at + "attn_sink"] = zeros
            elif isinstance(module, Gate):
                rules[at + "weight"] = normal
                if module.hash_routed:
                    rules[at + "tid2eid"] = _hash_table(module.weight.shape[0])
                else:
                    rules |= {at + "bias": zeros, at + "load": zeros}
        return rules

    def router_gates(self) -> list[Gate]:
        """Learned (bias-balanced) routers, MTP included."""
        return [m for m in self.modules() if isinstance(m, Gate) and not m.hash_routed]


def per_document_logits(model: nn.Module, tokens_BS: torch.Tensor, lengths_B: list[int]) -> torch.Tensor:
    """ModelSpec.padded_forward: logits_BSV of a padded batch, each row's document run alone (its own
    one-document call: window, compressor and indexer plans of that document only, no neighbours in
    the stream); the padding columns get zero logits."""
    B, S = tokens_BS.shape
    logits_BSV = None
    for b, n in enumerate(lengths_B):
        cu = torch.tensor([0, n], dtype=torch.int32)
        positions = torch.arange(n, device=tokens_BS.device)
        meta = BatchMeta(cu, cu, n, 1, positions, None, tokens=tokens_BS[b, :n])
        logits_nV = model(tokens_BS[b, :n], meta).logits
        if logits_BSV is None:
            logits_BSV = logits_nV.new_zeros(B, S, logits_nV.shape[-1])
        logits_BSV[b, :n] = logits_nV
    assert logits_BSV is not None, "an empty padded batch"
    return logits_BSV


def _hash_table(n_experts: int) -> InitRule:
    """A hash layer's token -> experts table: k distinct experts per token id (a row per token)."""

    def rule(t: torch.Tensor, g: torch.Generator) -> None:
        t.copy_(torch.rand(t.shape[0], n_experts, generator=g).argsort(-1)[:, : t.shape[1]])

    return rule


def build_dsv4(args: DSv4Args) -> DSv4Model:
    """Full model on CPU, initialised from the current RNG state (call under a seeded RNG)."""
    return build_initialised(lambda: DSv4Model(args))
