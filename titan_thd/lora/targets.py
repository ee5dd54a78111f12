"""Which projections a family can adapt, the `[lora]` targets resolved against it, and the adapters
attached to a model (on the meta device, before it is cut and sharded).

A family names its targets exactly (`ModelSpec.lora`, a `LoRATargets` of models/projection.py), as a
path inside each block of its `layers` (never a loose suffix match: dsv4's indexer has a `wq_b` too,
and `attn.wq_b` is not `attn.indexer.wq_b`), each a projection of models/projection.py:

    LoRATargets(targets={"attention.wq_a": Target("attn.wq_a"), ...,
                         "experts.w13": Target("ffn.experts", ("w1", "w3"))},
                groups={"attention": ("attention.wq_a", ...)})

    c = cfg.lora   # start-up: ValueError naming field, value, choices
    plan = resolve_lora(c.targets, c.rank, c.alpha, c.rslora, spec.lora, model, label)
    attach(model, plan)                     # adapters on every block, the base frozen
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from titan_thd.models.packed_weight import packed_weights
from titan_thd.models.projection import ADAPTERS, SCALING, LoRATargets, Target, is_projection
from titan_thd.parallel.seeded_init import adapter_rules, init_tensor
from titan_thd.parallel.shards import PAIRS, canonical_name


def scaling(alpha: float, rank: int, rslora: bool) -> float:
    """s = alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's `use_rslora`)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


@dataclass(frozen=True)
class LoRAPlan:
    """The `[lora]` section resolved against the model: what start-up decided, read by the rest."""

    targets: tuple[str, ...]
    """Qualified targets, groups expanded, in the family's order."""
    family: LoRATargets
    rank: int
    alpha: float
    rslora: bool
    base: dict[str, str] | None = field(default=None, repr=False)
    """The `lora.base` run setting: model.hf_path and its fingerprint (None: a seeded base), stored in
    checkpoints so that a resume against another base is refused (components/run_settings.py)."""

    @property
    def scaling(self) -> float:
        return scaling(self.alpha, self.rank, self.rslora)

    def describe(self, model: nn.Module) -> str:
        """The header's line: the adapters and what trains of this rank's shards."""
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # a base kept as released is no parameter (models/packed_weight.py): its values count too
        kept = sum(math.prod(w.shape) for w in packed_weights(model).values())
        total = sum(p.numel() for p in model.parameters()) + kept
        s = f"alpha / sqrt(r) = {self.scaling:g}" if self.rslora else f"alpha / r = {self.scaling:g}"
        released = f" ({kept:,} of its values kept as released, FP8 / FP4 codes)" if kept else ""
        return (
            f"lora: rank {self.rank}, {s}, targets {', '.join(self.targets)}; {trained:,} adapter parameters "
            f"train ({100 * trained / max(1, total):.2f}% of {total:,} here), the base is frozen{released}"
        )


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


def check_projection(name: str, where: str, target: Target, module: nn.Module) -> None:
    """ValueError (one line) unless the target's module is a projection that reads its adapters."""
    if not is_projection(module, target.params):
        raise ValueError(
            f"lora.targets: {name!r} is {where}.{target.module}, a {type(module).__module__}."
            f"{type(module).__qualname__} adapting {list(target.params)}, not a projection whose forward "
            "reads an adapter; build it as titan_thd.models.projection.Linear (params ('weight',)) or a "
            "GroupedExperts subclass (its w1 / w2 / w3 stacks), docs/adding_a_model.md §7"
        )


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
            check_projection(name, where, target, module)
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
    adapted, blocks = [], _blocks(model)
    for where, block in blocks.items():  # every target checked before anything is attached
        for name in plan.targets:
            target = plan.family.targets[name]
            check_projection(name, where, target, block.get_submodule(target.module))
    for where, block in blocks.items():
        for name in plan.targets:
            target = plan.family.targets[name]
            module = block.get_submodule(target.module)
            for p in target.params:
                a_name, b_name = ADAPTERS[p]
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


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Draw only the adapters (a model whose base weights are already in place), as `init_weights` would."""
    params = dict(model.named_parameters())
    for fqn, rule in adapter_rules(model).items():
        init_tensor(params[fqn], seed, fqn, rule)


def trained_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the parameters that train (a LoRA run's adapters): what its checkpoint holds."""
    return {canonical_name(name) for name, p in model.named_parameters() if p.requires_grad}
