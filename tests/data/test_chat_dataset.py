import copy
import dataclasses
import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from titan_thd.config import Data
from titan_thd.data.sources import ASSETS_DIR
from titan_thd.data.token_store import build_token_store
from titan_thd.data.tokenizer import ByteTokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_chat_dataset.py"
ASSET = ASSETS_DIR / "chat_sft.jsonl.gz"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("make_chat_dataset", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def shipped():
    with gzip.open(ASSET, "rt") as f:
        return [json.loads(line)["messages"] for line in f]


def test_regeneration_is_identical(gen):
    """Same JSON lines, byte for byte, and a reproducible gzip header (mtime 0). The compressed
    bytes themselves are not compared: they depend on the zlib build, not on the generator."""
    shipped_bytes = ASSET.read_bytes()
    assert shipped_bytes[4:8] == b"\0\0\0\0"  # gzip mtime 0
    regenerated = gen.serialise(gen.generate())
    assert regenerated[4:8] == b"\0\0\0\0"
    assert gzip.decompress(regenerated) == gzip.decompress(shipped_bytes)
    assert len(shipped_bytes) < 1_500_000


def test_every_answer_verifies(gen, shipped):
    assert len(shipped) == gen.NUM_CONVERSATIONS
    failures = [(i, e) for i, c in enumerate(shipped) for e in gen.check_conversation(c)]
    assert failures == []
    roles = {m["role"] for c in shipped for m in c}
    assert roles == {"system", "user", "assistant", "tool"}
    assert sum(m["content"].startswith("Now ") for c in shipped for m in c) > 50  # follow-ups need context


def test_checker_catches_wrong_answers(gen, shipped):
    by_kind = {
        "final": next(c for c in shipped if len(c) == 2 and "=" not in c[1]["content"]),
        "working": next(c for c in shipped if len(c) == 2 and " = " in c[1]["content"]),
        "tool": next(c for c in shipped if any(m["role"] == "tool" for m in c)),
        "follow_up": next(c for c in shipped if any(m["content"].startswith("Now ") for m in c)),
    }
    for kind, conv in by_kind.items():
        assert gen.check_conversation(conv) == [], kind
        bad = copy.deepcopy(conv)
        if kind == "final":
            bad[1]["content"] = bad[1]["content"][:-2] + ("0" if bad[1]["content"][-2] != "0" else "1") + "."
        elif kind == "working":
            lhs, rhs = bad[1]["content"].split(" = ", 1)
            bad[1]["content"] = f"{lhs} = 1{rhs}"
        elif kind == "tool":
            tool = next(m for m in bad if m["role"] == "tool")
            tool["content"] = str(int(tool["content"]) + 1)
        else:
            i = next(i for i, m in enumerate(bad) if m["content"].startswith("Now "))
            bad[i - 1]["content"] = bad[i - 1]["content"].replace("The answer is", "The answer is 9")
        assert gen.check_conversation(bad), kind
    assert gen.check_conversation(
        [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "x"}]
    )


def test_length_distribution_through_the_token_store(gen, shipped):
    data = dataclasses.replace(Data(), source="jsonl", path="chat_sft.jsonl.gz")  # resolved from the assets
    store = build_token_store(data, ByteTokenizer(), seed=0, cache_dir="", progress=False)
    lengths = store.lengths
    assert len(store) == len(shipped)
    assert gen.length_table(shipped)["max"] == lengths.max()
    assert 40 <= lengths.min() and 80 <= np.median(lengths) <= 200
    assert np.mean((lengths >= 40) & (lengths <= 300)) > 0.75  # most samples are short
    assert 1500 <= np.percentile(lengths, 99) and 2500 <= lengths.max() <= 3200  # with a long tail
    assert (store.num_targets > 0).all()
    tok = ByteTokenizer()
    for i in (0, int(np.argmax(lengths))):
        s = store[i]
        targets = tok.decode(s.input_ids[s.target_mask])
        assert targets.endswith(".<|end|>") and "The answer is" in targets


def test_a_larger_training_set_keeps_the_shipped_prefix_and_avoids_the_held_out_questions(gen, shipped):
    """`--num N --exclude-heldout`: the shipped 4,000 are its prefix (the held-out set already avoids
    them), and every later conversation asking a held-out question is dropped."""
    with gzip.open(ASSETS_DIR / "chat_heldout.jsonl.gz", "rt") as f:
        held = {q for line in f for q in gen._questions(json.loads(line)["messages"])}
    n = len(shipped) + 3000
    larger = gen.generate(gen.SEED, n)
    kept = gen.without_heldout_questions(larger)
    assert kept[: len(shipped)] == shipped
    assert not any(q in held for c in kept for q in gen._questions(c))
    kept_ids = {id(c) for c in kept}
    dropped = [c for c in larger if id(c) not in kept_ids]
    assert dropped and all(any(q in held for q in gen._questions(c)) for c in dropped)
