"""Step 5 of the check: greedy generation with the cache on the device gives the CPU's tokens.

Both recipes' models, untrained (the seeded initialisation), in float32, the same chat prompts. On a
CUDA machine: the cache decoder on cuda against the cache decoder on the CPU. Without CUDA: the cache
decoder against the full-recompute decoder (both on the CPU), which checks the comparison itself and
the cache. Greedy tokens of float32 runs agree unless two logits tie within the reduction-order noise
(~1e-6 relative); a differing token is reported with its position.
"""

from __future__ import annotations

import torch

from titan_thd.check.recipes import RECIPES, ROOT, SMALL
from titan_thd.check.steps import Context, Outcome, Step

PROMPTS = ["What is 12 + 7?", "Reverse the string 'abc'."]


def greedy(model: str, device: torch.device, decoder: str, new_tokens: int, small: bool) -> list[list[int]]:
    from titan_thd.inference.loading import load_model

    argv = ["--job.config_file", str(ROOT / "train_configs" / RECIPES[model])]
    argv += list(SMALL[model]) if small else []
    loaded = load_model(argv, untrained=True, device=device, dtype="float32")
    prompts = [loaded.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    return [c.tokens for c in loaded.generate(prompts, new_tokens, decoder=decoder)]


def generation_step(model: str) -> Step:
    def run(ctx: Context) -> Outcome:
        n, small = (32, False) if ctx.gpu else (6, True)
        if ctx.gpu:
            got, ref, what = (
                greedy(model, ctx.device, "cache", n, small),
                greedy(model, torch.device("cpu"), "cache", n, small),
                "cuda cache vs CPU",
            )
        else:
            got, ref, what = (
                greedy(model, ctx.device, "cache", n, small),
                greedy(model, ctx.device, "recompute", n, small),
                "cache vs recompute (CPU)",
            )
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                return Outcome(
                    "FAIL", f"prompt {i}: token {at} differs ({what})", {"got": got, "reference": ref}
                )
        tokens = sum(len(t) for t in got)
        return Outcome("PASS", f"{tokens} greedy tokens equal, {what}", {"tokens": got})

    return Step(f"5 {model} generation", run, limit_s=(120.0, 30.0))


STEPS = [generation_step("llama"), generation_step("dsv4")]
