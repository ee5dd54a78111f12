"""Megatron-Bridge packs (`*.idx.parquet` and the legacy `.npy`), written here in Bridge's layout:
stored sequences of runtime length + 1 with seq_start_id offsets, a loss_mask rolled left by one,
pad_seq_to_mult padding with EOS under a 0 mask. They train the labels Bridge would train."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_thd.config import Data
from titan_thd.data.chat_template import encode_conversation
from titan_thd.data.dataloader import DataLayout, build_dataloader
from titan_thd.data.rows import full_rows
from titan_thd.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
MULT, PACK = 8, 512  # Bridge's pad_seq_to_mult and packed_sequence_size


def conversations(n=14, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": ""}]
        for k in range(1 + i % 3):
            turns += [
                {"role": "user", "content": "q" * int(rng.integers(1, 40))},
                {"role": "assistant", "content": f"a{i}.{k} " + "x" * int(rng.integers(1, 60))},
            ]
        out.append(turns)
    return out


def bridge_rows(samples):
    """Bridge's stored rows: each sample's tokens (runtime length n = len - 1, padded to a multiple of
    MULT with EOS, plus the one label token), its answer mask rolled left by one, greedy bins of PACK
    runtime tokens."""
    rows, row, used = [], {"input_ids": [], "loss_mask": [], "seq_start_id": []}, 0
    for s in samples:
        ids, mask = s.input_ids.tolist(), s.target_mask.tolist()
        n = len(ids) - 1
        pad = -(-n // MULT) * MULT - n
        ids, mask = ids + [TOK.eos_id] * pad, mask + [False] * pad
        rolled = mask[1:] + [False]
        if used + n + pad > PACK:
            rows.append(row)
            row, used = {"input_ids": [], "loss_mask": [], "seq_start_id": []}, 0
        row["seq_start_id"].append(len(row["input_ids"]))
        row["input_ids"] += ids
        row["loss_mask"] += [int(m) for m in rolled]
        used += n + pad
    return rows + [row]


def write_parquet(rows, path):
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("seq_start_id", pa.list_(pa.int32())),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=500)


def loader(path, T=PACK, replan=True, G=1):
    cfg = Data(source="packed", path=str(path), pad_to_multiple=4, packed_replan=replan)
    return build_dataloader(
        cfg,
        None,
        DataLayout(
            dp_rank=0,
            dp=1,
            cp=2,
            rule=full_rows(T),
            global_batch_size=G,
            seed=0,
            planner="balanced",
            cost_attention=0.0,
            pad_to_multiple=cfg.pad_to_multiple,
        ),
        tokenizer=TOK,
    )


def trained_pairs(batch):
    """Per document: its real tokens and the positions j whose label (token j + 1) is trained."""
    out = []
    for mb in batch.microbatches:
        for a, n in zip(mb.cu_seqlens_padded.tolist(), mb.seqlens.tolist()):
            if n:
                toks = mb.tokens[a : a + n].tolist()
                labels, mask = mb.labels[a : a + n].tolist(), mb.loss_mask[a : a + n].tolist()
                assert all(labels[j] == toks[j + 1] for j in range(n - 1) if mask[j])
                out.append((tuple(toks), tuple(j for j in range(n) if mask[j])))
    return sorted(out)


def test_bridge_parquet_and_npy_train_what_bridge_trains(tmp_path):
    samples = [encode_conversation(TOK, c) for c in conversations()]
    rows = bridge_rows(samples)
    assert len(rows) == 4  # one step of global_batch_size 4 sees every row
    write_parquet(rows, tmp_path / "train.idx.parquet")
    np.save(tmp_path / "train.npy", np.array(rows, dtype=object), allow_pickle=True)
    # Bridge's view, straight from the rows: stored sequence s trains label s[j + 1] where loss_mask[j].
    expect = []
    for row in rows:
        bounds = row["seq_start_id"] + [len(row["input_ids"])]
        for a, b in zip(bounds[:-1], bounds[1:]):
            seq, m = row["input_ids"][a:b], row["loss_mask"][a:b]
            trained = tuple(j for j in range(b - a) if m[j])
            expect.append((seq, trained))
    batches = {}
    for name in ("train.idx.parquet", "train.npy"):
        ld = loader(tmp_path / name, G=len(rows))
        batches[name] = batch = next(ld)
        got = trained_pairs(batch)
        assert len(got) == len(expect) == len(samples)
        # Each document is its Bridge sequence up to its last trained label (the EOS padding and
        # anything after it cannot change a trained prediction), training exactly Bridge's labels.
        want = sorted((tuple(seq[: max(t) + 2]), t) for seq, t in expect)
        assert got == want
        assert (
            batch.trained_tokens
            == sum(len(t) for _, t in expect)
            == sum(int(s.target_mask.sum()) for s in samples)
        )
        for mb in batch.microbatches:
            mb.validate(divisor=4)
    a, b = (batches[n].microbatches for n in ("train.idx.parquet", "train.npy"))
    assert all(x.tokens.equal(y.tokens) and x.loss_mask.equal(y.loss_mask) for x, y in zip(a, b, strict=True))


def test_bridge_pack_errors(tmp_path):
    rows = bridge_rows([encode_conversation(TOK, c) for c in conversations(4)])
    write_parquet(rows, tmp_path / "ok.idx.parquet")
    with pytest.raises(ValueError, match="cannot be trained row by row here .* data.packed_replan = true"):
        loader(tmp_path / "ok.idx.parquet", replan=False)
    bad = [dict(rows[0], seq_start_id=[3] + rows[0]["seq_start_id"][1:])]
    write_parquet(bad, tmp_path / "start.idx.parquet")
    with pytest.raises(ValueError, match=r"row 0: seq_start_id \[3, .* must start at 0"):
        loader(tmp_path / "start.idx.parquet")
    bad = [dict(rows[0], loss_mask=rows[0]["loss_mask"][:-1])]
    write_parquet(bad, tmp_path / "mask.idx.parquet")
    with pytest.raises(ValueError, match="row 0: .* loss_mask entries for .* input_ids"):
        loader(tmp_path / "mask.idx.parquet")
    bad = [dict(rows[0], input_ids=rows[0]["input_ids"][:-1] + [999])]
    write_parquet(bad, tmp_path / "vocab.idx.parquet")
    with pytest.raises(
        ValueError, match=r"token ids span \d+..999, outside data.tokenizer's vocab_size = 264"
    ):
        loader(tmp_path / "vocab.idx.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}), tmp_path / "cols.idx.parquet")
    with pytest.raises(ValueError, match=r"columns \['seq_start_id'\] missing"):
        loader(tmp_path / "cols.idx.parquet")
    np.save(tmp_path / "ints.npy", np.arange(5))
    with pytest.raises(ValueError, match="expected a 1-D object array of dicts"):
        loader(tmp_path / "ints.npy")
