"""Validation loop: the loss of a held-out set, every `validation.freq` steps and after the last one.

Definitions (docs/design.md §3.9):
    val/loss   sum of token cross-entropy over every trained token of the validation set (its first
               `max_batches` batches), divided once by their global number: the same normalisation
               as the training loss, so it does not depend on the parallel layout
    val/ppl    exp(val/loss)
    val/loss_padded, val/padded_diff   (validation.compare_padded) the same documents as padded
               [B, S] batches through the model's padded forward, and that loss minus val/loss

The validation set (validation.fraction of the documents, held out by data/split.py, or the file
validation.path) is cut into batches of training.global_batch_size documents in order, and each
batch goes through the training data path: the same planner over the dp x cp ranks, the same
packer (THD, no padding rows beyond the per-document alignment), the same CP split. The model runs
in eval mode without gradients (dsv4: no indexer KL, no router-load counting), under pipeline
parallelism through the schedule's forward-only pass. Nothing of it is random and the set is fixed,
so validation has no state: a resumed run logs the same val/loss at the same steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import Validation
from titan_thd.data.dataloader import OrderedSteps, StepBatch
from titan_thd.data.packed_batch import IGNORE_INDEX, PackedBatch
from titan_thd.parallel import distributed as dist_utils

logger = logging.getLogger("titan_thd")

PaddedForward = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""(tokens_BS, lengths_B) -> logits_BSV of the model's padded forward (validation.compare_padded)."""


class ForwardOnly(Protocol):
    """What validation runs the model through: pipeline/runner.py `LocalRunner` or, under pipeline
    parallelism, pipeline/schedule.py `PipelineSchedule`. Named by its shape, not imported: the
    pipeline imports the loss from components, so components may not import the pipeline back."""

    def forward_only(self, inputs: list[Any]) -> torch.Tensor:
        """The summed cross-entropy of the microbatches `inputs` (each what `prepare` made of one)."""


class Validator:
    """The validation batches of this data-parallel replica and their evaluation."""

    def __init__(
        self,
        cfg: Validation,
        batches: OrderedSteps,
        *,
        runner: ForwardOnly,
        prepare: Callable[[PackedBatch], Any],
        loss_mesh: DeviceMesh | None,
        device: torch.device,
        last_step: int,
        is_main: bool,
        padded_forward: PaddedForward | None = None,
        pad_id: int = 0,
    ):
        assert not cfg.compare_padded or padded_forward is not None  # refused at start-up
        self.freq, self.last_step, self.compare_padded = cfg.freq, last_step, cfg.compare_padded
        self.batches, self.runner, self.prepare = batches, runner, prepare
        self.loss_mesh, self.device, self.is_main = loss_mesh, device, is_main
        self.padded_forward, self.pad_id = padded_forward, pad_id
        G = batches.global_batch_size
        available = -(-batches.num_samples // G)
        self.num_batches = min(available, cfg.max_batches) if cfg.max_batches else available
        self.num_docs = min(batches.num_samples, self.num_batches * G)

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    @torch.no_grad()
    def run(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """val/* metrics of the model now, after `step` (every rank calls it; the values are global)."""
        t0 = time.perf_counter()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # THD, padded CE sums of this rank
        trained = 0
        model.eval()
        try:
            for i in range(self.num_batches):
                batch: StepBatch = self.batches[i]
                trained += batch.trained_tokens  # global, from the plan
                sums[0] += self.runner.forward_only([self.prepare(mb) for mb in batch.microbatches])
                if self.compare_padded:
                    for mb in batch.microbatches:
                        sums[1] += self._padded_ce(mb)
        finally:
            model.train()
        sums = dist_utils.dist_sum(sums, self.loss_mesh)
        loss = float(sums[0]) / max(1, trained)
        out = {"val/loss": loss, "val/ppl": math.exp(loss) if loss < 700 else math.inf}
        if self.compare_padded:
            padded = float(sums[1]) / max(1, trained)
            out |= {"val/loss_padded": padded, "val/padded_diff": padded - loss}
        if self.is_main:
            logger.info(
                "validation after step %d: val/loss %.4f  val/ppl %.3f%s  (%d documents in %d batches, %d trained "
                "tokens, %.2f s)",
                step,
                loss,
                out["val/ppl"],
                f"  val/padded_diff {out['val/padded_diff']:.3e}" if self.compare_padded else "",
                self.num_docs,
                self.num_batches,
                trained,
                time.perf_counter() - t0,
            )
        return out

    def _padded_ce(self, microbatch: PackedBatch) -> torch.Tensor:
        """CE sum of the microbatch's documents as a padded [B, S] batch through the padded forward."""
        # Every rank runs the same number of rows (one-token rows without a trained label fill up):
        # dsv4's per-document forward under FSDP all-gathers once per row, and the calls must match.
        docs = int((microbatch.cu_seqlens.diff() > 0).sum())
        rows = int(dist_utils.dist_max(docs, self.loss_mesh))
        tokens_BS, labels_BS, mask_BS, lengths_B = padded_rows(microbatch, self.pad_id, rows)
        logits_BSV = self.padded_forward(tokens_BS.to(self.device), lengths_B)
        return cross_entropy_sum(
            logits_BSV.flatten(0, 1), labels_BS.flatten().to(self.device), mask_BS.flatten().to(self.device)
        ).double()


def padded_rows(
    microbatch: PackedBatch, pad_id: int, rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The real documents of a THD microbatch as a padded batch: (tokens_BS, labels_BS, loss_mask_BS,
    lengths_B). Row b holds document b from column 0, then pad_id / IGNORE_INDEX / False; rows past
    the documents (up to `rows`) are one pad token long and train nothing."""
    cu, cup = microbatch.cu_seqlens.tolist(), microbatch.cu_seqlens_padded.tolist()
    spans = [(cup[d], cu[d + 1] - cu[d]) for d in range(microbatch.num_docs) if cu[d + 1] > cu[d]]
    lengths_B = [n for _, n in spans] + [1] * max(0, rows - len(spans))
    B, S = len(lengths_B), max(lengths_B, default=1)
    tokens_BS = torch.full((B, S), pad_id, dtype=torch.int64)
    labels_BS = torch.full((B, S), IGNORE_INDEX, dtype=torch.int64)
    mask_BS = torch.zeros((B, S), dtype=torch.bool)
    for b, (start, n) in enumerate(spans):
        tokens_BS[b, :n] = microbatch.tokens[start : start + n]
        labels_BS[b, :n] = microbatch.labels[start : start + n]
        mask_BS[b, :n] = microbatch.loss_mask[start : start + n].bool()
    return tokens_BS, labels_BS, mask_BS, lengths_B
