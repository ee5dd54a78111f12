"""Generate the embedded default SFT dataset `titan_thd/assets/chat_sft.jsonl.gz` and its held-out
evaluation set `titan_thd/assets/chat_heldout.jsonl.gz`.

Chat conversations (OpenAI `messages` schema) whose answers a program can check: multi-digit
arithmetic, word problems, follow-ups on the previous answer ("Now add 17 to that."), sorting,
sums, minima / maxima, counting, reversing and counting letters, comparisons, unit conversions,
and calculator tool calls. Every assistant reply ends with "The answer is X." so a small model can
learn the format quickly and its accuracy can be measured with `check_conversation` (the checker
lives in titan_thd/inference/chat_tasks.py, which grades a model's replies with it).

The held-out set (`--heldout`) comes from the same generator under another seed, without any
conversation that asks a question of the training set (follow-ups such as "Now add 5 to that."
excepted: their answer depends on the question before), so no evaluated problem was trained on.

Lengths (byte tokenizer, chat template included) are long-tailed: most conversations are
40-300 tokens, multi-problem conversations and long lists reach ~3000, so packing matters.

The output is a pure function of --seed: gzip with mtime 0 and no file name, so regenerating gives
the same bytes.

    python scripts/make_chat_dataset.py            # (re)write the asset, print the length table
    python scripts/make_chat_dataset.py --check    # regenerate in memory, compare, verify answers
    python scripts/make_chat_dataset.py --heldout [--check]   # the same for the held-out set
    python scripts/make_chat_dataset.py --num 100000 --exclude-heldout --output DIR/chat100k.jsonl.gz
        # a larger training set (its first 4,000 are the shipped ones), disjoint from the held-out set
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titan_thd.data.chat_template import encode_conversation
from titan_thd.data.tokenizer import ByteTokenizer
from titan_thd.inference.chat_tasks import TOOL_SYSTEM, UNITS, check_conversation, solve  # noqa: F401

OUTPUT = ROOT / "titan_thd" / "assets" / "chat_sft.jsonl.gz"
NUM_CONVERSATIONS = 4000
SEED = 1234
HELDOUT_OUTPUT = ROOT / "titan_thd" / "assets" / "chat_heldout.jsonl.gz"
NUM_HELDOUT = 1000
HELDOUT_SEED = 4321

NAMES = [
    "Ana",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Gus",
    "Hana",
    "Ivan",
    "Jade",
    "Kofi",
    "Lena",
    "Mo",
    "Nia",
]
ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cards", "shells", "stamps", "cookies"]
WORDS = (
    "apple banana cherry planet rocket garden window yellow purple orange silver python kitten "
    "mountain river forest island castle dragon wizard pirate anchor bridge candle dolphin engine "
    "feather guitar hammer jacket ladder magnet needle pepper rabbit saddle tunnel violin walrus "
    "zebra banana mississippi committee balloon bookkeeper coffee letter summer success tomorrow"
).split()
SYSTEM_PROMPTS = [
    "You are a careful assistant. End every reply with 'The answer is X.'",
    "You are a math tutor. Show short working, then give the final answer.",
    "Answer precisely and briefly.",
]


# ============================================================================ generation
def _answer(value: object, working: str = "") -> str:
    return f"{working}The answer is {value}."


def _numbers(rng: random.Random, n: int) -> list[int]:
    hi = rng.choice([99, 999, 9999])
    return [rng.randint(1, hi) for _ in range(n)]


def _list_size(rng: random.Random) -> int:
    """Long-tailed list length: mostly 3-15 items, sometimes a few hundred."""
    return min(240, max(3, int(rng.lognormvariate(2.0, 0.9))))


def arithmetic(rng: random.Random) -> tuple[str, str, int]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 999), rng.randint(2, 99)
    else:
        a, b = sorted((rng.randint(10, 99999), rng.randint(10, 99999)), reverse=True)
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    named = {"+": "the sum of", "-": "the difference between", "*": "the product of"}[op]
    q = rng.choice(
        [
            f"What is {a} {op} {b}?",
            f"Compute {a} {op} {b}.",
            f"Calculate {a} {op} {b}.",
            f"What is {named} {a} and {b}?",
        ]
    )
    return q, _answer(c, f"{a} {op} {b} = {c}. "), c


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(2, 500), rng.randint(2, 500)
        return (
            f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
            _answer(a + b, f"{a} + {b} = {a + b}. "),
            a + b,
        )
    if kind == 1:
        b = rng.randint(1, 400)
        a = b + rng.randint(0, 400)
        q = f"{name} has {a} {item} and gives {b} of them to {other}. How many {item} does {name} have left?"
        return q, _answer(a - b, f"{a} - {b} = {a - b}. "), a - b
    if kind == 2:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        return (
            f"A box holds {a} {item}. How many {item} are in {b} boxes?",
            _answer(a * b, f"{a} * {b} = {a * b}. "),
            a * b,
        )
    if kind == 3:
        each, k = rng.randint(2, 40), rng.randint(2, 12)
        q = f"{name} shares {each * k} {item} equally among {k} friends. "
        q += f"How many {item} does each friend get?"
        return q, _answer(each, f"{each * k} / {k} = {each}. "), each
    a, b = rng.randint(20, 120), rng.randint(2, 9)
    return (
        f"A train travels {a} km per hour for {b} hours. How many km does it travel?",
        _answer(a * b, f"{a} * {b} = {a * b}. "),
        a * b,
    )


def list_task(rng: random.Random, size: int | None = None) -> tuple[str, str, object]:
    xs = _numbers(rng, size or _list_size(rng))
    listed = ", ".join(map(str, xs))
    kind = rng.randrange(5)
    if kind in (0, 1):
        order = "ascending" if kind == 0 else "descending"
        ys = ", ".join(map(str, sorted(xs, reverse=kind == 1)))
        return f"Sort these numbers in {order} order: {listed}.", _answer(ys), None
    if kind == 2:
        s = sum(xs)
        return (
            f"What is the sum of these numbers: {listed}?",
            _answer(s, f"{' + '.join(map(str, xs))} = {s}. "),
            s,
        )
    if kind == 3:
        which = rng.choice(["largest", "smallest"])
        v = max(xs) if which == "largest" else min(xs)
        return f"What is the {which} number in this list: {listed}?", _answer(v), v
    v = sum(x % 2 == 0 for x in xs)
    return f"How many even numbers are in this list: {listed}?", _answer(v), v


def string_task(rng: random.Random) -> tuple[str, str, object]:
    if rng.random() < 0.6:
        w = rng.choice(WORDS)
    else:
        w = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 14)))
    kind = rng.randrange(3)
    if kind == 0:
        return f'Reverse the string "{w}".', _answer(w[::-1]), None
    if kind == 1:
        ch = rng.choice(w) if rng.random() < 0.8 else rng.choice("xyz")
        return f'How many times does the letter "{ch}" appear in "{w}"?', _answer(w.count(ch)), w.count(ch)
    return f'How many letters are in the word "{w}"?', _answer(len(w)), len(w)


def compare_task(rng: random.Random) -> tuple[str, str, int]:
    a = rng.randint(10, 99999)
    b = max(1, a + rng.randint(-2000, 2000)) if rng.random() < 0.5 else int(str(a)[::-1])
    if a == b:
        b += 1
    which = rng.choice(["larger", "smaller"])
    v = max(a, b) if which == "larger" else min(a, b)
    return f"Which number is {which}: {a} or {b}?", _answer(v), v


def unit_task(rng: random.Random) -> tuple[str, str, None]:
    (src, dst), f = rng.choice(sorted(UNITS.items()))
    v = rng.randint(1, 250)
    # The answer carries a unit, so no numeric follow-up is asked on it (value None).
    return f"Convert {v} {src} to {dst}.", _answer(f"{v * f} {dst}", f"{v} * {f} = {v * f}. "), None


def follow_up(rng: random.Random, prev: int) -> tuple[str, str, int]:
    n = rng.randint(2, 99)
    op = rng.choice(["add", "subtract", "multiply"])
    if op == "add":
        return f"Now add {n} to that.", _answer(prev + n, f"{prev} + {n} = {prev + n}. "), prev + n
    if op == "subtract":
        return f"Now subtract {n} from that.", _answer(prev - n, f"{prev} - {n} = {prev - n}. "), prev - n
    n = rng.randint(2, 9)
    return f"Now multiply that by {n}.", _answer(prev * n, f"{prev} * {n} = {prev * n}. "), prev * n


SINGLE_TASKS = [arithmetic, word_problem, list_task, string_task, compare_task, unit_task]


def exchange(rng: random.Random, prev: object) -> tuple[list[dict], object]:
    """One user question and its assistant answer (a follow-up when the last answer was a number)."""
    if isinstance(prev, int) and rng.random() < 0.35:
        q, a, v = follow_up(rng, prev)
    else:
        q, a, v = rng.choice(SINGLE_TASKS)(rng)
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}], v


def conversation(rng: random.Random) -> list[dict]:
    u = rng.random()
    msgs: list[dict] = []
    if u < 0.03:  # calculator tool call
        a, b = rng.randint(100, 9999), rng.randint(11, 999)
        op = rng.choice("+*")
        c = a + b if op == "+" else a * b
        return [
            {"role": "system", "content": TOOL_SYSTEM},
            {"role": "user", "content": f"What is {a} {op} {b}?"},
            {"role": "assistant", "content": f"CALL calculator({a} {op} {b})"},
            {"role": "tool", "content": str(c)},
            {"role": "assistant", "content": _answer(c)},
        ]
    if rng.random() < 0.2:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if u < 0.06:  # one long list
        q, a, _ = list_task(rng, size=rng.randint(40, 240))
        return msgs + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    turns = 1 if u < 0.75 else min(24, 2 + int(rng.expovariate(1 / 3)))
    prev: object = None
    for _ in range(turns):
        pair, prev = exchange(rng, prev)
        msgs += pair
    return msgs


def generate(seed: int = SEED, n: int = NUM_CONVERSATIONS) -> list[list[dict]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def _questions(c: list[dict]) -> list[str]:
    """The questions a conversation asks (follow-ups excepted: their answer depends on the one before)."""
    return [m["content"] for m in c if m["role"] == "user" and not m["content"].startswith("Now ")]


def heldout(seed: int = HELDOUT_SEED, n: int = NUM_HELDOUT) -> list[list[dict]]:
    """`n` conversations of the generator under `seed`, none asking a question of the training set."""
    trained = {q for c in generate() for q in _questions(c)}
    rng = random.Random(seed)
    out: list[list[dict]] = []
    while len(out) < n:
        c = conversation(rng)
        if not any(q in trained for q in _questions(c)):
            out.append(c)
    return out


def without_heldout_questions(conversations: list[list[dict]]) -> list[list[dict]]:
    """A training set larger than the shipped one, less every conversation asking a held-out question
    (the shipped set is a prefix of `generate(SEED, n)` and needs no filter: the held-out set avoids it)."""
    with gzip.open(HELDOUT_OUTPUT, "rt") as f:
        held = {q for line in f for q in _questions(json.loads(line)["messages"])}
    return [c for c in conversations if not any(q in held for q in _questions(c))]


def serialise(conversations: list[list[dict]]) -> bytes:
    text = "".join(json.dumps({"messages": c}, ensure_ascii=True) + "\n" for c in conversations)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(text.encode("ascii"))
    return buf.getvalue()


# ============================================================================ main
def length_table(conversations: list[list[dict]]) -> dict[str, int]:
    import numpy as np

    tok = ByteTokenizer()
    lengths = np.array([len(encode_conversation(tok, c).input_ids) for c in conversations])
    q = {"min": lengths.min(), "median": np.median(lengths), "p90": np.percentile(lengths, 90)}
    q |= {"p99": np.percentile(lengths, 99), "max": lengths.max(), "mean": lengths.mean()}
    q["share_40_300"] = 100 * np.mean((lengths >= 40) & (lengths <= 300))
    return {k: round(float(v)) for k, v in q.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="regenerate in memory and compare with the shipped file"
    )
    ap.add_argument(
        "--heldout", action="store_true", help=f"the held-out evaluation set ({HELDOUT_OUTPUT.name}) instead"
    )
    ap.add_argument("--seed", type=int, default=None, help=f"default {SEED} ({HELDOUT_SEED} with --heldout)")
    ap.add_argument(
        "--num", type=int, default=None, help=f"default {NUM_CONVERSATIONS} ({NUM_HELDOUT} with --heldout)"
    )
    ap.add_argument("--output", type=Path, default=None, help="default: the shipped asset")
    ap.add_argument(
        "--exclude-heldout",
        action="store_true",
        help="drop conversations that ask a question of the held-out set (for a larger --num training set)",
    )
    args = ap.parse_args()
    if args.exclude_heldout and (args.heldout or args.output is None):
        ap.error("--exclude-heldout makes a training set of your own: give --output, not --heldout")
    if args.heldout:
        conversations = heldout(args.seed or HELDOUT_SEED, args.num or NUM_HELDOUT)
        args.output = args.output or HELDOUT_OUTPUT
    else:
        conversations = generate(args.seed or SEED, args.num or NUM_CONVERSATIONS)
        if args.exclude_heldout:
            n = len(conversations)
            conversations = without_heldout_questions(conversations)
            print(f"dropped {n - len(conversations)} of {n} conversations asking a held-out question")
        args.output = args.output or OUTPUT
    data = serialise(conversations)
    bad = [(i, e) for i, c in enumerate(conversations) for e in check_conversation(c)]
    stats = length_table(conversations)
    print(f"{len(conversations)} conversations, {len(data) / 1e6:.2f} MB compressed")
    print(
        "tokens (byte tokenizer): " + "  ".join(f"{k}={v}" for k, v in stats.items() if k != "share_40_300")
    )
    print(f"{stats['share_40_300']}% of conversations have 40-300 tokens")
    if bad:
        print(f"{len(bad)} checker failures, first: {bad[:3]}", file=sys.stderr)
        return 1
    if args.check:
        if not args.output.is_file() or args.output.read_bytes() != data:
            print(f"{args.output} differs from the regenerated dataset", file=sys.stderr)
            return 1
        print(f"{args.output}: identical, every answer verified")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(data)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
