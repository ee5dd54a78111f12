"""Tensor parallelism on CPU (dsv4): bytes exchanged per layer and step time for TP = 1, 2, 4.

Per block (the MTP block included) and microbatch, summed over the tp group, forward + backward
(docs/design.md §5.1): the attention and the MoE are each a partial-sum region, entered by an
all-gather of the sequence-parallel rows (backward: a reduce-scatter) and left by a reduce-scatter
of the partial output (backward: an all-gather). With t = T / tp rows per rank and d the width,
each of the four sends t d (tp - 1) elements per rank, so a region moves 4 (tp - 1) T d elements
and a block 8 (tp - 1) T d over the group. A CSA layer in training adds the no-grad all-reduce of
the indexer-KL teacher mass, [T, K] in float32 (K = index_topk), 2 (tp - 1) T K over the group
(a ring all-reduce sends 2 (tp - 1) / tp of the buffer per rank). Not counted: the vocabulary-
parallel embedding and head (torch's DTensor collectives), and the once-per-step all-reduce of the
replicated parameters' partial gradients.

The analytic totals are checked against the bytes handed to gloo in one instrumented forward +
backward. Step time: forward + backward of the whole model on one microbatch in tp spawned gloo
processes (one thread each; more processes than cores are time-sliced, so TP = 4 on 2 cores is
oversubscribed and its wall time is not a speedup measurement; the CPU-seconds column is).

    .venv/bin/python benchmarks/bench_tp.py --json /tmp/bench_tp.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import ActivationCheckpoint
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packed_batch import IGNORE_INDEX, PackedBatch
from titan_thd.models.dsv4 import DSv4Args, build_dsv4, flavors
from titan_thd.models.dsv4.parallelize import parallelize_dsv4, tp_divides
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.spawn import spawn
from titan_thd.parallel.tensor_parallel import reduce_replicated_grads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="tiny", help="dsv4 flavor (default tiny, the CPU recipe's)")
    p.add_argument(
        "--o_groups", type=int, default=0, help="override the flavor's output groups (tp must divide them)"
    )
    p.add_argument("--tokens", type=int, default=512, help="rows of the microbatch")
    p.add_argument("--degrees", default="1,2,4", help="tp degrees")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per degree")
    p.add_argument("--json", default="", help="write the report here")
    return p.parse_args(argv)


def microbatch(T: int, vocab: int, seed: int = 0) -> PackedBatch:
    """Documents of 3T/8, T/4, T/4 rows and T/8 tail padding, seeded random tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = [3 * T // 8, T // 4, T // 4]
    lens.append(T - sum(lens))
    tokens = torch.randint(0, vocab, (T,), generator=g)
    labels, start = torch.full((T,), IGNORE_INDEX), 0
    reals = lens[:-1] + [0]
    for L, P in zip(reals, lens):
        labels[start : start + L - 1] = tokens[start + 1 : start + L]
        start += P
    cu = torch.tensor([0, *reals], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_pad = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    pos = torch.cat([torch.arange(P) for P in lens])
    return PackedBatch(
        tokens, labels, labels != IGNORE_INDEX, pos, cu, cu_pad, max(lens), len(lens)
    ).validate()


def analytic_bytes(args: DSv4Args, T: int, tp: int, elem: int) -> dict[str, int]:
    """Bytes per block kind for one microbatch, forward + backward, summed over the tp group."""
    block = 8 * (tp - 1) * T * args.dim * elem
    return {"block": block, "csa_kl": 2 * (tp - 1) * T * args.index_topk * 4}


def model_bytes(args: DSv4Args, per: dict[str, int], train_indexer: bool) -> int:
    blocks = len(args.layer_types) + args.mtp_layers
    n_csa = sum(t == "csa" for t in args.layer_types)
    return blocks * per["block"] + (n_csa * per["csa_kl"] if train_indexer else 0)


def _count(counts: dict[str, int]) -> None:
    """Wrap the gloo collectives of the TP regions so that every call adds its outgoing bytes."""
    gather, scatter, reduce = dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce

    def n(group) -> int:
        return dist.get_world_size(group)

    def gather_counted(out, inp, group=None, async_op=False):
        counts["sent"] += inp.numel() * inp.element_size() * (n(group) - 1)
        return gather(out, inp, group=group, async_op=async_op)

    def scatter_counted(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        counts["sent"] += inp.numel() * inp.element_size() * (n(group) - 1) // n(group)
        return scatter(out, inp, op=op, group=group, async_op=async_op)

    def reduce_counted(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        counts["sent"] += 2 * t.numel() * t.element_size() * (n(group) - 1) // n(group)
        return reduce(t, op=op, group=group, async_op=async_op)

    dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce = (
        gather_counted,
        scatter_counted,
        reduce_counted,
    )


def _worker(rank: int, world: int, args: DSv4Args, batch: PackedBatch, repeats: int) -> dict:
    dims = ParallelDims(pp=1, dp_shard=1, cp=1, tp=world, world_size=world)
    dims.build_meshes("cpu")
    torch.manual_seed(0)
    model = parallelize_dsv4(
        build_dsv4(args).train(),
        dims,
        ac=ActivationCheckpoint(),
    )
    meta_batch = batch
    counts = {"sent": 0}

    def step() -> None:
        with loss_parallel():
            out = model(meta_batch.tokens, BatchMeta.from_batch(meta_batch))
            loss = cross_entropy_sum(out.logits, batch.labels, batch.loss_mask) + sum(out.aux_losses.values())
            loss.backward()
        model.zero_grad(set_to_none=True)

    _count(counts)
    step()
    sent = counts["sent"]
    wall, cpu = [], []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    reduce_replicated_grads(model)  # exercised once (not timed)
    return {"sent": sent, "wall": wall, "cpu": cpu}


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    args = flavors[opts.flavor]
    args = dataclasses.replace(args, o_groups=opts.o_groups or args.o_groups)
    batch = microbatch(opts.tokens, args.vocab_size)
    degrees = [int(x) for x in opts.degrees.split(",")]
    elem = 4
    report: dict = {"flavor": opts.flavor, "tokens": opts.tokens, "degrees": {}}
    print(
        f"dsv4 {opts.flavor}, T = {opts.tokens}, float32; bytes per microbatch forward + backward, all tp ranks"
    )
    print(
        f"{'tp':>3} {'KiB/block':>10} {'KiB/CSA KL':>11} {'model KiB':>10} {'measured':>10} {'wall ms':>8} {'CPU s/rank':>10}"
    )
    for tp in degrees:
        bad = {k: v for k, v in tp_divides(args).items() if v % tp}
        if bad or opts.tokens % tp:
            print(f"{tp:>3} skipped: tp does not divide {bad or {'tokens': opts.tokens}}")
            continue
        per = analytic_bytes(args, opts.tokens, tp, elem)
        expected = model_bytes(args, per, args.indexer_loss_coeff > 0)
        ranks = spawn(_worker, tp, args, batch, opts.repeats) if tp > 1 else [_one(args, batch, opts.repeats)]
        sent = sum(r["sent"] for r in ranks)
        assert sent == expected, f"instrumented {sent} bytes != analytic {expected} at tp {tp}"
        wall = statistics.median(max(r["wall"][i] for r in ranks) for i in range(opts.repeats))
        cpu = statistics.mean(sum(r["cpu"]) / len(r["cpu"]) for r in ranks)
        print(
            f"{tp:>3} {per['block'] / 1024:>10.1f} {per['csa_kl'] / 1024:>11.1f} {expected / 1024:>10.1f} "
            f"{sent / 1024:>10.1f} {1000 * wall:>8.1f} {cpu:>10.3f}"
        )
        report["degrees"][str(tp)] = {
            "bytes_per_block": per["block"],
            "bytes_per_csa_kl": per["csa_kl"],
            "bytes_model_analytic": expected,
            "bytes_model_instrumented": sent,
            "wall_s": wall,
            "cpu_s_per_rank": cpu,
            "processes": tp,
            "cores": os.cpu_count(),
        }
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {opts.json}")


def _one(args: DSv4Args, batch: PackedBatch, repeats: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_dsv4(args).train()
    wall, cpu = [], []
    for _ in range(repeats + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        out = model(batch.tokens, BatchMeta.from_batch(batch))
        (
            cross_entropy_sum(out.logits, batch.labels, batch.loss_mask) + sum(out.aux_losses.values())
        ).backward()
        model.zero_grad(set_to_none=True)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"sent": 0, "wall": wall[1:], "cpu": cpu[1:]}


if __name__ == "__main__":
    main()
