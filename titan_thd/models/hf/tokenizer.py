"""What a Hugging Face export needs of the run's tokenizer: its files and its special-token ids.

The export of every model family (hf/export.py) calls `write_tokenizer` and puts `special_token_ids`
into config.json and generation_config.json, so that
`AutoTokenizer.from_pretrained(out)` encodes like the trainer and `model.generate` stops at the end of
an assistant turn:

- the byte tokenizer becomes a `tokenizers` byte-level BPE without merges whose ids are the byte values
  (the GPT-2 byte-to-character table maps each byte to one vocabulary entry), plus the special tokens
  at the byte tokenizer's ids 256..263 (data/tokenizer.py). It encodes every text to the same ids,
  except that `tokenizers` matches a special token spelled inside a text ("<|user|>" becomes the
  marker; the byte tokenizer keeps it as bytes);
- a Hugging Face tokenizer.json is written back with the special tokens the trainer added to it;
- tokenizer_config.json names bos / eos / pad and, for the simple chat template (chat_template.py), carries
  it as a Jinja template, so `apply_chat_template(messages, add_generation_prompt=True)` gives the
  ids of `encode_prompt`. DeepSeek's format (deepseek_chat.py) keeps the source folder's own
  tokenizer_config.json template, when there is one.
- eos is the list of ids that end a turn: `<|end|>` and `<|eos|>` (DeepSeek's format: its end of sentence).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from titan_thd.data import deepseek_chat
from titan_thd.data.tokenizer import (
    BOS,
    END_OF_TURN,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
)

SIMPLE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if not (message['role'] == 'system' and not message['content']) %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}" + END_OF_TURN + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""chat_template.py's template in Jinja (roles system / user / assistant / tool: `<|role|>` markers)."""


def byte_to_char() -> dict[int, str]:
    """The byte-level table of GPT-2's tokenizer: printable Latin-1 bytes map to themselves, the other
    bytes to the characters from U+0100 on, in byte order (what `tokenizers`' ByteLevel uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> str:
    """tokenizer.json of the byte tokenizer (ids 0..255 the bytes, then its special tokens)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    vocab = {char: b for b, char in byte_to_char().items()}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [
        ByteTokenizer().special_id(t) for t in SPECIAL_TOKENS
    ]
    return tok.to_str()


def turn_end_token(tokenizer: Tokenizer) -> str:
    return deepseek_chat.EOS if tokenizer.chat_format == "deepseek" else END_OF_TURN


def special_token_ids(tokenizer: Tokenizer) -> dict:
    """bos / eos / pad ids for config.json and generation_config.json (eos: every id ending a turn)."""
    eos = sorted({tokenizer.special_id(turn_end_token(tokenizer)), tokenizer.eos_id})
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_id}


def write_tokenizer(
    tokenizer: Tokenizer, out: Path, source: str | Path | None = None, context: int = 0
) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json of `tokenizer` into `out`.

    `source`: the tokenizer.json path (or folder) the HF tokenizer was read from, whose
    tokenizer_config.json is kept as the base (its chat template, for DeepSeek's format);
    `context`: model_max_length (0 = not written)."""
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        names = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    elif isinstance(tokenizer, HFTokenizer):
        (out / "tokenizer.json").write_text(tokenizer._tok.to_str())  # with the tokens the trainer added
        names = {
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
        }
    else:
        raise ValueError(
            f"cannot export a {type(tokenizer).__name__} (expected the byte or a Hugging Face tokenizer)"
        )
    config: dict = {}
    if source is not None:
        src = Path(source)
        src_cfg = (src if src.is_dir() else src.parent) / "tokenizer_config.json"
        if src_cfg.is_file():
            config = json.loads(src_cfg.read_text(encoding="utf-8"))
            config.pop("added_tokens_decoder", None)  # ids as the source had them; tokenizer.json has ours
        for extra in ("special_tokens_map.json",):
            if (src_cfg.parent / extra).is_file():
                shutil.copy(src_cfg.parent / extra, out / extra)
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", **names, "clean_up_tokenization_spaces": False}
    if tokenizer.chat_format == "simple":
        config["chat_template"] = SIMPLE_CHAT_TEMPLATE
    if context:
        config["model_max_length"] = context
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    generation = {**special_token_ids(tokenizer), "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
