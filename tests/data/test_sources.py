import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_thd.data.sources import ASSETS_DIR, detect_schema, normalise, read_records, resolve_data_path

SYS = {"role": "system", "content": ""}


def write_jsonl(path, rows, gz=False):
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(
    "columns, schema",
    [
        (["messages", "conversations", "text", "instruction", "output"], "messages"),
        (["conversations", "text", "prompt", "response"], "sharegpt"),
        (["prompt", "completion", "text"], "alpaca"),
        (["question", "answer"], "alpaca"),
        (["query", "response", "context"], "alpaca"),
        (["instruction", "text"], "text"),  # an instruction without an output is not alpaca
        (["output", "text", "id"], "text"),
    ],
)
def test_detect_schema_priority(columns, schema):
    assert detect_schema(columns) == schema


def test_detect_schema_unknown_lists_columns_and_schemas():
    with pytest.raises(ValueError) as e:
        detect_schema(["foo", "instruction"])
    msg = str(e.value)
    assert "['foo', 'instruction']" in msg
    for name in ("messages", "sharegpt", "alpaca", "text"):
        assert name in msg


def test_sharegpt_role_mapping():
    turns = [
        ("human", "user"), ("USER", "user"), ("gpt", "assistant"), ("assistant", "assistant"),
        ("model", "assistant"), ("chatgpt", "assistant"), ("bing", "assistant"), ("bard", "assistant"),
        ("tool", "tool"), ("function", "tool"), ("observation", "tool"), (None, "user"),
    ]  # fmt: skip
    rec = {"conversations": [{"from": f, "value": f"v{i}"} for i, (f, _) in enumerate(turns)]}
    out = normalise(rec, "sharegpt", "f:1")["messages"]
    assert out[0] == SYS
    assert [m["role"] for m in out[1:]] == [r for _, r in turns]
    assert [m["content"] for m in out[1:]] == [f"v{i}" for i in range(len(turns))]
    # A role it does not know is refused, not guessed (a wrong guess trains the wrong turns).
    rec = {"conversations": [{"from": "human", "value": "q"}, {"from": "narrator", "value": "n"}]}
    with pytest.raises(
        ValueError, match=r"f:1: conversations\[1\].from: unknown role 'narrator'; expected one of human"
    ):
        normalise(rec, "sharegpt", "f:1")


def test_sharegpt_system_turn_and_top_level_system():
    rec = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"}]}
    assert normalise(rec, "sharegpt", "f:1")["messages"][0] == {"role": "system", "content": "S"}
    rec = {"system": "top", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    assert normalise(rec, "sharegpt", "f:1")["messages"] == [
        {"role": "system", "content": "top"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]


def test_messages_pass_through():
    rec = {
        "messages": [
            {"role": "user", "content": "q", "name": "x"},
            {"content": "no role"},
            {"role": "assistant", "content": None},
            {"role": "Developer", "content": "d"},
        ],
        "id": 7,
    }
    assert normalise(rec, "messages", "f:1") == {
        "messages": [
            SYS,
            {"role": "user", "content": "q"},
            {"role": "user", "content": "no role"},
            {"role": "assistant", "content": ""},
            {"role": "system", "content": "d"},
        ]
    }
    rec = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]}
    assert normalise(rec, "messages", "f:1")["messages"][0] == {"role": "system", "content": "S"}


def test_alpaca_join_and_synonyms():
    rec = {"instruction": "Add.", "input": "2 and 3", "output": "5"}
    assert normalise(rec, "alpaca", "f:1")["messages"] == [
        SYS, {"role": "user", "content": "Add.\n\n2 and 3"}, {"role": "assistant", "content": "5"}
    ]  # fmt: skip
    # first non-empty synonym wins; an empty input adds nothing; `context` works like `input`
    rec = {
        "instruction": "",
        "prompt": "P",
        "query": "Q",
        "output": None,
        "response": "R",
        "input": "",
        "context": "C",
    }
    assert normalise(rec, "alpaca", "f:1")["messages"][1:] == [
        {"role": "user", "content": "P\n\nC"}, {"role": "assistant", "content": "R"}
    ]  # fmt: skip
    rec = {"question": "Q", "answer": "A"}
    assert normalise(rec, "alpaca", "f:1")["messages"][1]["content"] == "Q"
    with pytest.raises(ValueError, match=r"f:4: alpaca record has no non-empty field among output\|response"):
        normalise({"instruction": "I", "output": ""}, "alpaca", "f:4")


def test_empty_or_malformed_conversation():
    with pytest.raises(ValueError, match="f:2: conversation has no turns"):
        normalise({"messages": []}, "messages", "f:2")
    with pytest.raises(ValueError, match="f:2: field 'messages': expected a list of turns, got str"):
        normalise({"messages": "hi"}, "messages", "f:2")
    with pytest.raises(ValueError, match=r"f:2: conversations\[1\]: expected an object"):
        normalise({"conversations": [{"from": "human", "value": "q"}, "oops"]}, "sharegpt", "f:2")


def test_text_schema():
    assert normalise({"text": "hello", "meta": 1}, "text", "f:1") == {"text": "hello"}


@pytest.mark.parametrize(
    "good, bad, field",
    [
        (
            {"messages": [{"role": "user", "content": "q"}]},
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}]},
            {"conversations": [{"from": "human", "value": {"x": 1}}]},
            "conversations[0].value",
        ),
        ({"instruction": "I", "output": "o"}, {"instruction": "I", "output": 5}, "'output'"),
        ({"instruction": "I", "output": "o"}, {"instruction": ["I"], "output": "o"}, "'instruction'"),
        ({"text": "ok"}, {"text": 3}, "'text'"),
    ],
)
def test_refusals_name_file_line_and_field(tmp_path, good, bad, field):
    path = write_jsonl(tmp_path / "d.jsonl", [good, bad])
    with pytest.raises(ValueError) as e:
        list(read_records(path))
    assert f"{path}:2: " in str(e.value) and field in str(e.value) and "expected a string" in str(e.value)


def test_read_jsonl_gz_with_provenance(tmp_path):
    rows = [{"text": "a"}, {"text": "b"}]
    path = write_jsonl(tmp_path / "d.jsonl.gz", [rows[0], "", rows[1]], gz=True)  # blank line skipped
    recs = list(read_records(path))
    assert [(r.where, r.data) for r in recs] == [(f"{path}:1", {"text": "a"}), (f"{path}:3", {"text": "b"})]


def test_forced_format(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [], "text": "t"}])
    assert next(read_records(path, fmt="text")).data == {"text": "t"}
    with pytest.raises(
        ValueError, match=r"d.jsonl:1: field 'conversations' missing; columns found: \['messages', 'text'\]"
    ):
        list(read_records(path, fmt="sharegpt"))
    with pytest.raises(ValueError, match="data.format"):
        read_records(path, fmt="csv")


def test_malformed_json_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}, '{"text": "c"'])
    with pytest.raises(ValueError, match=rf"^{path}:3: invalid JSON: "):
        list(read_records(path))
    path = write_jsonl(tmp_path / "e.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"e.jsonl:1: expected a JSON object, got list"):
        list(read_records(path))


def test_unknown_schema_names_record_and_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"foo": 1, "bar": 2}])
    with pytest.raises(
        ValueError, match=rf"{path}:1: cannot infer the record schema from columns \['bar', 'foo'\]"
    ):
        list(read_records(path))


def test_missing_empty_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="not a readable file"):
        read_records(tmp_path / "nope.jsonl")
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="empty dataset"):
        list(read_records(path))
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"text": "a"}\n')[:-12])  # truncated gzip stream
    with pytest.raises(ValueError, match="cannot read"):
        list(read_records(bad))


def test_parquet_rows(tmp_path):
    table = pa.table(
        {
            "conversations": [[{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]] * 3,
            "id": [0, 1, 2],
        }
    )
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    recs = list(read_records(path))
    assert [r.where for r in recs] == [f"{path}:row {i}" for i in range(3)]
    assert recs[2].data["messages"][1:] == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read parquet"):
        list(read_records(bad))


def test_resolve_data_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local.jsonl").write_text("")
    assert resolve_data_path("local.jsonl") == tmp_path / "local.jsonl"
    assert resolve_data_path("chat_sft.jsonl.gz") == ASSETS_DIR / "chat_sft.jsonl.gz"
    with pytest.raises(ValueError) as e:
        resolve_data_path("missing.jsonl")
    assert str(tmp_path / "missing.jsonl") in str(e.value) and str(ASSETS_DIR / "missing.jsonl") in str(
        e.value
    )
