"""Offline packs that balance: the documents of a step's packed rows planned again over the DP ranks
(data.packed_replan), and the packing report (padding waste, length histogram, PNG)."""

import json
import struct
import zlib
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.data.test_offline_packing import MULT, T, pack, reference_store, source  # noqa: F401
from titan_thd.config import Data
from titan_thd.data.dataloader import DataLayout, build_dataloader
from titan_thd.data.pack_report import BAR_WIDTH, MARGIN, PLOT_HEIGHT, bars_png
from titan_thd.data.packed_dataset import open_packed
from titan_thd.data.rows import full_rows
from titan_thd.data.sampler import global_batch_indices

COST = 1 / 64  # attention work matters: a row of long documents costs more than one of short ones
G = 8  # packed rows per step


def loader(path, dp_rank, replan, T_cfg=T, pad=MULT, G=4):
    cfg = Data(source="packed", path=str(path), pad_to_multiple=pad, packed_replan=replan)
    return build_dataloader(
        cfg,
        None,
        DataLayout(
            dp_rank=dp_rank,
            dp=2,
            cp=1,
            rule=full_rows(T_cfg),
            global_batch_size=G,
            seed=1,
            planner="balanced",
            cost_attention=COST,
            pad_to_multiple=cfg.pad_to_multiple,
        ),
    )


def documents(batch):
    """The real token sequences of every document of a StepBatch's microbatches."""
    out = []
    for mb in batch.microbatches:
        mb.validate()
        cup, lens = mb.cu_seqlens_padded.tolist(), mb.seqlens.tolist()
        out += [tuple(mb.tokens[a : a + n].tolist()) for a, n in zip(cup, lens) if n > 0]
    return out


def replica_cost(batch):
    """The planner's cost model: P + b P^2 per document of padded length P (the tail padding is free)."""
    return sum(
        p + COST * p * p
        for mb in batch.microbatches
        for n, p in zip(mb.seqlens.tolist(), mb.seqlens_padded.tolist())
        if n > 0
    )


def test_replanned_rows_train_the_same_documents_balanced(source, tmp_path):  # noqa: F811
    pack(source, tmp_path / "p")  # first fit decreasing: long documents share the first rows
    store = reference_store(source)
    rows = open_packed(tmp_path / "p")
    index = pq.read_table(tmp_path / "p" / "rows.parquet").column("sample_index").to_pylist()
    # The replanned stream may use another T than the pack's: its documents are packed again.
    replan = [loader(tmp_path / "p", r, True, T_cfg=2 * T, G=G) for r in range(2)]
    fixed = [loader(tmp_path / "p", r, False, G=G) for r in range(2)]
    assert replan[0].overlong_counts == {"truncated": 1, "dropped": 0}
    unbalanced = 0
    for step in range(4):
        ids = global_batch_indices(step, G, len(rows), 1)
        new, old = [next(ld) for ld in replan], [next(ld) for ld in fixed]
        expected = Counter(tuple(store[i].input_ids.tolist()) for r in ids for i in index[r])
        assert Counter(d for b in new for d in documents(b)) == expected  # every document once, exact tokens
        assert Counter(d for b in old for d in documents(b)) == expected
        assert len({b.num_microbatches for b in new}) == 1
        trained = sum(int(mb.loss_mask.sum()) for b in new for mb in b.microbatches)
        assert all(b.trained_tokens == trained == old[0].trained_tokens for b in new)
        assert new[0].real_tokens == sum(map(len, expected.elements()))
        assert new[0].slot_tokens == 2 * new[0].num_microbatches * 2 * T
        costs_new = [replica_cost(b) for b in new]
        costs_old = [replica_cost(b) for b in old]
        assert new[0].imbalance == pytest.approx(max(costs_new) / np.mean(costs_new), rel=1e-12)
        assert max(costs_new) <= max(costs_old)  # never slower than the fixed rows, and balanced:
        assert max(costs_new) / np.mean(costs_new) < 1.01
        unbalanced += max(costs_old) / np.mean(costs_old) > 1.05
    assert unbalanced >= 2  # where whole rows per replica are not


def decode_png(data: bytes) -> np.ndarray:
    """[H, W] pixels of an 8-bit grayscale, unfiltered PNG, every chunk's CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 0) and b"IEND" in chunks
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, w + 1)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:]


def test_packing_report_padding_histogram_and_png(source, tmp_path, capsys):  # noqa: F811
    pack(source, tmp_path / "p")
    out = capsys.readouterr().out
    meta = json.loads((tmp_path / "p" / "metadata.json").read_text())
    store = reference_store(source)
    padded = -(-store.lengths // MULT) * MULT
    pad = meta["padding"]
    assert pad["slots"] == meta["num_rows"] * T and pad["real"] == int(store.lengths.sum())
    assert pad["alignment_padding"] == int((padded - store.lengths).sum())
    assert pad["tail_padding"] == meta["num_rows"] * T - int(padded.sum())
    assert pad["waste"] == (pad["slots"] - pad["real"]) / pad["slots"]
    assert f"padding waste {100 * pad['waste']:.2f} %" in out
    hist = meta["length_histogram"]
    assert hist["edges"][0] == 0 and hist["edges"][-1] == T and len(hist["counts"]) == 16
    # Independent count: lengths in [lo, hi), the last bin closed (T itself is the truncated document).
    lo, hi = np.array(hist["edges"][:-1]), np.array(hist["edges"][1:])
    expect = [int(((store.lengths >= a) & ((store.lengths < b) | (b == T))).sum()) for a, b in zip(lo, hi)]
    assert hist["counts"] == expect and sum(expect) == 80
    assert (tmp_path / "p" / "length_histogram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    img = decode_png(bars_png(np.array(expect)))
    assert img.shape == (PLOT_HEIGHT + 2 * MARGIN, 16 * BAR_WIDTH + 2 * MARGIN)
    for i, n in enumerate(expect):  # each bar's height in black pixels, the tallest PLOT_HEIGHT
        column = img[:, MARGIN + i * BAR_WIDTH + BAR_WIDTH // 2]
        assert int((column == 0).sum()) == round(n * PLOT_HEIGHT / max(expect))
