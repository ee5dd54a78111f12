"""DeepSeek chat format: a small DeepSeek-like tokenizer.json (built here, no download) renders SFT
conversations in DeepSeek-V4's own format with its special tokens and assistant-only loss; the byte
tokenizer keeps the simple template."""

import json

import numpy as np
import pytest

from titan_thd.data.chat_template import encode_conversation, encode_prompt, render_conversation
from titan_thd.data.tokenizer import build_tokenizer

BOS, EOS, USER, ASSISTANT = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
)
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "Weather?"},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "Sunny, clear sky."},
]
# The format written out by hand (DeepSeek-V4 chat mode): system text without a marker, user and
# tool turns one user block (tool output in <tool_result>, parts joined by a blank line), each answer
# opened by <｜Assistant｜></think> and closed by the end of sentence.
EXPECTED = (
    f"{BOS}Be brief.{USER}2+2?{ASSISTANT}</think>4.{EOS}"
    f'{USER}Weather?\n\n<tool_result>{{"sky": "clear"}}</tool_result>{ASSISTANT}</think>Sunny, clear sky.{EOS}'
)


def deepseek_tokenizer(folder, think_token=True, template=f"{{{{ bos_token }}}}{USER}{{{{ m }}}}{ASSISTANT}"):
    """A byte-level BPE without merges plus DeepSeek's chat tokens, as tokenizer.json +
    tokenizer_config.json (bos / eos and a chat template that uses the DeepSeek markers)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS, USER, ASSISTANT, "<｜▁pad▁｜>"] + (["<think>", "</think>"] if think_token else [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": "<｜▁pad▁｜>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def trained_text(tok, sample):
    runs, run = [], []
    for i, m in zip(sample.input_ids.tolist(), sample.target_mask.tolist()):
        if m:
            run.append(i)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


@pytest.mark.parametrize("think_token", [True, False])
def test_deepseek_format_special_tokens_and_assistant_only_loss(tmp_path, think_token):
    tok = build_tokenizer(str(deepseek_tokenizer(tmp_path / "ds", think_token)))
    assert tok.chat_format == "deepseek" and tok.identity.endswith("-deepseek-chat")
    assert tok.added_tokens == ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
    s = encode_conversation(tok, CONV)
    assert tok.decode(s.input_ids) == EXPECTED
    ids = s.input_ids.tolist()
    for name in (BOS, EOS, USER, ASSISTANT):  # one token each, where the format puts them
        assert ids.count(tok.special_id(name)) == EXPECTED.count(name)
    assert ids[0] == tok.bos_id == tok.special_id(BOS) and tok.eos_id == tok.special_id(EOS)
    assert tok.has_token("</think>") == think_token
    assert not think_token or tok.special_id("</think>") in ids
    # Trained: each answer and its end of sentence, nothing else.
    assert trained_text(tok, s) == [f"4.{EOS}", f"Sunny, clear sky.{EOS}"]
    assert int(s.target_mask.sum()) == len(tok.encode("4.")) + len(tok.encode("Sunny, clear sky.")) + 2
    # A generation prompt ends with the answer opener, as the prefix of the full conversation.
    prompt = encode_prompt(tok, CONV[:5])
    assert tok.decode(prompt).endswith(f"</tool_result>{ASSISTANT}</think>") and ids[: len(prompt)] == prompt


def test_auto_keeps_the_simple_template_elsewhere_and_refusals(tmp_path):
    byte = build_tokenizer("byte")
    assert byte.chat_format == "simple"
    assert byte.decode(encode_conversation(byte, CONV).input_ids) == render_conversation(CONV)
    # A chat template that does not use DeepSeek's markers keeps the simple one; forcing works.
    path = deepseek_tokenizer(tmp_path / "other", template="{% for m in messages %}<|im_start|>{% endfor %}")
    assert build_tokenizer(str(path)).chat_format == "simple"
    forced = build_tokenizer(str(path), "deepseek")
    assert forced.decode(encode_conversation(forced, CONV).input_ids) == EXPECTED
    simple = build_tokenizer(str(deepseek_tokenizer(tmp_path / "ds")), "simple")
    assert simple.chat_format == "simple" and "<|user|>" in simple.decode(
        encode_conversation(simple, CONV).input_ids
    )
    with pytest.raises(ValueError, match="data.chat_template = deepseek needs a DeepSeek tokenizer.json"):
        build_tokenizer("byte", "deepseek")
    with pytest.raises(ValueError, match="data.chat_template: got 'jinja'"):
        build_tokenizer("byte", "jinja")
    tok = build_tokenizer(str(path), "deepseek")
    with pytest.raises(ValueError, match="must follow a user or tool turn in DeepSeek's chat format"):
        encode_conversation(tok, [{"role": "system", "content": "s"}, {"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="empty content"):
        encode_conversation(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}])
    np.testing.assert_array_equal(  # a user-only conversation trains nothing and ends with the opener
        encode_conversation(tok, [{"role": "user", "content": "q"}]).target_mask, False
    )
