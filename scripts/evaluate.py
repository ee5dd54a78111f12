"""Answer accuracy of a trained model on held-out conversations of the embedded chat dataset.

    .venv/bin/python scripts/evaluate.py --checkpoint outputs/dsv4_flash_thd/checkpoint/step-40 \\
        --config dsv4_flash_thd.toml --limit 200
    .venv/bin/python scripts/evaluate.py --untrained --config dsv4_flash_thd.toml --limit 200   # baseline
    .venv/bin/python scripts/evaluate.py --checkpoint outputs/dsv4_flash_lora --config dsv4_flash_lora.toml \\
        --model.hf_path outputs/dsv4_flash_thd/hf --limit 200   # a LoRA run: its adapters on its base

Every user question of the first --limit conversations of the held-out set (titan_thd/assets/
chat_heldout.jsonl.gz, never trained on: see titan_thd/inference/evaluation.py) is answered greedily
with its true conversation history and graded by the dataset's checker. Prints per task family the
exact-answer accuracy ("The answer is X." with the right X), the format accuracy ("The answer is
...." at the end) and, for calculator conversations, the tool-call accuracy; --json PATH writes the
same numbers. --checkpoint / --config / overrides as for scripts/generate.py: a LoRA run's checkpoint
holds its adapters only, so give the LoRA run's --config and its base as --model.hf_path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titan_thd.exits import one_line
from titan_thd.inference.evaluation import HELDOUT, evaluate, heldout_conversations
from titan_thd.inference.generate import DECODERS
from titan_thd.inference.loading import config_argv, load_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint",
        help="RUN/checkpoint/step-N, a checkpoint folder or a run folder (a LoRA run's: with its base as "
        "--model.hf_path)",
    )
    p.add_argument("--config", required=True, help="the run's TOML: a path or a name in train_configs/")
    p.add_argument("--untrained", action="store_true", help="no weights: the seeded initialisation")
    p.add_argument("--limit", type=int, default=200, help="conversations to evaluate (0 = all 1,000)")
    p.add_argument("--data", default=str(HELDOUT), help="held-out conversations (messages JSONL, .gz ok)")
    p.add_argument("--max_new_tokens", type=int, default=512, help="cap of a reply's token budget")
    p.add_argument("--batch_size", type=int, default=16, help="problems generated together")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--decoder", default="auto", choices=DECODERS)
    p.add_argument("--samples", type=int, default=3, help="print this many questions with the model's reply")
    p.add_argument("--json", type=Path, help="write the accuracies here")
    opts, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    bad = [a for a in overrides if a.startswith("-") and "." not in a]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are --section.field value)")
    try:
        if opts.limit < 0 or opts.batch_size < 1 or opts.max_new_tokens < 1:
            raise ValueError("--limit must be >= 0, --batch_size and --max_new_tokens >= 1")
        conversations = heldout_conversations(opts.data, opts.limit)
        loaded = load_model(
            config_argv(opts.config) + overrides,
            opts.checkpoint,
            untrained=opts.untrained,
            device=opts.device,
            dtype=opts.dtype,
        )
        print(f"loaded {loaded.source} on {loaded.device}", file=sys.stderr)
        result = evaluate(
            loaded.model,
            loaded.tokenizer,
            conversations,
            spec=loaded.spec,
            device=loaded.device,
            context=loaded.context,
            max_new_tokens=opts.max_new_tokens,
            batch_size=opts.batch_size,
            decoder=opts.decoder,
            keep_samples=opts.samples,
            progress=lambda done, total, seconds: print(
                f"evaluate: {done}/{total} problems answered, {seconds:.0f} s", file=sys.stderr, flush=True
            ),
        )
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    for question, reply, exact in result.samples:
        print(f"{'right' if exact else 'wrong'}: {question[:70]!r} -> {reply[-70:]!r}")
    print(f"{len(conversations)} held-out conversations, {result.total.problems} problems ({opts.data})")
    print(result.table())
    print(f"{result.stats.line()}; {result.seconds:.0f} s in all")
    if opts.json:
        record = {"source": loaded.source, "conversations": len(conversations), **result.metrics("")}
        record["counts"] = {name: t.counts() for name, t in result.families.items()}
        opts.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
