"""Generation over packed THD microbatches: several prompts at once, one token per sequence per step.

Legend:  N active sequences   V vocabulary

    spec = get_model_spec(cfg.model.name)
    completions = generate(model, prompts, spec=spec, max_new_tokens=64, stop_ids={end_of_turn})

The prompts are packed into one microbatch (`cu_seqlens` boundaries, positions restarting per prompt,
no padding) for the first forward ("prefill"); every later step feeds each unfinished sequence its
newest token. What a step costs depends on the decoder (`make_decoder`):

- the family's cached decoder, `spec.decoder` (models/<family>/decode.py, beside the attention it
  mirrors), keeps per-layer caches, so a step computes one row per sequence;
- `RecomputeDecoder` (here) runs the model's own packed forward over every sequence in full at every
  step: O(length) work per token, but it needs nothing of the model beyond its training forward. It is
  the reference the cached decoders are tested against, and the fallback for a family without one.

A sequence finishes at a stop token (kept as its last token, reason "stop"), after its
`max_new_tokens` (reason "length"), or when it reaches `context` tokens (reason "context"); finished
sequences leave the batch. Only the logits of each sequence's last row are sampled (sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from titan_thd.inference.sampling import Sampling, make_generator, next_tokens
from titan_thd.models.decoding import Decoder, last_rows, packed_meta
from titan_thd.models.spec import ModelSpec

DECODERS = ("auto", "cache", "recompute")


class RecomputeDecoder:
    """Every step is the model's packed forward over the whole sequences (no cache)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.seqs: list[list[int]] = []

    def _forward(self) -> torch.Tensor:
        lengths = [len(s) for s in self.seqs]
        tokens_T = torch.tensor([t for s in self.seqs for t in s], dtype=torch.int64, device=self.device)
        logits_TV = self.model(tokens_T, packed_meta(lengths, tokens_T)).logits
        return logits_TV[last_rows(lengths).to(self.device)]

    def prefill(self, prompts: Sequence[Sequence[int]], room: int) -> torch.Tensor:
        self.seqs = [list(p) for p in prompts]
        return self._forward()

    def step(self, tokens_N: torch.Tensor) -> torch.Tensor:
        for seq, t in zip(self.seqs, tokens_N.tolist(), strict=True):
            seq.append(t)
        return self._forward()

    def keep(self, index: list[int]) -> None:
        self.seqs = [self.seqs[i] for i in index]


def make_decoder(
    model: nn.Module, spec: ModelSpec | None, device: torch.device, kind: str = "auto"
) -> Decoder:
    """`auto`/`cache`: the family's cached decoder, `spec.decoder` (`cache` refuses a family without
    one, or no spec); `recompute`: the full forward at every step."""
    if kind not in DECODERS:
        raise ValueError(f"decoder {kind!r}: expected one of {', '.join(DECODERS)}")
    if kind != "recompute":
        if spec is not None and spec.decoder is not None:
            return spec.decoder(model, device)
        if kind == "cache":
            name = spec.name if spec is not None else type(model).__name__
            raise ValueError(
                f"decoder cache: no cached decoder for {name} (ModelSpec.decoder); use recompute"
            )
    return RecomputeDecoder(model, device)


@dataclass
class Completion:
    tokens: list[int]
    """The generated ids (a stop token, when one ended the sequence, is the last)."""
    reason: str
    """Why it ended: "stop", "length" (max_new_tokens) or "context"."""

    def text_ids(self, stop_ids: set[int]) -> list[int]:
        """The generated ids without the stop token."""
        return self.tokens[:-1] if self.reason == "stop" and self.tokens[-1] in stop_ids else self.tokens


@dataclass
class GenerationStats:
    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated per second of the decode steps (the first token comes from the prefill)."""
        return (self.new_tokens - self.prompts) / self.decode_s if self.decode_s > 0 else 0.0

    def line(self) -> str:
        return (
            f"{self.prompts} prompts, {self.prompt_tokens} prompt tokens: prefill {self.prefill_s:.2f} s "
            f"({self.prompt_tokens / max(self.prefill_s, 1e-9):.0f} tokens/s); {self.new_tokens} new tokens in "
            f"{self.steps} steps, {self.decode_s:.2f} s ({self.decode_tokens_per_s:.1f} tokens/s)"
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    spec: ModelSpec | None,
    max_new_tokens: int | Sequence[int],
    stop_ids: set[int],
    sampling: Sampling = Sampling(),
    vocab_size: int | None = None,
    context: int | None = None,
    device: torch.device | str = "cpu",
    decoder: str | Decoder = "auto",
    stats: GenerationStats | None = None,
) -> list[Completion]:
    """Continue every prompt (lists of token ids) until a stop id, its token budget or the context.

    `spec`: the model's family (`get_model_spec(cfg.model.name)`), whose `decoder` a string `decoder`
    picks (make_decoder; None = only the recompute decoder). `max_new_tokens`: one budget for all, or
    one per prompt. `vocab_size`: the tokenizer's (ids the model has beyond it are never sampled).
    `context`: the most tokens a sequence may hold (prompt + generated); a prompt that long already is
    a ValueError. The model runs in eval mode."""
    device = torch.device(device)
    requested = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    assert len(requested) == len(prompts), (len(requested), len(prompts))
    if not prompts:
        return []
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if context is not None and len(p) >= context:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; the model's context is {context} tokens "
                "(training.tokens_per_microbatch): shorten it"
            )
    budgets = [b if context is None else min(b, context - len(p)) for b, p in zip(requested, prompts)]
    if min(budgets) < 1:
        raise ValueError(f"max_new_tokens: got {min(requested)}, expected at least 1")
    was_training = model.training
    model.eval()
    dec = make_decoder(model, spec, device, decoder) if isinstance(decoder, str) else decoder
    vocab_size = vocab_size or model.args.vocab_size
    gen = make_generator(sampling, device)
    out = [Completion([], "") for _ in prompts]
    active = list(range(len(prompts)))
    stats = stats if stats is not None else GenerationStats()
    stats.prompts += len(prompts)
    stats.prompt_tokens += sum(len(p) for p in prompts)
    try:
        t0 = time.perf_counter()
        logits_NV = dec.prefill(prompts, max(budgets))
        stats.prefill_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        while True:
            tokens_N = next_tokens(logits_NV, sampling, vocab_size, gen)
            keep = []
            for j, (i, t) in enumerate(zip(active, tokens_N.tolist(), strict=True)):
                out[i].tokens.append(t)
                if t in stop_ids:
                    out[i].reason = "stop"
                elif len(out[i].tokens) >= budgets[i]:
                    out[i].reason = "length" if budgets[i] == requested[i] else "context"
                else:
                    keep.append(j)
            stats.new_tokens += len(active)
            if not keep:
                break
            if len(keep) < len(active):
                dec.keep(keep)
                active = [active[j] for j in keep]
                tokens_N = tokens_N[torch.tensor(keep, device=tokens_N.device)]
            logits_NV = dec.step(tokens_N)
            stats.steps += 1
        stats.decode_s += time.perf_counter() - t0
    finally:
        model.train(was_training)
    return out
