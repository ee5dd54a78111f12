import dataclasses
import itertools
import json
import os

import numpy as np
import pytest

import titan_thd.data.token_store as ts
from titan_thd.config import Data
from titan_thd.data.chat_template import encode_conversation, encode_text
from titan_thd.data.sources import normalise
from titan_thd.data.token_store import ArrayTokenStore, build_token_store
from titan_thd.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": f"The answer is {2 * i}."},
        ]
    }
    for i in range(1, 40)
] + [
    {
        "messages": [
            {"role": "system", "content": "S" * 300},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]
    }
]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(path, **kw):
    return dataclasses.replace(Data(), source="jsonl", path=str(path), **kw)


def reference(rows):
    """Naive per-record encoding, independent of the store's flat arrays."""
    out = []
    for r in rows:
        d = normalise(r, "messages" if "messages" in r else "text", "ref")
        out.append(encode_text(TOK, d["text"]) if "text" in d else encode_conversation(TOK, d["messages"]))
    return out


def assert_matches(store, samples):
    assert len(store) == len(samples)
    assert store.lengths.tolist() == [len(s.input_ids) for s in samples]
    assert store.num_targets.tolist() == [int(s.target_mask.sum()) for s in samples]
    for i, s in enumerate(samples):
        got = store[i]
        assert got.input_ids.dtype == np.int32 and got.target_mask.dtype == bool
        assert np.array_equal(got.input_ids, s.input_ids) and np.array_equal(got.target_mask, s.target_mask)


def test_jsonl_store_matches_per_record_encoding(tmp_path):
    path = write(tmp_path / "d.jsonl", ROWS)
    store = build_token_store(cfg(path), TOK, seed=0, cache_dir="", progress=False)
    assert_matches(store, reference(ROWS))
    assert (store.vocab_size, store.pad_id) == (TOK.vocab_size, TOK.pad_id)
    with pytest.raises(IndexError):
        store[len(ROWS)]


def test_text_store(tmp_path):
    rows = [{"text": "hello world"}, {"text": "é" * 50}]
    path = write(tmp_path / "t.jsonl", rows)
    store = build_token_store(cfg(path), TOK, seed=0, cache_dir="", progress=False)
    assert_matches(store, reference(rows))
    assert store.num_targets.tolist() == (store.lengths - 1).tolist()


def test_cache_reuse_and_invalidation(tmp_path, monkeypatch):
    path = write(tmp_path / "d.jsonl", ROWS)
    cache = tmp_path / "cache"
    first = build_token_store(cfg(path), TOK, seed=0, cache_dir=str(cache), progress=False)
    assert not first.loaded_from_cache and first.cache_path.parent == cache
    assert sorted(p.name for p in first.cache_path.iterdir()) == [
        "ids.npy", "meta.json", "num_targets.npy", "offsets.npy", "target_mask.npy"
    ]  # fmt: skip
    assert [p.name for p in cache.iterdir()] == [first.cache_path.name]  # no temporary folder left

    def no_reading(*a, **k):
        raise AssertionError("the second build must not read the dataset")

    monkeypatch.setattr(ts, "read_records", no_reading)
    second = build_token_store(cfg(path), TOK, seed=0, cache_dir=str(cache), progress=False)
    assert second.loaded_from_cache and second.cache_path == first.cache_path
    assert isinstance(second._ids, np.memmap)
    assert_matches(second, reference(ROWS))
    monkeypatch.undo()

    # Different schema setting -> different key; changed file (size and mtime) -> different key.
    forced = build_token_store(
        cfg(path, format="messages"), TOK, seed=0, cache_dir=str(cache), progress=False
    )
    assert forced.cache_path != first.cache_path
    write(path, ROWS[:5])
    os.utime(path, ns=(first.cache_path.stat().st_mtime_ns + 10**9,) * 2)
    third = build_token_store(cfg(path), TOK, seed=0, cache_dir=str(cache), progress=False)
    assert not third.loaded_from_cache and third.cache_path != first.cache_path
    assert_matches(third, reference(ROWS[:5]))


def test_crash_leaves_no_cache(tmp_path, monkeypatch):
    path = write(tmp_path / "d.jsonl", ROWS)
    cache = tmp_path / "cache"
    real_save, calls = np.save, []

    def crashing_save(file, arr):
        calls.append(file)
        if len(calls) == 3:
            raise OSError("disk full")
        real_save(file, arr)

    monkeypatch.setattr(ts.np, "save", crashing_save)
    with pytest.raises(OSError, match="disk full"):
        build_token_store(cfg(path), TOK, seed=0, cache_dir=str(cache), progress=False)
    assert list(cache.iterdir()) == []
    monkeypatch.undo()
    store = build_token_store(cfg(path), TOK, seed=0, cache_dir=str(cache), progress=False)
    assert not store.loaded_from_cache and len(store) == len(ROWS)


def test_tokenisation_error_names_the_record(tmp_path):
    rows = ROWS[:2] + [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}]
    path = write(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=rf"{path}:3: assistant turn with empty content"):
        build_token_store(cfg(path), TOK, seed=0, cache_dir="", progress=False)


def test_pool_matches_serial(tmp_path, monkeypatch):
    path = write(tmp_path / "d.jsonl", ROWS * 30)
    monkeypatch.setattr(ts, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(ts, "_CHUNK", 64)
    contexts = []
    real_get_context = ts.multiprocessing.get_context
    monkeypatch.setattr(
        ts.multiprocessing, "get_context", lambda m: contexts.append(m) or real_get_context(m)
    )
    store = build_token_store(cfg(path, num_workers=2), TOK, seed=0, cache_dir="", progress=False)
    assert contexts == ["spawn"]
    assert_matches(store, reference(ROWS * 30))
    # An error raised while reading (here: in the record iterator) still reaches the caller.
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]) + "{broken\n")
    with pytest.raises(ValueError, match=rf"{path}:4: invalid JSON"):
        build_token_store(cfg(path, num_workers=2), TOK, seed=0, cache_dir="", progress=False)


def test_sources_and_paths(tmp_path):
    with pytest.raises(ValueError, match="data.source = 'packed' has no token store"):
        build_token_store(dataclasses.replace(Data(), source="packed", path="x"), TOK, 0, "", progress=False)
    with pytest.raises(ValueError, match="data.path: 'nope.jsonl' not found"):
        build_token_store(cfg("nope.jsonl"), TOK, 0, "", progress=False)
    with pytest.raises(ValueError, match="is not a file"):
        build_token_store(cfg(tmp_path), TOK, 0, "", progress=False)


def test_mock_store():
    data = dataclasses.replace(Data(), source="mock", num_samples=50)
    store = build_token_store(data, TOK, seed=3, cache_dir="", progress=False)
    assert len(store) == 50 and store.lengths.min() >= 16 and store.lengths.max() <= 1024
    assert store.num_targets.tolist() == (store.lengths - 1).tolist()
    again = build_token_store(data, TOK, seed=3, cache_dir="", progress=False)
    for i in (0, 17, 49):
        s = store[i]
        assert len(s.input_ids) == store.lengths[i] and s.target_mask.sum() == store.num_targets[i]
        assert not s.target_mask[0] and s.target_mask[1:].all()
        assert s.input_ids.max() < 256  # byte tokenizer: no special ids
        assert np.array_equal(s.input_ids, again[i].input_ids)
    assert (
        len(build_token_store(dataclasses.replace(data, num_samples=0), TOK, 0, "", progress=False))
        == 100_000
    )
    view = store.view(40, "truncate")
    assert view.num_truncated == int((store.lengths > 40).sum()) > 0
    for i in range(50):
        assert view.num_targets[i] == view[i].target_mask.sum() == min(40, store.lengths[i]) - 1


def _toy_store():
    lengths = [3, 8, 5, 10]
    ids = np.arange(sum(lengths), dtype=np.int32)
    mask = np.tile([False, True, True, False], 7)[: sum(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for a in offsets[:-1]:
        mask[a] = False
    nt = [int(mask[a:b].sum()) for a, b in itertools.pairwise(offsets)]
    return ArrayTokenStore(
        {"ids": ids, "target_mask": mask, "offsets": offsets, "num_targets": np.array(nt)}, 300, 0
    )


def test_view_truncate():
    base = _toy_store()
    view = base.view(5, "truncate")
    assert (view.num_truncated, view.num_dropped) == (2, 0)
    assert view.lengths.tolist() == [3, 5, 5, 5]
    for i in range(4):
        full, cut = base[i], view[i]
        assert np.array_equal(cut.input_ids, full.input_ids[:5]) and np.array_equal(
            cut.target_mask, full.target_mask[:5]
        )
        assert view.num_targets[i] == cut.target_mask.sum()
    assert view.num_targets.tolist() != base.num_targets.tolist()


def test_view_drop():
    base = _toy_store()
    view = base.view(5, "drop")
    assert (view.num_truncated, view.num_dropped) == (0, 2)
    assert len(view) == 2 and view.lengths.tolist() == [3, 5]
    assert np.array_equal(view[1].input_ids, base[2].input_ids)
    assert view.num_targets.tolist() == [base.num_targets[0], base.num_targets[2]]
    nested = view.view(4, "drop")  # views compose
    assert len(nested) == 1 and nested.num_dropped == 1
    with pytest.raises(
        ValueError, match="empty dataset after filtering: all 4 samples are longer than max_len=2"
    ):
        base.view(2, "drop")
    with pytest.raises(ValueError, match="data.overlong: got 'clip'"):
        base.view(5, "clip")
    with pytest.raises(ValueError, match="max_len: got 0"):
        base.view(0, "truncate")
