"""A llama flavor small enough for trainer tests that run many steps in many processes.

The trainer takes model sizes from named flavors only, so tests register one more flavor (in
every process that builds a Trainer: spawn workers and subprocesses call `register()` too).
"""

from titan_thd.models.llama.args import LlamaArgs, flavors

NAME = "test_tiny"
ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160)  # 127k parameters
DEEP = "test_tiny4"
"""The same with 4 layers: pipeline tests with a middle stage (pp 3 splits it 2 | 1 | 1)."""


def register() -> str:
    flavors.setdefault(NAME, ARGS)
    flavors.setdefault(DEEP, LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160))
    return NAME


def unregister() -> None:
    flavors.pop(NAME, None)
    flavors.pop(DEEP, None)
