"""What generation needs of a model's cached decoder, and the packed prompts every decoder starts from.

Legend:  N active sequences   V vocabulary   T rows of a packed microbatch

    decoder = spec.decoder(model, device)       # ModelSpec.decoder: a family's cached decoder
    logits_NV = decoder.prefill(prompts, room)  # the packed forward of the prompts; caches filled
    logits_NV = decoder.step(tokens_N)          # one new row per sequence
    decoder.keep([0, 2])                        # sequences 1 and 3 finished

`titan_thd/inference/generate.py` drives any `Decoder` (and has the fallback that recomputes the
packed forward at every step); a family's decoder lives beside the attention it mirrors
(`models/<family>/decode.py`), so the inference code never imports a family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from titan_thd.data.batch_meta import BatchMeta


class Decoder(Protocol):
    def prefill(self, prompts: Sequence[Sequence[int]], room: int) -> torch.Tensor:
        """logits_NV of the last position of every prompt; `room`: tokens each may still grow by."""
        ...

    def step(self, tokens_N: torch.Tensor) -> torch.Tensor:
        """Append one token to every active sequence; logits_NV of those new positions."""
        ...

    def keep(self, index: list[int]) -> None:
        """Keep only the active sequences at these positions (in this order)."""
        ...


def packed_meta(lengths: Sequence[int], tokens_T: torch.Tensor) -> BatchMeta:
    """BatchMeta of sequences of these lengths packed back to back (no padding)."""
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n, device=tokens_T.device) for n in lengths])
    return BatchMeta(cu, cu, max(lengths), len(lengths), positions, None, tokens=tokens_T)


def last_rows(lengths: Sequence[int]) -> torch.Tensor:
    """Row of every sequence's last token in the packed microbatch."""
    return torch.tensor(lengths, dtype=torch.int64).cumsum(0) - 1
