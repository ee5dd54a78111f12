"""Forward+backward FLOPs of DeepSeek-V4 on packed documents (docs/dsv4.md §11).

Megatron-LM's `_dsv4_hybrid_self_attention_flops` counts per token: the attention projections, the
window core 2*H*n_win*D, the compressors and indexer, and the compressed-entry core (CSA top-k,
HCA all visible entries, indexer scoring over all visible entries). Instead of its closed-form
averages we sum the exact per-query key counts of every real document (window clipped at the
document start, entries visible at block granularity, top-k capped by what is visible). MoE counts
the k routed experts plus the shared one and the router; mHC, the heads and the MTP block are
counted too (Megatron leaves mHC out). FLOPs = 2 (multiply-add) x 3 (forward, two backward GEMMs).
"""

from __future__ import annotations

from collections.abc import Sequence

from titan_thd.models.dsv4.args import DSv4Args


def _floor_sum(L: int, m: int) -> int:
    """sum_{u=1..L} floor(u / m): total entries visible to the L queries of a document."""
    q, r = divmod(L, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def _window_keys(L: int, w: int) -> int:
    return L * (L + 1) // 2 if L <= w else w * (w + 1) // 2 + (L - w) * w


def _capped_visible(L: int, m: int, k: int) -> int:
    """sum over queries of min(k, visible entries)."""
    u = min(L, k * m - 1)
    return _floor_sum(u, m) + k * (L - u)


def _attention_macs(a: DSv4Args, layer_type: str, L: int) -> int:
    H, D, d = a.n_heads, a.head_dim, a.dim
    proj = a.q_lora_rank * (d + H * D) + d * D + H * D * a.o_lora_rank + a.o_groups * a.o_lora_rank * d
    core_per_key = 2 * H * D  # q.k and p.v
    macs = L * proj + core_per_key * _window_keys(L, a.window)
    if layer_type == "hca":
        macs += L * 2 * d * D + core_per_key * _floor_sum(L, a.hca_ratio)
    elif layer_type == "csa":
        HI, dI, m = a.index_n_heads, a.index_head_dim, a.csa_ratio
        macs += L * (2 * d * 2 * D + 2 * d * 2 * dI + a.q_lora_rank * HI * dI + d * HI)
        macs += HI * dI * _floor_sum(L, m) + core_per_key * _capped_visible(L, m, a.index_topk)
    return macs


def _dense_macs_per_token(a: DSv4Args) -> int:
    """MoE + two mHC per block (no attention)."""
    n, d = a.hc_mult, a.dim
    moe = d * a.n_experts + (a.n_activated_experts + 1) * 3 * d * a.moe_inter_dim
    mhc = (2 + n) * n * n * d + 2 * n * d + n * n * d
    return moe + 2 * mhc


def flops_per_step(args: DSv4Args, doc_lengths: Sequence[int]) -> float:
    """Forward+backward FLOPs of a step over documents of these real lengths."""
    a, n, d = args, args.hc_mult, args.dim
    head = n * n * d + d * a.vocab_size  # hc_head + LM head
    per_token = len(a.layer_types) * _dense_macs_per_token(a) + head
    if a.mtp_layers:
        per_token += a.mtp_layers * (d * d + n * d * d + _dense_macs_per_token(a) + head)
    macs = 0
    for L in doc_lengths:
        L = int(L)
        if L <= 0:
            continue
        macs += L * per_token + sum(_attention_macs(a, t, L) for t in a.layer_types)
        macs += a.mtp_layers * _attention_macs(a, "sliding", L)
    return 6.0 * macs
