"""Llama FLOPs against the Megatron THD formula and its worked numbers (docs/thd_reference.md §5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_thd.models.llama import Llama, LlamaArgs, flavors, flops_per_step
from titan_thd.models.llama.args import flops_per_token_linear


def megatron_flops(
    h: int,
    layers: int,
    heads: int,
    kv_channels: int,
    groups: int,
    ffn: int,
    vocab: int,
    tokens: int,
    sum_sq: int,
) -> int:
    """Megatron's num_floating_point_operations for a dense SwiGLU GQA model, written from the
    formula: T * [L * (mlp + attn_lin) + logit] + S2 * L * core."""
    q, kv = kv_channels * heads, kv_channels * groups
    attn_lin = 6 * (h * (q + kv + kv) + q * h)
    mlp = 6 * h * ffn * 3
    logit = 6 * h * vocab
    core = 6 * q
    return tokens * (layers * (mlp + attn_lin) + logit) + sum_sq * layers * core


LLAMA3_8B = {
    "h": 4096,
    "layers": 32,
    "heads": 32,
    "kv_channels": 128,
    "groups": 8,
    "ffn": 14336,
    "vocab": 128256,
}
WORKED = [  # (document lengths, T, sum of squares, FLOPs) from docs/thd_reference.md §5
    ([5, 9, 3], 17, 115, 765_565_599_744),
    ([8, 12, 4], 24, 224, 1_080_846_974_976),
    ([8192], 8192, 67_108_864, 421_645_529_382_912),
    ([1024] * 8, 8192, 8_388_608, 375_466_041_016_320),
]


def args_of(c: dict) -> LlamaArgs:
    return LlamaArgs(
        dim=c["h"],
        n_layers=c["layers"],
        n_heads=c["heads"],
        n_kv_heads=c["groups"],
        ffn_hidden_dim=c["ffn"],
        vocab_size=c["vocab"],
    )


def test_megatron_helper_reproduces_worked_numbers():
    assert megatron_flops(**LLAMA3_8B, tokens=1, sum_sq=0) == 45_027_950_592  # per-token linear
    for lengths, T, sum_sq, flops in WORKED:
        assert (sum(lengths), sum(n * n for n in lengths)) == (T, sum_sq)
        assert megatron_flops(**LLAMA3_8B, tokens=T, sum_sq=sum_sq) == flops


@pytest.mark.parametrize("lengths,T,sum_sq,flops", WORKED)
def test_llama_flops_equal_worked_numbers(lengths, T, sum_sq, flops):
    assert flops_per_step(args_of(LLAMA3_8B), lengths) == flops


def test_attention_counts_sum_of_squares_not_square_of_sum():
    args = args_of(LLAMA3_8B)
    one, eight = flops_per_step(args, [8192]), flops_per_step(args, [1024] * 8)
    linear = 8192 * flops_per_token_linear(args)
    assert (one - linear) == pytest.approx(0.125 * one, rel=2e-3)  # 12.5 % (docs/thd_reference.md §5)
    assert (one - linear) == 8 * (eight - linear)  # 8192^2 = 8 * (8 * 1024^2)


def test_padded_lengths_cost_more_than_real():
    args = args_of(LLAMA3_8B)
    assert flops_per_step(args, [8, 12, 4]) > flops_per_step(args, [5, 9, 3])
    assert flops_per_step(args, []) == 0.0


@pytest.mark.parametrize("flavor", sorted(flavors))
def test_linear_flops_are_six_times_matmul_weights(flavor):
    """Per-token linear FLOPs = 6 x weights of every nn.Linear (blocks and LM head) of the real model."""
    args = flavors[flavor]
    with torch.device("meta"):
        model = Llama(args)
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert flops_per_token_linear(args) == 6 * matmul_weights
    c = {
        "h": args.dim,
        "layers": args.n_layers,
        "heads": args.n_heads,
        "kv_channels": args.head_dim,
        "groups": args.n_kv_heads,
        "ffn": args.ffn_hidden_dim,
        "vocab": args.vocab_size,
    }
    lengths = [300, 17, 1024]
    assert flops_per_step(args, lengths) == megatron_flops(**c, tokens=1341, sum_sq=300**2 + 17**2 + 1024**2)
