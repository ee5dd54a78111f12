"""The one way a family multiplies by a base weight: its projections (docs/adding_a_model.md §7).

Legend:  T rows   I in-features   O out-features   r adapter rank   E routed experts   N routed rows
         G groups of a block-diagonal projection

A projection's base weight W is a parameter (whole, or this rank's DTensor shard) or, in a LoRA run
whose frozen base stays as released, a `PackedWeight` in its place (FP8 / FP4 codes dequantised per
use, models/packed_weight.py). lora/ may attach a low-rank adapter next to it (lora/targets.py,
`attach`, on the meta model before it is cut and sharded). A family builds each projection that may
be adapted or packed as one of two kinds, and multiplies through the functions below, never by
reading W itself:

    Linear(in, out, bias=False)     y = module(x) (plain or DTensor operands); inside a tensor-parallel
                                    partial-sum region `linear_local(x, module)`; block-diagonal
                                    (dsv4's wo_a, W viewed [G, O, I]) `grouped_local(x_TGI, module)`
    a `GroupedExperts` subclass     stacked routed experts w1, w3 [E, F, d], w2 [E, d, F]: each stack
                                    through `base_grouped(x, counts, local_weight(w))`, its adapters
                                    `expert_adapters(module)` through `expert_delta`

`ModelSpec.lora` (`LoRATargets`) names these projections by path inside a block; `attach` refuses a
target of any other class (a plain `nn.Linear`'s forward would never read its adapter).

An adapted weight W [O, I] computes  y = x W^T + s * (x A^T) B^T  with A [r, I] drawn from the seed,
B [O, r] zero at the start (so step 0 is the base model exactly), s = alpha / r (or alpha / sqrt(r),
rsLoRA). The adapters are parameters of the module that holds W, next to it (`ADAPTERS`):

    Linear                      <module>.lora_A [r, I], <module>.lora_B [O, r]
    routed experts (stacked)    experts.lora_A_w13 [E, r, d]     shared by w1 and w3 (PEFT's fused
                                experts.lora_B_w1, lora_B_w3 [E, F, r]   gate_up_proj adapter)
                                experts.lora_A_w2 [E, r, F], experts.lora_B_w2 [E, d, r]

so the base names never change (the HF loader, the seeded init and the checkpoint fingerprint read
them as before), and each adapter is sharded by the rule of its base (the module's `PAIRS`,
parallel/shards.py): a split of W's output rows splits B's rows, a split of W's input columns splits
A's columns, the other factor is whole on every rank; expert parallelism splits every [E, ...]
adapter with its experts. One adapter per expert: the result never depends on the expert-parallel
degree. The seeded init draws them from `PAIRS` (parallel/seeded_init.py `adapter_rules`).

The routed experts add their adapter inside their grouped product: x A^T, times (s B)^T, added in
place to the base's product (s scales the [out, r] factor, not a [T, out] product: no
activation-sized temporary in the forward or the backward). `peft` computes (x A^T B^T) s: the same
up to float rounding, exactly the same when s is a power of two (tests/lora/test_peft.py bounds the
logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from titan_thd.models.packed_weight import PackedWeight, base_grouped, base_groups, base_linear, local_weight
from titan_thd.ops.grouped_linear import grouped_linear
from titan_thd.parallel.tensor_parallel import local

__all__ = [
    "ADAPTERS",
    "SCALING",
    "ExpertAdapters",
    "GroupedExperts",
    "LoRATargets",
    "Linear",
    "Target",
    "base_grouped",
    "expert_adapters",
    "expert_delta",
    "grouped_local",
    "is_projection",
    "linear_local",
    "local_weight",
]

SCALING = "lora_scaling"
"""Attribute of an adapted module: s, the factor of its update."""

ADAPTERS = {
    "weight": ("lora_A", "lora_B"),
    "w1": ("lora_A_w13", "lora_B_w1"),
    "w3": ("lora_A_w13", "lora_B_w3"),
    "w2": ("lora_A_w2", "lora_B_w2"),
}
"""Base parameter -> (A's name, B's name) of its adapter: a `Linear`'s weight, a `GroupedExperts`' stacks."""

_A, _B = ADAPTERS["weight"]


class Linear(nn.Linear):
    """`nn.Linear` (no bias) whose weight may be a `PackedWeight` and that adds its low-rank adapter
    when one is attached: the dense projection of a family."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        y = base_linear(x, w) if isinstance(w, PackedWeight) else F.linear(x, w, self.bias)
        A = self._parameters.get(_A)
        if A is None:
            return y
        return y.add_(F.linear(F.linear(x, A), self._parameters[_B] * getattr(self, SCALING)))


def linear_local(x: torch.Tensor, m: Linear) -> torch.Tensor:
    """x times this rank's shard of `m.weight` (`local`), plus the adapter's share: inside a
    tensor-parallel region the shards of A and B follow W's, so the output is the same partial sum."""
    y = base_linear(x, m.weight)
    A = m._parameters.get(_A)
    if A is None:
        return y
    return y.add_(F.linear(F.linear(x, local(A)), local(m._parameters[_B]) * getattr(m, SCALING)))


def grouped_local(x_TGI: torch.Tensor, m: Linear) -> torch.Tensor:
    """A block-diagonal projection (dsv4's `wo_a`, this rank's W viewed [G, O, I]): group g's rows
    times (W_g + s B_g A)^T -> [T, G, O], B_g = B's rows of group g."""
    y_TGO = base_groups(x_TGI, local_weight(m.weight))
    A = m._parameters.get(_A)
    if A is None:
        return y_TGO
    B = local(m._parameters[_B])
    G = x_TGI.shape[1]
    xa_TGR = F.linear(x_TGI, local(A))
    return y_TGO.add_(torch.einsum("tgr,gor->tgo", xa_TGR, B.view(G, -1, B.shape[-1]) * getattr(m, SCALING)))


class GroupedExperts(nn.Module):
    """Routed experts stacked as three parameters w1, w3 [E, F, d] and w2 [E, d, F] (expert e's
    matrices at index e, [out, in] each), multiplied through `base_grouped` on `local_weight(w)`,
    with `expert_adapters(self)`: the grouped projection of a family. A subclass builds the stacks
    and its forward."""

    STACKS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class ExpertAdapters:
    """The routed experts' adapters of this rank (local shards), for `expert_delta`."""

    A13_ERD: torch.Tensor
    B1_EFR: torch.Tensor
    B3_EFR: torch.Tensor
    A2_ERF: torch.Tensor | None
    B2_EDR: torch.Tensor | None
    scaling: float


def expert_adapters(experts: GroupedExperts) -> ExpertAdapters | None:
    """The adapters attached to a routed-experts module (None: not adapted)."""
    p = experts._parameters
    (a13, b1), (_, b3), (a2, b2) = ADAPTERS["w1"], ADAPTERS["w3"], ADAPTERS["w2"]
    if p.get(a13) is None and p.get(a2) is None:
        return None

    def get(name: str) -> torch.Tensor | None:
        t = p.get(name)
        return None if t is None else local(t)

    return ExpertAdapters(get(a13), get(b1), get(b3), get(a2), get(b2), getattr(experts, SCALING))


def expert_delta(
    x_NI: torch.Tensor, counts: list[int], A_ERI: torch.Tensor, B_EOR: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Rows grouped by expert (`counts`), group e times s (B_e A_e)^T, as two grouped products."""
    return grouped_linear(grouped_linear(x_NI, counts, A_ERI), counts, B_EOR * scaling)


def is_projection(module: nn.Module, params: tuple[str, ...]) -> bool:
    """Whether `module`'s forward reads the adapters of `params` (and takes their packed weights):
    a `Linear`'s weight or a `GroupedExperts`' stacks."""
    if isinstance(module, Linear):
        return params == ("weight",)
    return isinstance(module, GroupedExperts) and set(params) <= set(GroupedExperts.STACKS)


@dataclass(frozen=True)
class Target:
    module: str
    """The module's path inside a block (`attn.wq_a`): a `Linear` or a `GroupedExperts`."""
    params: tuple[str, ...] = ("weight",)
    """The base parameters adapted: ("weight",) for a linear; ("w1", "w3") (one A shared, as PEFT's
    fused gate_up_proj) or ("w2",) for the stacked routed experts [E, out, in]."""
    peft_param: str = ""
    """For a stacked target: the name of the Hugging Face model's 3-D parameter it adapts (PEFT's
    `target_parameters`, e.g. `gate_up_proj`); "" for a linear module (PEFT's `target_modules`)."""


@dataclass(frozen=True)
class LoRATargets:
    """A family's adaptable projections (`ModelSpec.lora`)."""

    targets: dict[str, Target]
    """Qualified target name -> where it is in a block of the model's `layers`."""
    groups: dict[str, tuple[str, ...]]
    """Group name (what `lora.targets` usually lists) -> its qualified targets."""
    notes: dict[str, str] = field(default_factory=dict)
    """Qualified target -> what a user must know (shown by --help), e.g. what cannot be exported."""

    def choices(self) -> list[str]:
        return [*self.groups, *self.targets]
