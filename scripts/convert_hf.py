"""Convert weights between a Hugging Face folder and a DCP checkpoint folder (needs the `hf` extra:
./scripts/setup_env.sh hf).

    # a trainer checkpoint -> HF folder with the run's tokenizer, loadable by transformers'
    # AutoModelForCausalLM / AutoTokenizer (dsv4: DeepseekV4ForCausalLM, llama: LlamaForCausalLM)
    .venv/bin/python scripts/convert_hf.py to-hf RUN_OR_CHECKPOINT OUT_DIR [--config dsv4_flash_thd.toml] [--dtype bfloat16]

    # a LoRA run's checkpoint -> adapter_config.json + adapter_model.safetensors for transformers + peft
    # on the base folder (model.hf_path); `to-hf` on a LoRA run writes the merged model, W + s * B @ A
    .venv/bin/python scripts/convert_hf.py to-peft outputs/dsv4_flash_lora OUT_DIR [--dtype bfloat16]

    # a dsv4 LoRA run's checkpoint -> the same two files in the layout vLLM serves on the release folder
    # (DeepSeek's tensor names, one adapter per routed expert); prints the `vllm serve` command
    .venv/bin/python scripts/convert_hf.py to-vllm outputs/dsv4_flash_lora OUT_DIR

    # HF (config.json + *.safetensors) -> DCP folder holding the trainer's "model" entries (dsv4)
    .venv/bin/python scripts/convert_hf.py to-dcp HF_DIR OUT_DIR [--flavor tiny]

    # a to-dcp folder (or a dsv4 checkpoint without its run's config) -> HF weights and config.json only
    .venv/bin/python scripts/convert_hf.py to-hf DCP_DIR OUT_DIR (--flavor tiny | --hf-config config.json)

With --config (the run's TOML, a path or a name in train_configs/, plus `--section.field value` overrides
as for the trainer) `to-hf` reads a trainer checkpoint of any parallel layout: `RUN/checkpoint/step-N`, or
a run folder / checkpoint folder for its newest step (titan_thd/export/checkpoint.py checks the
checkpoint's model fingerprint against the config). The export then holds config.json (with the
tokenizer's bos / eos / pad ids), the weights, tokenizer.json, tokenizer_config.json (with the chat
template) and generation_config.json, so `generate` stops at the end of an assistant turn
(titan_thd/models/hf/tokenizer.py).

`to-hf` never builds the model: it streams the checkpoint's model entries a group at a time
(titan_thd/models/hf/write.py) into safetensors files of at most `--max-shard-size` bytes (default
5GB, as transformers), `model.safetensors` alone or `model-0000K-of-0000N.safetensors` with
`model.safetensors.index.json`; peak memory is about 1.25 files plus the largest tensor plus the
process (docs/dsv4.md §17.3). `to-dcp` never builds the model either: DCP plans the checkpoint from a
meta-device model and reads each tensor from the folder when it writes it (titan_thd/models/hf/to_dcp.py:
the peak is one tensor plus the process).

A LoRA run's checkpoint holds its adapters only (titan_thd/export/, docs/lora.md §4):
both exports check that it was trained with the config's lora.* and on the config's base (the
fingerprint of model.hf_path, or the seed), read only the adapter entries, and never gather the base. `to-peft`
writes a block of adapters at a time (--dtype float32 by default). `to-hf` reads the base a group of
tensors at a time (model.hf_path's, FP8 / FP4 dequantised on read, or drawn from training.seed),
folds each adapter in as W + s * B @ A in float32 (expert stacks one expert at a time) and writes
float32 or bfloat16. Its peak is the same as above plus one group's adapters.

    # a run whose base (model.hf_path) is a release folder -> that folder's FP8 / FP4 format; a LoRA
    # merge prints per target how much of its update survives the re-encoding (docs/lora.md §7)
    .venv/bin/python scripts/convert_hf.py to-hf outputs/dsv4_flash_lora OUT_DIR --config dsv4_flash_lora.toml --dtype released

    # any HF folder (dsv4) -> DeepSeek's release format, e.g. a small base to try lora.base_dtype = "released"
    .venv/bin/python scripts/convert_hf.py to-release HF_DIR OUT_DIR [--fp8-block 128x128]

    # a trainer checkpoint written before the routed experts were stacked (one tensor per expert)
    # -> the same checkpoint with [E, out, in] stacks (model and optimizer state; resumable)
    .venv/bin/python scripts/convert_hf.py stack-experts outputs/x/checkpoint/step-60 NEW/step-60

The DCP state dict has the trainer's layout (`{"model": {fqn: tensor}}`, so keys `model.<fqn>`),
written by one process; DCP reshards it when a multi-rank job loads it. The model family is reached
through its ModelSpec's Hugging Face adapter (`spec.hf`, read and written by titan_thd/models/hf/; the
names live in titan_thd/models/<family>/). `to-dcp` reads DeepSeek's published FP8 / packed-FP4
checkpoints too: their weights are dequantised to float32 (docs/dsv4.md §17.1). For `to-hf` the
architecture comes from the flavor (its vocabulary size is taken from the checkpoint's embedding, since
the trainer rounds the tokenizer's up to a multiple of 64) or from an HF config.json; `to-dcp` copies
config.json next to the shards so the folder converts back with `--hf-config OUT_DIR/config.json`.
`to-hf` also reads the per-expert layout of checkpoints written before the experts were stacked.

What a run recorded is not asked again (titan_thd/export/recorded.py): without --config, `to-hf` /
`to-peft` of a run read the config the trainer saved as <job.dump_folder>/config.toml, and a config
without model.hf_path gets the base folder a LoRA checkpoint recorded (lora.base; gone or changed:
refused). Every export writes into a folder beside OUT_DIR and moves its files in at the end
(titan_thd/models/hf/staging.py): a failure leaves OUT_DIR as it was, and an OUT_DIR that is, contains
or lies inside an input (base folder, run, checkpoint step, source folder) is refused before anything
is read. Bad input: one `error:` line, exit code 2 (as the trainer's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_thd.exits import USER_ERRORS, one_line
from titan_thd.export import commands, recorded
from titan_thd.export.stack import stack_checkpoint
from titan_thd.export.vllm_adapters import to_vllm
from titan_thd.inference.loading import config_argv, inference_config
from titan_thd.models.hf.write import DEFAULT_MAX_SHARD_SIZE, parse_size
from titan_thd.run import Run
from titan_thd.startup import resolve_run

# This script parses the arguments and prints; what each subcommand does is titan_thd/export/commands.py.

HF_EXTRA = "the hf extra (safetensors, transformers): install it with ./scripts/setup_env.sh hf"


def _run(argv: list[str]) -> Run:
    """The run of a trainer argv for one process; ValueError without a Hugging Face format."""
    cfg = inference_config(argv)
    run = resolve_run(cfg, 1)
    if run.spec.hf is None:
        raise ValueError(f"model {cfg.model.name} has no Hugging Face export (its ModelSpec.hf is None)")
    return run


def _config(config: str | None) -> list[str] | None:
    return config_argv(config) if config else None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-dcp", help="HF folder -> DCP folder")
    a.add_argument("src", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--flavor", default=None, help="fail unless config.json matches this flavor")
    b = sub.add_parser("to-hf", help="trainer checkpoint or DCP folder -> HF folder")
    b.add_argument(
        "src", type=Path, help="RUN/checkpoint/step-N, a run folder (its newest step) or a DCP folder"
    )
    b.add_argument("out", type=Path)
    b.add_argument("--config", default=None, help="the run's TOML (default: the run's saved config.toml)")
    b.add_argument("--flavor", default=None, help="without --config: the flavor of a DCP folder")
    b.add_argument("--hf-config", type=Path, default=None, help="without --config: an HF config.json")
    b.add_argument("--dtype", default=None, help="float32, bfloat16 (default: as stored) or released")
    b.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest safetensors file (bytes, or 5GB / 500MB / 2GiB; default 5GB as transformers)",
    )
    d = sub.add_parser("to-peft", help="a LoRA run's checkpoint -> PEFT adapter folder")
    d.add_argument("src", type=Path, help="RUN/checkpoint/step-N or a run folder (its newest step)")
    d.add_argument("out", type=Path)
    d.add_argument("--config", default=None, help="the run's TOML (default: the run's saved config.toml)")
    d.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    v = sub.add_parser("to-vllm", help="a dsv4 LoRA run's checkpoint -> adapter folder vLLM serves")
    v.add_argument("src", type=Path, help="RUN/checkpoint/step-N or a run folder (its newest step)")
    v.add_argument("out", type=Path)
    v.add_argument("--config", default=None, help="the run's TOML (default: the run's saved config.toml)")
    v.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    r = sub.add_parser("to-release", help="HF folder -> the family's release format (FP8 / packed FP4)")
    r.add_argument("src", type=Path, help="an HF folder (config.json + *.safetensors)")
    r.add_argument("out", type=Path)
    r.add_argument(
        "--fp8-block",
        default="128x128",
        help="FP8 scale block ROWSxCOLS (default the release's 128x128; 16x16 lets a tiny model's TP cuts fall on blocks)",
    )
    r.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_SIZE)
    c = sub.add_parser("stack-experts", help="trainer checkpoint, per-expert layout -> stacked experts")
    c.add_argument("src", type=Path)
    c.add_argument("out", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    opts, overrides = p.parse_known_args(argv)
    # to-hf of a DCP folder names its model with --flavor / --hf-config; else it exports a run
    of_run = opts.cmd in ("to-peft", "to-vllm") or (
        opts.cmd == "to-hf" and opts.flavor is None and opts.hf_config is None
    )
    if overrides and not of_run:
        p.error(
            f"unrecognized arguments: {' '.join(overrides)} (config overrides are for a run's checkpoint)"
        )
    try:
        if opts.cmd == "to-dcp":
            line = commands.to_dcp(opts.src, opts.out, opts.flavor)
        elif opts.cmd == "to-release":
            line = commands.to_release(opts.src, opts.out, opts.fp8_block, opts.max_shard_size)
        elif opts.cmd == "stack-experts":
            line = stack_checkpoint(opts.src, opts.out)
        elif opts.cmd == "to-hf" and opts.config is not None and not of_run:
            raise ValueError(
                "to-hf --config reads the model from the run's config: drop --flavor / --hf-config"
            )
        elif opts.cmd in ("to-peft", "to-vllm"):
            run = lambda: _run(recorded.run_argv(opts.src, opts.out, _config(opts.config), overrides))  # noqa: E731
            export = commands.to_peft if opts.cmd == "to-peft" else to_vllm
            line = export(opts.src, opts.out, opts.dtype, run, _stderr)
        elif of_run:
            run = _run(recorded.run_argv(opts.src, opts.out, _config(opts.config), overrides))
            line = commands.run_to_hf(run, opts.src, opts.out, opts.dtype, opts.max_shard_size, _stderr)
        else:
            args = (opts.src, opts.out, opts.flavor, opts.hf_config, opts.dtype, opts.max_shard_size)
            line = commands.dcp_to_hf(*args)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("safetensors", "transformers"):
            raise
        print(f"error: convert_hf.py needs {HF_EXTRA} ({e})", file=sys.stderr)
        return 1
    except USER_ERRORS as e:  # NotExportable too: bad input, exit code 2 as the trainer's
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
