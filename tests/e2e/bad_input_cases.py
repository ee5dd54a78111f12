"""The bad-input table of tests/e2e/test_bad_input.py: builders of small input files (JSONL, parquet,
npy, tokenizer, offline packs, HF folders, checkpoints) and one `Case` per wrong input, with the
substrings its `error:` line must contain."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# A small, fast run: mock lengths, 1 step of the llama debug model on 256-token microbatches.
MOCK = '{"mode": "distribution", "type": "lognormal", "min_seq_len": 16, "max_seq_len": 200, "mean_seq_len": 64, "lognormal_sigma": 1.0}'
BASE = [
    "--data.source", "mock", "--data.num_samples", "16", "--data.mock_config", MOCK,
    "--training.steps", "1", "--training.global_batch_size", "2", "--training.tokens_per_microbatch", "256",
    "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1", "--job.dump_folder", "{tmp}/out",
]  # fmt: skip
Files = dict[str, "str | bytes | Callable[[Path], None]"]


# ============================================================================ input builders
def jsonl(*rows: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def chat(*turns: tuple[str, object]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


GOOD = chat(("user", "2+2?"), ("assistant", "4"))


def parquet(columns: dict[str, list]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue()


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def tokenizer_json() -> str:
    """A tiny word-level Hugging Face tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "2+2?", "4", "hello"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def packed(
    T: int = 256,
    edit_meta: Callable[[dict], None] | None = None,
    rows: bytes | None = None,
    lengths: tuple[int, ...] = (40, 90, 120, 30, 70, 200),
):
    """A pack folder (scripts/prepare_packed_data.py's format) of mock documents (every token but a
    document's first is trained)."""

    def write(folder: Path) -> None:
        from titan_thd.data.packed_dataset import pack_rows, write_packed
        from titan_thd.data.token_store import MockTokenStore
        from titan_thd.data.tokenizer import ByteTokenizer

        tok = ByteTokenizer()
        store = MockTokenStore(np.array(lengths), tok, seed=0)
        meta = {"tokens_per_microbatch": T, "pad_to_multiple": 1, "algorithm": "first_fit_decreasing"}
        meta |= {"seed": 0, "pad_id": tok.pad_id, "vocab_size": tok.vocab_size, "tokenizer": tok.identity}
        meta |= {"num_truncated": 0, "num_dropped": 0}
        write_packed(folder, store, pack_rows(store.lengths, T, 1, "first_fit_decreasing", 0), meta, False)
        if edit_meta is not None:
            m = json.loads((folder / "metadata.json").read_text())
            edit_meta(m)
            (folder / "metadata.json").write_text(json.dumps(m))
        if rows is not None:
            (folder / "rows.parquet").write_bytes(rows)

    return write


_HF_CACHE: dict[str, Path] = {}


def hf_folder(edit_config: Callable[[dict], None] | None = None, safetensors: bytes | None = None):
    """An HF DeepSeek-V4 folder of the dsv4 micro flavor (config.json + model.safetensors)."""

    def write(folder: Path) -> None:
        if "micro" not in _HF_CACHE:
            import torch

            from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors

            torch.manual_seed(0)
            _HF_CACHE["micro"] = export_hf(
                build_dsv4(flavors["micro"]), flavors["micro"], folder.parent / "hf0"
            )
        shutil.copytree(_HF_CACHE["micro"], folder)
        if edit_config is not None:
            cfg = json.loads((folder / "config.json").read_text())
            edit_config(cfg)
            (folder / "config.json").write_text(json.dumps(cfg))
        if safetensors is not None:
            (folder / "model.safetensors").write_bytes(safetensors)

    return write


def checkpoint(folder: Path) -> None:
    """<folder>/checkpoint/step-1 with the meta.json that CheckpointManager.save writes for the BASE run
    (llama debug, byte tokenizer: 320 embedding rows); its fingerprint is read before any shard."""
    import dataclasses

    from titan_thd.components.checkpoint_folder import META_FILE, model_fingerprint
    from titan_thd.models.llama import build_llama, flavors
    from titan_thd.parallel.fsdp import build_on_meta

    model = build_on_meta(lambda: build_llama(dataclasses.replace(flavors["debug"], vocab_size=320)))
    meta = {
        "step": 1,
        "world_size": 1,
        "fingerprint": model_fingerprint([model], model="llama", flavor="debug"),
    }
    (folder / "checkpoint" / "step-1").mkdir(parents=True)
    (folder / "checkpoint" / "step-1" / META_FILE).write_text(json.dumps(meta))


def remove(path: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / path).unlink()

    return edit


# ============================================================================ the table
@dataclass
class Case:
    name: str
    args: list[str]
    expect: list[str]
    """Substrings of the error line ({tmp} is the case's folder)."""
    files: Files = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def _del(key: str) -> Callable[[dict], None]:
    return lambda d: d.pop(key)


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda d: d.__setitem__(key, value)


CASES = [
    # ---- config files and the command line
    Case("toml syntax", ["--job.config_file", "{tmp}/c.toml"], ["{tmp}/c.toml", "invalid TOML", "line 2"],
         {"c.toml": "[training]\nsteps = = 3\n"}),
    Case("toml unknown section", ["--job.config_file", "{tmp}/c.toml"],
         ["{tmp}/c.toml", "unknown config section 'trainig'", "Did you mean 'training'?"],
         {"c.toml": "[trainig]\nsteps = 3\n"}),
    Case("toml unknown key", ["--job.config_file", "{tmp}/c.toml"],
         ["{tmp}/c.toml", "unknown key 'training.step'", "Did you mean 'steps'?"],
         {"c.toml": "[training]\nstep = 3\n"}),
    Case("toml wrong type", ["--job.config_file", "{tmp}/c.toml"],
         ["{tmp}/c.toml", "training.steps", "'ten'", "expected an integer"], {"c.toml": '[training]\nsteps = "ten"\n'}),
    Case("toml key outside a section", ["--job.config_file", "{tmp}/c.toml"],
         ["{tmp}/c.toml", "'steps'", "[section] table"], {"c.toml": "steps = 3\n"}),
    Case("toml not utf-8", ["--job.config_file", "{tmp}/c.toml"], ["{tmp}/c.toml:2", "not UTF-8", "0xff"],
         {"c.toml": b"[job]\ndescription = '\xff'\n"}),
    Case("config file missing", ["--job.config_file", "{tmp}/none.toml"], ["config file not found", "{tmp}/none.toml"]),
    Case("config file is a folder", ["--job.config_file", "{tmp}/d"], ["{tmp}/d", "is a folder"],
         {"d/x": ""}),
    Case("negative steps", ["--training.steps", "-5"], ["training.steps", "-5", "positive"]),
    Case("zero batch", ["--training.global_batch_size", "0"], ["training.global_batch_size", "got 0", "positive"]),
    Case("beta out of range", ["--optimizer.beta1", "1.5"], ["optimizer.beta1", "1.5", "0 <= value < 1"]),
    Case("bad choice", ["--training.dtype", "float16"], ["training.dtype", "'float16'", "float32, bfloat16"]),
    Case("compile without a C++ compiler", ["--training.compile", "true"],
         ["training.compile = true", "no C++ compiler", "g++"], env={"PATH": "/nonexistent"}),
    Case("cli value of the wrong type", ["--training.steps", "abc"],
         ["command line", "training.steps", "'abc'", "an integer"]),
    Case("cli key without value", ["--training.steps"], ["--training.steps needs a value"]),
    Case("cli word that is no key", ["steps=3"], ["command line", "'steps=3'", "--section.field"]),
    Case("cli unknown key", ["--training.stpes", "3"], ["command line", "'training.stpes'", "Did you mean 'steps'?"]),
    Case("cli bad table", ["--data.mock_config", "{mode"], ["data.mock_config", "'{mode'", "a table"]),
    Case("bad model flavor", ["--model.flavor", "huge"], ["model.flavor", "'huge'", "debug"]),
    Case("knob of another model", ["--model.args.mtp_loss_weight", "0.3"],
         ["model.args.mtp_loss_weight", "model llama has no such setting", "attention_backend"]),
    Case("model knob in the old place", ["--model.mtp_loss_weight", "0.3"],
         ["model.mtp_loss_weight is a setting of one model family", "--model.args.mtp_loss_weight"]),
    Case("model knob of the wrong type", ["--model.args.n_layers", "many"],
         ["model.args.n_layers", "'many'", "an integer"]),
    # ---- data files
    Case("data path missing", ["--data.source", "jsonl", "--data.path", "{tmp}/none.jsonl"],
         ["data.path", "none.jsonl", "not found"]),
    Case("data path is a folder", ["--data.source", "jsonl", "--data.path", "{tmp}/d"],
         ["data.path", "{tmp}/d", "not a file"], {"d/a.jsonl": jsonl(GOOD)}),
    Case("jsonl broken line", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:2", "invalid JSON"], {"a.jsonl": jsonl(GOOD, '{"text": "a"')}),
    Case("jsonl not utf-8", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:1", "UTF-8"], {"a.jsonl": b'{"text": "\xff"}\n'}),
    Case("jsonl.gz truncated", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl.gz"],
         ["{tmp}/a.jsonl.gz", "gzip"], {"a.jsonl.gz": gzip.compress(jsonl(*[GOOD] * 50).encode())[:-30]}),
    Case("jsonl.gz corrupt", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl.gz"],
         ["{tmp}/a.jsonl.gz", "gzip"], {"a.jsonl.gz": b"\x1f\x8b" + b"garbage" * 20}),
    Case("record not an object", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:2", "expected a JSON object", "list"], {"a.jsonl": jsonl(GOOD, [1, 2])}),
    Case("record of no known schema", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:1", "['body', 'title']", "data.format"], {"a.jsonl": jsonl({"title": "t", "body": "b"})}),
    Case("record without the forced schema's fields",
         ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl", "--data.format", "alpaca"],
         ["{tmp}/a.jsonl:1", "alpaca", "instruction|prompt"], {"a.jsonl": jsonl(GOOD)}),
    Case("unknown role", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:2", "messages[1].role", "'narrator'", "assistant", "user"],
         {"a.jsonl": jsonl(GOOD, chat(("user", "q"), ("narrator", "a")))}),
    Case("unknown sharegpt speaker", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:1", "conversations[0].from", "'robot'", "gpt", "human"],
         {"a.jsonl": jsonl({"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]})}),
    Case("messages not a list", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:1", "'messages'", "list", "str"], {"a.jsonl": jsonl({"messages": "hi"})}),
    Case("turn not an object", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:1", "messages[0]", "'role'"], {"a.jsonl": jsonl({"messages": ["hi"]})}),
    Case("content not a string", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:1", "messages[0].content", "expected a string", "list"],
         {"a.jsonl": jsonl(chat(("user", [{"type": "image_url"}]), ("assistant", "a")))}),
    Case("text not a string", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:2", "'text'", "expected a string", "int"], {"a.jsonl": jsonl({"text": "a"}, {"text": 5})}),
    Case("empty assistant turn", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:1", "assistant", "empty"], {"a.jsonl": jsonl(chat(("user", "q"), ("assistant", "")))}),
    Case("empty data file", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl", "no records"], {"a.jsonl": "\n"}),
    Case("nothing to train (no assistant turn)", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl", "nothing to train", "assistant"],
         {"a.jsonl": jsonl(chat(("user", "q")), chat(("system", "s"), ("user", "q2")))}),
    Case("nothing left after drop", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl",
                                     "--data.overlong", "drop", "--training.tokens_per_microbatch", "8"],
         ["data.overlong", "longer than", "8"], {"a.jsonl": jsonl(GOOD)}),
    Case("parquet not parquet", ["--data.source", "parquet", "--data.path", "{tmp}/a.parquet"],
         ["{tmp}/a.parquet", "parquet"], {"a.parquet": jsonl(GOOD)}),
    Case("parquet missing columns", ["--data.source", "parquet", "--data.path", "{tmp}/a.parquet"],
         ["{tmp}/a.parquet:row 0", "['id', 'score']"], {"a.parquet": parquet({"id": [1, 2], "score": [0.5, 0.1]})}),
    Case("parquet bad cell", ["--data.source", "parquet", "--data.path", "{tmp}/a.parquet"],
         ["{tmp}/a.parquet:row 1", "'text'", "expected a string"], {"a.parquet": parquet({"text": ["a", None]})}),
    # ---- offline packs
    Case("pack folder missing", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["data.path", "pack", "not found"]),
    Case("pack without metadata", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["{tmp}/pack", "metadata.json"], {"pack": lambda p: (packed()(p), remove("metadata.json")(p))}),
    Case("pack metadata not json", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["{tmp}/pack/metadata.json", "invalid JSON", "line 1"],
         {"pack": lambda p: (packed()(p), (p / "metadata.json").write_text("{oops"))}),
    Case("pack of another version", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["{tmp}/pack/metadata.json", "'titan_thd-packed-v0'", "titan_thd-packed-v1"],
         {"pack": packed(edit_meta=_set("format", "titan_thd-packed-v0"))}),
    Case("pack metadata missing a key", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["{tmp}/pack/metadata.json", "pad_to_multiple"], {"pack": packed(edit_meta=_del("pad_to_multiple"))}),
    Case("pack rows corrupt", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["{tmp}/pack/rows.parquet", "parquet"], {"pack": packed(rows=b"not parquet at all")}),
    Case("pack rows missing columns", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["{tmp}/pack/rows.parquet", "input_ids"], {"pack": packed(rows=parquet({"x": [1]}))}),
    Case("pack rows inconsistent", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["{tmp}/pack/rows.parquet", "row 0", "3 input_ids", "doc_lengths summing to 2"],
         {"pack": packed(rows=parquet({"input_ids": [[1, 2, 3]], "target_mask": [[False, True, True]],
                                       "doc_lengths": [[2]]}))}),
    Case("pack with nothing to train", ["--data.source", "packed", "--data.path", "{tmp}/pack"],
         ["{tmp}/pack/rows.parquet", "nothing to train"], {"pack": packed(lengths=(1, 1, 1))}),
    Case("pack of another T, row by row",
         ["--data.source", "packed", "--data.path", "{tmp}/pack", "--data.packed_replan", "false"],
         ["{tmp}/pack", "T = 512", "training.tokens_per_microbatch = 256"], {"pack": packed(T=512)}),
    # ---- Megatron-Bridge packs (*.idx.parquet, legacy .npy)
    Case("bridge pack missing a column", ["--data.source", "packed", "--data.path", "{tmp}/b.idx.parquet"],
         ["{tmp}/b.idx.parquet", "['seq_start_id'] missing"],
         {"b.idx.parquet": parquet({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 0]]})}),
    Case("bridge pack bad seq_start_id", ["--data.source", "packed", "--data.path", "{tmp}/b.idx.parquet"],
         ["{tmp}/b.idx.parquet", "row 0", "seq_start_id [0, 5]", "must start at 0"],
         {"b.idx.parquet": parquet({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 0]], "seq_start_id": [[0, 5]]})}),
    Case("bridge pack loss_mask too short", ["--data.source", "packed", "--data.path", "{tmp}/b.idx.parquet"],
         ["{tmp}/b.idx.parquet", "row 0", "2 loss_mask entries for 3 input_ids"],
         {"b.idx.parquet": parquet({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1]], "seq_start_id": [[0]]})}),
    Case("bridge pack of another tokenizer", ["--data.source", "packed", "--data.path", "{tmp}/b.idx.parquet"],
         ["{tmp}/b.idx.parquet", "token ids span 1..70000", "vocab_size = 264"],
         {"b.idx.parquet": parquet({"input_ids": [[1, 70000]], "loss_mask": [[1, 0]], "seq_start_id": [[0]]})}),
    Case("bridge npy not an object array", ["--data.source", "packed", "--data.path", "{tmp}/b.npy"],
         ["{tmp}/b.npy", "1-D object array of dicts"], {"b.npy": npy(np.arange(4))}),
    Case("bridge npy rows not dicts", ["--data.source", "packed", "--data.path", "{tmp}/b.npy"],
         ["{tmp}/b.npy", "row 0", "expected a dict"], {"b.npy": npy(np.array([[1, 2], None], dtype=object))}),
    Case("bridge pack row by row",
         ["--data.source", "packed", "--data.path", "{tmp}/b.idx.parquet", "--data.packed_replan", "false"],
         ["{tmp}/b.idx.parquet", "data.packed_replan = true"],
         {"b.idx.parquet": parquet({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 0]], "seq_start_id": [[0]]})}),
    Case("deepseek chat template with the byte tokenizer", ["--data.chat_template", "deepseek"],
         ["data.chat_template = deepseek", "DeepSeek tokenizer.json"]),
    Case("hybrid CP for a contiguous model",
         ["--model.name", "dsv4", "--model.flavor", "micro", "--parallelism.context_parallel_mode", "hybrid"],
         ["context_parallel_mode = hybrid", "model dsv4", "computes only contiguous"]),
    Case("hybrid CP threshold negative", ["--parallelism.hybrid_cp_threshold", "-1"],
         ["parallelism.hybrid_cp_threshold", "-1", "non-negative"]),
    Case("pack of another tokenizer",
         ["--data.source", "packed", "--data.path", "{tmp}/pack", "--data.tokenizer", "{tmp}/tok.json"],
         ["data.path = '{tmp}/pack'", "vocab_size 264", "data.tokenizer = '{tmp}/tok.json'", "repack"],
         {"pack": packed(), "tok.json": tokenizer_json()}),
    # ---- mock lengths
    Case("mock_config unknown key", ["--data.mock_config", '{"mode": "distribution", "typ": "lognormal"}'],
         ["data.mock_config", "unknown keys ['typ']", "missing keys"]),
    Case("mock_config bad mode", ["--data.mock_config", '{"mode": "uniform"}'],
         ["data.mock_config.mode", "'uniform'", "'distribution' or 'file'"]),
    Case("mock_config bad value", ["--data.mock_config", MOCK.replace('"min_seq_len": 16', '"min_seq_len": -3')],
         ["data.mock_config.min_seq_len", "-3", "positive integer"]),
    Case("lengths file missing", ["--data.mock_config", '{"mode": "file", "path": "{tmp}/none.csv"}'],
         ["data.mock_config.path", "none.csv", "not found"]),
    Case("lengths file bad value", ["--data.mock_config", '{"mode": "file", "path": "{tmp}/l.csv"}'],
         ["{tmp}/l.csv:3", "'-3'", "positive integer"], {"l.csv": "length\n12\n-3\n"}),
    Case("lengths path not a string", ["--data.mock_config", '{"mode": "file", "path": 5}'],
         ["data.mock_config.path", "5", "a string"]),
    # ---- tokenizers
    Case("tokenizer missing", ["--data.tokenizer", "{tmp}/tok.json"], ["data.tokenizer", "{tmp}/tok.json"]),
    Case("tokenizer not json", ["--data.tokenizer", "{tmp}/tok.json"], ["data.tokenizer", "{tmp}/tok.json"],
         {"tok.json": "not json"}),
    Case("tokenizer json of something else", ["--data.tokenizer", "{tmp}/tok.json"],
         ["data.tokenizer", "{tmp}/tok.json"], {"tok.json": '{"hello": 1}'}),
    Case("tokenizer_config.json broken", ["--data.tokenizer", "{tmp}/tok/tokenizer.json"],
         ["{tmp}/tok/tokenizer_config.json", "invalid JSON"],
         {"tok/tokenizer.json": tokenizer_json(), "tok/tokenizer_config.json": "{"}),
    # ---- Hugging Face folders
    Case("hf_path on a model without HF support", ["--model.hf_path", "{tmp}/hf"], ["model.hf_path", "llama"]),
    Case("hf folder missing", ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "{tmp}/hf"],
         ["model.hf_path", "{tmp}/hf", "does not exist"]),
    Case("hf config.json missing",
         ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "{tmp}/hf"],
         ["{tmp}/hf/config.json", "does not exist"], {"hf": lambda p: (hf_folder()(p), remove("config.json")(p))}),
    Case("hf config.json not json",
         ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "{tmp}/hf"],
         ["{tmp}/hf/config.json", "invalid JSON", "line 1"],
         {"hf": lambda p: (hf_folder()(p), (p / "config.json").write_text("{"))}),
    Case("hf config.json without vocab_size",
         ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "{tmp}/hf"],
         ["{tmp}/hf/config.json", "vocab_size"], {"hf": hf_folder(_del("vocab_size"))}),
    Case("hf safetensors missing",
         ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "{tmp}/hf"],
         ["{tmp}/hf", "safetensors"], {"hf": lambda p: (hf_folder()(p), remove("model.safetensors")(p))}),
    Case("hf safetensors corrupt",
         ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "{tmp}/hf"],
         ["{tmp}/hf/model.safetensors"], {"hf": hf_folder(safetensors=b"\x08\x00\x00\x00\x00\x00\x00\x00{}")}),
    Case("hf architecture mismatch",
         ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "{tmp}/hf"],
         ["{tmp}/hf/config.json", "does not match model.flavor = 'micro'", "dim: checkpoint 256 vs 128"],
         {"hf": hf_folder(_set("hidden_size", 256))}),
    Case("hf model_type", ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "{tmp}/hf"],
         ["{tmp}/hf/config.json", "model_type", "'llama'"], {"hf": hf_folder(_set("model_type", "llama"))}),
    # ---- checkpoints and output folders
    Case("checkpoint of another model",
         ["--checkpoint.enable", "true", "--job.dump_folder", "{tmp}/run", "--data.tokenizer", "{tmp}/tok.json"],
         ["{tmp}/run/checkpoint/step-1", "another model"], {"run": checkpoint, "tok.json": tokenizer_json()}),
    Case("checkpoint step missing",
         ["--checkpoint.enable", "true", "--job.dump_folder", "{tmp}/run", "--checkpoint.load_step", "7"],
         ["checkpoint.load_step = 7", "{tmp}/run/checkpoint", "steps found", "1"], {"run": checkpoint}),
    Case("checkpoint meta.json broken",
         ["--checkpoint.enable", "true", "--job.dump_folder", "{tmp}/run", "--job.preflight", "true"],
         ["{tmp}/run/checkpoint/step-1/meta.json", "invalid JSON"],
         {"run": lambda p: (checkpoint(p), (p / "checkpoint/step-1/meta.json").write_text("{"))}),
    Case("dump_folder is a file", ["--job.dump_folder", "{tmp}/out.txt"],
         ["job.dump_folder", "{tmp}/out.txt", "not a folder"], {"out.txt": "keep me\n"}),
    Case("cache_dir is a file",
         ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl", "--data.cache_dir", "{tmp}/cache"],
         ["data.cache_dir", "{tmp}/cache", "not a folder"], {"a.jsonl": jsonl(GOOD), "cache": "x"}),
    # ---- parallel layouts and model limits
    Case("cp that does not divide the world", ["--parallelism.context_parallel_degree", "3",
                                               "--training.tokens_per_microbatch", "264", "--data.pad_to_multiple", "6"],
         ["context_parallel_degree 3", "does not fit 4 processes", "cp 3 × tp 1 = 3 does not divide world size 4"],
         env={"WORLD_SIZE": "4"}),
    Case("dp x cp not the world", ["--parallelism.data_parallel_shard_degree", "3"],
         ["data_parallel_shard_degree 3", "multiply to 3", "the world has 4 processes"], env={"WORLD_SIZE": "4"}),
    Case("tp that does not divide the heads", ["--parallelism.tensor_parallel_degree", "3",
                                               "--training.tokens_per_microbatch", "264", "--data.pad_to_multiple", "6"],
         ["parallelism.tensor_parallel_degree = 3 does not divide", "n_heads = 4", "n_kv_heads = 2",
          "nearest valid degrees are 2"], env={"WORLD_SIZE": "3"}),
    Case("zigzag pad_to_multiple", ["--parallelism.context_parallel_degree", "2", "--data.pad_to_multiple", "2"],
         ["data.pad_to_multiple = 2", "multiple of 4"]),
    Case("cp mode the model cannot do", ["--parallelism.context_parallel_degree", "2",
                                         "--parallelism.context_parallel_mode", "contiguous"],
         ["parallelism.context_parallel_mode = contiguous", "zigzag"]),
    Case("microbatch too small for the model",
         ["--model.name", "dsv4", "--model.flavor", "micro", "--parallelism.context_parallel_degree", "2",
          "--parallelism.context_parallel_mode", "contiguous", "--training.tokens_per_microbatch", "16"],
         ["training.tokens_per_microbatch = 16", "needs at least"]),
    Case("NGPU not a number", ["--comm.mode", "fake"], ["NGPU", "'two'", "integer"], env={"NGPU": "two"}),
    Case("preflight: bad data for NGPU=2", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl",
                                            "--job.preflight", "true"],
         ["{tmp}/a.jsonl:1", "unknown role 'bot'"], {"a.jsonl": jsonl(chat(("bot", "x")))}, env={"NGPU": "2"}),
    Case("preflight: checkpoint of another model", ["--checkpoint.enable", "true", "--job.dump_folder", "{tmp}/run",
                                                    "--data.tokenizer", "{tmp}/tok.json", "--job.preflight", "true"],
         ["{tmp}/run/checkpoint/step-1", "another model"], {"run": checkpoint, "tok.json": tokenizer_json()},
         env={"NGPU": "2"}),
    # ---- validation
    Case("validation fraction out of range", ["--validation.enable", "true", "--validation.fraction", "1.5"],
         ["validation.fraction", "1.5", "0 < fraction < 1"]),
    Case("validation freq zero", ["--validation.freq", "0"], ["validation.freq", "got 0", "positive"]),
    Case("validation without a set", ["--validation.enable", "true"],
         ["validation.enable = true needs", "validation.fraction", "validation.path"]),
    Case("validation fraction and path", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl",
                                          "--validation.enable", "true", "--validation.fraction", "0.1",
                                          "--validation.path", "{tmp}/a.jsonl"],
         ["validation.fraction = 0.1", "validation.path = '{tmp}/a.jsonl'", "set one"], {"a.jsonl": jsonl(GOOD)}),
    Case("validation path missing", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl",
                                     "--validation.enable", "true", "--validation.path", "{tmp}/none.jsonl"],
         ["validation.path", "none.jsonl", "not found"], {"a.jsonl": jsonl(GOOD)}),
    Case("validation path with mock data", ["--validation.enable", "true", "--validation.path", "{tmp}/a.jsonl"],
         ["validation.path", "data.source = mock", "validation.fraction"], {"a.jsonl": jsonl(GOOD)}),
    Case("validation holds out nothing", ["--validation.enable", "true", "--validation.fraction", "0.001"],
         ["validation.fraction = 0.001", "16 documents", "holds out 0"]),
    Case("validation compare_padded with cp", ["--validation.enable", "true", "--validation.fraction", "0.5",
                                               "--validation.compare_padded", "true",
                                               "--parallelism.context_parallel_degree", "2"],
         ["validation.compare_padded = true", "context_parallel_degree 2", "expected 1 and 1"]),
]  # fmt: skip


def with_tmp(value: str, tmp: Path) -> str:
    return value.replace("{tmp}", str(tmp))


def write_files(tmp: Path, files: Files) -> None:
    for rel, content in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def file_hashes(tmp: Path) -> dict[str, str]:
    return {
        str(p.relative_to(tmp)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
