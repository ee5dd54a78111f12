"""Generation speed: cached decoding vs recomputing the packed forward at every step, side by side.

    .venv/bin/python benchmarks/bench_generate.py                      # dsv4 tiny and llama debug, 8 prompts
    .venv/bin/python benchmarks/bench_generate.py --models dsv4 --prompts 16 --prompt_len 256 --json gen.json

Each model (randomly initialised at the byte vocabulary; the speed does not depend on the weights) greedily
continues the same prompts (random byte ids) with both decoders of titan_thd/inference/generate.py: the
family's cached decoder (its ModelSpec.decoder, models/<family>/decode.py) and RecomputeDecoder (the
model's own THD forward over every whole sequence, each step). Prefill (the packed forward of the
prompts) and decode (the steps after it) are timed separately; "same tokens" says whether both decoders
chose the same tokens (float32: they compute the same logits up to rounding). The table names the CPU;
--json writes the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from titan_thd.components.hardware import cpu_model_name
from titan_thd.inference.generate import GenerationStats, generate
from titan_thd.models import get_model_spec
from titan_thd.models.dsv4 import build_dsv4
from titan_thd.models.dsv4 import flavors as dsv4_flavors
from titan_thd.models.llama import build_llama
from titan_thd.models.llama import flavors as llama_flavors

VOCAB = 320  # the byte tokenizer's 264 ids rounded up to a multiple of 64, as the trainer does


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "dsv4":
        return build_dsv4(dataclasses.replace(dsv4_flavors["tiny"], vocab_size=VOCAB)).eval()
    return build_llama(dataclasses.replace(llama_flavors["debug"], vocab_size=VOCAB)).eval()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="dsv4,llama", help="comma-separated: dsv4 (tiny), llama (debug)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (opts.prompt_len,), generator=g).tolist() for _ in range(opts.prompts)]
    rows = []
    for name in opts.models.split(","):
        model = build(name)
        tokens = {}
        for decoder in ("cache", "recompute"):
            stats = GenerationStats()
            t0 = time.perf_counter()
            out = generate(
                model,
                prompts,
                spec=get_model_spec(name),
                max_new_tokens=opts.new_tokens,
                stop_ids=set(),
                decoder=decoder,
                stats=stats,
            )
            total = time.perf_counter() - t0
            tokens[decoder] = [c.tokens for c in out]
            rows.append(
                {
                    "model": name,
                    "decoder": decoder,
                    "prefill_tokens_per_s": stats.prompt_tokens / stats.prefill_s,
                    "decode_tokens_per_s": stats.decode_tokens_per_s,
                    "new_tokens_per_s": stats.new_tokens / total,
                    "seconds": total,
                }
            )
        rows[-2]["same_tokens"] = rows[-1]["same_tokens"] = tokens["cache"] == tokens["recompute"]
        rows[-2]["speedup"] = rows[-2]["new_tokens_per_s"] / rows[-1]["new_tokens_per_s"]
        rows[-1]["speedup"] = 1.0
    print(
        f"{opts.prompts} prompts x {opts.prompt_len} tokens, {opts.new_tokens} new tokens each, greedy; "
        f"{cpu_model_name()}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'model':<7}{'decoder':<11}{'prefill tok/s':>14}{'decode tok/s':>14}{'new tok/s':>11}{'s':>8}{'speedup':>9}  same tokens"
    )
    for r in rows:
        print(
            f"{r['model']:<7}{r['decoder']:<11}{r['prefill_tokens_per_s']:>14.0f}{r['decode_tokens_per_s']:>14.1f}"
            f"{r['new_tokens_per_s']:>11.1f}{r['seconds']:>8.1f}{r['speedup']:>8.1f}x  {r['same_tokens']}"
        )
    if opts.json:
        setup = {k: getattr(opts, k) for k in ("prompts", "prompt_len", "new_tokens")}
        opts.json.write_text(
            json.dumps(
                {"cpu": cpu_model_name(), "threads": torch.get_num_threads(), **setup, "rows": rows}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
