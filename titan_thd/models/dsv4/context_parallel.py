"""What DeepSeek-V4's attention exchanges under contiguous context parallelism (docs/dsv4.md §9.2).

Legend:  T this rank's rows   R key rows (halo + T)   d model width   C entries   Dc entry width

Two exchanges per attention layer, both differentiable (cp_comm's backward is the adjoint):

    with_left_halo(x_TD, plan)        [R, d]: the last `halo` rows of rank r-1's attention input,
                                      then this rank's rows. Only the d-wide hidden state travels;
                                      the receiver re-projects the halo rows locally (window K=V of
                                      its first queries, compressor inputs).
    gather_entries(mine_CD, cplan, g) [C, Dc]: the entries each rank computed (those whose window
                                      ends on it), padded to a fixed capacity, all-gathered, then
                                      put in the single-process (document-major) order.

Without CP (plan.halo == 0, cplan.gather_C is None) both return their input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_thd.models.dsv4.plans import BatchPlan, CompressPlan
from titan_thd.parallel.cp_comm import all_gather_rows, left_halo


def with_left_halo(x_TD: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
    """[halo + T, d] key rows: rank r-1's last `halo` rows (zeros on rank 0), then x_TD."""
    if plan.halo == 0:
        return x_TD
    return torch.cat([left_halo(x_TD, plan.halo, plan.group), x_TD])


def gather_entries(
    mine_CD: torch.Tensor, cplan: CompressPlan, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """[num_entries, Dc] every entry of the microbatch from this rank's [C_mine, Dc]."""
    if cplan.gather_C is None:
        return mine_CD
    pad = cplan.capacity - mine_CD.shape[0]
    assert pad >= 0, (mine_CD.shape, cplan.capacity)
    padded_CD = torch.cat([mine_CD, mine_CD.new_zeros(pad, *mine_CD.shape[1:])])
    return all_gather_rows(padded_CD, group)[cplan.gather_C]
