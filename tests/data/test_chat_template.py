import numpy as np
import pytest

from titan_thd.data.chat_template import (
    encode_conversation,
    encode_prompt,
    encode_text,
    encode_turn,
    render_conversation,
)
from titan_thd.data.tokenizer import ByteTokenizer, HFTokenizer

from .test_tokenizer import _train_bpe

TOK = ByteTokenizer()
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "Use the tool for 7 * 6."},
    {"role": "assistant", "content": "CALL calculator(7 * 6)"},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "The answer is 42."},
]


def _targets(sample) -> str:
    return TOK.decode(sample.input_ids[sample.target_mask])


def test_masks_cover_assistant_content_and_end_only():
    s = encode_conversation(TOK, CONV)
    assert s.input_ids.dtype == np.int32 and s.target_mask.dtype == bool
    assert len(s.input_ids) == len(s.target_mask) and not s.target_mask[0]
    assert TOK.decode(s.input_ids) == render_conversation(CONV)
    assert _targets(s) == "The answer is 5.<|end|>CALL calculator(7 * 6)<|end|>The answer is 42.<|end|>"
    # Per-token reference: a token is a target iff it lies inside an assistant span (after its marker).
    assistant, end = TOK.special_id("<|assistant|>"), TOK.special_id("<|end|>")
    inside, expected = False, []
    for t in s.input_ids:
        expected.append(inside)
        if t == assistant:
            inside = True
        elif t == end:
            inside = False
    assert s.target_mask.tolist() == expected


def test_turn_separable_and_prefix_property():
    s = encode_conversation(TOK, CONV)
    ids, mask = [TOK.bos_id], [False]
    for m in CONV:
        turn_ids, turn_mask = encode_turn(TOK, m)
        ids += turn_ids
        mask += turn_mask
    assert s.input_ids.tolist() == ids + [TOK.eos_id] and s.target_mask.tolist() == mask + [False]
    for k in range(1, len(CONV)):
        head = encode_conversation(TOK, CONV[:k])
        assert s.input_ids[: len(head.input_ids) - 1].tolist() == head.input_ids[:-1].tolist()
        assert s.target_mask[: len(head.target_mask) - 1].tolist() == head.target_mask[:-1].tolist()


def test_turn_separable_for_bpe(tmp_path):
    # Tokenising the rendered text in one go gives the same ids as the per-turn encoding: BPE merges
    # never cross a turn boundary because every boundary is a special token.
    tok = HFTokenizer(_train_bpe(tmp_path / "tokenizer.json", special_tokens=[]))
    s = encode_conversation(tok, CONV)
    assert tok.encode(render_conversation(CONV)) == s.input_ids.tolist()
    assert tok.decode(s.input_ids) == render_conversation(CONV)


def test_empty_system_is_omitted_and_prompt_is_prefix():
    conv = [{"role": "system", "content": ""}, *CONV[1:3]]
    s = encode_conversation(TOK, conv)
    assert (
        TOK.decode(s.input_ids)
        == "<|bos|><|user|>What is 2 + 3?<|end|><|assistant|>The answer is 5.<|end|><|eos|>"
    )
    prompt = encode_prompt(TOK, conv[:2])
    assert s.input_ids[: len(prompt)].tolist() == prompt
    assert TOK.decode(prompt).endswith("<|end|><|assistant|>")


def test_assistant_not_after_user_is_trained():
    conv = [
        {"role": "system", "content": "sys"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "assistant", "content": "Ask me."},
    ]
    assert _targets(encode_conversation(TOK, conv)) == "Hi!<|end|>Ask me.<|end|>"


def test_no_assistant_turn_has_no_targets():
    s = encode_conversation(TOK, [{"role": "system", "content": ""}, {"role": "user", "content": "hello"}])
    assert s.target_mask.sum() == 0


def test_refusals():
    with pytest.raises(ValueError, match="empty content"):
        encode_conversation(TOK, [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}])
    with pytest.raises(ValueError, match="role 'robot'"):
        encode_conversation(TOK, [{"role": "robot", "content": "q"}])
    with pytest.raises(ValueError, match="must be a string, got list"):
        encode_conversation(TOK, [{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ValueError, match="must be a string"):
        encode_text(TOK, None)


def test_encode_text_trains_every_token_after_bos():
    s = encode_text(TOK, "héllo")
    assert s.input_ids.tolist() == [TOK.bos_id, *"héllo".encode(), TOK.eos_id]
    assert s.target_mask.tolist() == [False] + [True] * (len(s.input_ids) - 1)
