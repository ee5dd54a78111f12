"""CP collectives against a single-process reference: values and gradients (float64, exact)."""

import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn
from titan_thd.parallel.cp_comm import all_gather_rows, left_halo

ROWS, HALO, D = 6, 4, 3


def _full_input(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(world * ROWS, D, generator=g, dtype=torch.float64)


def _weights(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, D, generator=g, dtype=torch.float64)


def _body(rank: int, world: int):
    group = dist.group.WORLD
    full = _full_input(world)
    mine = full[rank * ROWS : (rank + 1) * ROWS].clone().requires_grad_(True)

    gathered = all_gather_rows(mine, group)
    # A rank-dependent loss, so the reduce-scatter has to sum different contributions.
    (gathered * _weights(world * ROWS) * (rank + 1)).sum().backward()
    gather_grad = mine.grad.clone()

    mine.grad = None
    halo = left_halo(mine, HALO, group)
    (halo * _weights(HALO) * (rank + 1)).sum().backward()
    return gathered.detach(), gather_grad, halo.detach(), mine.grad.clone()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_collectives_match_reference(world):
    full = _full_input(world)
    results = spawn(_body, world)
    w_all = _weights(world * ROWS)
    coeff_sum = sum(r + 1 for r in range(world))
    for rank, (gathered, gather_grad, halo, halo_grad) in enumerate(results):
        torch.testing.assert_close(gathered, full, rtol=0, atol=0)
        own = slice(rank * ROWS, (rank + 1) * ROWS)
        torch.testing.assert_close(gather_grad, w_all[own] * coeff_sum, rtol=1e-12, atol=0)
        expected_halo = (
            torch.zeros(HALO, D, dtype=torch.float64) if rank == 0 else full[rank * ROWS - HALO : rank * ROWS]
        )
        torch.testing.assert_close(halo, expected_halo, rtol=0, atol=0)
        # My last HALO rows were read by rank + 1 with coefficient rank + 2.
        expected_grad = torch.zeros(ROWS, D, dtype=torch.float64)
        if rank + 1 < world:
            expected_grad[-HALO:] = _weights(HALO) * (rank + 2)
        torch.testing.assert_close(halo_grad, expected_grad, rtol=1e-12, atol=0)
