"""Optimizers (AdamW, or Muon for matrices + AdamW for the rest) and gradient-norm clipping.

`build_optimizers` returns one container that the trainer and the checkpoint treat as a single
optimizer: `step`, `zero_grad`, `state_dict`, `load_state_dict`. Its state dict is flattened by
parameter name (`torch.distributed.checkpoint.state_dict`), so it reshards across layouts and the
Muon and AdamW halves never collide.

Weight decay follows nanoGPT: matrices (ndim >= 2) decay, vectors (norm gains, biases) do not.
Muon (muon.py) scales its learning rate to match AdamW's update RMS, so one `optimizer.lr` suits
both halves.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titan_thd.components import hardware
from titan_thd.components.muon import Muon
from titan_thd.config import Optimizer as OptimizerConfig

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def default_matrix_params(model: nn.Module) -> list[str]:
    """Every 2-D weight except embeddings and the LM head (a matrix with vocabulary-many rows)."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    skip = {id(p) for m in embeddings for p in m.parameters()}
    vocab_rows = {m.num_embeddings for m in embeddings}
    vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
    if vocab_size is not None:  # a last pipeline stage holds the head without the embedding
        vocab_rows.add(vocab_size)
    return [
        name
        for name, p in model.named_parameters()
        if p.ndim == 2 and id(p) not in skip and p.shape[0] not in vocab_rows
    ]


def _adamw(params: list[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.AdamW:
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )


class OptimizersContainer:
    """The optimizers of one model (Muon + AdamW, or AdamW) behind one API, and one Stateful for the
    checkpoint: its state is keyed by parameter FQN (DCP reshards it across layouts). Under pipeline
    parallelism the model is the rank's module, whose chunks share its parameters."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]):
        self.model, self.optimizers = model, optimizers

    def step(self) -> None:
        """Step every optimizer; a parameter without a gradient (an expert no token was routed to
        in this step) steps with a zero one, as under FSDP, whose reduce-scatter hands unused
        parameters zero gradients: weight decay and momentum then evolve the same in every
        layout (and as in Megatron's gradient buffers)."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is None and p.requires_grad:
                        p.grad = torch.zeros_like(p)
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizers, options=_FLAT)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's state (moments, step counts); the hyperparameters stay this run's (its
        config: a resume may change them with checkpoint.allow_changes, components/run_settings.py),
        where loading alone would restore the saved ones (weight decay, betas, ...). The learning rate
        is the schedule's: the LR scheduler's state sets it (lr_scheduler.py)."""
        schedule = ("params", "lr", "initial_lr")
        hyper = [
            [{k: v for k, v in g.items() if k not in schedule} for g in o.param_groups]
            for o in self.optimizers
        ]
        set_optimizer_state_dict(self.model, self.optimizers, state, options=_FLAT)
        for opt, groups in zip(self.optimizers, hyper, strict=True):
            for group, values in zip(opt.param_groups, groups, strict=True):
                group.update(values)


class MuonSplit(Protocol):
    """What `build_optimizers` reads of the model's `ModelSpec` (models/spec.py). Named by its shape,
    not imported: the models import the loss and the precision from components, so components may
    not import the models back."""

    @property
    def name(self) -> str: ...

    @property
    def matrix_params(self) -> Callable[[nn.Module], list[str]] | None:
        """The parameters Muon updates (None: `default_matrix_params`)."""


def build_optimizers(model: nn.Module, cfg: OptimizerConfig, spec: MuonSplit) -> OptimizersContainer:
    """AdamW over every trainable parameter, or (`optimizer.name = muon`) Muon over the model's
    matrices. A frozen parameter (a LoRA run's base, lora/) gets no optimizer state."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if cfg.name == "adamw":
        return OptimizersContainer(model, [_adamw(list(params.values()), cfg)])
    assert cfg.name == "muon", cfg.name
    matrix_names = set((spec.matrix_params or default_matrix_params)(model))
    wrong = sorted(n for n in matrix_names if n not in params or params[n].ndim not in (2, 3))
    if wrong:
        raise ValueError(
            f"model {spec.name}: Muon needs 2-D parameters (or [E, out, in] stacks of them), "
            f"but matrix_params names {wrong}"
        )
    matrices = [params[n] for n in params if n in matrix_names]
    first = matrices[0] if matrices else next(iter(params.values()))
    muon = Muon(
        matrices,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        ns_dtype=hardware.muon_ns_dtype(cfg.muon_ns_dtype, hardware.detect(first.device), first.dtype),
    )
    rest = [p for n, p in params.items() if n not in matrix_names]
    return OptimizersContainer(model, [muon, _adamw(rest, cfg)] if rest else [muon])


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    pp_group: torch.distributed.ProcessGroup | None = None,
    also_scale: Iterable[torch.Tensor] = (),
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Global L2 norm of all gradients (DTensor-aware); scale them to `max_norm` if it is > 0.

    Gradients on different device meshes (e.g. dense and expert weights) are reduced mesh by mesh
    and then combined. Pipeline stages add the other stages' squared norms over `pp_group`;
    `also_scale` are gradients that are clipped but not counted (a stage's copy of weights that
    another stage counts). The routed experts of an expert-parallel run are DTensors on the 2-D
    (efsdp, ep) mesh: their norm is reduced over both, so every expert counts once. `device` holds
    the zero norm of no gradients (a stage without any sends it to the pipeline's all-reduce).
    """
    by_mesh: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for mesh, params in by_mesh.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms and pp_group is None:
        return torch.zeros((), device=device)
    # At least float32 (bf16 norms would round the clip factor); float64 stays float64 for parity runs.
    total = (
        torch.linalg.vector_norm(
            torch.stack([n.to(torch.promote_types(n.dtype, torch.float32)) for n in norms])
        )
        if norms
        else torch.zeros((), device=device)
    )
    if pp_group is not None:
        squared = total.square()
        torch.distributed.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    for p in also_scale:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    if max_norm > 0:
        for params in by_mesh.values():  # one foreach multiply per mesh: DTensor ops cannot mix meshes
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
