"""What a check step is and returns (the command's table rows): shared by the runner (cli.py) and
the steps (recipes.py, layers.py, generation.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Outcome:
    """What a step found: its verdict, the one figure the table shows, and the numbers behind it."""

    verdict: str  # PASS, FAIL or SKIP
    figure: str
    details: dict = field(default_factory=dict)


@dataclass
class Context:
    device: torch.device
    gpu: bool
    """Full scale (a CUDA device): the recipes' own batches, 8K-token layers; else CPU scale (seconds)."""
    workdir: Path
    memo: dict = field(default_factory=dict)
    """Results one step leaves for a later one (the recipes' runs for the throughput rows)."""


@dataclass
class Row:
    step: str
    verdict: str
    seconds: float
    figure: str
    details: dict


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Context], Outcome]
    needs_cuda: bool = False
    limit_s: tuple[float, float] = (60.0, 30.0)
    """Time limit on a GPU, on the CPU."""
