"""The embedded chat dataset's problems, solved from their text and graded (the dataset's own checker).

`scripts/make_chat_dataset.py` generates the conversations of `titan_thd/assets/chat_sft.jsonl.gz`
(training) and `chat_heldout.jsonl.gz` (evaluation); both are verified by `check_conversation`, and
evaluation.py grades a model's replies with `solve` / `grade_reply`. Every question pattern belongs
to one task family of the generator (`FAMILIES`), so accuracy can be reported per family.

A problem is one user question and the assistant turn(s) answering it: a plain reply ending with
"The answer is X.", or in a calculator conversation `CALL calculator(a op b)`, the tool's result as
the tool turn, then the reply. Follow-up questions ("Now add 17 to that.") are solved from the
previous problem's answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNITS = {  # (from, to) -> factor
    ("kilometers", "meters"): 1000,
    ("meters", "centimeters"): 100,
    ("hours", "minutes"): 60,
    ("minutes", "seconds"): 60,
    ("kilograms", "grams"): 1000,
    ("days", "hours"): 24,
    ("weeks", "days"): 7,
    ("feet", "inches"): 12,
}
TOOL_SYSTEM = "You can use a calculator: reply CALL calculator(<expression>) and wait for its result."
FAMILIES = ("arithmetic", "word_problem", "list", "string", "compare", "unit", "follow_up", "tool")
"""Task families, named after the generator's task functions; `tool` = calculator conversations."""

_NUM = r"(-?\d+)"
_LIST = r"([\d, ]+)"
_PATTERNS: list[tuple[str, re.Pattern, object]] = [
    (
        "arithmetic",
        re.compile(rf"^(?:What is|Compute|Calculate) {_NUM} ([+*-]) {_NUM}[?.]$"),
        lambda a, op, b: _apply(int(a), op, int(b)),
    ),
    ("arithmetic", re.compile(rf"^What is the sum of {_NUM} and {_NUM}\?$"), lambda a, b: int(a) + int(b)),
    (
        "arithmetic",
        re.compile(rf"^What is the difference between {_NUM} and {_NUM}\?$"),
        lambda a, b: int(a) - int(b),
    ),
    (
        "arithmetic",
        re.compile(rf"^What is the product of {_NUM} and {_NUM}\?$"),
        lambda a, b: int(a) * int(b),
    ),
    (
        "word_problem",
        re.compile(rf"^(\w+) has {_NUM} (\w+) and buys {_NUM} more\. How many \3 does \1 have now\?$"),
        lambda _, a, __, b: int(a) + int(b),
    ),
    (
        "word_problem",
        re.compile(
            rf"^(\w+) has {_NUM} (\w+) and gives {_NUM} of them to \w+\. How many \3 does \1 have left\?$"
        ),
        lambda _, a, __, b: int(a) - int(b),
    ),
    (
        "word_problem",
        re.compile(rf"^A box holds {_NUM} (\w+)\. How many \2 are in {_NUM} boxes\?$"),
        lambda a, _, b: int(a) * int(b),
    ),
    (
        "word_problem",
        re.compile(
            rf"^\w+ shares {_NUM} (\w+) equally among {_NUM} friends\. How many \2 does each friend get\?$"
        ),
        lambda a, _, b: _exact_div(int(a), int(b)),
    ),
    (
        "word_problem",
        re.compile(rf"^A train travels {_NUM} km per hour for {_NUM} hours\. How many km does it travel\?$"),
        lambda a, b: int(a) * int(b),
    ),
    (
        "list",
        re.compile(rf"^Sort these numbers in (ascending|descending) order: {_LIST}\.$"),
        lambda order, xs: ", ".join(map(str, sorted(_ints(xs), reverse=order == "descending"))),
    ),
    ("list", re.compile(rf"^What is the sum of these numbers: {_LIST}\?$"), lambda xs: sum(_ints(xs))),
    (
        "list",
        re.compile(rf"^What is the (largest|smallest) number in this list: {_LIST}\?$"),
        lambda w, xs: (max if w == "largest" else min)(_ints(xs)),
    ),
    (
        "list",
        re.compile(rf"^How many even numbers are in this list: {_LIST}\?$"),
        lambda xs: sum(x % 2 == 0 for x in _ints(xs)),
    ),
    ("string", re.compile(r'^Reverse the string "([a-z]+)"\.$'), lambda w: w[::-1]),
    (
        "string",
        re.compile(r'^How many times does the letter "([a-z])" appear in "([a-z]+)"\?$'),
        lambda c, w: w.count(c),
    ),
    ("string", re.compile(r'^How many letters are in the word "([a-z]+)"\?$'), len),
    (
        "compare",
        re.compile(rf"^Which number is (larger|smaller): {_NUM} or {_NUM}\?$"),
        lambda w, a, b: (max if w == "larger" else min)(int(a), int(b)),
    ),
    (
        "unit",
        re.compile(rf"^Convert {_NUM} (\w+) to (\w+)\.$"),
        lambda v, src, dst: _convert(int(v), src, dst),
    ),
]
_FOLLOW_UP = re.compile(rf"^Now (add|subtract|multiply) (?:that by )?{_NUM}(?: (?:to|from) that)?\.$")
_EQUATION = re.compile(r"(-?\d+(?: [+*/-] -?\d+)+) = (-?\d+)")
CALL = re.compile(r"^CALL calculator\((-?\d+) ([+*-]) (-?\d+)\)$")
"""A calculator call as the dataset writes it (the whole assistant turn)."""
_FINAL = re.compile(r"The answer is ([^\n]+)\.$")


def _apply(a: int, op: str, b: int) -> int:
    if op == "/":
        return _exact_div(a, b)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _convert(v: int, src: str, dst: str) -> str | None:
    f = UNITS.get((src, dst))
    return None if f is None else f"{v * f} {dst}"


def _exact_div(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} / {b} is not exact")
    return a // b


def _ints(listed: str) -> list[int]:
    return [int(x) for x in listed.split(", ")]


def solve(question: str, prev: object = None) -> object:
    """The correct final answer of a question, computed from its text alone (None if unknown)."""
    return classify(question, prev)[1]


def classify(question: str, prev: object = None) -> tuple[str | None, object]:
    """(task family, correct final answer) of a question; (None, None) if it is not the dataset's."""
    m = _FOLLOW_UP.match(question)
    if m:
        if not isinstance(prev, int):
            return "follow_up", None
        op, n = m.group(1), int(m.group(2))
        return "follow_up", _apply(prev, {"add": "+", "subtract": "-", "multiply": "*"}[op], n)
    for family, pattern, fn in _PATTERNS:
        m = pattern.match(question)
        if m:
            return family, fn(*m.groups())
    return None, None


def calculator(call: str) -> str | None:
    """The tool's result for an assistant turn `CALL calculator(a op b)` (None if it is not one)."""
    m = CALL.match(call.strip())
    return None if m is None else str(_apply(int(m[1]), m[2], int(m[3])))


@dataclass(frozen=True)
class Grade:
    exact: bool
    """The reply ends with "The answer is X." for the correct X."""
    format: bool
    """The reply ends with "The answer is ...." (any value)."""


def grade_reply(reply: str, expected: object) -> Grade:
    """Grade a model's final reply against the expected answer, as check_conversation does."""
    reply = reply.strip()
    return Grade(exact=reply.endswith(f"The answer is {expected}."), format=_FINAL.search(reply) is not None)


def check_conversation(messages: list[dict]) -> list[str]:
    """Every problem found in a conversation: unknown questions, wrong equations in the working,
    wrong final answers, wrong tool calls. An empty list means the conversation is correct."""
    errors: list[str] = []
    prev: object = None
    i = 0
    while i < len(messages):
        if messages[i]["role"] != "user":
            i += 1
            continue
        question = messages[i]["content"]
        replies = []
        i += 1
        while i < len(messages) and messages[i]["role"] != "user":
            replies.append(messages[i])
            i += 1
        expected = solve(question, prev)
        if expected is None:
            errors.append(f"cannot solve {question[:60]!r}")
            continue
        if len(replies) == 3 and replies[0]["role"] == "assistant" and replies[1]["role"] == "tool":
            result = calculator(replies[0]["content"])
            if result != str(expected) or replies[1]["content"] != str(expected):
                errors.append(
                    f"bad tool call for {question!r}: {replies[0]['content']!r} -> {replies[1]['content']!r}"
                )
            replies = replies[2:]
        if len(replies) != 1 or replies[0]["role"] != "assistant":
            errors.append(
                f"expected one assistant reply to {question[:60]!r}, got {[r['role'] for r in replies]}"
            )
            continue
        answer = replies[0]["content"]
        for lhs, rhs in _EQUATION.findall(answer):
            tokens = lhs.split(" ")
            value = int(tokens[0])
            for op, operand in zip(tokens[1::2], tokens[2::2]):
                value = _apply(value, op, int(operand))
            if value != int(rhs):
                errors.append(f"wrong working {lhs} = {rhs} (is {value})")
        if not grade_reply(answer, expected).exact:
            errors.append(f"wrong answer to {question[:60]!r}: {answer[-60:]!r}, expected {expected}")
        prev = expected
    return errors
