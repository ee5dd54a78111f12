"""docs/data.md §1's copy-paste pair, run as written: pack the recipe's data offline, then train on
the pack. The commands run in a scratch folder that links `.venv`, `scripts`, `train_configs`,
`run_train.sh`, `titan_thd` and `pyproject.toml` of this checkout, so `packs/` and `outputs/` land there. One deviation: the training
command gets `--training.steps 1` (and no MFU peak measurement); the pack is the real one."""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA_MD = (ROOT / "docs" / "data.md").read_text()


def pack_commands() -> list[str]:
    section = DATA_MD.split("## 1. Offline packs that balance", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, "docs/data.md §1 has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_docs_give_a_pack_and_train_pair():
    pack, train = pack_commands()
    assert "scripts/prepare_packed_data.py" in pack and "--output packs/chat_2048" in pack
    assert train.startswith("./run_train.sh") and "--data.source packed --data.path packs/chat_2048" in train


@pytest.mark.slow
def test_the_pack_and_train_pair_runs_as_written(tmp_path):
    for name in (".venv", "scripts", "train_configs", "run_train.sh", "titan_thd", "pyproject.toml"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pack, train = pack_commands()
    for line, extra in ((pack, []), (train, ["--training.steps", "1", "--metrics.peak_tflops", "1"])):
        proc = subprocess.run(
            [*shlex.split(line), *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    meta = json.loads((tmp_path / "packs" / "chat_2048" / "metadata.json").read_text())
    assert meta["tokens_per_microbatch"] == 2048
    record = json.loads(
        (tmp_path / "outputs" / "dsv4_flash_thd" / "metrics.jsonl").read_text().splitlines()[0]
    )
    # 2 rows of ~9 conversations: about the recipe's 12 conversations per step, all of them real tokens
    assert record["step"] == 1 and 2 * 2048 * 0.9 < record["tokens_real"] <= 2 * 2048, record
