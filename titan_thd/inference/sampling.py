"""Choosing the next token from the logits of the last position: greedy, temperature, top-k, top-p.

Legend:  N sequences   V vocabulary

Greedy (`temperature = 0`) is `argmax`, which returns the LOWEST index among exactly equal maxima
(torch's documented tie rule, and the one transformers' greedy search uses too), so a tie can never
make two greedy decoders disagree. Sampling draws from softmax(logits / temperature) restricted to
the `top_k` most likely tokens and then to the smallest set whose probability reaches `top_p`, with
one `torch.Generator` seeded by `seed`: the same seed gives the same tokens (on the same device).
Ids at or above `vocab_size` (the rows the model rounds its vocabulary up with, never trained) are
never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    """0 = greedy; otherwise the logits are divided by it before the softmax."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = all)."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities sum to at least p (1 = all)."""
    seed: int = 0
    """Seed of the sampling generator (ignored when greedy)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature}: expected 0 (greedy) or a positive number")
        if self.top_k < 0:
            raise ValueError(f"--top_k {self.top_k}: expected 0 (off) or a positive number of tokens")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p {self.top_p}: expected a probability in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_tokens(
    logits_NV: torch.Tensor, sampling: Sampling, vocab_size: int, generator: torch.Generator | None
) -> torch.Tensor:
    """[N] next token of each sequence (int64, on the logits' device)."""
    logits_NV = logits_NV[:, :vocab_size].float()
    if sampling.greedy:
        return logits_NV.argmax(dim=-1)
    logits_NV = logits_NV / sampling.temperature
    if 0 < sampling.top_k < vocab_size:
        kth_N1 = logits_NV.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth_N1, float("-inf"))
    if sampling.top_p < 1:
        sorted_NV, order_NV = logits_NV.sort(dim=-1, descending=True)
        probs_NV = sorted_NV.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first one always stays).
        drop_NV = probs_NV.cumsum(dim=-1) - probs_NV >= sampling.top_p
        logits_NV = logits_NV.scatter(1, order_NV, sorted_NV.masked_fill(drop_NV, float("-inf")))
    probs_NV = logits_NV.softmax(dim=-1)
    return torch.multinomial(probs_NV, 1, generator=generator)[:, 0]


def make_generator(sampling: Sampling, device: torch.device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    return torch.Generator(device=device).manual_seed(sampling.seed)
