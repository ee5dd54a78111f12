"""THD vs padded (validation.compare_padded): the same documents through the packed THD forward and
through the model's padded forward (llama: [B, S, D] activations and one causal SDPA over
[B, H, S, E]; dsv4: each document alone) give the same cross-entropy sum: to float64 rounding in
float64, and within the float32 rounding bound derived below in float32."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.components.validation import padded_rows
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packed_batch import IGNORE_INDEX
from titan_thd.data.packer import pack_microbatch
from titan_thd.data.sample import Sample
from titan_thd.models import get_model_spec
from titan_thd.models.dsv4 import flavors as dsv4_flavors
from titan_thd.models.llama import LlamaArgs

U32 = 2.0**-24  # float32 unit roundoff
LLAMA = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160, vocab_size=320)
DSV4 = dataclasses.replace(dsv4_flavors["micro"], vocab_size=320)
CASES = [  # model, args, document lengths, T, per-document padding
    ("llama", LLAMA, [37, 5, 64, 18, 90, 1], 256, 4),
    ("dsv4", DSV4, [37, 5, 50, 20], 128, 1),  # each row is one more forward call: few, short ones
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread: tiny matmuls gain nothing from two, and a busy machine loses a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def microbatch(lengths: list[int], T: int, pad_to: int, vocab: int):
    rng = np.random.default_rng(0)
    samples = []
    for n in lengths:
        mask = rng.random(n) < 0.8
        mask[0] = False
        samples.append(Sample(rng.integers(0, vocab, n), mask))
    return pack_microbatch(samples, T, pad_to, pad_id=0)


def thd_and_padded(spec, model, mb, rows: int = 0):
    """(THD logits of the trained rows, padded logits of the same rows, labels, number trained)."""
    out = model(mb.tokens, BatchMeta.from_batch(mb)).logits
    tokens_BS, labels_BS, mask_BS, lengths_B = padded_rows(mb, pad_id=7, rows=rows)
    padded = spec.padded_forward(model, tokens_BS, lengths_B).flatten(0, 1)
    trained_T = mb.loss_mask & (mb.labels != IGNORE_INDEX)
    trained_P = mask_BS.flatten() & (labels_BS.flatten() != IGNORE_INDEX)
    assert torch.equal(mb.labels[trained_T], labels_BS.flatten()[trained_P])  # the same targets, in order
    return out[trained_T], padded[trained_P], mb.labels[trained_T]


@pytest.mark.parametrize("name, args, lengths, T, pad_to", CASES, ids=[c[0] for c in CASES])
def test_thd_and_padded_forward_agree(name, args, lengths, T, pad_to):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build(args).eval()
    mb = microbatch(lengths, T, pad_to, args.vocab_size)
    with torch.no_grad():
        z32_thd, z32_pad, y = thd_and_padded(spec, model, mb, rows=len(lengths) + 1)  # a filler row
        model.double()  # the same weights (float32 values are exact in float64)
        z64_thd, z64_pad, _ = thd_and_padded(spec, model, mb)
    N = y.numel()
    assert N > 70

    def ce(z):
        return cross_entropy_sum(z, y).item()

    # float64: two code paths, float64 rounding apart (measured ~1e-16 relative).
    l64_thd, l64_pad = ce(z64_thd), ce(z64_pad)
    assert abs(l64_pad - l64_thd) <= 1e-12 * l64_thd, (l64_thd, l64_pad)
    assert (z64_pad - z64_thd).abs().max() <= 1e-12 * z64_thd.abs().max()

    # float32. Let z* be the exact logits (the float64 run: its own error is ~1e-16, negligible) and
    # z = z* + d a float32 path's. For one token CE(z) = logsumexp(z) - z_y has gradient p - e_y,
    # whose l1 norm is <= 2, so |CE(z) - CE(z*)| <= max_v d_v - min_v d_v <= 2 |d|_inf (mean value
    # theorem). Evaluating CE in float32 adds <= gamma_V * (1 + |logsumexp|) (the V-term sum of exps,
    # its log, the subtraction; gamma_n = n u / (1 - n u)), and summing N token losses in float32
    # adds <= gamma_N * sum_t CE_t. Both paths err independently from the same CE(z*), so
    #   |L_pad - L_thd| <= sum over the two paths of [sum_t 2 |d_t|_inf + N gamma_V (1 + max|lse|)]
    #                      + 2 gamma_N * sum_t CE_t.
    def gamma(n: int) -> float:
        return n * U32 / (1 - n * U32)

    V = z64_thd.shape[-1]
    lse = torch.logsumexp(z64_thd, -1).abs().max().item()
    bound = 2 * gamma(N) * l64_thd
    for z32 in (z32_thd, z32_pad):
        d_inf = (z32.double() - z64_thd).abs().amax(-1)
        # Each path's logits are within float32 rounding of z*: a wrong mask or position would be O(1).
        assert d_inf.max() <= 1e3 * U32 * z64_thd.abs().max(), (name, d_inf.max().item())
        bound += 2 * d_inf.sum().item() + N * gamma(V) * (1 + lse)
    l32_thd, l32_pad = ce(z32_thd), ce(z32_pad)
    print(
        f"{name}: N {N}, float64 rel {abs(l64_pad / l64_thd - 1):.1e}; float32 |diff| {abs(l32_pad - l32_thd):.2e}, "
        f"bound {bound:.2e} (loss sum {l64_thd:.1f})"
    )
    assert abs(l32_pad - l32_thd) <= bound
    assert bound <= 1e-4 * l64_thd  # the bound is float32 rounding, not a loose tolerance


def test_padded_rows_layout():
    mb = microbatch([3, 6, 2], T=16, pad_to=4, vocab=50)
    tokens_BS, labels_BS, mask_BS, lengths = padded_rows(mb, pad_id=9, rows=5)
    assert lengths == [3, 6, 2, 1, 1] and tokens_BS.shape == (5, 6)
    cup = mb.cu_seqlens_padded.tolist()
    for b, (start, n) in enumerate(zip(cup, [3, 6, 2])):
        assert torch.equal(tokens_BS[b, :n], mb.tokens[start : start + n])
        assert torch.equal(labels_BS[b, :n], mb.labels[start : start + n])
        assert (tokens_BS[b, n:] == 9).all() and (labels_BS[b, n:] == IGNORE_INDEX).all()
    assert not mask_BS[3:].any() and (labels_BS[3:] == IGNORE_INDEX).all()
    assert int(mask_BS.sum()) == int(mb.loss_mask.sum())
