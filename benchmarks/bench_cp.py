"""Context parallelism on CPU: bytes exchanged per layer and step time for CP = 1, 2, 4.

One function per model family fills one report; `MODEL_BENCHES` lists them (`--model` picks).

dsv4 (contiguous CP with halo exchange, docs/dsv4.md §9.2), per layer and
microbatch, summed over the CP group, forward + backward:
  contiguous  halo rows x d (P2P to rank r+1; the gradient comes back) + the all-gather of the
              compressed KV (capacity ceil(T_local / m) rows x D per rank) and, for CSA, of the
              indexer keys (x dI); an all-gather's backward is a reduce-scatter of the same buffer.
  full-KV     the alternative (prime-rl PR #3508): all-gather every rank's per-token K=V (D) and
              compressor projections (kv and gate: 2 x 2D for CSA plus 2 x 2dI for its indexer,
              2 x D for HCA), reduce-scatter in backward.
A collective's bytes are what leaves each rank: an all-gather of B bytes per rank sends B (cp - 1)
per rank, a reduce-scatter of a cp x B buffer B (cp - 1), a P2P send its size. The analytic totals
are cross-checked against the bytes actually handed to gloo in one instrumented forward+backward.

llama (zigzag CP, titan_thd/ops/cp_attention.py), per layer and microbatch, summed over the CP
group, forward + backward; t = T / cp rows per rank, kv = 2 K E elements (K and V of one row):
  all-gather  ours: all-gather of every rank's K/V (t x kv) in forward, reduce-scatter of their
              gradient in backward: 2 cp (cp - 1) t kv.
  ring        P2P ring attention: K/V blocks travel cp - 1 hops in forward and again in backward,
              where their gradient accumulators travel cp hops back to the owner:
              2 cp (cp - 1) t kv + cp^2 t kv.
  all-to-all  head-parallel (Ulysses): q, k, v to head shards and the output back, the same for
              the gradients: 2 (cp - 1) t (2H + 2K) E; needs cp | K (else K/V heads are
              replicated and it moves more).
  hybrid      (docs/data.md §4) documents shorter than T / cp stay whole on one rank; only the
              zigzagged long ones' rows (s_split in all) are all-gathered: 2 (cp - 1) s_split kv.
              Timed like zigzag on the same microbatch ("hybrid_bytes", "hybrid_step" in --json).
The microbatch is padded per document to 2 * max(cp) for every degree, so all degrees do the same
work. `--seed-lengths`: the lognormal lengths of Megatron's mock SFT example, scaled to T.

Step time: forward + backward of the whole model on one microbatch in cp spawned gloo processes
(one thread each; more processes than cores are time-sliced, so CP = 4 on 2 cores is
oversubscribed and its wall time is not a speedup measurement; the CPU-seconds column is).

    .venv/bin/python benchmarks/bench_cp.py --model dsv4 --json /tmp/bench_cp.json
    .venv/bin/python benchmarks/bench_cp.py --model llama --json /tmp/bench_cp_llama.json
    .venv/bin/python benchmarks/bench_cp.py --model llama --cp 1,2 --seed-lengths --json /tmp/bench_cp_hybrid.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import hybrid_layout, partition
from titan_thd.data.mock import mock_lengths
from titan_thd.data.packer import pack_microbatch
from titan_thd.models.dsv4 import DSv4Args, build_dsv4, flavors
from titan_thd.models.llama import LlamaArgs, build_llama
from titan_thd.models.llama import flavors as llama_flavors
from titan_thd.parallel.spawn import spawn


@dataclasses.dataclass
class Document:
    input_ids: np.ndarray
    target_mask: np.ndarray


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dsv4", choices=sorted(MODEL_BENCHES))
    p.add_argument("--flavor", default="", help="model flavor (default: dsv4 tiny, llama debug)")
    p.add_argument("--tokens", type=int, default=2048, help="T: rows of the microbatch before the split")
    p.add_argument("--cp", default="1,2,4", help="CP degrees to time")
    p.add_argument("--mean-doc", type=int, default=400, help="mean document length (lognormal)")
    p.add_argument(
        "--sigma", type=float, default=1.0, help="lognormal sigma (Megatron's mock SFT example: 1.1)"
    )
    p.add_argument(
        "--seed-lengths",
        action="store_true",
        help="llama: the lengths of Megatron's mock SFT example scaled to T (min T/8, max T, mean T/2, sigma 1.1)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    return p.parse_args(argv)


def microbatch(
    T: int,
    vocab: int,
    mean_doc: int,
    seed: int,
    pad_to_multiple: int = 1,
    sigma: float = 1.0,
    min_len: int = 2,
    truncate: bool = True,
):
    """One packed microbatch of seeded lognormal documents (in order until T is full, tail padding).
    truncate=False: a document that does not fit is skipped, not cut (first fit over the stream)."""
    cfg = {
        "mode": "distribution",
        "type": "lognormal",
        "min_seq_len": min_len,
        "max_seq_len": T,
        "mean_seq_len": mean_doc,
        "lognormal_sigma": sigma,
    }
    rng = np.random.default_rng(seed)
    docs, used = [], 0
    for n in mock_lengths(cfg, 1000, seed).tolist():
        if not truncate and -(-n // pad_to_multiple) * pad_to_multiple > T - used:
            continue
        n = min(n, (T - used) // pad_to_multiple * pad_to_multiple)
        if n < 2:
            break
        docs.append(Document(rng.integers(0, vocab, n), np.arange(n) > 0))
        used += -(-n // pad_to_multiple) * pad_to_multiple
    return pack_microbatch(docs, T, pad_to_multiple=pad_to_multiple, pad_id=0)


# ---------------------------------------------------------------------------------------------- dsv4


def dsv4_bytes(args: DSv4Args, T: int, cp: int, elem: int, train_indexer: bool) -> dict[str, dict[str, int]]:
    """Analytic bytes per layer type (and the MTP block) for one microbatch, forward + backward."""
    t = T // cp
    d, D, dI = args.dim, args.head_dim, args.index_head_dim

    def gathered(rows: int, width: int, backward: bool = True) -> int:
        return cp * (cp - 1) * rows * width * elem * (2 if backward else 1)

    out = {}
    for kind in ("sliding", "csa", "hca"):
        row = {"halo": 2 * (cp - 1) * args.halo * d * elem, "compressed_kv": 0, "indexer_keys": 0}
        width = D
        if kind != "sliding":
            cap = -(-t // args.ratios[kind])
            row["compressed_kv"] = gathered(cap, D)
            width += 2 * 2 * D if kind == "csa" else 2 * D
        if kind == "csa":
            row["indexer_keys"] = gathered(-(-t // args.csa_ratio), dI, backward=train_indexer)
            width += 2 * 2 * dI
        row["contiguous"] = row["halo"] + row["compressed_kv"] + row["indexer_keys"]
        row["full_kv"] = gathered(t, width)
        out[kind] = row
    return out


def dsv4_model_bytes(per_kind: dict[str, dict[str, int]], args: DSv4Args) -> dict[str, int]:
    """Sum over the main layers and the MTP block (a sliding-window layer)."""
    kinds = list(args.layer_types) + ["sliding"] * args.mtp_layers
    return {k: sum(per_kind[kind][k] for kind in kinds) for k in ("contiguous", "full_kv")}


def _count_collectives(counts: dict[str, int], phase: list[str]) -> None:
    """Wrap the gloo collectives cp_comm uses so that every call adds its outgoing bytes."""
    all_gather, reduce_scatter, batch_p2p = (
        dist.all_gather_single,
        dist.reduce_scatter_single,
        dist.batch_isend_irecv,
    )

    def world(group) -> int:
        return dist.get_world_size(group)

    def gather_counted(out, inp, group=None, async_op=False):
        counts[phase[0]] += inp.numel() * inp.element_size() * (world(group) - 1)
        return all_gather(out, inp, group=group, async_op=async_op)

    def scatter_counted(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        counts[phase[0]] += inp.numel() * inp.element_size() * (world(group) - 1) // world(group)
        return reduce_scatter(out, inp, op=op, group=group, async_op=async_op)

    def p2p_counted(ops):
        counts[phase[0]] += sum(o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.isend)
        return batch_p2p(ops)

    dist.all_gather_single, dist.reduce_scatter_single = gather_counted, scatter_counted
    dist.batch_isend_irecv = p2p_counted


_BUILDERS: dict[str, Callable] = {"dsv4": build_dsv4, "llama": build_llama}


def _step_worker(rank: int, world: int, model_name: str, args, mode: str, batch, repeats: int) -> dict:
    """One instrumented fwd+bwd (bytes), then `repeats` timed ones (wall and CPU seconds)."""
    threshold = batch.total_tokens // world  # hybrid: the default, T / cp
    group = dist.group.WORLD if world > 1 else None
    cp = CPContext(size=world, rank=rank, group=group, mode=mode, hybrid_threshold=threshold)
    local = partition(batch, world, rank, mode, threshold)
    torch.manual_seed(0)
    model = _BUILDERS[model_name](args).train()
    counts, phase = {"forward": 0, "backward": 0}, ["forward"]
    _count_collectives(counts, phase)

    def step() -> None:
        phase[0] = "forward"
        out = model(local.tokens, BatchMeta.from_batch(local, cp=cp, full=batch))
        loss = cross_entropy_sum(out.logits, local.labels, local.loss_mask) + sum(out.aux_losses.values())
        phase[0] = "backward"
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    bytes_sent = dict(counts)
    wall, cpu = [], []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"bytes": bytes_sent, "wall": wall, "cpu": cpu}


def time_steps(
    model_name: str, args, mode: str, batch, degrees: list[int], repeats: int, analytic: dict[int, int]
) -> dict:
    """Step-time table for each CP degree; the bytes handed to gloo must equal `analytic[cp]`."""
    load = os.getloadavg()[0]
    print(f"\nstep (forward + backward, one microbatch, 1 thread per process; load average {load:.1f})")
    print(
        f"{'cp':>3} {'procs/cores':>11} {'wall ms':>9} {'CPU s/rank':>11} {'model bytes':>12} {'analytic':>12}"
    )
    cores = os.cpu_count() or 1
    report = {}
    for cp in degrees:
        ranks = spawn(_step_worker, cp, model_name, args, mode, batch, repeats, timeout=1800)
        steps = [max(r["wall"][i] for r in ranks) for i in range(repeats)]
        cpu = statistics.median(statistics.median(r["cpu"]) for r in ranks)
        sent = sum(r["bytes"]["forward"] + r["bytes"]["backward"] for r in ranks)
        expected = analytic.get(cp, 0)
        note = " (oversubscribed)" if cp > cores else ""
        print(
            f"{cp:>3} {f'{cp}/{cores}':>11} {statistics.median(steps) * 1e3:>9.0f} {cpu:>11.2f} "
            f"{sent:>12,} {expected:>12,}{note}"
        )
        assert sent == expected, f"instrumented {sent} bytes != analytic {expected} at cp {cp}"
        report[str(cp)] = {
            "wall_ms_median": statistics.median(steps) * 1e3,
            "wall_ms_min": min(steps) * 1e3,
            "cpu_s_per_rank": cpu,
            "bytes_instrumented": sent,
            "bytes_forward": sum(r["bytes"]["forward"] for r in ranks),
            "bytes_backward": sum(r["bytes"]["backward"] for r in ranks),
            "oversubscribed": cp > cores,
            "load_average": load,
        }
    return report


def bench_dsv4(opts: argparse.Namespace) -> dict:
    opts.flavor = opts.flavor or "tiny"
    args = flavors[opts.flavor]
    batch = microbatch(opts.tokens, args.vocab_size, opts.mean_doc, opts.seed)
    elem = torch.zeros((), dtype=torch.float32).element_size()
    degrees = [int(c) for c in opts.cp.split(",")]
    docs = int((batch.seqlens > 0).sum())
    print(
        f"dsv4 {opts.flavor}: T = {opts.tokens} rows ({docs} documents, mean {opts.mean_doc}), float32, "
        f"d = {args.dim}, D = {args.head_dim}, dI = {args.index_head_dim}, halo = {args.halo}, "
        f"m = {args.csa_ratio}, m' = {args.hca_ratio}; layers {','.join(args.layer_types)} + MTP"
    )
    report: dict = {"flavor": opts.flavor, "tokens": opts.tokens, "documents": docs, "bytes": {}}

    print("\nbytes per layer per microbatch (forward + backward, all CP ranks), KiB")
    head = ("cp", "layer", "halo", "comp KV", "idx keys", "contiguous", "full-KV", "full/contig")
    print("{:>3} {:>8} {:>9} {:>9} {:>9} {:>11} {:>11} {:>11}".format(*head))
    for cp in (c for c in degrees if c > 1):
        per_kind = dsv4_bytes(args, opts.tokens, cp, elem, train_indexer=args.indexer_loss_coeff > 0)
        for kind, row in per_kind.items():
            kib = [row[k] / 1024 for k in ("halo", "compressed_kv", "indexer_keys", "contiguous", "full_kv")]
            print(f"{cp:>3} {kind:>8} " + " ".join(f"{v:>9.1f}" for v in kib[:3]), end=" ")
            print(f"{kib[3]:>11.1f} {kib[4]:>11.1f} {row['full_kv'] / row['contiguous']:>10.1f}x")
        report["bytes"][str(cp)] = {"per_layer": per_kind, "model": dsv4_model_bytes(per_kind, args)}

    analytic = {cp: report["bytes"][str(cp)]["model"]["contiguous"] for cp in degrees if cp > 1}
    report["step"] = time_steps("dsv4", args, "contiguous", batch, degrees, opts.repeats, analytic)
    return report


# --------------------------------------------------------------------------------------------- llama


def llama_bytes(args: LlamaArgs, T: int, cp: int, elem: int) -> dict[str, int]:
    """Analytic bytes per layer for one microbatch, forward + backward, summed over the CP group."""
    t, E = T // cp, args.head_dim
    kv = 2 * args.n_kv_heads * E
    return {
        "all_gather": 2 * cp * (cp - 1) * t * kv * elem,
        "ring": (2 * cp * (cp - 1) + cp * cp) * t * kv * elem,
        "all_to_all": 2 * (cp - 1) * t * (2 * args.n_heads + 2 * args.n_kv_heads) * E * elem,
    }


def bench_llama(opts: argparse.Namespace) -> dict:
    opts.flavor = opts.flavor or "debug"
    args = llama_flavors[opts.flavor]
    degrees = [int(c) for c in opts.cp.split(",")]
    pad = 2 * max(degrees)  # zigzag: every document a multiple of 2 cp, the same batch for every cp
    if opts.seed_lengths:  # the PR's {"min_seq_len": 1024, "max_seq_len": 8192, "mean_seq_len": 4096} at 8192
        opts.mean_doc, opts.sigma, min_len = opts.tokens // 2, 1.1, opts.tokens // 8
    else:
        min_len = 2
    truncate = not opts.seed_lengths
    batch = microbatch(
        opts.tokens,
        args.vocab_size,
        opts.mean_doc,
        opts.seed,
        pad_to_multiple=pad,
        sigma=opts.sigma,
        min_len=min_len,
        truncate=truncate,
    )
    elem = torch.zeros((), dtype=torch.float32).element_size()
    docs = int((batch.seqlens > 0).sum())
    print(
        f"llama {opts.flavor}: T = {opts.tokens} rows ({docs} documents, mean {opts.mean_doc}, padded to "
        f"{pad}), float32, d = {args.dim}, H = {args.n_heads}, K = {args.n_kv_heads}, E = {args.head_dim}, "
        f"{args.n_layers} layers"
    )
    report: dict = {"flavor": opts.flavor, "tokens": opts.tokens, "documents": docs, "bytes": {}}

    print("\nbytes per layer per microbatch (forward + backward, all CP ranks), KiB")
    head = ("cp", "all-gather", "ring", "all-to-all", "ring/ag", "a2a/ag", "cp | K")
    print("{:>3} {:>11} {:>11} {:>11} {:>8} {:>8} {:>7}".format(*head))
    for cp in (c for c in degrees if c > 1):
        row = llama_bytes(args, opts.tokens, cp, elem)
        kib = [row[k] / 1024 for k in ("all_gather", "ring", "all_to_all")]
        ratios = [row[k] / row["all_gather"] for k in ("ring", "all_to_all")]
        divides = "yes" if args.n_kv_heads % cp == 0 else "no"
        print(f"{cp:>3} " + " ".join(f"{v:>11.1f}" for v in kib), end=" ")
        print(" ".join(f"{r:>7.2f}x" for r in ratios) + f" {divides:>7}")
        report["bytes"][str(cp)] = {"per_layer": row, "model": {k: v * args.n_layers for k, v in row.items()}}

    analytic = {cp: report["bytes"][str(cp)]["model"]["all_gather"] for cp in degrees if cp > 1}
    report["step"] = time_steps("llama", args, "zigzag", batch, degrees, opts.repeats, analytic)

    # Hybrid CP (docs/data.md §4): documents shorter than T / cp stay whole, only the long ones are
    # all-gathered, so the bytes shrink with the long documents' share of the rows.
    print("\nhybrid CP (documents below T / cp whole on one rank): bytes vs zigzag, per layer per microbatch")
    print(
        f"{'cp':>3} {'split docs':>10} {'split rows':>10} {'hybrid KiB':>11} {'zigzag KiB':>11} {'ratio':>7}"
    )
    hybrid = {}
    real, padded = batch.seqlens.tolist(), batch.seqlens_padded.tolist()
    for cp in (c for c in degrees if c > 1):
        layout = hybrid_layout(real, padded, cp, opts.tokens // cp)
        rows = sum(padded[i] for i in layout.split)
        per_layer = (
            2 * (cp - 1) * rows * 2 * args.n_kv_heads * args.head_dim * elem
        )  # 2 cp (cp-1) (rows/cp) kv
        zz = report["bytes"][str(cp)]["per_layer"]["all_gather"]
        print(
            f"{cp:>3} {len(layout.split):>10} {rows:>10} {per_layer / 1024:>11.1f} {zz / 1024:>11.1f} "
            f"{per_layer / zz:>6.2f}x"
        )
        hybrid[str(cp)] = {"split_documents": len(layout.split), "split_rows": rows, "per_layer": per_layer}
    # One microbatch says little about a length distribution: the mean over 200 seeded microbatches.
    for cp in (c for c in degrees if c > 1):
        shares = []
        for seed in range(200):
            b = microbatch(
                opts.tokens, args.vocab_size, opts.mean_doc, seed, pad, opts.sigma, min_len, truncate
            )
            lens, plens = b.seqlens.tolist(), b.seqlens_padded.tolist()
            shares.append(
                sum(plens[i] for i in hybrid_layout(lens, plens, cp, opts.tokens // cp).split) / opts.tokens
            )
        hybrid[str(cp)]["mean_ratio_200_microbatches"] = float(np.mean(shares))
        print(f"cp {cp}: hybrid / zigzag bytes over 200 microbatches: mean {np.mean(shares):.3f}, "
              f"{np.mean(np.array(shares) == 0):.0%} with no exchange at all")  # fmt: skip
    report["hybrid_bytes"] = hybrid
    analytic = {cp: hybrid[str(cp)]["per_layer"] * args.n_layers for cp in degrees if cp > 1}
    report["hybrid_step"] = time_steps("llama", args, "hybrid", batch, degrees, opts.repeats, analytic)
    return report


MODEL_BENCHES: dict[str, Callable[[argparse.Namespace], dict]] = {"dsv4": bench_dsv4, "llama": bench_llama}


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    report = MODEL_BENCHES[opts.model](opts)
    if opts.json:
        Path(opts.json).write_text(json.dumps({opts.model: report}, indent=2))
        print(f"wrote {opts.json}")


if __name__ == "__main__":
    main()
