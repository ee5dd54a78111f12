"""Tokenizers: a built-in byte-level one (no download) and any Hugging Face `tokenizer.json`.

Both expose the same small interface (`Tokenizer`): `encode` never adds special tokens (the chat
template in `chat_template.py` places them), and `special_id(name)` gives the id of a named special
token. The special tokens every tokenizer provides:

    PAD, BOS, EOS                 padding, begin / end of a sample
    ROLE_TOKENS[role]             one marker per chat role: system, user, assistant, tool
    END_OF_TURN                   closes every chat turn

Byte tokenizer layout: ids 0..255 are the UTF-8 bytes, then `<|pad|>` 256, `<|bos|>` 257,
`<|eos|>` 258, `<|system|>` 259, `<|user|>` 260, `<|assistant|>` 261, `<|tool|>` 262, `<|end|>` 263;
`vocab_size` = 264. Text that *spells* a special token (e.g. the string "<|user|>") encodes as
plain bytes, so user data can never inject a role marker.

Hugging Face tokenizers: bos / eos / pad are taken from a `tokenizer_config.json` next to the
`tokenizer.json` when one is there, else from the first common name the vocabulary already holds
(`BOS_NAMES`, `EOS_NAMES`, `PAD_NAMES`). Whatever is still missing -- bos `<|bos|>`, eos `<|eos|>`,
pad `<|pad|>`, and the five chat markers `<|system|>`, `<|user|>`, `<|assistant|>`, `<|tool|>`,
`<|end|>` unless the vocabulary has them -- is added as special tokens after the existing ids
(`HFTokenizer.added_tokens` lists them). Note that `tokenizers` matches added special tokens
inside text, so for HF tokenizers a literal "<|user|>" in the data becomes the marker.

Chat format (`chat_format`, from `data.chat_template`): a tokenizer.json with DeepSeek's chat tokens
renders conversations in DeepSeek's own format (deepseek_chat.py); every other tokenizer, the
byte one included, uses the simple template of chat_template.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import get_args

from titan_thd.config.choices import ChatTemplate
from titan_thd.config.jsonfile import read_json_object

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS.values(), END_OF_TURN)

# Names under which common tokenizers (Llama, Mistral, GPT-2, Qwen, DeepSeek, BERT) keep their
# bos / eos / pad tokens; the first one present in the vocabulary is reused.
BOS_NAMES = (BOS, "<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "<｜begin▁of▁sentence｜>", "[CLS]")
EOS_NAMES = (EOS, "</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "<｜end▁of▁sentence｜>", "[SEP]")
PAD_NAMES = (PAD, "<pad>", "[PAD]", "<|finetune_right_pad_id|>", "<｜▁pad▁｜>")


class Tokenizer:
    """Interface shared by all tokenizers (ids are always < `vocab_size`)."""

    vocab_size: int
    """Number of ids the model must embed."""
    bos_id: int
    eos_id: int
    pad_id: int
    identity: str
    """Stable string that changes whenever the id mapping or the chat format changes (keys the token cache)."""
    chat_format: str = "simple"
    """How chat_template.py renders conversations: `simple` (its own markers) or `deepseek`
    (deepseek_chat.py)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def special_id(self, name: str) -> int:
        """Id of a special token by its text, e.g. "<|user|>", "<|end|>"."""
        raise NotImplementedError

    def has_token(self, name: str) -> bool:
        """Whether `name` is one token of the vocabulary."""
        try:
            self.special_id(name)
        except ValueError:
            return False
        return True

    @property
    def special_ids(self) -> list[int]:
        """Sorted ids of every special token the chat template or the packer may emit."""
        ids = {self.bos_id, self.eos_id, self.pad_id}
        ids.update(self.special_id(t) for t in (*ROLE_TOKENS.values(), END_OF_TURN))
        return sorted(ids)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 followed by the special tokens (layout in the module docstring)."""

    identity = "byte-v1"

    def __init__(self) -> None:
        self._special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self._special_names = {i: name for name, i in self._special.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self.pad_id, self.bos_id, self.eos_id = self._special[PAD], self._special[BOS], self._special[EOS]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # Bytes between special tokens are decoded as one run so multi-byte characters survive.
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if i not in self._special_names:
                raise ValueError(f"token id {i} is outside the byte tokenizer (vocab_size {self.vocab_size})")
            out.append(self._special_names[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def special_id(self, name: str) -> int:
        if name not in self._special:
            raise ValueError(f"unknown special token {name!r}; the byte tokenizer has {list(self._special)}")
        return self._special[name]


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` loaded with the `tokenizers` library."""

    def __init__(self, path: str | Path, chat_template: str = "auto") -> None:
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _HFTok

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"data.tokenizer: {str(path)!r} is not a file; expected 'byte' or a tokenizer.json path"
            )
        try:
            self._tok = _HFTok.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise ValueError(
                f"data.tokenizer: cannot load {path} as a Hugging Face tokenizer.json: {e}"
            ) from e
        configured = _configured_specials(path.parent / "tokenizer_config.json")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.chat_format = _chat_format(chat_template, vocab, configured.get("chat_template"), path)

        def pick(kind: str, names: tuple[str, ...]) -> str:
            if configured.get(kind) in vocab:
                return configured[kind]
            return next((n for n in names if n in vocab), names[0])

        self.bos_token, self.eos_token = pick("bos", BOS_NAMES), pick("eos", EOS_NAMES)
        self.pad_token = pick("pad", PAD_NAMES)
        wanted = [self.bos_token, self.eos_token, self.pad_token, *ROLE_TOKENS.values(), END_OF_TURN]
        self.added_tokens = [t for t in dict.fromkeys(wanted) if t not in vocab]
        """Special tokens this class had to add (they take ids after the original vocabulary)."""
        self._tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in self.added_tokens]
        )

        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab = vocab
        self.vocab_size = max(vocab.values()) + 1
        self.bos_id, self.eos_id, self.pad_id = (
            vocab[self.bos_token],
            vocab[self.eos_token],
            vocab[self.pad_token],
        )
        digest = hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()[:16]
        self.identity = f"hf-{digest}" + ("-deepseek-chat" if self.chat_format == "deepseek" else "")

    def added_tokens_note(self) -> str:
        """What the trainer added to this tokenizer and why (the run header prints it), or ""."""
        if not self.added_tokens:
            return ""
        ids = [self._vocab[t] for t in self.added_tokens]
        return (
            f"tokenizer: added {len(ids)} special tokens the chat template needs and the tokenizer lacks "
            f"({', '.join(self.added_tokens)}) as ids {min(ids)}..{max(ids)}, after its vocabulary; the "
            "run's copy of the tokenizer (with them) is <job.dump_folder>/tokenizer/tokenizer.json"
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def special_id(self, name: str) -> int:
        if name not in self._vocab:
            raise ValueError(f"unknown special token {name!r} for this tokenizer")
        return self._vocab[name]


def _chat_format(setting: str, vocab: dict[str, int], template: str | None, path: Path) -> str:
    """`data.chat_template` resolved for a tokenizer.json: `auto` picks DeepSeek's format when the
    vocabulary holds its chat tokens and the tokenizer_config.json chat template (if any) uses them."""
    from titan_thd.data.deepseek_chat import REQUIRED_TOKENS, USER

    missing = [t for t in REQUIRED_TOKENS if t not in vocab]
    if setting == "deepseek" and missing:
        raise ValueError(
            f"data.chat_template = deepseek: {path} lacks DeepSeek's chat tokens {missing}; use auto or simple"
        )
    if setting == "auto":
        return "deepseek" if not missing and (template is None or USER in template) else "simple"
    return setting


def _configured_specials(config_path: Path) -> dict[str, str]:
    """bos / eos / pad token strings (and the chat_template text) from a tokenizer_config.json, when
    there is one."""
    if not config_path.is_file():
        return {}
    cfg = read_json_object(config_path)
    out = {}
    for kind in ("bos", "eos", "pad"):
        value = cfg.get(f"{kind}_token")
        if isinstance(value, dict):  # serialised AddedToken
            value = value.get("content")
        if isinstance(value, str) and value:
            out[kind] = value
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    if isinstance(template, str):
        out["chat_template"] = template
    return out


CHAT_TEMPLATES: tuple[str, ...] = get_args(ChatTemplate)


def build_tokenizer(spec: str, chat_template: str = "auto") -> Tokenizer:
    """`"byte"` for the built-in byte tokenizer, else a path to a Hugging Face tokenizer.json
    (or to the folder that holds it). `chat_template` is `data.chat_template`."""
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(
            f"data.chat_template: got {chat_template!r}, expected one of {', '.join(CHAT_TEMPLATES)}"
        )
    if spec == "byte":
        if chat_template == "deepseek":
            raise ValueError(
                "data.chat_template = deepseek needs a DeepSeek tokenizer.json (data.tokenizer = byte has no "
                "DeepSeek chat tokens); use auto or simple"
            )
        return ByteTokenizer()
    return HFTokenizer(spec, chat_template)
