"""A llama flavor small enough for trainer tests that run many steps in many processes.

The trainer takes model sizes from named flavors only, so tests register one more flavor: the
`tiny_llama` fixture (tests/conftest.py) for the test process, `register()` in spawn workers and
subprocesses (fresh processes whose table dies with them).
"""

from titan_thd.models.llama.args import LlamaArgs, flavors

NAME = "test_tiny"
ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=160)  # 127k parameters


def register() -> str:
    flavors.setdefault(NAME, ARGS)
    return NAME
