"""Offline packing: scripts/prepare_packed_data.py round trip, determinism, the packed StepBatch
stream, and the user errors of data.source = "packed"."""

import importlib.util
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from titan_thd.config import Data
from titan_thd.data.dataloader import DataLayout, build_dataloader
from titan_thd.data.packed_dataset import first_fit, open_packed, pack_rows
from titan_thd.data.packer import padded_lengths
from titan_thd.data.rows import full_rows
from titan_thd.data.sampler import global_batch_indices
from titan_thd.data.token_store import build_token_store
from titan_thd.data.tokenizer import build_tokenizer

T, MULT = 256, 4
ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location(
        "prepare_packed_data", ROOT / "scripts" / "prepare_packed_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("src") / "chat.jsonl"
    with path.open("w") as f:
        for i in range(80):
            q = "q" * int(rng.integers(1, 60))
            a = f"answer {i} " + "a" * int(rng.integers(1, 150 if i else 400))  # record 0 is longer than T
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                )
                + "\n"
            )
    return path


def pack(source, out, algorithm="first_fit_decreasing", seed=0):
    args = [
        "--source",
        "jsonl",
        "--path",
        str(source),
        "--tokens-per-microbatch",
        str(T),
        "--pad-to-multiple",
        str(MULT),
        "--algorithm",
        algorithm,
        "--seed",
        str(seed),
        "--output",
        str(out),
        "--no-progress",
    ]
    return load_script().main(args)


def reference_store(source):
    cfg = Data(source="jsonl", path=str(source), tokenizer="byte")
    return build_token_store(cfg, build_tokenizer("byte"), 0, "", progress=False).view(T, "truncate")


def test_round_trip_every_document_once_with_exact_tokens_and_masks(source, tmp_path):
    meta = pack(source, tmp_path / "p")
    store = reference_store(source)
    rows = open_packed(tmp_path / "p", pad_to_multiple=MULT)
    table = pq.read_table(tmp_path / "p" / "rows.parquet").to_pydict()
    seen = []
    for r in range(len(rows)):
        samples, index = rows.samples(r), table["sample_index"][r]
        assert padded_lengths(rows.doc_lengths(r), MULT).sum() <= T
        for s, i in zip(samples, index, strict=True):
            ref = store[i]
            np.testing.assert_array_equal(s.input_ids, ref.input_ids)
            np.testing.assert_array_equal(s.target_mask, ref.target_mask)
        seen += index
    assert sorted(seen) == list(range(len(store)))
    assert meta["num_docs"] == len(store) == 80 and meta["num_rows"] == len(rows)
    assert meta["num_truncated"] == 1 and meta["max_doc_len"] == T
    assert meta["packing_efficiency"] == pytest.approx(store.lengths.sum() / (len(rows) * T))
    assert meta["docs_per_row"]["max"] == max(len(x) for x in table["sample_index"])
    assert {"tokens_per_microbatch", "algorithm", "seed", "tokenizer", "pad_to_multiple"} <= meta.keys()


def test_deterministic_and_seeded(source, tmp_path):
    tables = {}
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        pack(source, tmp_path / name, "first_fit_shuffle", seed)
        tables[name] = pq.read_table(tmp_path / name / "rows.parquet").to_pydict()
    assert tables["a"] == tables["b"]
    assert tables["a"]["sample_index"] != tables["c"]["sample_index"]
    assert sorted([i for row in tables["a"]["sample_index"] for i in row]) == sorted(
        [i for row in tables["c"]["sample_index"] for i in row]
    )


def naive_first_fit(sizes, capacity, order):
    bins, free = [], []
    for i in order:
        for b, f in enumerate(free):
            if f >= sizes[i]:
                bins[b].append(i)
                free[b] -= sizes[i]
                break
        else:
            bins.append([i])
            free.append(capacity - sizes[i])
    return bins


@pytest.mark.parametrize("seed", range(3))
def test_first_fit_matches_naive(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 50, 300)
    order = rng.permutation(300)
    assert first_fit(sizes, 64, order) == naive_first_fit(sizes.tolist(), 64, order.tolist())
    decreasing = pack_rows(sizes, 64, 1, "first_fit_decreasing", 0)
    assert decreasing == naive_first_fit(sizes.tolist(), 64, np.lexsort((np.arange(300), -sizes)).tolist())


def packed_loader(path, dp_rank=0, dp_size=2, G=4, T_cfg=T, pad=MULT):
    cfg = Data(source="packed", path=str(path), pad_to_multiple=pad, packed_replan=False)  # row by row
    return build_dataloader(
        cfg,
        None,
        DataLayout(
            dp_rank=dp_rank,
            dp=dp_size,
            cp=1,
            rule=full_rows(T_cfg),
            global_batch_size=G,
            seed=1,
            planner="balanced",
            cost_attention=0.0,
            pad_to_multiple=cfg.pad_to_multiple,
        ),
    )


def test_packed_step_stream(source, tmp_path):
    pack(source, tmp_path / "p")
    rows = open_packed(tmp_path / "p")
    table = pq.read_table(tmp_path / "p" / "rows.parquet").to_pydict()
    loaders = [packed_loader(tmp_path / "p", dp_rank=r) for r in range(2)]
    assert loaders[0].overlong_counts == {"truncated": 1, "dropped": 0}
    for step in range(3):
        ids = global_batch_indices(step, 4, len(rows), 1)
        batches = [next(ld) for ld in loaders]
        for r, b in enumerate(batches):
            assert b.num_microbatches == 2 and b.slot_tokens == 4 * T
            for mb, row in zip(b.microbatches, ids[2 * r : 2 * r + 2], strict=True):
                mb.validate(divisor=MULT)
                assert mb.seqlens[mb.seqlens > 0].tolist() == rows.doc_lengths(int(row)).tolist()
                assert mb.tokens[mb.real_token_mask()].tolist() == table["input_ids"][row]
        assert batches[0].trained_tokens == sum(
            int(mb.loss_mask.sum()) for b in batches for mb in b.microbatches
        )
        assert Counter(batches[0].doc_lengths) == Counter(n for i in ids for n in table["doc_lengths"][i])


def test_packed_source_errors(source, tmp_path):
    pack(source, tmp_path / "p")
    with pytest.raises(
        ValueError, match=r"packed with T = 256 tokens, but training.tokens_per_microbatch = 512"
    ):
        packed_loader(tmp_path / "p", T_cfg=512)
    with pytest.raises(ValueError, match=r"global_batch_size = 5 counts packed rows .* multiple of .* 2"):
        packed_loader(tmp_path / "p", G=5)
    with pytest.raises(
        ValueError, match=r"padded to a multiple of 4, which is not a multiple of data.pad_to_multiple = 8"
    ):
        packed_loader(tmp_path / "p", pad=8)
    with pytest.raises(ValueError, match="rows.parquet and metadata.json"):
        packed_loader(tmp_path)


def test_script_help():
    with pytest.raises(SystemExit) as e:
        load_script().main(["--help"])
    assert e.value.code == 0
