"""Ask a trained model: continue prompts or a chat with a checkpoint, in the run's chat template.

    .venv/bin/python scripts/generate.py --checkpoint outputs/dsv4_flash_thd/checkpoint/step-40 \\
        --config dsv4_flash_thd.toml --prompt "What is 12 + 7?" --temperature 0 --max_new_tokens 24
    .venv/bin/python scripts/generate.py --checkpoint outputs/dsv4_flash_thd --config dsv4_flash_thd.toml -i
    .venv/bin/python scripts/generate.py --config dsv4_flash_thd.toml --model.hf_path HF_DIR \\
        --chat '[{"role": "user", "content": "Reverse the string \\"abc\\"."}]'
    .venv/bin/python scripts/generate.py --checkpoint outputs/dsv4_flash_lora --config dsv4_flash_lora.toml \\
        --model.hf_path outputs/dsv4_flash_thd/hf --prompt "What is 12 + 7?" --max_new_tokens 24

--checkpoint: a trainer checkpoint (RUN/checkpoint/step-N) of any parallel layout, a checkpoint folder or a
run folder (its newest step); or give --model.hf_path (a Hugging Face folder), or --untrained. --config is
the run's TOML (a path or a name in train_configs/); other `--section.field value` arguments override it as
for the trainer. A LoRA run's checkpoint holds its adapters only (the last example): give the LoRA run's
--config and the base it was trained on as --model.hf_path (none for a base drawn from the seed); its
merged export (`convert_hf.py to-hf` of the LoRA run) is a plain --model.hf_path. Each --prompt is one
user turn (after --system, if given), answered as the assistant; --raw continues plain text instead.
Several --prompt are generated together in one packed batch. The reply ends at the end-of-turn token
(or after --max_new_tokens). --temperature 0 is greedy (the default); otherwise sampling with --top_k /
--top_p and --seed. stdout gets the completions only; one line on stderr says what was loaded and the
speed. A bad input is one `error:` line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titan_thd.exits import one_line
from titan_thd.inference.generate import DECODERS, GenerationStats
from titan_thd.inference.loading import Loaded, config_argv, load_model
from titan_thd.inference.sampling import Sampling


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint",
        help="RUN/checkpoint/step-N, a checkpoint folder or a run folder (a LoRA run's: with its base as "
        "--model.hf_path)",
    )
    p.add_argument("--config", required=True, help="the run's TOML: a path or a name in train_configs/")
    p.add_argument("--untrained", action="store_true", help="no weights: the seeded initialisation")
    p.add_argument("--prompt", action="append", default=[], help="a user turn (repeat for several)")
    p.add_argument("--system", default="", help="a system turn before every prompt")
    p.add_argument("--chat", help="a conversation to continue: JSON list of {role, content} or a .json file")
    p.add_argument("--raw", action="store_true", help="continue --prompt as plain text (no chat template)")
    p.add_argument("-i", "--interactive", action="store_true", help="chat on the terminal (empty line ends)")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--decoder", default="auto", choices=DECODERS, help="cache (auto) or full recompute")
    opts, rest = p.parse_known_args(argv)
    bad = [a for a in rest if a.startswith("-") and "." not in a]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are --section.field value)")
    if not (opts.prompt or opts.chat or opts.interactive):
        p.error("nothing to generate: give --prompt, --chat or -i")
    return opts, rest


def read_chat(value: str) -> list[dict]:
    path = Path(value)
    text = path.read_text(encoding="utf-8") if path.suffix == ".json" and path.is_file() else value
    try:
        chat = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat: not JSON ({e}); expected a list of {{role, content}} messages") from None
    if isinstance(chat, dict) and isinstance(chat.get("messages"), list):
        chat = chat["messages"]
    if not isinstance(chat, list) or not all(isinstance(m, dict) for m in chat):
        raise ValueError("--chat: expected a JSON list of {role, content} messages")
    return chat


def run(
    loaded: Loaded, opts: argparse.Namespace, prompts: list[list[int]], stats: GenerationStats
) -> list[str]:
    sampling = Sampling(opts.temperature, opts.top_k, opts.top_p, opts.seed)
    completions = loaded.generate(
        prompts, opts.max_new_tokens, sampling=sampling, decoder=opts.decoder, stats=stats
    )
    return [loaded.tokenizer.decode(c.text_ids(loaded.stop_ids)) for c in completions]


def interactive(loaded: Loaded, opts: argparse.Namespace, stats: GenerationStats) -> None:
    messages = [{"role": "system", "content": opts.system}] if opts.system else []
    print("chat with the model: one user turn per line; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("user> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not line.strip():
            return
        messages.append({"role": "user", "content": line})
        reply = run(loaded, opts, [loaded.chat_prompt(messages)], stats)[0]
        print(f"assistant> {reply}", flush=True)
        messages.append({"role": "assistant", "content": reply or " "})


def main(argv: list[str] | None = None) -> int:
    opts, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        Sampling(opts.temperature, opts.top_k, opts.top_p, opts.seed)  # bad values before the model loads
        loaded = load_model(
            config_argv(opts.config) + overrides,
            opts.checkpoint,
            untrained=opts.untrained,
            device=opts.device,
            dtype=opts.dtype,
        )
        tok, stats = loaded.tokenizer, GenerationStats()
        print(f"loaded {loaded.source} on {loaded.device}", file=sys.stderr)
        if opts.interactive:
            interactive(loaded, opts, stats)
        else:
            if opts.chat:
                prompts = [loaded.chat_prompt(read_chat(opts.chat))]
            elif opts.raw:
                prompts = [[tok.bos_id, *tok.encode(p)] for p in opts.prompt]
            else:
                system = [{"role": "system", "content": opts.system}] if opts.system else []
                prompts = [loaded.chat_prompt([*system, {"role": "user", "content": p}]) for p in opts.prompt]
            texts = run(loaded, opts, prompts, stats)
            for i, text in enumerate(texts):
                if len(texts) > 1:
                    print(f"### {i}: {opts.prompt[i]}")
                print(text, flush=True)
        print(stats.line(), file=sys.stderr)
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
