"""Host synchronisations of one optimizer step stay where docs/design.md §3.12 lists them.

One step of the dsv4 recipe (micro flavor) and of the tiny llama, each as configured and with
loss.chunked + full recomputation + activation_checkpoint.offload, counted per place by
tests/_syncs.py; every place must be listed in the table and its count must not exceed the listed
one (a new `.item()` in the step fails here, with its place).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests import _tiny_llama
from tests._syncs import SyncCounter
from tests.test_train_compose import config
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
DOC = Path(__file__).resolve().parents[1] / "docs" / "design.md"
OPTIONS = ["--loss.chunked", "true", "--loss.chunk_tokens", "37", "--activation_checkpoint.mode", "full"]
OPTIONS += ["--activation_checkpoint.offload", "true"]
COLUMNS = {("dsv4", False): 0, ("dsv4", True): 1, ("llama", False): 2, ("llama", True): 3}


def listed() -> dict[str, list[int]]:
    """{place: counts per column} of the table of docs/design.md §3.12."""
    section = DOC.read_text().split("### 3.12 Host synchronisations", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", section, re.M)
    assert len(rows) >= 10, rows
    return {place: [int(n) for n in counts] for place, *counts in rows}


def _counts(dump: Path, model: str, options: bool) -> dict[str, int]:
    trainer = Trainer(
        resolve_run(config(dump, model, 1, "--checkpoint.enable", "false", *(OPTIONS * options)))
    )
    try:
        batch = trainer.next_step_batch()
        with SyncCounter() as counter:
            trainer.train_step(batch)
    finally:
        trainer.close()
    return dict(counter.counts)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "options"), list(COLUMNS))
def test_host_synchronisations_stay_as_listed(tmp_path, model, options):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _tiny_llama.register()
    try:
        got = _counts(tmp_path / "run", model, options)
    finally:
        torch.set_num_threads(threads)
    table, column = listed(), COLUMNS[(model, options)]
    assert got, "nothing counted: the counter sees no op"
    for place, n in sorted(got.items()):
        assert place in table, (
            f"{place}: {n} host synchronisations in one step, not listed in docs/design.md §3.12"
        )
        assert n <= table[place][column], (
            f"{place}: {n} > {table[place][column]} listed in docs/design.md §3.12"
        )
