"""Which projections a family can adapt, the `[lora]` targets resolved against it, and the adapters
attached to a model (on the meta device, before it is cut and sharded).

A family names its targets exactly, as a path inside each block of its `layers` (never a loose
suffix match: dsv4's indexer has a `wq_b` too, and `attn.wq_b` is not `attn.indexer.wq_b`):

    LoRATargets(targets={"attention.wq_a": Target("attn.wq_a"), ...,
                         "experts.w13": Target("ffn.experts", ("w1", "w3"))},
                groups={"attention": ("attention.wq_a", ...)})

    plan = resolve_lora(cfg.lora, spec.lora, model)    # start-up: ValueError naming field, value, choices
    attach(model, plan)                                 # adapters on every block, the base frozen
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from titan_thd.lora.layers import PAIRS, SCALING, scaling
from titan_thd.lora.resident import residents
from titan_thd.parallel.seeded_init import init_tensor
from titan_thd.parallel.shards import canonical_name


@dataclass(frozen=True)
class Target:
    module: str
    """The module's path inside a block (`attn.wq_a`), an `nn.Linear` or a routed-experts module."""
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


@dataclass(frozen=True)
class LoRAPlan:
    """The `[lora]` section resolved against the model: what start-up decided, read by the rest."""

    targets: tuple[str, ...]
    """Qualified targets, groups expanded, in the family's order."""
    family: LoRATargets
    rank: int
    alpha: float
    rslora: bool

    @property
    def scaling(self) -> float:
        return scaling(self.alpha, self.rank, self.rslora)

    def describe(self, model: nn.Module) -> str:
        """The header's line: the adapters and what trains of this rank's shards."""
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # a base kept as released is no parameter (lora/resident.py): its values count too
        kept = sum(math.prod(r.shape) for r in residents(model).values())
        total = sum(p.numel() for p in model.parameters()) + kept
        s = f"alpha / sqrt(r) = {self.scaling:g}" if self.rslora else f"alpha / r = {self.scaling:g}"
        released = f" ({kept:,} of its values kept as released, FP8 / FP4 codes)" if kept else ""
        return (
            f"lora: rank {self.rank}, {s}, targets {', '.join(self.targets)}; {trained:,} adapter parameters "
            f"train ({100 * trained / max(1, total):.2f}% of {total:,} here), the base is frozen{released}"
        )


# The adapter parameters of each base parameter: (A's name, B's name).
_LINEAR = {"weight": ("lora_A", "lora_B")}
_EXPERTS = {
    "w1": ("lora_A_w13", "lora_B_w1"),
    "w3": ("lora_A_w13", "lora_B_w3"),
    "w2": ("lora_A_w2", "lora_B_w2"),
}


def adapter_names(module: nn.Module) -> dict[str, tuple[str, str]]:
    """{base parameter: (A, B)} of the adapters attached to `module` (empty when it has none)."""
    return getattr(module, PAIRS, {})


def is_adapter(name: str) -> bool:
    """Whether a parameter name (any wrapper prefix) is an adapter's."""
    return name.rsplit(".", 1)[-1].startswith("lora_")


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    layers = getattr(model, "layers", None)
    return {} if layers is None else {f"layers.{k}": b for k, b in layers.items()}


def _shape(module: nn.Module, param: str) -> tuple[int, ...]:
    return tuple(module.get_parameter(param).shape)


def resolve_lora(
    targets: Sequence[str],
    rank: int,
    alpha: float,
    rslora: bool,
    family: LoRATargets | None,
    model: nn.Module,
    label: str,
) -> LoRAPlan:
    """The `[lora]` fields checked against the family and the (meta) model; ValueError naming the
    field, the value and the valid choices."""
    if family is None:
        raise ValueError(f"lora.enable = true: model {label} has no LoRA targets (set lora.enable = false)")
    choices = family.choices()
    if not targets:
        raise ValueError(f"lora.targets is empty: list at least one of {choices}")
    names: list[str] = []
    for t in targets:
        if t in family.groups:
            names += family.groups[t]
        elif t in family.targets:
            names.append(t)
        else:
            raise ValueError(
                f"lora.targets: unknown target {t!r} for model {label}; valid: {', '.join(choices)}"
            )
    chosen = tuple(n for n in family.targets if n in names)
    if rank <= 0:
        raise ValueError(f"lora.rank = {rank}: expected a positive integer (typical: 8 to 64)")
    if alpha <= 0:
        raise ValueError(
            f"lora.alpha = {alpha}: expected a positive number (the update is scaled by alpha / rank)"
        )
    blocks = _blocks(model)
    narrowest: tuple[int, str] = (rank, "")  # the true bound at once, not the first target's
    for name in chosen:
        target = family.targets[name]
        for where, block in blocks.items():
            try:
                module = block.get_submodule(target.module)
            except AttributeError:
                raise ValueError(
                    f"lora.targets: {name!r} needs {where}.{target.module}, which model {label} does not have"
                ) from None
            for p in target.params:
                out, inp = _shape(module, p)[-2:]
                if min(out, inp) < narrowest[0]:
                    narrowest = (min(out, inp), f"{name} ({where}.{target.module}.{p}: {out} x {inp})")
    if narrowest[1]:
        raise ValueError(
            f"lora.rank = {rank} is larger than the smaller side of {narrowest[1]}, the narrowest of the "
            f"targets; use lora.rank <= {narrowest[0]} or drop that target"
        )
    return LoRAPlan(chosen, family, rank, alpha, rslora)


def attach(model: nn.Module, plan: LoRAPlan) -> list[str]:
    """Add the planned adapters to every block of `model` (on its device, in its dtype, uninitialised:
    the seeded init fills them), freeze every other parameter; returns the adapted modules' names."""
    adapted = []
    for where, block in _blocks(model).items():
        for name in plan.targets:
            target = plan.family.targets[name]
            module = block.get_submodule(target.module)
            for p in target.params:
                a_name, b_name = (_LINEAR if p == "weight" else _EXPERTS)[p]
                w = module.get_parameter(p)
                lead, (out, inp) = tuple(w.shape[:-2]), tuple(w.shape[-2:])
                if module._parameters.get(a_name) is None:
                    A = torch.empty(*lead, plan.rank, inp, device=w.device, dtype=w.dtype)
                    module.register_parameter(a_name, nn.Parameter(A))
                B = torch.empty(*lead, out, plan.rank, device=w.device, dtype=w.dtype)
                module.register_parameter(b_name, nn.Parameter(B))
                setattr(module, PAIRS, adapter_names(module) | {p: (a_name, b_name)})
            setattr(module, SCALING, plan.scaling)
            adapted.append(f"{where}.{target.module}")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return adapted


def init_rules(model: nn.Module) -> dict[str, Callable[[torch.Tensor, torch.Generator], None]]:
    """Seeded-init rules of the adapters (parallel/seeded_init.py): A uniform in +-1/sqrt(in-features)
    (PEFT's default, kaiming-uniform with a = sqrt(5)), B zero, so the first step is the base model."""

    def uniform(bound: float):
        return lambda t, g: t.uniform_(-bound, bound, generator=g)

    def zero(t, g):
        t.zero_()

    rules = {}
    for mname, module in model.named_modules():
        for a_name, b_name in adapter_names(module).values():
            A = module.get_parameter(a_name)
            rules[canonical_name(f"{mname}.{a_name}")] = uniform(A.shape[-1] ** -0.5)
            rules[canonical_name(f"{mname}.{b_name}")] = zero
    return rules


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Draw only the adapters (a model whose base weights are already in place), as `init_weights` would."""
    params = dict(model.named_parameters())
    for fqn, rule in init_rules(model).items():
        init_tensor(params[fqn], seed, fqn, rule)


def trained_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the parameters that train (a LoRA run's adapters): what its checkpoint holds."""
    return {canonical_name(name) for name, p in model.named_parameters() if p.requires_grad}
