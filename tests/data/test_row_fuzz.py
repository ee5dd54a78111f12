"""Fuzz of the data path: every microbatch the loaders emit is legal for the layout that start-up accepted.

For every model x CP mode x CP degree 1-8 x TP 1-2 x PP 1-3 (dsv4 also EP 2) that `resolve_run` accepts,
at the smallest T it accepts and a larger one, steps are drawn from adversarial length distributions
(every document 1-3 tokens, documents of exactly T, longer than T truncated or dropped, zero-length
documents, fewer documents than replicas x microbatches, offline packs of nearly empty rows, planned row
by row or again) through the production builders (`Run.layout`, `build_dataloader`, the validation and pack steps), and each emitted
microbatch is checked against the rules of the consumers themselves, not against `RowRule`: the CP split
of every rank (`partition`), the dsv4 attention's index plan of every rank (`build_plan`, which refuses
what the model cannot compute, e.g. a shard below its CP halo), equal sequence-parallel shares on every
tp rank, the pipeline boundary's fixed shape. No model runs: seconds for thousands of steps.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from titan_thd.config import Config
from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import partition
from titan_thd.data.dataloader import OrderedSteps, PackedRowSteps, RepackedSteps, build_dataloader
from titan_thd.data.packed_dataset import PackedRows
from titan_thd.data.token_store import MockTokenStore
from titan_thd.models.dsv4.plans import build_plan
from titan_thd.startup import resolve_run

DP = 2
MODELS = {"llama": ("debug",), "dsv4": ("micro", "flash")}
MODES = {"llama": ("zigzag", "hybrid"), "dsv4": ("contiguous",)}


def config(model, flavor, mode, cp, tp, pp, ep, T, trim=True):
    cfg = Config()
    cfg.model.name, cfg.model.flavor = model, flavor
    cfg.parallelism.context_parallel_degree, cfg.parallelism.context_parallel_mode = cp, mode
    cfg.parallelism.tensor_parallel_degree, cfg.parallelism.pipeline_parallel_degree = tp, pp
    cfg.parallelism.expert_parallel_degree, cfg.parallelism.data_parallel_shard_degree = ep, DP
    cfg.training.tokens_per_microbatch, cfg.data.trim_padding = T, trim
    cfg.job.dump_folder = "/tmp/titan_thd_fuzz_unused"
    return cfg


def accepted(cfg):
    """The Run when start-up accepts cfg, else None."""
    try:
        return resolve_run(
            cfg,
            DP
            * cfg.parallelism.context_parallel_degree
            * cfg.parallelism.tensor_parallel_degree
            * cfg.parallelism.pipeline_parallel_degree,
        )
    except ValueError:
        return None


def layouts(model):
    """Every accepted (config, Run) of `model`: at the smallest accepted T, trimmed, and
    without pipeline parallelism also at 4x it and untrimmed (under PP every microbatch has T rows)."""
    for flavor, mode, cp, tp, pp in itertools.product(
        MODELS[model], MODES[model], range(1, 9), (1, 2), (1, 2, 3)
    ):
        if mode == "hybrid" and cp == 1:
            continue
        # Expert parallelism puts no rule on rows (all-to-all chunks may be empty): sampled, not crossed.
        for ep in (1, 2) if model == "dsv4" and tp == pp == 1 else (1,):
            big = 8192 - 8192 % int(np.lcm(2 * cp, cp * tp))
            cfg = config(model, flavor, mode, cp, tp, pp, ep, big)
            found = accepted(cfg)
            if found is None:  # e.g. tp does not divide the model's heads
                continue
            # The smallest T of this layout: a microbatch of the fewest rows the loader may emit.
            smallest = found.rule.minimum
            variants = (
                ((smallest, True), (2 * smallest, True), (smallest, False))
                if pp == 1
                else ((smallest, True),)
            )
            for T, trim in variants:
                cfg = config(model, flavor, mode, cp, tp, pp, ep, T, trim)
                found = accepted(cfg)
                assert found is not None, f"accepted at T = {big} but not at {T}: {cfg.parallelism}"
                yield cfg, found


def distributions(T, rng):
    """(name, lengths of the data set, data.overlong, training.global_batch_size)."""
    crumbs = rng.integers(1, 4, 200)
    yield "1-3 tokens", crumbs, "truncate", 24
    yield "exactly T", np.full(8, T), "truncate", 3
    yield "T among crumbs", rng.permutation(np.concatenate([[T, T], crumbs[:30]])), "truncate", 8
    yield "longer than T, truncated", rng.integers(T + 1, 3 * T + 2, 12), "truncate", 3
    yield (
        "longer than T, dropped",
        rng.permutation(np.concatenate([rng.integers(T + 1, 2 * T + 2, 8), crumbs[:8]])),
        "drop",
        5,
    )
    yield (
        "zero-length",
        rng.permutation(np.concatenate([np.zeros(20, np.int64), rng.integers(1, 9, 20)])),
        "truncate",
        12,
    )
    yield "fewer documents than replicas", rng.integers(1, T + 1, 40), "truncate", 1
    yield (
        "lognormal up to T",
        np.clip(rng.lognormal(np.log(max(2, T // 6)), 1.2, 60), 1, T).astype(int),
        "truncate",
        10,
    )


class Checker:
    """The consumers' own rules for one layout; counts what it saw."""

    def __init__(self, cfg, run):
        p, spec, args = cfg.parallelism, run.spec, run.model_args
        self.cfg, self.spec, self.args, self.model = cfg, spec, args, cfg.model.name
        self.T, self.cp, self.tp, self.pp = (
            cfg.training.tokens_per_microbatch,
            p.context_parallel_degree,
            p.tensor_parallel_degree,
            p.pipeline_parallel_degree,
        )
        self.mode, self.threshold, self.pad = run.cp_mode, run.hybrid_threshold, run.pad_to_multiple
        self.min_local = spec.parallel.min_tokens_per_cp_rank(args)
        self.fixed = self.pp > 1 or not cfg.data.trim_padding
        self.seen, self.rng = Counter(), np.random.default_rng(self.cp * 100 + self.tp * 10 + self.pp)
        self.planned: set = set()

    def step(self, batch, dp_size=DP):
        self.seen["steps"] += 1
        assert len(batch.microbatches) == batch.num_microbatches
        for mb in batch.microbatches:
            self.microbatch(mb)

    def microbatch(self, mb):
        self.seen["microbatches"] += 1
        rows = mb.total_tokens
        mb.validate(self.pad)
        assert 1 <= rows <= self.T
        if self.fixed:  # pipeline P2P buffers / trim_padding = false: static shapes
            assert rows == self.T, (rows, self.T)
        self.seen["trimmed"] += rows < self.T
        # The first and last CP ranks (rank 0 has no left halo, the last holds the tail padding) and one more.
        for r in sorted({0, self.cp - 1, int(self.rng.integers(self.cp))}):
            local = partition(mb, self.cp, r, self.mode, self.threshold)  # zigzag / hybrid chunking
            n = int(local.tokens.numel())
            assert n * self.cp == rows, (n, self.cp, rows)  # every rank the same share
            assert n % self.tp == 0 and n >= self.tp, (n, self.tp)  # sequence-parallel TP: equal shares
            if self.cp > 1:
                assert n >= self.min_local, (n, self.min_local)
            if self.pp > 1:
                shape = self.spec.pipeline.boundary_shape  # the P2P buffers' fixed shape
                assert shape(self.args, n) == shape(self.args, self.T // self.cp)
                assert n == self.T // self.cp
            # The dsv4 attention's own checks of this rank's rows (halo, contiguity, entries), once per geometry.
            key = (r, tuple(mb.cu_seqlens.tolist()), tuple(mb.cu_seqlens_padded.tolist()))
            if self.model == "dsv4" and key not in self.planned:
                self.planned.add(key)
                cp = CPContext(size=self.cp, rank=r, group=_NO_GROUP, mode=self.mode)
                build_plan(BatchMeta.from_batch(local, cp=cp, full=mb), self.args, torch.float32)


def packed_rows(T, pad, lengths, rng):
    """An in-memory offline pack: one document per row (nearly empty rows)."""
    meta = {
        "tokens_per_microbatch": T,
        "pad_to_multiple": pad,
        "pad_id": 0,
        "vocab_size": 256,
        "num_truncated": 0,
        "num_dropped": 0,
    }
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = rng.integers(3, 250, int(lengths.sum())).astype(np.int32)
    mask = np.ones(ids.size, bool)
    tok_off = np.concatenate([[0], np.cumsum(lengths)])
    mask[tok_off[:-1][lengths > 0]] = False
    doc_off = np.arange(lengths.size + 1)
    return PackedRows(None, meta, ids, mask, tok_off, lengths, doc_off)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_emitted_microbatch_is_legal_for_every_accepted_layout(model):
    rng = np.random.default_rng(0)
    totals, layouts_seen = Counter(), Counter()
    for cfg, run in layouts(model):
        layouts_seen[cfg.model.name] += 1
        T, check, pad = cfg.training.tokens_per_microbatch, Checker(cfg, run), run.pad_to_multiple
        # Every layout draws the crumbs (the shortest microbatches) and the packs, and 3 of the other 7
        # distributions in turn: each of them still meets every CP degree, TP and PP degree.
        dists = list(distributions(T, rng))
        picked = [dists[0]] + [dists[1 + (len(layouts_seen) * 3 + k) % 7] for k in range(3)]
        for name, lengths, overlong, G in picked:
            this = dataclasses.replace(
                cfg,
                data=dataclasses.replace(cfg.data, overlong=overlong),
                training=dataclasses.replace(cfg.training, global_batch_size=G),
            )
            store = MockTokenStore(lengths, _TOK, seed=1)
            layouts_of = [dataclasses.replace(run, cfg=this).layout(r) for r in range(DP)]
            try:
                loaders = [build_dataloader(this.data, store, lay, _TOK) for lay in layouts_of]
            except ValueError:  # refused before the first step (e.g. nothing to train within T)
                totals["refused at start-up"] += 1
                continue
            for loader in loaders:
                check.step(loader.steps[int(rng.integers(100))])
            validation = store.view(T, overlong)
            check.step(OrderedSteps(validation, layouts_of[0], pad_to_multiple=pad)[0])
        # Offline packs whose rows are nearly empty, row by row and planned again.
        rows = packed_rows(T, pad, rng.integers(1, min(3, T) + 1, 24), rng)
        packs = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, global_batch_size=2 * DP))
        for dp_rank in range(DP):
            lay = dataclasses.replace(run, cfg=packs).layout(dp_rank)
            check.step(PackedRowSteps(rows, lay, shuffle=True)[0])
            again = RepackedSteps(rows, lay, pad_to_multiple=pad, overlong="truncate", shuffle=True)
            check.step(again[1])
        totals += check.seen
    print(f"fuzz {model}: {sum(layouts_seen.values())} layouts, {dict(totals)}")
    # Every layout family was reached (CP 1-8 x TP 1-2 x PP 1-3 of each mode) and trimming exercised.
    assert sum(layouts_seen.values()) >= 80, layouts_seen
    assert totals["steps"] >= 1500 and totals["trimmed"] >= 300, totals


class _Tok:
    vocab_size, pad_id, special_ids = 256, 0, (0, 1, 2)


_TOK = _Tok()
_NO_GROUP = object()  # build_plan records the CP group, it runs no collective
