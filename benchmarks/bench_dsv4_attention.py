"""Forward+backward time per token of one dsv4 attention layer of each type at growing T.

    .venv/bin/python benchmarks/bench_dsv4_attention.py [--flavor tiny] [--doc-len 2048 | --lognormal]
        [--tokens 2048,4096,8192,16384] [--repeats 5] [--threads N] [--model] [--json out.json]

One attention layer (sliding / csa / hca) of the flavor on a packed microbatch of T tokens made of
documents of `--doc-len` tokens (default 2048, the last one shorter if T is not a multiple), or of
lognormal lengths (median 1024, sigma 1, clipped to 64..T) with `--lognormal`. CSA runs as in
training: indexer selection plus its sparse KL loss. The per-microbatch index plan is built once
beforehand (all layers share it) and is not timed. Every (T, layer type) pair is warmed up once,
then timed once per round for `--repeats` rounds that interleave all pairs, and the fastest round
counts: on a shared machine other processes only ever add time, and interleaving spreads a slow
spell over all pairs instead of whichever T happened to run during it. Project bar: sliding and CSA cost per token flat within +-20% from 2k to 16k tokens.
`--model` also times the whole model (all layers, MTP and the indexer loss, train mode, byte-
tokenizer vocabulary 320) at the first T: parameters and forward+backward tokens/s.
Output: a table, and with --json {"per_token_us": {"sliding": {"2048": us, ...}, "csa": ..., "hca": ...},
"config": {...}} (plus "model": {"params": n, "tokens": T, "tokens_per_s": x} with --model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.models.dsv4 import build_dsv4, flavors
from titan_thd.models.dsv4.attention import Attention
from titan_thd.models.dsv4.plans import get_plan

KINDS = ("sliding", "csa", "hca")


def doc_lengths(T: int, doc_len: int, lognormal: bool, gen: torch.Generator) -> list[int]:
    lengths = []
    while sum(lengths) < T:
        if lognormal:
            n = int(
                torch.empty(1).log_normal_(
                    mean=float(torch.log(torch.tensor(1024.0))), std=1.0, generator=gen
                )
            )
            n = max(64, n)
        else:
            n = doc_len
        lengths.append(min(n, T - sum(lengths)))
    return lengths


def make_meta(lengths: list[int]) -> BatchMeta:
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    T = int(cu[-1])
    batch = PackedBatch(torch.zeros(T, dtype=torch.long), None, None, pos, cu, cu, max(lengths), len(lengths))
    return BatchMeta.from_batch(batch.validate())


def time_layer(attn: Attention, x: torch.Tensor, plan) -> float:
    """Seconds of one forward+backward of `attn` on `x`, with its indexer loss when it has one."""
    x.grad = None
    attn.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out, kl = attn(x, plan, with_kl=True)
    loss = out.square().mean() + (kl if kl is not None else 0.0)
    loss.backward()
    return time.perf_counter() - t0


def time_model(args, lengths: list[int], repeats: int) -> tuple[int, float]:
    """(parameters, forward+backward tokens/s) of the whole model in train mode."""
    model = build_dsv4(dataclasses.replace(args, vocab_size=320)).train()
    meta = make_meta(lengths)
    T = meta.total_tokens
    tokens = torch.randint(0, 320, (T,))
    meta.labels_full = torch.roll(tokens, -1)
    meta.loss_mask_full = torch.ones(T, dtype=torch.bool)
    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = model(tokens, meta)
        (
            torch.nn.functional.cross_entropy(out.logits, meta.labels_full, reduction="sum")
            + sum(out.aux_losses.values())
        ).backward()
        if i:
            times.append(time.perf_counter() - t0)
    return sum(p.numel() for p in model.parameters()), T / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny", choices=sorted(flavors))
    p.add_argument("--tokens", default="2048,4096,8192,16384")
    p.add_argument("--doc-len", type=int, default=2048)
    p.add_argument("--lognormal", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--model", action="store_true", help="also time the whole model at the first T")
    p.add_argument("--json", default="")
    opts = p.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    args = flavors[opts.flavor]
    Ts = list(dict.fromkeys(int(t) for t in opts.tokens.split(",")))
    gen = torch.Generator().manual_seed(0)
    result: dict[str, dict[str, float]] = {k: {} for k in KINDS}
    docs = "lognormal(median 1024, sigma 1)" if opts.lognormal else f"{opts.doc_len}-token"
    print(f"dsv4 {opts.flavor} attention layer, fwd+bwd, {docs} documents, {torch.get_num_threads()} threads")
    cases = {}
    for T in Ts:
        meta = make_meta(doc_lengths(T, opts.doc_len, opts.lognormal, gen))
        plan = get_plan(meta, args, torch.float32)
        for kind in KINDS:
            torch.manual_seed(0)
            cases[T, kind] = (
                Attention(args, kind).train(),
                torch.randn(T, args.dim, requires_grad=True),
                plan,
            )
            time_layer(*cases[T, kind])  # warm-up: allocator, caches
    best = {case: float("inf") for case in cases}
    for _ in range(opts.repeats):
        for case, (attn, x, plan) in cases.items():
            best[case] = min(best[case], time_layer(attn, x, plan))
    for (T, kind), seconds in best.items():
        result[kind][str(T)] = seconds / T * 1e6
    print(f"{'T':>7} | " + " | ".join(f"{k:>12}" for k in KINDS) + "   (us per token)")
    for T in Ts:
        print(f"{T:>7} | " + " | ".join(f"{result[k][str(T)]:>12.1f}" for k in KINDS))
    base = str(Ts[0])
    spread = {
        k: (max(result[k].values()) / result[k][base], min(result[k].values()) / result[k][base])
        for k in KINDS
    }
    print(
        f"ratio to T={base}: "
        + ", ".join(f"{k} {hi:.2f}x max / {lo:.2f}x min" for k, (hi, lo) in spread.items())
    )
    report = {"per_token_us": result}
    if opts.model:
        params, tps = time_model(args, doc_lengths(Ts[0], opts.doc_len, opts.lognormal, gen), opts.repeats)
        print(f"whole {opts.flavor} model (vocab 320): {params:,} parameters, {tps:.0f} tokens/s fwd+bwd")
        report["model"] = {"params": params, "tokens": Ts[0], "tokens_per_s": tps}
    if opts.json:
        report["config"] = {
            "flavor": opts.flavor,
            "documents": docs,
            "threads": torch.get_num_threads(),
            "repeats": opts.repeats,
        }
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
