"""DeepSeek-V4 mixture of experts (docs/dsv4.md §6).

Legend:  T rows   d model width   E routed experts (E_local on this rank)   k experts per token
         F expert width   N routed rows (T k, sorted by expert)

Scores s = sqrt(softplus(x W_g^T)) (fp32). Learned layers pick top-k of s + b, with b a non-gradient
per-expert bias nudged after every optimizer step towards balanced load (aux-loss-free balancing);
hash layers take the experts from a frozen token-id table. The gate weights are the chosen scores
normalised to sum 1, times `route_scale`. Experts and the one shared expert are SwiGLU with clamps
(gate <= limit, |up| <= limit).

The routed experts of a layer are three stacked parameters (`Experts`): w1, w3 [E, F, d] and
w2 [E, d, F], expert e's matrices at index e ([out, in] each, like `nn.Linear.weight`). They run as
one grouped matrix product per projection on those tensors themselves (ops/grouped_linear.py: no
per-step copy); Muon orthogonalises each expert's matrix with one batched Newton-Schulz per
stacked tensor. The HF names stay per expert (`experts.<e>.w1.weight`, hf_names.py maps them).
With expert parallelism the stacks are DTensors sharded over `ep` on the expert dimension (rank r
computes with its E / ep experts, `local()`), and the rows travel to their experts' ranks and back
by all-to-all (parallel/expert_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.projection import (
    ExpertAdapters,
    GroupedExperts,
    Linear,
    base_grouped,
    expert_adapters,
    expert_delta,
    linear_local,
    local_weight,
)
from titan_thd.ops.grouped_linear import grouped_linear
from titan_thd.parallel.expert_parallel import dispatch_combine
from titan_thd.parallel.recompute import decided_once, in_recompute


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L) (no clamps for L <= 0)."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


class Expert(nn.Module):
    """The shared expert, clamped SwiGLU: w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))."""

    def __init__(self, dim: int, hidden: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)
        self.act = swiglu
        """`apply_compile` swaps in its compiled form (titan_thd/models/compile.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # local(): under tensor parallelism this rank's hidden columns (a partial output).
        gate, up = linear_local(x, self.w1), linear_local(x, self.w3)
        return linear_local(self.act(gate, up, self.limit), self.w2)


def grouped_experts(
    x_ND: torch.Tensor,
    counts: list[int],
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    limit: float,
    act=swiglu,
    lora: ExpertAdapters | None = None,
) -> torch.Tensor:
    """Clamped SwiGLU of rows sorted by expert: rows [sum(counts[:e]), sum(counts[:e+1])) go
    through expert e of the stacks; one grouped matrix product per projection. `lora`: the experts'
    adapters (models/projection.py), one per expert, added to each projection's product."""
    assert len(counts) == w1_EFD.shape[0] and sum(counts) == x_ND.shape[0], (counts, x_ND.shape)
    if x_ND.shape[0] == 0:  # nothing routed here: an empty result still in the graph (collectives)
        return x_ND * 0
    gate, up = base_grouped(x_ND, counts, w1_EFD), base_grouped(x_ND, counts, w3_EFD)
    if lora is not None and lora.A13_ERD is not None:  # w1 and w3 share A (PEFT's fused gate_up_proj)
        xa_NR = grouped_linear(x_ND, counts, lora.A13_ERD)
        gate = gate.add_(grouped_linear(xa_NR, counts, lora.B1_EFR * lora.scaling))
        up = up.add_(grouped_linear(xa_NR, counts, lora.B3_EFR * lora.scaling))
    h_NF = act(gate, up, limit)
    out = base_grouped(h_NF, counts, w2_EDF)
    if lora is not None and lora.A2_ERF is not None:
        out = out.add_(expert_delta(h_NF, counts, lora.A2_ERF, lora.B2_EDR, lora.scaling))
    return out


def looped_experts(
    x_ND: torch.Tensor,
    counts: list[int],
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Reference of `grouped_experts` (the test oracle): one F.linear per expert and projection
    (`w[e]` of a stack, or of a list of per-expert 2-D weights)."""
    outs, begin = [x_ND.new_zeros(0, x_ND.shape[1])], 0
    for e, n in enumerate(counts):
        if n:
            x = x_ND[begin : begin + n]
            h = swiglu(F.linear(x, w1_EFD[e]), F.linear(x, w3_EFD[e]), limit)
            outs.append(F.linear(h, w2_EDF[e]))
        begin += n
    return torch.cat(outs)


class Experts(GroupedExperts):
    """The routed experts, stacked: w1, w3 [E, F, d] and w2 [E, d, F] (expert e at index e), the
    grouped projection of models/projection.py (adapters and a packed base go through it). A
    module of its own so that FSDP can gather them as one unit when they are sharded apart from
    their block (expert parallelism)."""

    act = staticmethod(swiglu)
    """The experts' activation; `apply_compile` swaps in its compiled form on the instance."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x_ND: torch.Tensor, counts: list[int], limit: float) -> torch.Tensor:
        # This rank's experts (EP, Shard(0)) or hidden columns (TP, a partial output): the local shard
        # of each stack, or its packed codes (models/packed_weight.py).
        w1, w2, w3 = (local_weight(w) for w in (self.w1, self.w2, self.w3))
        return grouped_experts(x_ND, counts, w1, w2, w3, limit, self.act, expert_adapters(self))


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
            # Decided once: a recomputation (activation_checkpoint) routes as the forward did, and
            # counts no token again.
            experts_Tk = decided_once(
                lambda: torch.topk(scores_TE.detach() + self.bias, self.topk, dim=-1, sorted=False).indices
            )
            if self.training and not in_recompute():
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
        self.n_experts, self.limit = args.n_experts, args.swiglu_limit
        self.gate = Gate(args, hash_routed)
        self.experts = Experts(args.n_experts, args.dim, args.moe_inter_dim)
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
        self.ep_group: dist.ProcessGroup | None = None
        """Expert-parallel group (set by parallel.expert_parallel.apply_ep); None = all experts local."""

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
        counts_E = torch.bincount(flat, minlength=self.n_experts)
        # index_select, not x_TD[rows]: its backward is index_add_, where advanced indexing's is a
        # serial accumulating index_put_ (fwd+bwd 3.4 -> 0.5 ms at T = 1,744, d = 256, 2 threads).
        x_sorted = x_TD.index_select(0, rows)
        if self.ep_group is None:
            routed = self.experts(x_sorted, decided_once(counts_E.tolist), self.limit)
        else:
            routed = dispatch_combine(
                x_sorted, counts_E, self.ep_group, lambda x, c: self.experts(x, c, self.limit)
            )
        routed = routed * weights_Tk.flatten()[order, None].to(x_TD.dtype)
        y_TD = torch.zeros_like(x_TD).index_add_(0, rows, routed)
        return y_TD + self.shared_experts(x_TD)
