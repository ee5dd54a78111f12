"""The allowed values of the configuration's choice fields, one `typing.Literal` alias each.

sections.py annotates its fields with these; `CHOICES` (schema.py), the loader's coercion and
`--help` read the allowed values back from the annotations at run time, so they must be importable
without the modules that act on them. This module imports nothing but `typing`: the config package
stays a leaf of the import graph (tests/test_imports.py).

The modules that act on a choice import its alias from here and derive what they need from it
(`MODEL_NAMES = get_args(ModelName)` in titan_thd/models/__init__.py, `SCHEDULES` in
pipeline/schedule.py, ...). A choice used by one field only and acted on by no other module is
written inline in sections.py (`Literal["adamw", "muon"]`).
"""

from typing import Literal

# ============================================================================ [model]
ModelName = Literal["llama", "dsv4"]
"""Values of model.name: one per family package of titan_thd/models/ (a family is imported only
when asked for, by `get_model_spec`)."""

# ============================================================================ [data]
Schema = Literal["messages", "sharegpt", "alpaca", "text"]
"""Record schemas (data/sources.py detects and reads them; data.format also accepts `auto`)."""
ChatTemplate = Literal["auto", "simple", "deepseek"]
"""Values of data.chat_template: `simple` (the project's markers), `deepseek` (DeepSeek-V4's own format)
or `auto` (deepseek for a tokenizer that has DeepSeek's chat tokens); data/tokenizer.py renders them."""

# ============================================================================ [training]
Policy = Literal["balanced", "dp_balanced"]
"""Values of training.planner (data/planner.py)."""
ComputeChoice = Literal["auto", "float32", "bfloat16"]
"""Values of training.mixed_precision_param (components/precision.py)."""
ReduceChoice = Literal["float32", "bfloat16"]
"""Values of training.mixed_precision_reduce (components/precision.py)."""
CompileChoice = bool | Literal["auto"]
"""Values of training.compile (models/compile.py decides what `auto` means)."""

# ============================================================================ [parallelism]
CPConfigMode = Literal["auto", "zigzag", "contiguous", "hybrid"]
"""Values of parallelism.context_parallel_mode: a CP mode (parallel/context_parallel.py `CPMode`), or
"auto" = the model's declared mode."""
Schedule = Literal["1F1B", "GPipe", "Interleaved1F1B"]
"""Values of parallelism.pipeline_parallel_schedule (pipeline/schedule.py plays each on one timetable)."""

# ============================================================================ [activation_checkpoint]
ACMode = Literal["none", "full", "selective"]
"""activation_checkpoint.mode: nothing, whole blocks, or the named regions of each block
(parallel/activation_checkpoint.py)."""
