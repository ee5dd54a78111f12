"""llama's LoRA targets (models/projection.py, resolved by lora/targets.py): the attention and MLP projections of every block."""

from __future__ import annotations

from titan_thd.models.projection import LoRATargets, Target

_ATTENTION = ("wq", "wk", "wv", "wo")
_MLP = ("w1", "w3", "w2")

LORA = LoRATargets(
    targets={f"attention.{n}": Target(f"attention.{n}") for n in _ATTENTION}
    | {f"mlp.{n}": Target(f"feed_forward.{n}") for n in _MLP},
    groups={"attention": tuple(f"attention.{n}" for n in _ATTENTION), "mlp": tuple(f"mlp.{n}" for n in _MLP)},
)
