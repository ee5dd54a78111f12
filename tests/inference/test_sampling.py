"""next_tokens: greedy is argmax with the lowest index on exact ties; temperature / top-k / top-p restrict
and reweight the distribution as documented; a seed reproduces the draws; padded vocabulary rows are
never chosen."""

import pytest
import torch

from titan_thd.inference.sampling import Sampling, make_generator, next_tokens


def test_greedy_is_argmax_lowest_index_on_ties_and_ignores_padded_rows():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0, 9.0], [2.0, 2.0, 2.0, 2.0, 9.0]])
    # Column 4 is a rounded-up vocabulary row (vocab_size 4): never chosen, whatever its logit.
    assert next_tokens(logits, Sampling(), vocab_size=4, generator=None).tolist() == [1, 0]


def draws(logits, sampling, n=4000):
    gen = make_generator(sampling, torch.device("cpu"))
    return next_tokens(logits.expand(n, -1), sampling, logits.shape[-1], gen)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert set(draws(logits, Sampling(1.0, top_k=2)).tolist()) == {0, 1}
    # top_p 0.65: 0.4 < 0.65, 0.4 + 0.3 >= 0.65, so tokens 0 and 1; the third is dropped.
    assert set(draws(logits, Sampling(1.0, top_p=0.65)).tolist()) == {0, 1}
    assert set(draws(logits, Sampling(1.0, top_p=0.3)).tolist()) == {0}  # the first token always stays
    full = draws(logits, Sampling(1.0), n=20000)
    freq = torch.bincount(full, minlength=4).double() / full.numel()
    assert torch.allclose(freq, torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64), atol=0.015)
    # Renormalised over the top 2: 0.4 / 0.7 and 0.3 / 0.7.
    top2 = draws(logits, Sampling(1.0, top_k=2), n=20000)
    assert (top2 == 0).double().mean().item() == pytest.approx(4 / 7, abs=0.015)


def test_temperature_sharpens_and_a_seed_reproduces():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    cold = draws(logits, Sampling(0.25), n=20000)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1]) ** 4
    assert (cold == 0).double().mean().item() == pytest.approx((p[0] / p.sum()).item(), abs=0.015)
    a, b = draws(logits, Sampling(1.0, seed=7)), draws(logits, Sampling(1.0, seed=7))
    assert torch.equal(a, b) and not torch.equal(a, draws(logits, Sampling(1.0, seed=8)))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"temperature": -1}, "--temperature -1"), ({"top_k": -2}, "--top_k -2"), ({"top_p": 0}, "--top_p 0")],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)
