"""Mock dataset: sample lengths from a distribution or a CSV file, tokens generated on demand.

Distribution mode (Megatron's `MockSFTLowLevelDataset`, docs/thd_reference.md §6.1):
    {mode = "distribution", type = "lognormal", min_seq_len, max_seq_len, mean_seq_len, lognormal_sigma}
    mu = ln(mean_seq_len) - sigma^2 / 2, lengths = lognormal(mu, sigma) drawn with numpy's legacy
    `RandomState(seed)`, clipped to [min_seq_len, max_seq_len], truncated to int. The clip makes
    the realised mean differ from `mean_seq_len`.
File mode:
    {mode = "file", path = "lengths.csv"}: comma / newline separated positive integers, with or
    without a header line (a first line that is not all integers is a header; Megatron's
    pandas reader silently dropped the first length of a headerless file).
    num_samples = 0 takes the file as is, otherwise its lengths repeat cyclically to num_samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from titan_thd.data.sources import resolve_data_path

DEFAULT_NUM_SAMPLES = 100_000
_DISTRIBUTION_KEYS = ("mode", "type", "min_seq_len", "max_seq_len", "mean_seq_len", "lognormal_sigma")
_FILE_KEYS = ("mode", "path")


def mock_lengths(mock_config: dict, num_samples: int, seed: int) -> np.ndarray:
    """[num_samples] int64 sample lengths (num_samples = 0: the mode's default, see module doc)."""
    if num_samples < 0:
        raise ValueError(f"data.num_samples: got {num_samples}, expected >= 0")
    mode = mock_config.get("mode")
    if mode == "distribution":
        _check_keys(mock_config, _DISTRIBUTION_KEYS)
        return _lognormal_lengths(mock_config, num_samples or DEFAULT_NUM_SAMPLES, seed)
    if mode == "file":
        _check_keys(mock_config, _FILE_KEYS)
        path = mock_config["path"]
        if not isinstance(path, str) or not path:
            raise ValueError(
                f"data.mock_config.path: got {path!r}, expected a string (a CSV file of lengths)"
            )
        lengths = read_lengths_csv(path)
        if num_samples:
            lengths = np.resize(lengths, num_samples)
        return lengths
    raise ValueError(f"data.mock_config.mode: got {mode!r}, expected 'distribution' or 'file'")


def mock_tokens(
    index: int, length: int, vocab_lo: int, vocab_hi: int, seed: int, exclude: Sequence[int] = ()
) -> np.ndarray:
    """[length] int32 ids drawn uniformly from [vocab_lo, vocab_hi) minus `exclude` (special ids),
    a pure function of (seed, index)."""
    skip = sorted({e for e in exclude if vocab_lo <= e < vocab_hi})
    span = vocab_hi - vocab_lo - len(skip)
    if span <= 0:
        raise ValueError(f"no token ids left in [{vocab_lo}, {vocab_hi}) after excluding {skip}")
    ids = np.random.default_rng([seed, index]).integers(0, span, size=length, dtype=np.int64) + vocab_lo
    # Shift past each excluded id in ascending order: a bijection onto the allowed ids.
    for e in skip:
        ids[ids >= e] += 1
    return ids.astype(np.int32)


def read_lengths_csv(path: str | Path) -> np.ndarray:
    """Positive integer lengths of a CSV file, header line optional."""
    path = resolve_data_path(path, field="data.mock_config.path")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"data.mock_config.path: cannot read {path}: {e}") from e
    lengths: list[int] = []
    seen_content = False
    for lineno, line in enumerate(lines, start=1):
        cells = [c.strip() for c in line.split(",") if c.strip()]
        if not cells:
            continue
        is_header = not seen_content and not all(_is_int(c) for c in cells)
        seen_content = True
        if is_header:
            continue
        for cell in cells:
            if not _is_int(cell) or int(cell) <= 0:
                raise ValueError(f"{path}:{lineno}: expected a positive integer length, got {cell!r}")
            lengths.append(int(cell))
    if not lengths:
        raise ValueError(f"{path}: no lengths found (empty dataset)")
    return np.asarray(lengths, dtype=np.int64)


def _lognormal_lengths(cfg: dict, num_samples: int, seed: int) -> np.ndarray:
    if cfg["type"] != "lognormal":
        raise ValueError(f"data.mock_config.type: got {cfg['type']!r}, expected 'lognormal'")
    lo, hi, mean = (_positive_int(cfg, k) for k in ("min_seq_len", "max_seq_len", "mean_seq_len"))
    sigma = cfg["lognormal_sigma"]
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma >= 0:
        raise ValueError(f"data.mock_config.lognormal_sigma: got {sigma!r}, expected a number >= 0")
    if lo > hi:
        raise ValueError(f"data.mock_config: min_seq_len = {lo} > max_seq_len = {hi}")
    mu = math.log(mean) - sigma**2 / 2
    draws = np.random.RandomState(seed).lognormal(mu, sigma, num_samples)
    return np.clip(draws, lo, hi).astype(np.int64)


def _check_keys(cfg: dict, expected: tuple[str, ...]) -> None:
    missing = [k for k in expected if k not in cfg]
    unknown = [k for k in cfg if k not in expected]
    if missing or unknown:
        raise ValueError(
            f"data.mock_config (mode = {cfg['mode']!r}): missing keys {missing}, unknown keys {unknown}; "
            f"expected exactly {list(expected)}"
        )


def _positive_int(cfg: dict, key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"data.mock_config.{key}: got {value!r}, expected a positive integer")
    return value


def _is_int(text: str) -> bool:
    return text.lstrip("+-").isdigit()
