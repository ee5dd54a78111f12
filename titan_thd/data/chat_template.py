"""Chat template and loss masks for SFT conversations and pre-training text.

Template (one sample; `<|x|>` are single special tokens of the tokenizer):

    <|bos|>
    <|system|> system text <|end|>          (omitted when the system text is empty)
    <|user|> question <|end|>
    <|assistant|> answer <|end|>
    <|tool|> tool output <|end|>
    ...
    <|eos|>

Every turn is `role marker + encode(content) + <|end|>`, with nothing between turns, so the
template is turn-separable: the ids of a conversation are `bos`, the ids of each turn encoded on
its own, then `eos`; and a prefix of the turns encodes to a prefix of the ids. Content never
touches a neighbouring turn's text, so no merge of the tokenizer can cross a turn boundary.

Targets (`Sample.target_mask[i]` = "token i is predicted and trained"): the content tokens and
the closing `<|end|>` of assistant turns; never the assistant marker, system / user / tool
turns, bos or eos. The model therefore learns to answer and to stop.

Decisions:
- An assistant turn with empty content is a ValueError (it would train only `<|end|>`).
- An assistant turn that does not follow a user or tool turn (a greeting right after the
  system prompt, two assistant turns in a row) is accepted and trained. Megatron asserts here;
  we do not, because each turn carries its own role marker, so the text stays unambiguous and
  such data (multi-part answers, openers) is legitimate.
- Roles must be system / user / assistant / tool (`sources.normalise` maps other spellings).

Pre-training text (`encode_text`): `bos + encode(text) + eos`, every token after bos a target.

A DeepSeek tokenizer (`Tokenizer.chat_format == "deepseek"`, data.chat_template) renders
conversations in DeepSeek's own chat format instead: deepseek_chat.py.
"""

from __future__ import annotations

import numpy as np

from titan_thd.data import deepseek_chat
from titan_thd.data.sample import Sample
from titan_thd.data.tokenizer import BOS, END_OF_TURN, EOS, ROLE_TOKENS, Tokenizer


def encode_turn(tok: Tokenizer, message: dict) -> tuple[list[int], list[bool]]:
    """Ids and target flags of one turn (role marker, content, end-of-turn)."""
    role, content = message.get("role"), message.get("content")
    if role not in ROLE_TOKENS:
        raise ValueError(f"turn role {role!r} is not one of {list(ROLE_TOKENS)}")
    if not isinstance(content, str):
        raise ValueError(f"{role} turn content must be a string, got {type(content).__name__}")
    if role == "system" and not content:
        return [], []
    if role == "assistant" and not content:
        raise ValueError("assistant turn with empty content (nothing to train on)")
    body = tok.encode(content)
    ids = [tok.special_id(ROLE_TOKENS[role]), *body, tok.special_id(END_OF_TURN)]
    trained = role == "assistant"
    return ids, [False] + [trained] * (len(body) + 1)


def encode_conversation(tok: Tokenizer, messages: list[dict]) -> Sample:
    """bos + every turn + eos; loss on assistant content and its `<|end|>` only. A tokenizer whose
    `chat_format` is `deepseek` renders DeepSeek's own format instead (deepseek_chat.py)."""
    if tok.chat_format == "deepseek":
        return deepseek_chat.encode_conversation(tok, messages)
    ids, mask = [tok.bos_id], [False]
    for message in messages:
        turn_ids, turn_mask = encode_turn(tok, message)
        ids += turn_ids
        mask += turn_mask
    ids.append(tok.eos_id)
    mask.append(False)
    return _sample(ids, mask)


def encode_prompt(tok: Tokenizer, messages: list[dict]) -> list[int]:
    """Ids that ask the model for the next assistant turn: bos + turns + `<|assistant|>`.
    Generation stops at `<|end|>` (DeepSeek's format: at its end of sentence)."""
    if tok.chat_format == "deepseek":
        return deepseek_chat.encode_prompt(tok, messages)
    ids = [tok.bos_id]
    for message in messages:
        ids += encode_turn(tok, message)[0]
    return ids + [tok.special_id(ROLE_TOKENS["assistant"])]


def encode_text(tok: Tokenizer, text: str) -> Sample:
    """Pre-training text: bos + text + eos, every token after bos a target."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    ids = [tok.bos_id, *tok.encode(text), tok.eos_id]
    return _sample(ids, [False] + [True] * (len(ids) - 1))


def render_conversation(messages: list[dict]) -> str:
    """The template as text (special tokens spelled out), e.g. for logs and template tests."""
    parts = [BOS]
    for m in messages:
        if m["role"] == "system" and not m["content"]:
            continue
        parts += [ROLE_TOKENS[m["role"]], m["content"], END_OF_TURN]
    return "".join(parts + [EOS])


def _sample(ids: list[int], mask: list[bool]) -> Sample:
    assert len(ids) == len(mask) and not mask[0]
    return Sample(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool))
