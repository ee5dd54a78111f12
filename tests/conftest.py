"""Shared fixtures and argument lists.

- `tiny_llama`: the small llama test flavor, registered in the flavors table for the tests of one
  module and removed afterwards (tests never edit the global table themselves; spawned workers
  and subprocesses, where fixtures do not run, call `tests._tiny_llama.register()`).
- `TRAIN_ARGS` / `make_config`: the small chat-SFT trainer run most trainer tests start from.
"""

import pytest

from tests import _tiny_llama
from titan_thd.config import Config, load_config
from titan_thd.models.llama.args import flavors as llama_flavors

TRAIN_ARGS: tuple[str, ...] = (
    "--data.source", "jsonl",
    "--data.path", "chat_sft.jsonl.gz",
    "--training.global_batch_size", "8",
    "--training.tokens_per_microbatch", "512",
    "--metrics.enable_tensorboard", "false",
)  # fmt: skip
"""Chat SFT on the embedded dataset, 8 conversations per step in microbatches of 512 tokens."""


@pytest.fixture(autouse=True, scope="session")
def _activation_cache(tmp_path_factory):
    """Activation measurements cached on disk (titan_thd/memory/cache.py) go to the session's tmp
    folder (subprocesses inherit it): tests neither read a developer's cache nor leave one behind."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TITAN_THD_CACHE", str(tmp_path_factory.mktemp("titan_thd_cache")))
        yield


@pytest.fixture(scope="module")
def tiny_llama():
    """The flavor name of `tests._tiny_llama` (127k parameters), registered for one test module
    (with its 4-layer sibling `_tiny_llama.DEEP`)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, args in _tiny_llama.FLAVORS.items():
            mp.setitem(llama_flavors, name, args)
        yield _tiny_llama.NAME


@pytest.fixture
def make_config(tmp_path):
    """`make_config(*overrides)`: a validated 2-step TRAIN_ARGS config dumping under tmp_path."""

    def make(*extra: str) -> Config:
        return load_config([*TRAIN_ARGS, "--training.steps", "2", "--job.dump_folder", str(tmp_path), *extra])

    return make
