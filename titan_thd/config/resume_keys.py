"""What a resume may change: the config keys that define a run, against those that only decide how it
is computed (docs/design.md §3.11).

A config fact, read by the checks of `checkpoint.allow_changes` (checks.py) and by the comparison of a
checkpoint's settings with this run's (components/run_settings.py). Keys not named here (layout,
`training.steps`, checkpoint / metrics / job settings, ...) are free to change between invocations.
"""

RUN_KEYS: tuple[str, ...] = (
    # schedule
    "optimizer.lr",
    "lr_scheduler.total_steps",
    "lr_scheduler.warmup_steps",
    "lr_scheduler.decay",
    "lr_scheduler.min_lr_factor",
    # optimizer and update
    "optimizer.name",
    "optimizer.weight_decay",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "optimizer.muon_momentum",
    "optimizer.muon_ns_steps",
    "training.max_norm",
    "training.dtype",
    # batch
    "training.global_batch_size",
    "training.tokens_per_microbatch",
    # data
    "training.seed",
    "data.source",
    "data.path",
    "data.format",
    "data.tokenizer",
    "data.chat_template",
    "data.mock_config",
    "data.num_samples",
    "data.shuffle",
    "data.overlong",
    "validation.fraction",
    # what is trained (lora.base: the frozen base's fingerprint, added by start-up)
    "lora.enable",
    "lora.rank",
    "lora.alpha",
    "lora.rslora",
    "lora.targets",
)
"""Config keys that define the run (plus `model.args.<name>`, except `HOW_MODEL_ARGS`)."""
ADDED = ("lora.base",)
"""Run settings that start-up adds, not config keys: lora.base, a LoRA run's frozen base (its folder and
fingerprint; components/run_settings.py BASE). checkpoint.allow_changes may name them."""
FIXED = ("training.seed", "training.global_batch_size")
"""Run settings a resume cannot change: they place the checkpoint's data position."""
HOW_MODEL_ARGS = ("attention_backend", "attn_chunk")
"""model.args entries that change how the model is computed, not what it computes."""
