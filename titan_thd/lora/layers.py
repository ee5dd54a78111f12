"""Low-rank adapters on a frozen model: where they live and how a layer applies them (docs/lora.md).

Legend:  T rows   I in-features   O out-features   r adapter rank   E routed experts   N routed rows

An adapted weight W [O, I] computes  y = x W^T + s * (x A^T) B^T  with A [r, I] drawn from the seed,
B [O, r] zero at the start (so step 0 is the base model exactly), s = alpha / r (or alpha / sqrt(r),
rsLoRA). The adapters are parameters of the module that holds W, next to it:

    nn.Linear target            <module>.lora_A [r, I], <module>.lora_B [O, r]
    routed experts (stacked)    experts.lora_A_w13 [E, r, d]     shared by w1 and w3 (PEFT's fused
                                experts.lora_B_w1, lora_B_w3 [E, F, r]   gate_up_proj adapter)
                                experts.lora_A_w2 [E, r, F], experts.lora_B_w2 [E, d, r]

so the base names never change (the HF loader, the seeded init and the checkpoint fingerprint read
them as before), and each adapter is sharded by the rule of its base (`SPLIT_FOLLOWS`): a split of
W's output rows splits B's rows, a split of W's input columns splits A's columns, the other factor
is whole on every rank; expert parallelism splits every [E, ...] adapter with its experts. One
adapter per expert: the result never depends on the expert-parallel degree.

A frozen base kept as released (`lora.base_dtype = "released"`) is a `resident.Resident` in W's
place, dequantised per use by `Linear.forward` / `linear_local` (lora/resident.py).

A layer applies its adapter with `Linear.forward` (a module call, plain or DTensor operands) or
`linear_local` (this rank's shards inside a tensor-parallel partial-sum region); the routed experts
with `expert_delta` inside their grouped product: x A^T, times (s B)^T, added in place to the base's
product (s scales the [out, r] factor, not a [T, out] product: no activation-sized temporary in the
forward or the backward). `peft` computes (x A^T B^T) s: the same up to float rounding, exactly the
same when s is a power of two (tests/lora/test_peft.py bounds the logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_thd.lora import resident
from titan_thd.ops.grouped_linear import grouped_linear
from titan_thd.parallel.tensor_parallel import local

SCALING = "lora_scaling"
"""Attribute of an adapted module: s, the factor of its update."""
PAIRS = "lora_pairs"
"""Attribute of an adapted module: {base parameter: (A's name, B's name)}. The parallelisms read it
(`tensor_parallel.ShardedLocal`, `expert_parallel.apply_ep`) to shard each adapter by its base's rule."""


class Linear(nn.Linear):
    """`nn.Linear` (no bias) that adds its low-rank adapter when one is attached (`attach`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        y = resident.base_linear(x, w) if isinstance(w, resident.Resident) else F.linear(x, w, self.bias)
        A = self._parameters.get("lora_A")
        if A is None:
            return y
        return y.add_(F.linear(F.linear(x, A), self.lora_B * getattr(self, SCALING)))


def linear_local(x: torch.Tensor, m: nn.Linear) -> torch.Tensor:
    """x times this rank's shard of `m.weight` (`local`), plus the adapter's share: inside a
    tensor-parallel region the shards of A and B follow W's, so the output is the same partial sum."""
    y = resident.base_linear(x, m.weight)
    A = m._parameters.get("lora_A")
    if A is None:
        return y
    return y.add_(F.linear(F.linear(x, local(A)), local(m.lora_B) * getattr(m, SCALING)))


def grouped_delta(x_TGI: torch.Tensor, m: nn.Linear) -> torch.Tensor | None:
    """The adapter's update of a block-diagonal grouped projection (dsv4's `wo_a`, W viewed [G, O, I]):
    group g's rows times (W_g + s B_g A)^T, B_g = B's rows of group g -> [T, G, O]; None without one."""
    A = m._parameters.get("lora_A")
    if A is None:
        return None
    B = local(m.lora_B)
    G = x_TGI.shape[1]
    xa_TGR = F.linear(x_TGI, local(A))
    return torch.einsum("tgr,gor->tgo", xa_TGR, B.view(G, -1, B.shape[-1]) * getattr(m, SCALING))


@dataclass(frozen=True)
class ExpertAdapters:
    """The routed experts' adapters of this rank (local shards), for `expert_delta`."""

    A13_ERD: torch.Tensor
    B1_EFR: torch.Tensor
    B3_EFR: torch.Tensor
    A2_ERF: torch.Tensor | None
    B2_EDR: torch.Tensor | None
    scaling: float


def expert_adapters(experts: nn.Module) -> ExpertAdapters | None:
    """The adapters attached to a routed-experts module (None: not adapted)."""
    p = experts._parameters
    if p.get("lora_A_w13") is None and p.get("lora_A_w2") is None:
        return None

    def get(name: str) -> torch.Tensor | None:
        t = p.get(name)
        return None if t is None else local(t)

    return ExpertAdapters(
        get("lora_A_w13"), get("lora_B_w1"), get("lora_B_w3"), get("lora_A_w2"), get("lora_B_w2"),
        getattr(experts, SCALING),
    )  # fmt: skip


def expert_delta(
    x_NI: torch.Tensor, counts: list[int], A_ERI: torch.Tensor, B_EOR: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Rows grouped by expert (`counts`), group e times s (B_e A_e)^T, as two grouped products."""
    return grouped_linear(grouped_linear(x_NI, counts, A_ERI), counts, B_EOR * scaling)


def scaling(alpha: float, rank: int, rslora: bool) -> float:
    """s = alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's `use_rslora`)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank
