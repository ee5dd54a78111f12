"""Muon for 2-D weights: Nesterov momentum, then a Newton-Schulz orthogonalised update.

The update rule and hyperparameters are torch.optim.Muon's (torch 2.13): momentum buffer
`m <- m + (1 - mu)(g - m)`, Nesterov update `g + mu (m - g)`, five quintic Newton-Schulz
iterations with coefficients (3.4445, -4.7750, 2.0315) on the update scaled to unit Frobenius norm,
decoupled weight decay, and the `match_rms_adamw` learning-rate scale `0.2 * sqrt(max(rows, cols))`
so that one `optimizer.lr` suits the Muon and the AdamW halves. State: one `momentum_buffer` per
parameter, as in torch's Muon.

Why not torch.optim.Muon itself: on FSDP2 parameters (DTensors sharded over dp x cp) it runs the
Newton-Schulz matmuls as DTensor ops, which redistribute the shards at every iteration and sum in
a layout-dependent order, always in bfloat16, so two layouts of the same run drift apart by ~1e-5
per step. Here a sharded update is gathered once, orthogonalised as a whole on every rank (the same
arithmetic as one process), and each rank keeps its own shard; `ns_dtype = float32` then makes
every layout match one process to float32 rounding. (Every rank repeats the Newton-Schulz work of
every matrix; spreading matrices over ranks is the known next step for very large models.)
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g_AB: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix with the singular vectors of `g_AB` (in `dtype`).

    The quintic iteration X <- aX + (bXX^T + c(XX^T)^2)X pushes every singular value of the
    norm-scaled input towards ~1; it runs on the wide orientation so that XX^T is the small Gram.
    """
    a, b, c = NS_COEFFICIENTS
    x = g_AB.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        ns_steps: int = 5,
        ns_dtype: str = "bfloat16",
        nesterov: bool = True,
    ):
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "ns_steps": ns_steps,
            "ns_dtype": ns_dtype,
            "nesterov": nesterov,
        }
        if ns_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"Muon ns_dtype: got {ns_dtype!r}, expected 'bfloat16' or 'float32'")
        super().__init__(params, defaults)
        for group in self.param_groups:
            bad = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
            if bad:
                raise ValueError(f"Muon updates 2-D weights only, got parameters of shapes {bad}")

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon does not re-evaluate the loss"
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                update = self._orthogonalise(update, group["ns_steps"], getattr(torch, group["ns_dtype"]))
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))

    @staticmethod
    def _orthogonalise(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
        if not isinstance(update, DTensor):
            return newton_schulz(update, steps, dtype).to(update.dtype)
        full = newton_schulz(update.full_tensor(), steps, dtype).to(update.dtype)
        # Every rank holds the same full result: keep the local shard, no communication.
        return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
