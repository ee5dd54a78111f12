"""THD packing vs per-batch padding: real tokens/s of one dense llama training step on CPU.

Both variants run the same model (same weights) on the same documents, microbatch by microbatch:
- thd:    the documents of a microbatch concatenated into one stream (no tail padding: the
          trainer's data.trim_padding),
          attention = titan_thd.ops.varlen_attention (a per-document causal SDPA loop);
- padded: the same documents as a [B, S_max] batch padded to the longest one, attention = one
          `scaled_dot_product_attention(is_causal=True)` on [B, H, S_max, D] (padding sits at the
          causal tail, so no key mask is needed), padded labels ignored by the loss. This is the
          usual padded training step, with the fastest CPU attention kernel.
A step is forward + backward of the summed cross-entropy (no optimizer). Each variant runs in its
own process so that its peak resident memory (ru_maxrss) is its own. On a shared machine the
load drifts: `--rounds` alternates the two processes and keeps each variant's fastest round, and
the CPU-time column (process time, immune to time slicing at --threads 1) is printed beside the
wall clock.

    .venv/bin/python benchmarks/bench_thd_vs_padded.py --json /tmp/thd_vs_padded.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.mock import mock_lengths
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.data.packer import pack_microbatch, packer_throughput
from titan_thd.data.rows import RowRule
from titan_thd.models.llama import build_llama, flavors

VARIANTS = ("thd", "padded")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="bench", choices=sorted(flavors))
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4096, help="T: tokens per THD microbatch")
    p.add_argument("--mean-len", type=int, default=512)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=1, help="microbatches run before timing")
    p.add_argument("--steps", type=int, default=4, help="timed microbatches")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each variant; the best counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the headline figures to this file")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process mode
    args = p.parse_args(argv)
    if args.max_len > args.tokens:
        p.error(f"--max-len {args.max_len} must not exceed --tokens {args.tokens} (a document must fit T)")
    return args


# ============================================================================ data
@dataclasses.dataclass
class Document:
    input_ids: np.ndarray
    target_mask: np.ndarray


def microbatch_documents(args: argparse.Namespace) -> list[list[Document]]:
    """warmup + steps microbatches of seeded lognormal documents, filled in order up to T tokens."""
    cfg = {
        "mode": "distribution",
        "type": "lognormal",
        "min_seq_len": args.min_len,
        "max_seq_len": args.max_len,
        "mean_seq_len": args.mean_len,
        "lognormal_sigma": args.sigma,
    }
    lengths = iter(mock_lengths(cfg, 100_000, args.seed).tolist())
    rng = np.random.default_rng(args.seed)
    batches: list[list[Document]] = [[]]
    while len(batches) <= args.warmup + args.steps:
        n = next(lengths)
        if sum(len(d.input_ids) for d in batches[-1]) + n > args.tokens:
            batches.append([])
        batches[-1].append(Document(rng.integers(0, args.vocab_size, n), np.arange(n) > 0))
    return batches[:-1]


def microbatch(docs: list[Document], variant: str, T: int) -> tuple[PackedBatch, BatchMeta]:
    """thd: the documents in one [T] stream. padded: every document padded to the longest, which is
    the [B, S_max] batch flattened token-major (rows of one document are contiguous either way)."""
    if variant == "thd":
        batch = pack_microbatch(docs, T, pad_to_multiple=1, pad_id=0, rule=RowRule(T, 1, 1, False))  # trimmed
    else:
        s_max = max(len(d.input_ids) for d in docs)
        batch = pack_microbatch(docs, s_max * len(docs), pad_to_multiple=s_max, pad_id=0)
    return batch, BatchMeta.from_batch(batch)


class PaddedCausalAttention(nn.Module):
    """Attention of a padded [B, S] batch whose rows arrive flattened token-major ([B*S, H, D])."""

    def forward(self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, meta: BatchMeta):
        S = meta.max_seqlen  # every document of the batch is padded to S rows
        q, k, v = (x.unflatten(0, (-1, S)).transpose(1, 2) for x in (q_THD, k_TKD, v_TKD))
        o_BHSD = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return o_BHSD.transpose(1, 2).flatten(0, 1)


# ============================================================================ one variant (child)
def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_variant(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_llama(dataclasses.replace(flavors[args.flavor], vocab_size=args.vocab_size))
    inputs = [microbatch(docs, args.variant, args.tokens) for docs in microbatch_documents(args)]
    if args.variant == "padded":
        for block in model.layers.values():
            block.attention.inner_attention = PaddedCausalAttention()
    setup_mb = rss_mb()
    elapsed, cpu, real_tokens, slots, losses = 0.0, 0.0, 0, 0, []
    for i, (batch, meta) in enumerate(inputs):
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model(batch.tokens, meta).logits
        loss = cross_entropy_sum(logits, batch.labels, batch.loss_mask)
        loss.backward()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        model.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if i >= args.warmup:
            elapsed += dt
            cpu += dc
            real_tokens += batch.num_real_tokens
            slots += batch.total_tokens
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "variant": args.variant,
        "tokens_per_s": real_tokens / elapsed,
        "seconds_per_step": elapsed / args.steps,
        "cpu_seconds_per_step": cpu / args.steps,
        "real_tokens": real_tokens,
        "slots": slots,
        "peak_mb": peak_mb,
        "peak_over_setup_mb": peak_mb - setup_mb,
        "losses": losses,
    }


# ============================================================================ main
def main() -> None:
    args = parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode:
                sys.exit(f"{variant} run failed:\n{proc.stderr}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if variant not in best or r["tokens_per_s"] > best[variant]["tokens_per_s"]:
                best[variant] = r
    thd, pad = best["thd"], best["padded"]
    # Same weights, same documents: the two layouts must compute the same loss.
    for a, b in zip(thd["losses"], pad["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b), (thd["losses"], pad["losses"])
    packer = packer_throughput(T=args.tokens)  # numpy: one core
    speedup = thd["tokens_per_s"] / pad["tokens_per_s"]

    print(
        f"llama/{args.flavor} fp32, {args.threads} threads, T={args.tokens}, lognormal lengths "
        f"mean {args.mean_len} sigma {args.sigma} clipped to [{args.min_len}, {args.max_len}], "
        f"{args.steps} timed microbatches ({thd['real_tokens']} real tokens) after {args.warmup} warm-up, "
        f"best of {args.rounds} rounds; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    header = ("variant", "real tok/s", "s/step", "cpu s/step", "slots", "padding", "peak MB", "Δ MB")
    print(f"{header[0]:<8}" + "".join(f"{h:>11}" for h in header[1:]))
    for r in (thd, pad):
        print(
            f"{r['variant']:<8}{r['tokens_per_s']:>11.0f}{r['seconds_per_step']:>11.2f}"
            f"{r['cpu_seconds_per_step']:>11.2f}{r['slots']:>11}{1 - r['real_tokens'] / r['slots']:>11.1%}"
            f"{r['peak_mb']:>11.0f}{r['peak_over_setup_mb']:>11.0f}"
        )
    cpu_speedup = pad["cpu_seconds_per_step"] / thd["cpu_seconds_per_step"]
    print(f"speedup (thd / padded real tokens/s): {speedup:.2f}x wall clock, {cpu_speedup:.2f}x CPU time")
    print(f"packer (pack_microbatch, 1 core): {packer:,.0f} tokens/s")
    if args.json:
        figures = {
            "speedup": speedup,
            "thd_tokens_per_s": thd["tokens_per_s"],
            "padded_tokens_per_s": pad["tokens_per_s"],
            "thd_peak_mb": thd["peak_mb"],
            "padded_peak_mb": pad["peak_mb"],
            "packer_tokens_per_s": packer,
            "speedup_cpu_time": cpu_speedup,
        }
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
