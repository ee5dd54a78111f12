"""StatefulDataLoader assembly: one `StepBatch` per optimizer step for this DP replica.

A map-style dataset indexed by the step does the per-step work (in `data.num_workers` worker
processes, or in-process for 0): sample ids of the global batch from the sampler, the plan of ALL
replicas from the global lengths (every rank computes the same plan), then only this replica's
samples are read and packed. Its output depends on (dataset, seed, step, layout) only, so:

- the resume state is layout-free: `state_dict()` is `data_state()` = {"step", "epoch", "cursor",
  "seed"}, identical on every rank, and `load_state_dict()` rebuilds the loader at that step. A
  checkpoint written with one DP degree (or number of workers) therefore resumes with another.
  The StatefulDataLoader's own state is deliberately not kept: the dataset is a pure function of
  the step, so rebuilding at the step is already exact (with workers too: prefetched batches are
  simply recomputed), while that state names this rank's dp_rank and worker layout, which a
  checkpoint (one copy for all ranks) could not restore on other ranks anyway.

`data.source = "packed"` reads offline-packed rows instead (packed_dataset.py; Megatron-Bridge
packs via bridge_pack.py): there `training.global_batch_size` counts packed rows. By default
(`data.packed_replan = true`) the documents of the step's rows are planned again over the DP x CP
ranks like any other documents (`RepackedSteps`); with `false` each row is one microbatch and
replica d takes rows [d*G/dp, (d+1)*G/dp) of the step's rows (`PackedRowSteps`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ModuleNotFoundError as e:
    # A node's preinstalled stack (no network) may lack it: one line, not an import traceback.
    raise SystemExit(
        f"error: titan_thd needs torchdata (its StatefulDataLoader), which this Python ({e.name} missing) lacks: "
        "pip install torchdata, or on a node without network carry its pure-Python wheel "
        "(pip download torchdata --no-deps elsewhere, then pip install --no-deps torchdata-*.whl)"
    ) from None

from titan_thd.data import sampler
from titan_thd.data.bridge_pack import BRIDGE_FORMAT
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.data.packed_dataset import PackedRows
from titan_thd.data.packer import pack_microbatch, padded_lengths
from titan_thd.data.packs import open_pack
from titan_thd.data.planner import Policy, make_plan, sample_costs
from titan_thd.data.rows import RowRule


@dataclass(frozen=True)
class DataLayout:
    """How one data-parallel replica's data is planned and cut: computed once at start-up from the
    config, the parallel layout and the model (`titan_thd.startup.Run.layout`), the same on every
    rank except `dp_rank`."""

    dp_rank: int
    """This replica (0 .. dp - 1)."""
    dp: int
    """Data-parallel replicas the plan spreads each step over."""
    cp: int
    """Context-parallel ranks of one replica (the planner balances what each of them carries)."""
    rule: RowRule
    """The row counts every microbatch may have (T = rule.T, trimming, the layout's minimum)."""
    global_batch_size: int
    """Samples per step, all replicas (packed sources: packed rows)."""
    seed: int
    planner: Policy = "balanced"
    cost_attention: float = 0.0
    """Planner weight of sum(len^2) per token (docs/design.md §3.2)."""
    microbatch_group: int | None = None
    """Microbatches per replica come in multiples of this (Interleaved1F1B: pp)."""
    hybrid_threshold: int = 0
    """> 0 under hybrid CP: the planner balances what each CP rank really carries (data/planner.py)."""
    pad_to_multiple: int = 1
    """Each document's rows are a multiple of this (data.pad_to_multiple, 0 resolved at start-up)."""

    @property
    def T(self) -> int:
        return self.rule.T


@dataclass
class StepBatch:
    step: int
    microbatches: list[PackedBatch]
    """This DP replica's microbatches, before the CP split."""
    num_microbatches: int
    """Microbatches per replica (identical on every replica)."""
    trained_tokens: int
    """GLOBAL trained labels of the step (all replicas): the loss normaliser."""
    real_tokens: int
    """GLOBAL real (non-padding) tokens."""
    slot_tokens: int
    """GLOBAL rows computed: the rows of every replica's microbatches (dp * num_microbatches * T
    without data.trim_padding)."""
    doc_lengths: list[int]
    """GLOBAL real document lengths of the step (for FLOPs)."""
    imbalance: float
    """max / mean replica cost of the plan (1.0 = perfect)."""


class _Steps(torch.utils.data.Dataset):
    """Step index -> StepBatch; the parts shared by every source."""

    num_samples: int
    overlong_counts: dict[str, int]
    """Samples truncated / dropped for being longer than T (data.overlong; offline packs: at pack time)."""

    def __init__(self, layout: DataLayout, shuffle: bool):
        if not 0 <= layout.dp_rank < layout.dp:
            raise ValueError(f"dp_rank {layout.dp_rank} is outside 0..{layout.dp - 1}")
        self.layout, self.shuffle = layout, shuffle
        self.dp_rank, self.dp_size, self.rule, self.T = layout.dp_rank, layout.dp, layout.rule, layout.T
        self.global_batch_size, self.seed = layout.global_batch_size, layout.seed

    def sample_ids(self, step: int) -> np.ndarray:
        return sampler.global_batch_indices(
            step, self.global_batch_size, self.num_samples, self.seed, self.shuffle
        )

    def rows_of(self, used_per_microbatch) -> int:
        """Rows computed for microbatches whose documents take these padded token counts."""
        return sum(self.rule.rows(int(u)) for u in used_per_microbatch)

    def plan_and_pack(self, lengths: np.ndarray, sample, pad_id: int):
        """(plan of the step's documents over dp x cp, this replica's packed microbatches, the rows
        of every replica's microbatches: slot_tokens); `sample(p)` is the step's p-th document. For
        the sources planned every step (they set pad_to_multiple)."""
        lay = self.layout
        plan = make_plan(
            lay.planner,
            padded_lengths(lengths, self.pad_to_multiple),
            lay.dp,
            lay.cp,
            lay.T,
            lay.cost_attention,
            lay.microbatch_group,
            lay.hybrid_threshold,
        )
        mine = [
            pack_microbatch([sample(p) for p in mb], self.T, self.pad_to_multiple, pad_id, self.rule)
            for mb in plan.microbatches[self.dp_rank]
        ]
        padded = padded_lengths(lengths, self.pad_to_multiple)
        slots = self.rows_of(padded[list(mb)].sum() for replica in plan.microbatches for mb in replica)
        return plan, mine, slots


class PlannedSteps(_Steps):
    """Samples of a TokenStore planned into microbatches every step."""

    def __init__(self, store, layout: DataLayout, *, pad_to_multiple: int, shuffle: bool):
        super().__init__(layout, shuffle)
        self.store, self.num_samples = store, len(store)
        self.overlong_counts = {"truncated": store.num_truncated, "dropped": store.num_dropped}
        self.pad_to_multiple = pad_to_multiple

    def __getitem__(self, step: int) -> StepBatch:
        ids = self.sample_ids(step)
        lengths = self.store.lengths[ids]
        plan, mine, slots = self.plan_and_pack(lengths, lambda p: self.store[ids[p]], self.store.pad_id)
        return StepBatch(
            step=step,
            microbatches=mine,
            num_microbatches=plan.num_microbatches,
            trained_tokens=int(self.store.num_targets[ids].sum()),
            real_tokens=int(lengths.sum()),
            slot_tokens=slots,
            doc_lengths=lengths.tolist(),
            imbalance=plan.imbalance,
        )


class OrderedSteps(PlannedSteps):
    """Validation batch i = documents [i*G, (i+1)*G) of the store, in order, planned like a step."""

    def __init__(self, store, layout: DataLayout, *, pad_to_multiple: int):
        super().__init__(store, layout, pad_to_multiple=pad_to_multiple, shuffle=False)

    def sample_ids(self, step: int) -> np.ndarray:
        G = self.global_batch_size
        return np.arange(step * G, min((step + 1) * G, self.num_samples), dtype=np.int64)


class PackedRowSteps(_Steps):
    """Offline-packed rows: G rows per step, G / dp consecutive rows per replica."""

    def __init__(self, rows: PackedRows, layout: DataLayout, *, shuffle: bool):
        super().__init__(layout, shuffle)
        self.rows, self.num_samples = rows, len(rows)
        # The rows hold documents padded to the pack's multiple: the microbatches come in it too.
        self.rule = self.rule.with_multiple(rows.pad_to_multiple)
        self.overlong_counts = {k: int(rows.metadata[f"num_{k}"]) for k in ("truncated", "dropped")}
        if rows.metadata.get("format") == BRIDGE_FORMAT:
            raise ValueError(
                f"{rows.path}: a Megatron-Bridge pack cannot be trained row by row here (its sequences carry one "
                "token more than a row of T holds); set data.packed_replan = true"
            )
        if rows.T != self.T:
            raise ValueError(
                f"{rows.path}: rows were packed with T = {rows.T} tokens, but training.tokens_per_microbatch = "
                f"{self.T}; repack with --tokens-per-microbatch {self.T} or set the config to {rows.T}"
            )
        if self.global_batch_size % self.dp_size:
            raise ValueError(
                f"training.global_batch_size = {self.global_batch_size} counts packed rows (one microbatch each) "
                f"and must be a multiple of the data-parallel degree {self.dp_size}"
            )

    def __getitem__(self, step: int) -> StepBatch:
        ids = self.sample_ids(step)
        per = self.global_batch_size // self.dp_size
        doc_lengths = [self.rows.doc_lengths(int(i)) for i in ids]
        costs = np.array(
            [
                sample_costs(padded_lengths(d, self.rows.pad_to_multiple), self.layout.cost_attention).sum()
                for d in doc_lengths
            ]
        )
        replica = costs.reshape(self.dp_size, per).sum(axis=1)
        mine = [
            pack_microbatch(
                self.rows.samples(int(i)),
                self.T,
                self.rows.pad_to_multiple,
                self.rows.pad_id,
                self.rule,
            )
            for i in ids[self.dp_rank * per : (self.dp_rank + 1) * per]
        ]
        used = [padded_lengths(d, self.rows.pad_to_multiple).sum() for d in doc_lengths]
        all_docs = np.concatenate(doc_lengths)
        return StepBatch(
            step=step,
            microbatches=mine,
            num_microbatches=per,
            trained_tokens=int(self.rows.num_targets[ids].sum()),
            real_tokens=int(all_docs.sum()),
            slot_tokens=self.rows_of(used),
            doc_lengths=all_docs.tolist(),
            imbalance=float(replica.max() / replica.mean()) if replica.mean() > 0 else 1.0,
        )


class RepackedSteps(_Steps):
    """Offline-packed rows unpacked into their documents and planned again every step (Megatron's
    `_unpack_batch` before its scheduler): G rows per step, their documents spread over the DP x CP
    ranks by `training.planner` exactly like the documents of a jsonl source. The pack then fixes
    which documents train together in a step, not how they are cut into microbatches, so T and
    data.pad_to_multiple may differ from the pack's. Documents longer than T are truncated or
    dropped (data.overlong), counted on top of the pack's own counts."""

    def __init__(
        self, rows: PackedRows, layout: DataLayout, *, pad_to_multiple: int, overlong: str, shuffle: bool
    ):
        super().__init__(layout, shuffle)
        if overlong not in ("truncate", "drop"):
            raise ValueError(f"data.overlong: got {overlong!r}, expected 'truncate' or 'drop'")
        self.rows, self.num_samples = rows, len(rows)
        self.pad_to_multiple, self.overlong = pad_to_multiple, overlong
        too_long = rows.doc_lengths_all > self.T
        self.overlong_counts = {k: int(rows.metadata.get(f"num_{k}", 0)) for k in ("truncated", "dropped")}
        self.overlong_counts["dropped" if overlong == "drop" else "truncated"] += int(too_long.sum())
        if overlong == "drop" and too_long.all():
            raise ValueError(
                f"{rows.path}: every one of its {too_long.size} documents is longer than "
                f"training.tokens_per_microbatch = {self.T} and data.overlong = drop; raise T or truncate"
            )

    def __getitem__(self, step: int) -> StepBatch:
        rows = self.sample_ids(step)
        docs = self.rows.row_docs(rows)
        lengths = self.rows.doc_lengths_all[docs]
        if self.overlong == "drop":
            keep = lengths <= self.T
            if not keep.any():
                raise ValueError(
                    f"{self.rows.path}: step {step}: all {lengths.size} documents of its {rows.size} rows are longer "
                    f"than T = {self.T} (data.overlong = drop); raise training.tokens_per_microbatch"
                )
            docs, lengths = docs[keep], lengths[keep]
        lengths = np.minimum(lengths, self.T)
        plan, mine, slots = self.plan_and_pack(
            lengths, lambda p: self.rows.doc(int(docs[p]), self.T), self.rows.pad_id
        )
        return StepBatch(
            step=step,
            microbatches=mine,
            num_microbatches=plan.num_microbatches,
            trained_tokens=int(self.rows.doc_targets(docs, self.T).sum()),
            real_tokens=int(lengths.sum()),
            slot_tokens=slots,
            doc_lengths=lengths.tolist(),
            imbalance=plan.imbalance,
        )


def _identity(x):
    return x


class THDDataLoader:
    """Endless iterator of StepBatch (steps start_step, start_step + 1, ...) over a StatefulDataLoader."""

    def __init__(self, steps: _Steps, num_workers: int, start_step: int = 0):
        self.steps, self.num_workers = steps, num_workers
        self._build(start_step)

    def _build(self, start_step: int) -> None:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.next_step = start_step
        self._loader = StatefulDataLoader(
            self.steps,
            batch_size=None,
            sampler=range(start_step, sys.maxsize),
            num_workers=self.num_workers,
            collate_fn=_identity,
            prefetch_factor=2 if self.num_workers else None,
        )
        self._iter = None

    def __iter__(self) -> THDDataLoader:
        return self

    def __next__(self) -> StepBatch:
        if self._iter is None:
            self._iter = iter(self._loader)
        batch = next(self._iter)
        assert batch.step == self.next_step, (batch.step, self.next_step)
        self.next_step = batch.step + 1
        return batch

    @property
    def overlong_counts(self) -> dict[str, int]:
        """{"truncated": n, "dropped": m}: samples longer than T handled per data.overlong."""
        return self.steps.overlong_counts

    def data_state(self) -> dict[str, int]:
        """Layout-free resume point: the next step to yield, its epoch and cursor, the seed."""
        s = self.steps
        return sampler.data_state(self.next_step, s.global_batch_size, s.num_samples, s.seed)

    def state_dict(self) -> dict[str, int]:
        """The layout-free `data_state()`: the same on every rank (a checkpoint stores one copy)."""
        return self.data_state()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the step of a `data_state()` (any layout); ValueError if it is another data order."""
        s = self.steps
        self._build(sampler.step_from_state(state, s.global_batch_size, s.num_samples, s.seed))


def build_dataloader(
    data_cfg, store, layout: DataLayout, tokenizer=None, start_step: int = 0
) -> THDDataLoader:
    """The loader of replica `layout.dp_rank`. `store`: a TokenStore (None for `data.source = "packed"`,
    whose rows are read from `data.path`). Overlong samples are truncated or dropped first
    (`data.overlong`; counted in `overlong_counts`). `tokenizer` gives the pad id and vocabulary of
    packs that do not record them (Megatron-Bridge packs); ValueError when a pack was made with
    another tokenizer."""
    steps: _Steps
    if data_cfg.source == "packed":
        rows = open_pack(data_cfg.path, 1 if data_cfg.packed_replan else layout.pad_to_multiple, tokenizer)
        if tokenizer is not None and (rows.vocab_size, rows.pad_id) != (
            tokenizer.vocab_size,
            tokenizer.pad_id,
        ):
            raise ValueError(
                f"data.path = {data_cfg.path!r} was packed with tokenizer {rows.metadata.get('tokenizer')!r} "
                f"(vocab_size {rows.vocab_size}, pad id {rows.pad_id}), but data.tokenizer = {data_cfg.tokenizer!r} "
                f"has vocab_size {tokenizer.vocab_size}, pad id {tokenizer.pad_id}: repack with this tokenizer"
            )
        if data_cfg.packed_replan:
            steps = RepackedSteps(
                rows,
                layout,
                pad_to_multiple=layout.pad_to_multiple,
                overlong=data_cfg.overlong,
                shuffle=data_cfg.shuffle,
            )
        else:
            steps = PackedRowSteps(rows, layout, shuffle=data_cfg.shuffle)
    else:
        steps = PlannedSteps(
            store.view(layout.T, data_cfg.overlong),
            layout,
            pad_to_multiple=layout.pad_to_multiple,
            shuffle=data_cfg.shuffle,
        )
    return THDDataLoader(steps, data_cfg.num_workers, start_step)
