"""DeepSeek-V4's own chat format, for SFT with a DeepSeek tokenizer (docs/data.md §3).

Chosen when `data.chat_template` is `deepseek`, or `auto` with a tokenizer.json whose vocabulary holds
DeepSeek's chat tokens (and whose tokenizer_config.json chat template, if it has one, uses them).
The byte tokenizer and other tokenizers keep the simple template of chat_template.py.

One conversation, non-thinking ("chat") mode, `<｜x｜>` single special tokens:

    <｜begin▁of▁sentence｜>{system}
    <｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user 2}<｜Assistant｜></think>{answer 2}<｜end▁of▁sentence｜>

(no newlines: they only break the lines here). As in DeepSeek's reference encoder: the system text
has no marker; the model has no tool role, so a run of user and tool turns is one user block whose
parts are joined by a blank line, a tool output written `<tool_result>{output}</tool_result>`; the
`<｜Assistant｜></think>` that opens an answer closes the (empty) thinking block; a conversation that
ends with a user block ends with that opener, ready for generation.

Targets (assistant-only loss): the answer's tokens and its `<｜end▁of▁sentence｜>`; never the system
text, user blocks, the opener or bos. Text between two special tokens is encoded as one string, so
a tokenizer merge never crosses a marker. Refused (ValueError): an empty answer, and an answer that
does not follow a user or tool turn (DeepSeek's format has no assistant marker of its own there, so
it would run into the text before it). Thinking-mode data (`reasoning_content`) is not rendered:
the record schemas carry only role and content.
"""

from __future__ import annotations

import numpy as np

from titan_thd.data.sample import Sample

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_END = "</think>"
REQUIRED_TOKENS = (BOS, EOS, USER, ASSISTANT)
"""Special tokens a tokenizer must have for this format."""


def _user_block(turns: list[dict]) -> str:
    parts = [
        t["content"] if t["role"] == "user" else f"<tool_result>{t['content']}</tool_result>" for t in turns
    ]
    return "\n\n".join(parts)


def segments(messages: list[dict]) -> list[tuple[str, bool, bool]]:
    """The conversation as (text, is_special_token, trained) pieces, in order."""
    out: list[tuple[str, bool, bool]] = [(BOS, True, False)]
    i = 0
    while i < len(messages):
        role, content = messages[i].get("role"), messages[i].get("content")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"turn role {role!r} is not one of ['system', 'user', 'assistant', 'tool']")
        if not isinstance(content, str):
            raise ValueError(f"{role} turn content must be a string, got {type(content).__name__}")
        if role == "system":
            if content:
                out.append((content, False, False))
            i += 1
        elif role in ("user", "tool"):
            j = i
            while j < len(messages) and messages[j].get("role") in ("user", "tool"):
                j += 1
            out += [(USER, True, False), (_user_block(messages[i:j]), False, False)]
            if j == len(messages) or messages[j].get("role") == "assistant":  # the answer's opener
                out += [(ASSISTANT, True, False), (THINK_END, True, False)]
            i = j
        else:
            if not content:
                raise ValueError("assistant turn with empty content (nothing to train on)")
            if i == 0 or messages[i - 1].get("role") not in ("user", "tool"):
                raise ValueError(
                    f"turn {i}: an assistant turn must follow a user or tool turn in DeepSeek's chat format "
                    f"(it follows {messages[i - 1].get('role') if i else 'nothing'!r}); merge it into the answer "
                    "before it or use data.chat_template = simple"
                )
            out += [(content, False, True), (EOS, True, True)]
            i += 1
    return [s for s in out if s[0]]


def _encode(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    trained: list[bool] = []
    for text, special, target in segments(messages):
        if special and (text != THINK_END or tok.has_token(THINK_END)):
            piece = [tok.special_id(text)]
        else:  # `</think>` is plain text for a tokenizer without it as one token
            piece = tok.encode(text)
        ids += piece
        trained += [target] * len(piece)
    return ids, trained


def encode_conversation(tok, messages: list[dict]) -> Sample:
    """Ids and target mask of one conversation in DeepSeek's chat format."""
    ids, trained = _encode(tok, messages)
    assert not trained[0]
    return Sample(np.asarray(ids, dtype=np.int32), np.asarray(trained, dtype=bool))


def encode_prompt(tok, messages: list[dict]) -> list[int]:
    """Ids that ask for the next answer: the conversation so far, ending with the answer opener."""
    ids, _ = _encode(tok, messages)
    if not messages or messages[-1].get("role") not in ("user", "tool"):
        raise ValueError("a generation prompt must end with a user or tool turn")
    return ids
