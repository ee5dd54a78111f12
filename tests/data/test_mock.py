import numpy as np
import pytest

from titan_thd.data.mock import DEFAULT_NUM_SAMPLES, mock_lengths, mock_tokens


def dist(lo, hi, mean, sigma, **extra):
    return {"mode": "distribution", "type": "lognormal", "min_seq_len": lo, "max_seq_len": hi,
            "mean_seq_len": mean, "lognormal_sigma": sigma, **extra}  # fmt: skip


def test_lognormal_vectors_from_the_spec():
    # docs/thd_reference.md §6.1 (numpy legacy RNG, seed 0)
    lengths = mock_lengths(dist(1024, 2048, 1536, 1.1), 8, seed=0)
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [2048, 1302, 2048, 2048, 2048, 1024, 2048, 1024]
    assert mock_lengths(dist(2048, 4096, 3072, 1.1), 8, seed=0).tolist() == [
        4096,
        2605,
        4096,
        4096,
        4096,
        2048,
        4096,
        2048,
    ]


def test_lognormal_realised_statistics_match_the_spec():
    lengths = mock_lengths(dist(1024, 2048, 1536, 1.1), 1_000_000, seed=0)
    assert np.mean(lengths == 1024) == pytest.approx(0.571, abs=1e-3)
    assert np.mean(lengths == 2048) == pytest.approx(0.209, abs=1e-3)
    assert lengths.mean() == pytest.approx(1331.8, abs=0.1)


def test_default_size_and_seed_dependence():
    cfg = dist(16, 1024, 192, 1.0)
    assert len(mock_lengths(cfg, 0, seed=1)) == DEFAULT_NUM_SAMPLES
    a, b = mock_lengths(cfg, 64, seed=1), mock_lengths(cfg, 64, seed=2)
    assert a.tolist() == mock_lengths(cfg, 64, seed=1).tolist() and a.tolist() != b.tolist()
    assert a.min() >= 16 and a.max() <= 1024


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5\n7\n9\n", [5, 7, 9]),  # headerless: the first length is kept
        ("length\n5\n7\n", [5, 7]),
        ("\nseq_len,other\n5,6\n\n7\n", [5, 6, 7]),
        ("3,4,5", [3, 4, 5]),
    ],
)
def test_lengths_csv(tmp_path, text, expected):
    path = tmp_path / "lengths.csv"
    path.write_text(text)
    assert mock_lengths({"mode": "file", "path": str(path)}, 0, seed=0).tolist() == expected


def test_lengths_csv_cycles_to_num_samples(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("5\n7\n9\n")
    assert mock_lengths({"mode": "file", "path": str(path)}, 7, seed=0).tolist() == [5, 7, 9, 5, 7, 9, 5]


@pytest.mark.parametrize(
    "text, match",
    [("5\nabc\n", r"lengths.csv:2: expected a positive integer length, got 'abc'"),
     ("5\n0\n", r"lengths.csv:2: .*got '0'"),
     ("header\n", "no lengths found")],
)  # fmt: skip
def test_lengths_csv_errors(tmp_path, text, match):
    path = tmp_path / "lengths.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        mock_lengths({"mode": "file", "path": str(path)}, 0, seed=0)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"mode": "uniform"}, "mode: got 'uniform'"),
        ({**dist(1, 2, 1, 1.0), "type": "normal"}, "type: got 'normal'"),
        (
            {k: v for k, v in dist(1, 2, 1, 1.0).items() if k != "mean_seq_len"},
            r"missing keys \['mean_seq_len'\]",
        ),
        (dist(1, 2, 1, 1.0, max_len=3), r"unknown keys \['max_len'\]"),
        (dist(64, 32, 48, 1.0), "min_seq_len = 64 > max_seq_len = 32"),
        (dist(0, 32, 16, 1.0), "min_seq_len: got 0"),
        (dist(8, 32, -1, 1.0), "mean_seq_len: got -1"),
        (dist(8, 32, 16, -0.5), "lognormal_sigma: got -0.5"),
        ({"mode": "file"}, r"missing keys \['path'\]"),
        (
            {"mode": "file", "path": "/nonexistent/lengths.csv"},
            "data.mock_config.path: '/nonexistent/lengths.csv' not found",
        ),
    ],
)
def test_config_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        mock_lengths(cfg, 10, seed=0)


def test_mock_tokens_deterministic_in_range_and_avoid_specials():
    exclude = [0, 5, 9, 12]  # ids inside the range (12 is outside [0, 12))
    a = mock_tokens(3, 5000, 0, 12, seed=7, exclude=exclude)
    assert a.dtype == np.int32 and len(a) == 5000
    assert np.array_equal(a, mock_tokens(3, 5000, 0, 12, seed=7, exclude=exclude))
    assert not np.array_equal(a, mock_tokens(4, 5000, 0, 12, seed=7, exclude=exclude))
    assert not np.array_equal(a, mock_tokens(3, 5000, 0, 12, seed=8, exclude=exclude))
    assert sorted(set(a.tolist())) == [1, 2, 3, 4, 6, 7, 8, 10, 11]  # every allowed id, nothing else
    b = mock_tokens(0, 1000, 100, 110, seed=0)
    assert b.min() >= 100 and b.max() < 110
    with pytest.raises(ValueError, match="no token ids left"):
        mock_tokens(0, 4, 0, 2, seed=0, exclude=[0, 1])
