"""Optional Transformer Engine backend of THD causal attention (`model.args.attention_backend = "te"`).

Imported only when asked for. Transformer Engine raises RuntimeError (not ImportError) when it is
imported without CUDA, so every import failure becomes one clear ValueError.

Boundaries: like Megatron, the *padded* boundaries are given as both `cu_seqlens` and
`cu_seqlens_padded`. Per-document padding then sits at the causal tail of its document, so real
rows never see it, no segment is empty, and TE keeps its fast kernels (real `cu_seqlens` with
`pad_between_seqs` is slower). Padding rows are zeroed afterwards, as in `varlen_attention`.
Not exercised by the CPU test suite.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.data.batch_meta import BatchMeta


def _import_te():
    if not torch.cuda.is_available():
        raise ValueError(
            'model.args.attention_backend = "te" needs CUDA; this machine has none (use "native")'
        )
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # RuntimeError without a usable CUDA setup, ImportError when not installed
        raise ValueError(
            f'model.args.attention_backend = "te": Transformer Engine cannot be imported '
            f'({type(e).__name__}: {e}); install the `gpu` extra or use "native"'
        ) from e
    return te


class TEAttention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        te = _import_te()
        self.attn = te.DotProductAttention(
            num_attention_heads=n_heads,
            kv_channels=head_dim,
            num_gqa_groups=n_kv_heads,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type="padding_causal",
        )

    def forward(
        self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, meta: BatchMeta
    ) -> torch.Tensor:
        if meta.cp.size > 1:
            # Refused at start-up (inputs.validate_combinations); a hand-built meta gets the same rule here.
            raise ValueError(
                "te attention runs without context parallelism only: use attention_backend native"
            )
        cu_N1, real_T = meta.cached("te_boundaries", lambda: _boundaries(meta, q_THD.device))
        o = self.attn(
            q_THD,
            k_TKD,
            v_TKD,
            cu_seqlens_q=cu_N1,
            cu_seqlens_kv=cu_N1,
            cu_seqlens_q_padded=cu_N1,
            cu_seqlens_kv_padded=cu_N1,
            max_seqlen_q=meta.max_seqlen,
            max_seqlen_kv=meta.max_seqlen,
        )
        return o.view(q_THD.shape).masked_fill(~real_T[:, None, None], 0.0)


def _boundaries(meta: BatchMeta, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded cu_seqlens on the device and the [T] bool real-row mask."""
    offset_T = meta.position_ids  # position = offset inside the physical document
    lens = torch.tensor(meta.seqlens, device=device)
    doc_T = torch.repeat_interleave(
        torch.arange(meta.num_docs, device=device), torch.tensor(meta.seqlens_padded, device=device)
    )
    real_T = offset_T.to(device) < lens[doc_T]
    return meta.cu_seqlens_padded.to(device=device, dtype=torch.int32), real_T
