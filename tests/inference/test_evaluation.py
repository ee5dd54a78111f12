"""The held-out set and its grading: disjoint from the training set, every problem solvable and in a
family; a perfect model (the references as replies) scores 100 % everywhere, calculator turns included
(its call is run and the result fed back); wrong or unformatted replies are counted as such."""

import gzip
import json

import pytest

from titan_thd.data.sources import ASSETS_DIR
from titan_thd.data.tokenizer import ByteTokenizer
from titan_thd.inference import evaluation
from titan_thd.inference.chat_tasks import FAMILIES, calculator, check_conversation, classify, grade_reply
from titan_thd.inference.evaluation import evaluate, heldout_conversations, problems
from titan_thd.inference.generate import Completion


@pytest.fixture(scope="module")
def heldout():
    return heldout_conversations()


def test_heldout_asks_no_training_question_and_verifies(heldout):
    with gzip.open(ASSETS_DIR / "chat_sft.jsonl.gz", "rt") as f:
        trained = {m["content"] for line in f for m in json.loads(line)["messages"] if m["role"] == "user"}
    asked = [m["content"] for c in heldout for m in c if m["role"] == "user"]
    assert len(heldout) == 1000
    assert not [q for q in asked if q in trained and not q.startswith("Now ")]
    assert [e for c in heldout for e in check_conversation(c)] == []
    found = problems(heldout)
    assert len(found) == len(asked)  # every question is a graded problem
    assert {p.family for p in found} == set(FAMILIES)


def test_grading_rules():
    assert grade_reply("12 + 7 = 19. The answer is 19.", 19) == evaluation.grade_reply(
        "The answer is 19.", 19
    )
    assert grade_reply("The answer is 19.", 19).exact and grade_reply("The answer is 18.", 19).format
    assert not grade_reply("The answer is 18.", 19).exact and not grade_reply("19", 19).format
    assert grade_reply("The answer is 2604 inches.", "2604 inches").exact
    assert classify("Now add 5 to that.", 10) == ("follow_up", 15) and classify("Tell me a joke.") == (
        None,
        None,
    )
    assert calculator("CALL calculator(12 * 3)") == "36" and calculator("12 * 3") is None


def fake_generate(answer):
    """generate() replaced: each prompt's reply is `answer(prompt text)`, ending at <|end|>."""
    tok = ByteTokenizer()
    end = tok.special_id("<|end|>")

    def gen(model, prompts, **kwargs):
        return [Completion(tok.encode(answer(tok.decode(p))) + [end], "stop") for p in prompts]

    return gen


def test_a_perfect_model_scores_everything_and_the_tool_result_is_fed_back(heldout, monkeypatch):
    convs = heldout[:120]
    assert any(p.family == "tool" for p in problems(convs))
    replies = {}
    for c in convs:  # the reference reply after each exact history (the tool turn included)
        for i, m in enumerate(c):
            if m["role"] == "assistant":
                replies[ByteTokenizer().decode(evaluation.encode_prompt(ByteTokenizer(), c[:i]))] = m[
                    "content"
                ]
    monkeypatch.setattr(evaluation, "generate", fake_generate(lambda prompt: replies[prompt]))
    result = evaluate(None, ByteTokenizer(), convs, spec=None, context=100_000)
    assert result.total.problems == len(problems(convs)) and result.accuracy == result.format_accuracy == 1.0
    tool = result.families["tool"]
    assert tool.problems and tool.tool_calls == tool.problems
    assert result.metrics()["val/tool_call_accuracy"] == 1.0
    assert "accuracy 100.0%" in result.table()


def test_wrong_replies_and_the_context_limit(heldout, monkeypatch):
    convs = heldout[:40]
    monkeypatch.setattr(evaluation, "generate", fake_generate(lambda prompt: "The answer is banana."))
    result = evaluate(None, ByteTokenizer(), convs, spec=None, context=100_000)
    assert result.accuracy == 0.0 and result.format_accuracy == 1.0
    monkeypatch.setattr(evaluation, "generate", fake_generate(lambda prompt: "I do not know"))
    short = evaluate(None, ByteTokenizer(), convs, spec=None, context=120)
    t = short.total
    assert t.skipped > 0 and t.problems + t.skipped == len(problems(convs)) and short.format_accuracy == 0.0
