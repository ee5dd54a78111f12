"""Configuration: nested dataclass sections, TOML files and `--section.field value` overrides.

Precedence: command line > TOML file > defaults. Every field has a docstring (the string literal
right after it), which `--help` prints. Unknown keys, wrong types and invalid values are
`ValueError`s that name the field, the value and what is allowed. `validate()` runs before any
process group exists.

    cfg = load_config(["--job.config_file", "train_configs/debug_dense_thd.toml",
                       "--training.steps", "20"])

One concern a file: sections.py (the dataclasses and their field docstrings), choices.py (the
Literal aliases of the choice fields), schema.py (what the sections declare, read back: types,
docstrings, CHOICES), loader.py (TOML, command line, coercion), checks.py (validate),
resume_keys.py (what a resume may change), render.py (to_toml, help_text), __main__.py
(`python -m titan_thd.config`). Callers import from the package: `from titan_thd.config import
Config, load_config`.

The package is a leaf of the import graph: it imports nothing else of titan_thd (nor torch or
numpy), so every other module may import it at run time (tests/test_imports.py).
"""

from titan_thd.config.checks import validate
from titan_thd.config.loader import coerce, load_config
from titan_thd.config.render import help_text, to_toml
from titan_thd.config.schema import CHOICES, field_docs
from titan_thd.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Config,
    Data,
    Evaluation,
    Job,
    Loss,
    LRScheduler,
    Memory,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Training,
    Validation,
)

__all__ = [
    "CHOICES",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Config",
    "Data",
    "Evaluation",
    "Job",
    "Loss",
    "LRScheduler",
    "Memory",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Training",
    "Validation",
    "coerce",
    "field_docs",
    "help_text",
    "load_config",
    "to_toml",
    "validate",
]
