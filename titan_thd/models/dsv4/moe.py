"""DeepSeek-V4 mixture of experts (docs/dsv4.md §6).

Legend:  T rows   d model width   E routed experts   k experts per token   F expert width

Scores s = sqrt(softplus(x W_g^T)) (fp32). Learned layers pick top-k of s + b, with b a non-gradient
per-expert bias nudged after every optimizer step towards balanced load (aux-loss-free balancing);
hash layers take the experts from a frozen token-id table. The gate weights are the chosen scores
normalised to sum 1, times `route_scale`. Experts and the one shared expert are SwiGLU with clamps
(gate <= limit, |up| <= limit). Expert weights are per-expert 2-D matrices (Muon orthogonalises
each expert separately), named like the reference checkpoint (`experts.<e>.w1`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.parallel.tensor_parallel import local


class Expert(nn.Module):
    """Clamped SwiGLU: w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))."""

    def __init__(self, dim: int, hidden: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # local(): under tensor parallelism this rank's hidden columns (a partial output).
        gate, up = F.linear(x, local(self.w1.weight)), F.linear(x, local(self.w3.weight))
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return F.linear(F.silu(gate) * up, local(self.w2.weight))


class Gate(nn.Module):
    def __init__(self, args: DSv4Args, hash_routed: bool):
        super().__init__()
        self.topk, self.route_scale, self.hash_routed = (
            args.n_activated_experts,
            args.route_scale,
            hash_routed,
        )
        self.bias_update_rate = args.router_bias_update_rate
        self.weight = nn.Parameter(torch.empty(args.n_experts, args.dim))
        if hash_routed:
            # Frozen token id -> experts table: part of the checkpoint, never trained.
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.topk, dtype=torch.long))
        else:
            # Aux-loss-free balancing: the bias changes which experts are chosen, never their weights;
            # `load` counts the real tokens routed to each expert since the last bias update.
            self.register_buffer("bias", torch.zeros(args.n_experts))
            self.register_buffer("load", torch.zeros(args.n_experts, dtype=torch.long), persistent=False)

    def _apply(self, fn, recurse=True):
        # The balancing bias stays float32 when the model is cast (e.g. to bfloat16): steps of
        # rate 1e-3 would vanish in bfloat16's 8-bit mantissa.
        super()._apply(fn, recurse)
        if not self.hash_routed and self.bias.is_floating_point() and self.bias.dtype != torch.float32:
            self.bias = self.bias.float()
        return self

    def forward(self, x_TD: torch.Tensor, tokens_T: torch.Tensor, real_T: torch.Tensor):
        """(experts_Tk, weights_Tk)."""
        acc = torch.promote_types(x_TD.dtype, torch.float32)
        scores_TE = F.softplus(F.linear(x_TD.to(acc), self.weight.to(acc))).sqrt()
        if self.hash_routed:
            experts_Tk = self.tid2eid[tokens_T]
        else:
            experts_Tk = torch.topk(scores_TE + self.bias, self.topk, dim=-1, sorted=False).indices
            if self.training:
                self.load += torch.bincount(experts_Tk[real_T].flatten(), minlength=self.load.numel())
        weights_Tk = scores_TE.gather(1, experts_Tk)
        weights_Tk = weights_Tk / (weights_Tk.sum(-1, keepdim=True) + 1e-20) * self.route_scale
        return experts_Tk, weights_Tk

    @torch.no_grad()
    def update_bias(self, group: dist.ProcessGroup | None) -> None:
        """b_e += rate * sign(mean load - load_e) over the whole data-parallel step, then reset."""
        load = self.load.clone()
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        load = load.to(self.bias.dtype)
        self.bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.load.zero_()


class MoE(nn.Module):
    def __init__(self, args: DSv4Args, hash_routed: bool):
        super().__init__()
        self.gate = Gate(args, hash_routed)
        self.experts = nn.ModuleList(
            Expert(args.dim, args.moe_inter_dim, args.swiglu_limit) for _ in range(args.n_experts)
        )
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)

    def forward(self, x_TD: torch.Tensor, tokens_T: torch.Tensor, real_T: torch.Tensor) -> torch.Tensor:
        # Per-token metadata must describe exactly these rows (all T/cp rows also under TP).
        assert x_TD.shape[0] == tokens_T.shape[0] == real_T.shape[0], (
            x_TD.shape,
            tokens_T.shape,
            real_T.shape,
        )
        experts_Tk, weights_Tk = self.gate(x_TD, tokens_T, real_T)
        k = experts_Tk.shape[1]
        flat = experts_Tk.flatten()
        order = torch.argsort(flat, stable=True)
        rows = order // k
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        x_sorted = x_TD[rows]
        outs, begin = [], 0
        for expert, n in zip(self.experts, counts):
            if n:
                outs.append(expert(x_sorted[begin : begin + n]))
            begin += n
        routed = torch.cat(outs) * weights_Tk.flatten()[order, None].to(x_TD.dtype)
        y_TD = torch.zeros_like(x_TD).index_add_(0, rows, routed)
        return y_TD + self.shared_experts(x_TD)
