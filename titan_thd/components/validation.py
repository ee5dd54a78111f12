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

import dataclasses
import logging
import math
import time
from typing import Any

import numpy as np
import torch

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import Config
from titan_thd.data.dataloader import PlannedSteps, StepBatch
from titan_thd.data.packed_batch import IGNORE_INDEX, PackedBatch
from titan_thd.data.rows import RowRule
from titan_thd.data.sources import resolve_data_path
from titan_thd.data.split import split_store
from titan_thd.data.token_store import TokenStore, build_token_store
from titan_thd.data.tokenizer import Tokenizer
from titan_thd.parallel import distributed as dist_utils

logger = logging.getLogger("titan_thd")


# ============================================================================ the validation set
def check_path(cfg: Config) -> None:
    """ValueError naming validation.path when it is set and is not a file (before any process group)."""
    v = cfg.validation
    if v.enable and v.path:
        path = resolve_data_path(v.path, "validation.path")
        if not path.is_file():
            raise ValueError(f"validation.path: {path} is not a file (data.source = {cfg.data.source})")


def build_stores(
    cfg: Config, store: TokenStore, tokenizer: Tokenizer, cache_dir: str, progress: bool
) -> tuple[TokenStore, TokenStore | None]:
    """(training store, validation store or None): `store` split by validation.fraction, or `store`
    and the tokenised validation.path."""
    v = cfg.validation
    if not v.enable:
        return store, None
    if v.fraction:
        return split_store(store, v.fraction, cfg.training.seed)
    check_path(cfg)
    data = dataclasses.replace(cfg.data, path=v.path)
    return store, build_token_store(data, tokenizer, cfg.training.seed, cache_dir, progress=progress)


class _InOrder(PlannedSteps):
    """Validation batch i = documents [i*G, (i+1)*G) of the set, in order, planned like a step."""

    def sample_ids(self, step: int) -> np.ndarray:
        G = self.global_batch_size
        return np.arange(step * G, min((step + 1) * G, self.num_samples), dtype=np.int64)


# ============================================================================ the loop
class Validator:
    """The validation batches of this data-parallel replica and their evaluation."""

    def __init__(
        self,
        cfg: Config,
        store: TokenStore,
        *,
        dp_rank: int,
        dp_size: int,
        cp_size: int,
        cost_attention: float,
        rule: RowRule,
    ):
        v, t = cfg.validation, cfg.training
        self.freq, self.last_step, self.compare_padded = v.freq, t.steps, v.compare_padded
        self.batches = _InOrder(
            store.view(t.tokens_per_microbatch, cfg.data.overlong),
            pad_to_multiple=cfg.data.pad_to_multiple,
            cp_size=cp_size,
            planner=t.planner,
            cost_attention=cost_attention,
            dp_rank=dp_rank,
            dp_size=dp_size,
            rule=rule,
            global_batch_size=t.global_batch_size,
            seed=t.seed,
            shuffle=False,
        )
        available = -(-self.batches.num_samples // t.global_batch_size)
        self.num_batches = min(available, v.max_batches) if v.max_batches else available
        self.num_docs = min(self.batches.num_samples, self.num_batches * t.global_batch_size)

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    @torch.no_grad()
    def run(self, trainer: Any) -> dict[str, float]:
        """val/* metrics of `trainer`'s model now (every rank calls it; the values are global)."""
        t0 = time.perf_counter()
        model, device = trainer.model, trainer.dist.device
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # THD, padded CE sums of this rank
        trained = 0
        model.eval()
        try:
            for i in range(self.num_batches):
                batch: StepBatch = self.batches[i]
                trained += batch.trained_tokens  # global, from the plan
                inputs = [trainer.local_inputs(mb) for mb in batch.microbatches]
                if trainer.pipeline is not None:
                    sums[0] += trainer.pipeline.forward_only(inputs)
                else:
                    for inp in inputs:
                        out = model(inp.tokens, inp.meta)
                        sums[0] += cross_entropy_sum(out.logits, inp.labels, inp.loss_mask).double()
                if self.compare_padded:
                    for mb in batch.microbatches:
                        sums[1] += self._padded_ce(trainer, mb)
        finally:
            model.train()
        sums = dist_utils.dist_sum(sums, trainer.parallel_dims.get_optional_mesh("loss"))
        loss = float(sums[0]) / max(1, trained)
        out = {"val/loss": loss, "val/ppl": math.exp(loss) if loss < 700 else math.inf}
        if self.compare_padded:
            padded = float(sums[1]) / max(1, trained)
            out |= {"val/loss_padded": padded, "val/padded_diff": padded - loss}
        if trainer.dist.is_main:
            logger.info(
                "validation after step %d: val/loss %.4f  val/ppl %.3f%s  (%d documents in %d batches, %d trained "
                "tokens, %.2f s)",
                trainer.step,
                loss,
                out["val/ppl"],
                f"  val/padded_diff {out['val/padded_diff']:.3e}" if self.compare_padded else "",
                self.num_docs,
                self.num_batches,
                trained,
                time.perf_counter() - t0,
            )
        return out

    def _padded_ce(self, trainer: Any, microbatch: PackedBatch) -> torch.Tensor:
        """CE sum of the microbatch's documents as a padded [B, S] batch through spec.padded_forward."""
        # Every rank runs the same number of rows (one-token rows without a trained label fill up):
        # dsv4's per-document forward under FSDP all-gathers once per row, and the calls must match.
        docs = int((microbatch.cu_seqlens.diff() > 0).sum())
        rows = int(dist_utils.dist_max(docs, trainer.parallel_dims.get_optional_mesh("loss")))
        tokens_BS, labels_BS, mask_BS, lengths_B = padded_rows(microbatch, trainer.tokenizer.pad_id, rows)
        device = trainer.dist.device
        logits_BSV = trainer.spec.padded_forward(trainer.model, tokens_BS.to(device), lengths_B)
        return cross_entropy_sum(
            logits_BSV.flatten(0, 1), labels_BS.flatten().to(device), mask_BS.flatten().to(device)
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
