"""Answer accuracy on held-out conversations of the embedded dataset, graded by its own checker.

    conversations = heldout_conversations(limit=200)
    result = evaluate(model, tokenizer, conversations, spec=get_model_spec(cfg.model.name), context=2048)
    result.accuracy, result.format_accuracy, result.families["arithmetic"].accuracy

The held-out set is `titan_thd/assets/chat_heldout.jsonl.gz` (scripts/make_chat_dataset.py --heldout: the
training set's generator under another seed, without any conversation that asks a question of the
training set), or any file of the same schema. Every user question is one problem, asked with the
conversation's true history before it (earlier questions and their reference answers), so a follow-up
("Now add 17 to that.") is graded on its own. The model's greedy reply is graded by chat_tasks.py:

- exact: the reply ends with "The answer is X." for the correct X (the dataset's own check);
- format: the reply ends with "The answer is ...." (any value);
- calculator conversations (family `tool`): the model should first reply `CALL calculator(a op b)`; a
  call is counted in `tool_call_accuracy` when it computes the right value, and whatever it computes
  is returned by the calculator as the tool turn, after which the model's next reply is the graded
  answer. A reply that is not a call is graded as the answer directly.

A problem is `skipped` when its prompt leaves fewer than its reply budget within the context. The
reply budget is the reference answer's length plus `slack` tokens (capped by `max_new_tokens`): a
reply longer than that could not be right. Problems are generated in packed batches of
`batch_size` (generate.py, cached decoding), sorted by prompt length.
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from titan_thd.data.chat_template import encode_prompt
from titan_thd.data.sources import ASSETS_DIR
from titan_thd.data.tokenizer import Tokenizer
from titan_thd.inference.chat_tasks import FAMILIES, TOOL_SYSTEM, calculator, classify, grade_reply
from titan_thd.inference.generate import GenerationStats, generate
from titan_thd.inference.loading import stop_ids
from titan_thd.inference.sampling import Sampling
from titan_thd.models.spec import ModelSpec
from titan_thd.parallel.shards import canonical_name

HELDOUT = ASSETS_DIR / "chat_heldout.jsonl.gz"
logger = logging.getLogger("titan_thd")


def heldout_conversations(path: str | Path = HELDOUT, limit: int = 0) -> list[list[dict]]:
    """The first `limit` conversations (0 = all) of a `messages` JSONL(.gz) file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"held-out conversations: {path} is not a file")
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line)["messages"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: expected a JSON object with a messages list") from None
            if limit and len(out) == limit:
                break
    return out


@dataclass
class Problem:
    history: list[dict]
    """The conversation up to and including the question (true history before it)."""
    expected: object
    family: str
    reference: str
    """The dataset's longest reply to it (its length sets the reply budget)."""


def problems(conversations: Sequence[list[dict]]) -> list[Problem]:
    """Every user question of the conversations the checker can solve, with its family."""
    out = []
    for messages in conversations:
        tool = any(m["role"] == "system" and m["content"] == TOOL_SYSTEM for m in messages)
        prev: object = None
        for i, m in enumerate(messages):
            if m["role"] != "user":
                continue
            family, expected = classify(m["content"], prev)
            replies = []
            for r in messages[i + 1 :]:
                if r["role"] == "user":
                    break
                if r["role"] == "assistant":
                    replies.append(r["content"])
            if family is None or expected is None or not replies:
                continue
            out.append(
                Problem(messages[: i + 1], expected, "tool" if tool else family, max(replies, key=len))
            )
            prev = expected
    return out


@dataclass
class Tally:
    problems: int = 0
    exact: int = 0
    format: int = 0
    skipped: int = 0
    tool_calls: int = 0
    """Tool problems whose first reply was a correct calculator call."""

    @property
    def accuracy(self) -> float:
        return self.exact / self.problems if self.problems else 0.0

    @property
    def format_accuracy(self) -> float:
        return self.format / self.problems if self.problems else 0.0

    def add(self, other: Tally) -> None:
        for k in ("problems", "exact", "format", "skipped", "tool_calls"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def counts(self) -> list[int]:
        return [self.problems, self.exact, self.format, self.skipped, self.tool_calls]


@dataclass
class EvalResult:
    families: dict[str, Tally] = field(default_factory=lambda: {f: Tally() for f in FAMILIES})
    seconds: float = 0.0
    stats: GenerationStats = field(default_factory=GenerationStats)
    samples: list[tuple[str, str, bool]] = field(default_factory=list)
    """(question, final reply, exact) of the first problems, for a look at what the model says."""

    @property
    def total(self) -> Tally:
        t = Tally()
        for f in self.families.values():
            t.add(f)
        return t

    @property
    def accuracy(self) -> float:
        return self.total.accuracy

    @property
    def format_accuracy(self) -> float:
        return self.total.format_accuracy

    def metrics(self, prefix: str = "val/") -> dict[str, float]:
        """`val/accuracy`, `val/format_accuracy`, and `val/accuracy/<family>` of the families asked."""
        out = {f"{prefix}accuracy": self.accuracy, f"{prefix}format_accuracy": self.format_accuracy}
        tool = self.families["tool"]
        if tool.problems:
            out[f"{prefix}tool_call_accuracy"] = tool.tool_calls / tool.problems
        for name, t in self.families.items():
            if t.problems:
                out[f"{prefix}accuracy/{name}"] = t.accuracy
        return out

    def table(self) -> str:
        rows = [f"{'family':<14}{'problems':>9}{'skipped':>9}   exact-answer accuracy   format accuracy"]
        for name, t in [*self.families.items(), ("all", self.total)]:
            if t.problems or t.skipped or name == "all":
                extra = (
                    f"   tool-call accuracy {t.tool_calls / t.problems:6.1%}"
                    if name == "tool" and t.problems
                    else ""
                )
                rows.append(
                    f"{name:<14}{t.problems:>9}{t.skipped:>9}   accuracy {t.accuracy:6.1%} ({t.exact:>4})"
                    f"       accuracy {t.format_accuracy:6.1%}{extra}"
                )
        return "\n".join(rows)

    def counts(self) -> torch.Tensor:
        """[families, 5] counts (problems, exact, format, skipped, tool calls): summable over ranks."""
        return torch.tensor([t.counts() for t in self.families.values()], dtype=torch.float64)

    def set_counts(self, counts: torch.Tensor) -> None:
        for t, row in zip(self.families.values(), counts.round().long().tolist(), strict=True):
            t.problems, t.exact, t.format, t.skipped, t.tool_calls = row


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokenizer: Tokenizer,
    conversations: Sequence[list[dict]],
    *,
    spec: ModelSpec | None,
    device: torch.device | str = "cpu",
    context: int,
    max_new_tokens: int = 512,
    slack: int = 16,
    batch_size: int = 16,
    decoder: str = "auto",
    keep_samples: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
) -> EvalResult:
    """Grade the model's greedy replies to every problem of `conversations` (module docstring);
    `spec`: the model's family (its cached decoder; generate.generate); `progress(done, total,
    seconds)` is called after every batch."""
    t0 = time.perf_counter()
    result = EvalResult()
    stops = stop_ids(tokenizer)
    todo = []
    for p in problems(conversations):
        prompt = encode_prompt(tokenizer, p.history)
        budget = min(max_new_tokens, len(tokenizer.encode(p.reference)) + slack)
        if len(prompt) + budget > context:
            result.families[p.family].skipped += 1
            continue
        todo.append((prompt, budget, p))
    todo.sort(key=lambda item: len(item[0]))

    def replies(prompts: list[list[int]], budgets: list[int]) -> list[str]:
        completions = generate(
            model,
            prompts,
            spec=spec,
            max_new_tokens=budgets,
            stop_ids=stops,
            sampling=Sampling(),
            vocab_size=tokenizer.vocab_size,
            context=context,
            device=device,
            decoder=decoder,
            stats=result.stats,
        )
        return [tokenizer.decode(c.text_ids(stops)) for c in completions]

    for b in range(0, len(todo), batch_size):
        batch = todo[b : b + batch_size]
        first = replies([prompt for prompt, _, _ in batch], [budget for _, budget, _ in batch])
        final = list(first)
        # Calculator conversations: run the model's call, feed the result back, ask for the answer.
        called = [(j, calculator(r)) for j, r in enumerate(first) if batch[j][2].family == "tool"]
        called = [(j, value) for j, value in called if value is not None]
        follow = []
        for j, value in called:
            p = batch[j][2]
            history = [
                *p.history,
                {"role": "assistant", "content": first[j]},
                {"role": "tool", "content": value},
            ]
            follow.append((j, encode_prompt(tokenizer, history), batch[j][1]))
            if value == str(p.expected):
                result.families["tool"].tool_calls += 1
        follow = [(j, prompt, budget) for j, prompt, budget in follow if len(prompt) + budget <= context]
        if follow:
            for (j, _, _), reply in zip(follow, replies([f[1] for f in follow], [f[2] for f in follow])):
                final[j] = reply
        for (_, _, p), reply in zip(batch, final):
            grade = grade_reply(reply, p.expected)
            t = result.families[p.family]
            t.problems += 1
            t.exact += grade.exact
            t.format += grade.format
            if len(result.samples) < keep_samples:
                result.samples.append((p.history[-1]["content"], reply, grade.exact))
        if progress is not None:
            progress(b + len(batch), len(todo), time.perf_counter() - t0)
    result.seconds = time.perf_counter() - t0
    return result


# ============================================================================ during training
class TrainingEvaluator:
    """`[evaluation]` of a training run: every `freq` steps and after the last, the accuracy metrics.

    Takes what it needs as arguments, not the trainer: the live model (sharded or not), a builder of a
    whole single-process copy, the device. On one process the live model answers; on several, every
    rank gathers the whole weights (FSDP / TP shards, get_model_state_dict(full_state_dict=True)) into
    its own copy, answers 1/world of the conversations, and the counts are summed, so the metrics do
    not depend on the layout (pipeline and expert parallelism are refused by the config check)."""

    def __init__(self, cfg, last_step: int, tokenizer: Tokenizer, context: int, spec: ModelSpec):
        self.freq, self.last_step, self.max_new_tokens = cfg.freq, last_step, cfg.max_new_tokens
        self.tokenizer, self.context, self.spec = tokenizer, context, spec
        self.conversations = heldout_conversations(cfg.path or HELDOUT, cfg.limit)

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    def run(self, model: nn.Module, build_model, device: torch.device) -> dict[str, float]:
        """val/* accuracy metrics of `model` now; every rank calls it (the values are global)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        conversations = self.conversations
        if world > 1:
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            with torch.random.fork_rng(devices=[]):  # the copy's initialisation leaves the run's RNG alone
                copy = build_model()
            copy.load_state_dict({canonical_name(k): v for k, v in full.items()})
            model = copy.to(device=device, dtype=next(model.parameters()).dtype)
            conversations = conversations[rank::world]
        result = evaluate(
            model,
            self.tokenizer,
            conversations,
            spec=self.spec,
            device=device,
            context=self.context,
            max_new_tokens=self.max_new_tokens,
        )
        if world > 1:
            counts = result.counts().to(device)
            dist.all_reduce(counts)
            result.set_counts(counts.cpu())
            seconds = torch.tensor([result.seconds], device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            result.seconds = float(seconds)
        if rank == 0:
            t = result.total
            logger.info(
                "evaluation: val/accuracy %.3f  val/format_accuracy %.3f  (%d problems of %d held-out "
                "conversations, %d skipped, %.1f s)",
                result.accuracy,
                result.format_accuracy,
                t.problems,
                len(self.conversations),
                t.skipped,
                result.seconds,
            )
        return result.metrics("val/")
