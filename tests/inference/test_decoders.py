"""Cached decoding equals the model's own packed forward over the whole sequences (float64, relative
1e-12 at every step), for several prompts at once whose windows and compressed entries complete at
different steps, and after sequences leave the batch; generate()'s stopping rules and input errors.

The reference is RecomputeDecoder: the training forward (THD microbatch of every full sequence) at
every step, an independent code path from the cached decoders' one-row steps.
"""

import dataclasses

import pytest
import torch

from tests.models.dsv4._util import build, micro
from titan_thd.inference.generate import RecomputeDecoder, generate, make_decoder
from titan_thd.models import get_model_spec
from titan_thd.models.llama import LlamaArgs, build_llama

CPU = torch.device("cpu")
LLAMA = get_model_spec("llama")
# Lengths across the micro flavor's window (8), CSA ratio (4) and HCA ratio (16), and one token.
LENGTHS = (3, 17, 40, 1, 33)
STEPS, LEAVE_AT, KEEP = 26, 9, [0, 2, 4]


def dsv4_model():
    # index_topk 4 < the entries of the longer sequences: the indexer's selection is exercised.
    return build(micro(vocab_size=64), seed=3, dtype=torch.float64).eval()


def llama_model():
    torch.manual_seed(0)
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160, vocab_size=64)
    return build_llama(args).double().eval()


def run_steps(decoder, prompts, tokens):
    """Logits of the prefill and of every step; sequences 1 and 3 leave after LEAVE_AT steps."""
    out = [decoder.prefill(prompts, STEPS + 1)]
    for j, t in enumerate(tokens):
        if j == LEAVE_AT:
            decoder.keep(KEEP)
        out.append(decoder.step(t[KEEP] if j >= LEAVE_AT else t))
    return out


MODELS = {"dsv4": dsv4_model, "llama": llama_model}


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_cached_decoding_equals_the_full_forward(name):
    model, spec = MODELS[name](), get_model_spec(name)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in LENGTHS]
    tokens = torch.randint(0, 64, (STEPS, len(prompts)), generator=g)
    cached_decoder = make_decoder(model, spec, CPU, "cache")
    assert isinstance(cached_decoder, spec.decoder)  # the family's hook, not the fallback
    cached = run_steps(cached_decoder, prompts, tokens)
    reference = run_steps(RecomputeDecoder(model, CPU), prompts, tokens)
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(cached, reference, strict=True))
    print(f"worst relative logits difference over {STEPS} steps: {worst:.1e}")
    assert worst <= 1e-12


def test_generate_stops_at_a_stop_id_the_budget_or_the_context():
    model = llama_model().float()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    free = generate(model, prompts, spec=LLAMA, max_new_tokens=6, stop_ids=set())
    assert [c.reason for c in free] == ["length", "length"] and all(len(c.tokens) == 6 for c in free)
    # The greedy continuation is the same whatever ends it: stop at its 3rd token of prompt 0.
    stop = free[0].tokens[2]
    first = next(i for i, t in enumerate(free[0].tokens) if t == stop)
    stopped = generate(model, prompts, spec=LLAMA, max_new_tokens=6, stop_ids={stop})
    assert stopped[0].tokens == free[0].tokens[: first + 1] and stopped[0].reason == "stop"
    assert stopped[0].text_ids({stop}) == free[0].tokens[:first]
    short = generate(model, prompts, spec=LLAMA, max_new_tokens=6, stop_ids=set(), context=8)
    assert [len(c.tokens) for c in short] == [5, 3] and [c.reason for c in short] == ["context", "context"]
    assert short[0].tokens == free[0].tokens[:5]
    with pytest.raises(ValueError, match="prompt 1 has 5 tokens; the model's context is 5 tokens"):
        generate(model, prompts, spec=LLAMA, max_new_tokens=6, stop_ids=set(), context=5)
    assert model.training is False


def test_a_family_without_a_decoder_hook_recomputes():
    """ModelSpec.decoder None: `auto` falls back to the full forward (same tokens), `cache` is refused."""
    model = llama_model().float()
    bare = dataclasses.replace(LLAMA, decoder=None)
    assert isinstance(make_decoder(model, bare, CPU, "auto"), RecomputeDecoder)
    assert isinstance(make_decoder(model, None, CPU, "auto"), RecomputeDecoder)
    assert not isinstance(make_decoder(model, LLAMA, CPU, "auto"), RecomputeDecoder)
    with pytest.raises(ValueError, match="no cached decoder for llama"):
        make_decoder(model, bare, CPU, "cache")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached = generate(model, prompts, spec=LLAMA, max_new_tokens=6, stop_ids=set())
    recomputed = generate(model, prompts, spec=bare, max_new_tokens=6, stop_ids=set())
    assert [c.tokens for c in recomputed] == [c.tokens for c in cached]
