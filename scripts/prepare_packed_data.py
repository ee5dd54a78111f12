#!/usr/bin/env python
"""Offline packing: tokenise a dataset and pack its documents into rows of T tokens.

The output folder (rows.parquet + metadata.json, format in titan_thd/data/packed_dataset.py) is
read with `data.source = "packed"` and `data.path = <folder>`; `training.global_batch_size` counts
rows. By default the trainer plans the documents of each step's rows again over its DP x CP ranks
(`data.packed_replan`); with `data.packed_replan = false` each row is one microbatch and
`training.tokens_per_microbatch` must equal the T used here.

Algorithms: first_fit_decreasing (longest first) and first_fit_shuffle (Megatron-Bridge's default:
a seeded shuffle, then first fit). The report gives the padding waste (alignment padding inside
documents, tail padding of rows) and a document length histogram, also written as
length_histogram.png in the output folder (with matplotlib when installed).

Examples:
    # the embedded chat SFT set, byte tokenizer, rows of 2048 tokens, zigzag CP up to cp = 4
    python scripts/prepare_packed_data.py --source jsonl --path chat_sft.jsonl.gz \\
        --tokens-per-microbatch 2048 --pad-to-multiple 8 --output packs/chat_2048

    # the data section of a training config, shuffled first fit
    python scripts/prepare_packed_data.py --config train_configs/debug_dense_thd.toml \\
        --algorithm first_fit_shuffle --seed 1 --output packs/debug

    # mock lengths (lognormal), 20,000 documents
    python scripts/prepare_packed_data.py --source mock --num-samples 20000 \\
        --tokens-per-microbatch 4096 --output packs/mock_4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_thd.config import Config, load_config
from titan_thd.data.pack_report import format_report, length_histogram, padding_summary, write_histogram_png
from titan_thd.data.packed_dataset import ALGORITHMS, METADATA_FILE, pack_rows, write_packed
from titan_thd.data.packer import padded_lengths
from titan_thd.data.token_store import build_token_store
from titan_thd.data.tokenizer import build_tokenizer
from titan_thd.models import get_model_spec
from titan_thd.parallel.context_parallel import default_pad_to_multiple, resolve_mode

HISTOGRAM_FILE = "length_histogram.png"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("Examples:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--output", required=True, help="output folder (rows.parquet, metadata.json)")
    p.add_argument(
        "--config", help="training TOML whose [data] section, tokens_per_microbatch and seed are the defaults"
    )
    p.add_argument("--source", choices=("mock", "jsonl", "parquet"), help="data.source")
    p.add_argument("--path", help="data.path (jsonl / parquet file)")
    p.add_argument("--format", help="data.format: auto, messages, sharegpt, alpaca or text")
    p.add_argument("--tokenizer", help="data.tokenizer: byte or a path to tokenizer.json")
    p.add_argument(
        "--chat-template", dest="chat_template", help="data.chat_template: auto, simple or deepseek"
    )
    p.add_argument(
        "--mock-config",
        type=json.loads,
        help='data.mock_config as JSON, e.g. \'{"mode": "file", "path": "l.csv"}\'',
    )
    p.add_argument("--num-samples", type=int, help="data.num_samples (mock source)")
    p.add_argument(
        "--tokens-per-microbatch", type=int, help="T: tokens per packed row (default: the config's)"
    )
    p.add_argument(
        "--pad-to-multiple", type=int, help="pad every document to a multiple of this (zigzag CP: 2*cp)"
    )
    p.add_argument("--overlong", choices=("truncate", "drop"), help="documents longer than T")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="first_fit_decreasing")
    p.add_argument(
        "--seed", type=int, help="seed of the mock data and of first_fit_shuffle (default: the config's)"
    )
    p.add_argument("--histogram-bins", type=int, default=16, help="bins of the length histogram")
    p.add_argument("--cache-dir", default="", help="token cache folder (empty: keep in memory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = load_config(["--job.config_file", args.config]) if args.config else Config()
    # The command line's data settings over the config's, in a new section (the loaded config is not written).
    given = {
        field: getattr(args, field)
        for field in (
            "source",
            "path",
            "format",
            "tokenizer",
            "chat_template",
            "mock_config",
            "num_samples",
            "pad_to_multiple",
            "overlong",
        )
    }
    data = dataclasses.replace(cfg.data, **{k: v for k, v in given.items() if v is not None})
    T = args.tokens_per_microbatch or cfg.training.tokens_per_microbatch
    seed = cfg.training.seed if args.seed is None else args.seed
    if data.pad_to_multiple == 0:  # what the run's CP mode needs, as the trainer derives it
        p = cfg.parallelism
        mode = resolve_mode(
            p.context_parallel_mode, cfg.model.name, get_model_spec(cfg.model.name).parallel.cp_mode
        )
        data = dataclasses.replace(
            data, pad_to_multiple=default_pad_to_multiple(p.context_parallel_degree, mode)
        )
    if T % data.pad_to_multiple:
        raise ValueError(
            f"--tokens-per-microbatch {T} is not a multiple of --pad-to-multiple {data.pad_to_multiple}"
        )

    start = time.perf_counter()
    tokenizer = build_tokenizer(data.tokenizer, data.chat_template)
    store = build_token_store(data, tokenizer, seed, args.cache_dir, progress=not args.no_progress).view(
        T, data.overlong
    )
    rows = pack_rows(store.lengths, T, data.pad_to_multiple, args.algorithm, seed)
    meta = write_packed(
        args.output,
        store,
        rows,
        {
            "tokens_per_microbatch": T,
            "pad_to_multiple": data.pad_to_multiple,
            "algorithm": args.algorithm,
            "seed": seed,
            "tokenizer": data.tokenizer,
            "vocab_size": tokenizer.vocab_size,
            "pad_id": tokenizer.pad_id,
            "source": {
                "source": data.source,
                "path": data.path,
                "format": data.format,
                "num_samples": len(store),
            },
            "num_truncated": store.num_truncated,
            "num_dropped": store.num_dropped,
        },
        progress=not args.no_progress,
    )
    lengths = store.lengths
    summary = padding_summary(lengths, padded_lengths(lengths, data.pad_to_multiple), meta["num_rows"], T)
    edges, counts = length_histogram(lengths, T, args.histogram_bins)
    png = Path(args.output) / HISTOGRAM_FILE
    writer = write_histogram_png(png, edges, counts, f"{meta['num_docs']} documents, T = {T}")
    meta["padding"] = summary
    meta["length_histogram"] = {"edges": edges.tolist(), "counts": counts.tolist()}
    (Path(args.output) / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    print(format_report(summary, edges, counts))
    print(f"length histogram ({writer}) -> {png}")
    print(
        f"packed {meta['num_docs']} documents into {meta['num_rows']} rows of {T} tokens with {args.algorithm}: "
        f"efficiency {meta['packing_efficiency']:.4f} (real tokens / slots), docs per row mean "
        f"{meta['docs_per_row']['mean']:.2f} max {meta['docs_per_row']['max']}, truncated {store.num_truncated}, "
        f"dropped {store.num_dropped}, {time.perf_counter() - start:.1f} s -> {args.output}"
    )
    return meta


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")
