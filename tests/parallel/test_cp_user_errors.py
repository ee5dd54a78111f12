"""A context-parallel degree that does not divide the world is refused by the Trainer before any
process group exists, with the numbers. (T or data.pad_to_multiple not divisible by 2*cp:
tests/test_config.py; a document not a multiple of 2*cp: tests/ops/test_cp_attention.py.)"""

import pytest
import torch

from tests.test_train import _cfg
from titan_thd.train import Trainer


@pytest.mark.parametrize("world, cp", [("4", "3"), ("3", "2")])
def test_cp_degree_must_divide_the_world(tmp_path, monkeypatch, world, cp):
    monkeypatch.setenv("WORLD_SIZE", world)
    overrides = ["--parallelism.context_parallel_degree", cp, "--data.pad_to_multiple", str(2 * int(cp))]
    cfg = _cfg(tmp_path, *overrides, "--training.tokens_per_microbatch", "504")  # 504 = 2^3 * 3^2 * 7
    with pytest.raises(ValueError, match=rf"pp 1 × cp {cp} × tp 1 = {cp} does not divide world size {world}"):
        Trainer(cfg)
    assert not torch.distributed.is_initialized()
