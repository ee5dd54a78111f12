import json
import pickle

import pytest

from titan_thd.data.tokenizer import (
    END_OF_TURN,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
)

CORPUS = ["the cat sat on the mat", "what is 12 + 30? the answer is 42.", "héllo wörld ünïcode"] * 20


def _train_bpe(path, special_tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return path


def test_byte_round_trip_and_layout():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 + len(SPECIAL_TOKENS) == 264
    for text in ["", "plain ascii", "héllo → 世界 🎉"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    specials = [tok.special_id(t) for t in SPECIAL_TOKENS]
    assert specials == list(range(256, 264))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
    assert tok.special_ids == specials


def test_byte_special_text_is_not_a_marker_and_decodes_specials():
    tok = ByteTokenizer()
    assert tok.encode("<|user|>") == list(b"<|user|>")  # data cannot inject role markers
    ids = [tok.bos_id, *tok.encode("é"), tok.special_id(END_OF_TURN)]
    assert tok.decode(ids) == "<|bos|>é<|end|>"
    with pytest.raises(ValueError, match="unknown special token"):
        tok.special_id("<|nope|>")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([999])


def test_hf_tokenizer_adds_missing_specials(tmp_path):
    path = _train_bpe(tmp_path / "tokenizer.json", special_tokens=[])
    base_size = json.loads(path.read_text())["model"]["vocab"].__len__()
    tok = build_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.added_tokens == ["<|bos|>", "<|eos|>", "<|pad|>", *ROLE_TOKENS.values(), END_OF_TURN]
    assert tok.vocab_size == base_size + 8
    ids = sorted(tok.special_ids)
    assert ids == list(range(base_size, base_size + 8))  # appended after the original vocabulary
    for text in CORPUS[:3]:
        enc = tok.encode(text)
        assert tok.decode(enc) == text and max(enc) < base_size


def test_the_added_tokens_are_explained(tmp_path):
    tok = build_tokenizer(
        str(_train_bpe(tmp_path / "tokenizer.json", special_tokens=["<s>", "</s>", "<pad>"]))
    )
    first = tok.special_id("<|system|>")
    note = tok.added_tokens_note()
    assert note.startswith("tokenizer: added 5 special tokens the chat template needs")
    assert "<|system|>, <|user|>, <|assistant|>, <|tool|>, <|end|>" in note
    assert f"as ids {first}..{first + 4}," in note and "/tokenizer/tokenizer.json" in note
    _train_bpe(
        tmp_path / "full.json", special_tokens=["<s>", "</s>", "<pad>", *ROLE_TOKENS.values(), END_OF_TURN]
    )
    assert build_tokenizer(str(tmp_path / "full.json")).added_tokens_note() == ""


def test_hf_tokenizer_reuses_existing_specials(tmp_path):
    _train_bpe(tmp_path / "tokenizer.json", special_tokens=["<s>", "</s>", "<pad>", "<|user|>"])
    tok = HFTokenizer(tmp_path)  # a folder works too
    vocab = tok._tok.get_vocab()
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (vocab["<s>"], vocab["</s>"], vocab["<pad>"]) == (0, 1, 2)
    assert tok.special_id("<|user|>") == 3
    assert tok.added_tokens == ["<|system|>", "<|assistant|>", "<|tool|>", "<|end|>"]
    assert max(tok.special_ids) == tok.vocab_size - 1


def test_hf_tokenizer_config_wins_and_pickles(tmp_path):
    path = _train_bpe(tmp_path / "tokenizer.json", special_tokens=["<s>", "</s>", "<|endoftext|>"])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|endoftext|>"}, "eos_token": "<|endoftext|>"})
    )
    tok = HFTokenizer(path)
    eot = tok._tok.token_to_id("<|endoftext|>")
    assert tok.bos_id == tok.eos_id == eot
    clone = pickle.loads(pickle.dumps(tok))  # the tokenisation pool ships it to workers
    assert clone.encode(CORPUS[1]) == tok.encode(CORPUS[1]) and clone.identity == tok.identity
    assert tok.identity != HFTokenizer(_train_bpe(tmp_path / "other.json", special_tokens=[])).identity


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        build_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        build_tokenizer(str(bad))
