"""A llama flavor small enough for trainer tests that run many steps in many processes.

The trainer takes model sizes from named flavors only, so tests register one more flavor: the
`tiny_llama` fixture (tests/conftest.py) for the test process, `register()` in spawn workers and
subprocesses (fresh processes whose table dies with them).
"""

from titan_thd.models.llama.args import LlamaArgs, flavors

NAME = "test_tiny"
ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160)  # 127k parameters
DEEP = "test_tiny4"
"""The same with 4 layers: pipeline tests with a middle stage (pp 3 splits it 2 | 1 | 1)."""
DEEP_ARGS = LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160)
FLAVORS = {NAME: ARGS, DEEP: DEEP_ARGS}


def register() -> str:
    for name, args in FLAVORS.items():
        flavors.setdefault(name, args)
    return NAME
