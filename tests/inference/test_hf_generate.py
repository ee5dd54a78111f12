"""The exported Hugging Face checkpoints in transformers: the same greedy tokens as our generation, the
tokenizer and the special-token ids that make `generate` stop at the end of a turn.

- dsv4 (seeded random `micro` architecture with 32 indexer heads, float32) through
  DeepseekV4ForCausalLM.generate (greedy, eager attention, transformers' own cache): exactly our cached
  decoder's tokens. Ties: greedy is argmax on both sides (lowest index on an exact tie); the two logit
  computations differ by rounding (~1e-6), so a flip needs two logits within that of each other: the
  test asserts every chosen token leads the runner-up by more than 10x the measured difference between
  the two models' logits (the head is scaled up so that random logits spread), so the equality is not
  luck of this CPU's rounding. Indexer top-k: transformers' topk breaks exact score ties
  arbitrarily, ours by the lower entry; an exact tie needs every head's ReLU to be 0 (probability
  2^-32 per entry with 32 heads), so both select the same entries.
- llama through LlamaForCausalLM: logits within 1e-6 of their largest magnitude of each document alone
  (float32: the x10 head puts logits near 39, where one ulp is 3.8e-6; the two sides' differently ordered
  float32 sums measured 9.5e-6 on an AMD EPYC and 1.14e-5 on an Intel Xeon, 2-3 ulps), the same greedy
  tokens, and the weights back unchanged by the load.
"""

import json

import pytest
import torch

from tests.models.dsv4._util import build, micro
from titan_thd.data.chat_template import encode_prompt
from titan_thd.data.tokenizer import ByteTokenizer
from titan_thd.inference.generate import generate
from titan_thd.inference.loading import stop_ids
from titan_thd.models import get_model_spec
from titan_thd.models.decoding import packed_meta
from titan_thd.models.dsv4 import export_hf
from titan_thd.models.hf import export, load
from titan_thd.models.llama import LlamaArgs, build_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
TOK = ByteTokenizer()
NEW = 24


def prompts(seed=0, lengths=(5, 37)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def check_no_near_tie(model, hf, prompt, completion):
    """Every greedy token leads its runner-up in our logits by more than 10x the largest difference
    between our and transformers' logits of the whole sequence: no rounding can flip a choice."""
    seq = torch.tensor(prompt + completion)
    with torch.no_grad():
        ours = model(seq, packed_meta([len(seq)], seq)).logits[len(prompt) - 1 : -1]
        theirs = hf(seq[None]).logits[0, len(prompt) - 1 : -1]
    top2 = ours.topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == completion
    lead, diff = (top2.values[:, 0] - top2.values[:, 1]).min().item(), (ours - theirs).abs().max().item()
    print(f"smallest greedy lead {lead:.1e}, largest logits difference to transformers {diff:.1e}")
    assert lead > 10 * diff, (lead, diff)


def hf_greedy(hf, prompt):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    args = micro(vocab_size=320, index_n_heads=32, index_head_dim=16)
    model = build(args, seed=1, dtype=torch.float32).eval()
    with torch.no_grad():  # logits of a few units: clear greedy choices (small random logits nearly tie)
        model.head.weight.mul_(30)
    out = export_hf(model, args, tmp_path_factory.mktemp("dsv4_hf"), tokenizer=TOK, context=512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    return model, out, hf


def test_dsv4_greedy_tokens_equal_transformers_generate(dsv4):
    model, _, hf = dsv4
    assert type(hf).__name__ == "DeepseekV4ForCausalLM"
    ps = prompts(seed=1)
    ours = generate(
        model, ps, spec=get_model_spec("dsv4"), max_new_tokens=NEW, stop_ids=set(), vocab_size=320
    )
    for p, c in zip(ps, ours, strict=True):
        assert hf_greedy(hf, p) == c.tokens
        check_no_near_tie(model, hf, p, c.tokens)


def test_export_carries_the_tokenizer_and_its_special_ids(dsv4):
    _, out, hf = dsv4
    cfg = json.loads((out / "config.json").read_text())
    end, eos = TOK.special_id("<|end|>"), TOK.eos_id
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        TOK.bos_id,
        [eos, end],
        TOK.pad_id,
    )
    assert set(hf.generation_config.eos_token_id) == stop_ids(TOK) and hf.generation_config.do_sample is False
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = 'Reverse the string "abc". é 漢 \n\t\x00'
    assert tok.encode(text, add_special_tokens=False) == TOK.encode(text)
    assert tok.decode(TOK.encode(text)) == text
    chat = [
        {"role": "system", "content": "Answer precisely and briefly."},
        {"role": "user", "content": "What is 12 + 7?"},
        {"role": "assistant", "content": "The answer is 19."},
        {"role": "user", "content": "Now add 5 to that."},
    ]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert ids == encode_prompt(TOK, chat)


def test_llama_exports_to_llama_for_causal_lm(tmp_path):
    torch.manual_seed(0)
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160, vocab_size=320)
    model = build_llama(args).eval()
    with torch.no_grad():
        model.output.weight.mul_(10)
    out = export(get_model_spec("llama"), model, args, tmp_path / "hf", tokenizer=TOK, context=512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ps = prompts(1, (7, 60, 33))
    tokens = torch.tensor([t for p in ps for t in p])
    with torch.no_grad():  # one packed batch against each document alone in transformers
        ours = model(tokens, packed_meta([len(p) for p in ps], tokens)).logits
        starts = torch.tensor([0, *[len(p) for p in ps]]).cumsum(0).tolist()
        err = max(
            (ours[a:b] - hf(torch.tensor([p])).logits[0]).abs().max().item()
            for p, a, b in zip(ps, starts[:-1], starts[1:], strict=True)
        )
    scale = ours.abs().max().item()
    print(f"llama vs LlamaForCausalLM: max abs logits difference {err:.1e} at logits up to {scale:.1f}")
    assert err <= 1e-6 * scale
    for p, c in zip(
        ps,
        generate(model, ps, spec=get_model_spec("llama"), max_new_tokens=NEW, stop_ids=set(), vocab_size=320),
        strict=True,
    ):
        assert hf_greedy(hf, p) == c.tokens
        check_no_near_tie(model, hf, p, c.tokens)
    back = load(get_model_spec("llama"), out)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), back.state_dict().values(), strict=True)
    )


def test_a_hugging_face_tokenizer_is_exported_with_the_tokens_the_trainer_added(tmp_path):
    from tests.data.test_tokenizer import _train_bpe
    from titan_thd.data.tokenizer import HFTokenizer
    from titan_thd.models.hf.tokenizer import special_token_ids, write_tokenizer

    ours = HFTokenizer(_train_bpe(tmp_path / "tokenizer.json", ["<s>", "</s>"]))
    assert "<|end|>" in ours.added_tokens  # the trainer's chat markers, after the original ids
    write_tokenizer(ours, tmp_path / "out", tmp_path / "tokenizer.json", context=256)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "what is 12 + 30? the answer is 42. héllo"
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>") and tok.model_max_length == 256
    chat = [{"role": "user", "content": "what is 12 + 30?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert ids == encode_prompt(ours, chat)
    assert special_token_ids(ours)["eos_token_id"] == sorted({ours.special_id("<|end|>"), ours.eos_id})
