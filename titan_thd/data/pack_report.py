"""Packing report: padding waste and the document length histogram of a pack (docs/data.md §1).

`scripts/prepare_packed_data.py` prints it and writes the histogram as a PNG next to the pack:
with matplotlib when it is installed (an optional extra), else as plain bars by the tiny PNG writer
below (zlib only), so the report never needs more than numpy.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np


def padding_summary(lengths: np.ndarray, padded: np.ndarray, num_rows: int, T: int) -> dict:
    """Token slots of `num_rows` rows of T split into real tokens, per-document alignment padding and
    the tail padding of each row; `waste` = padding / slots."""
    slots = num_rows * T
    real, aligned = int(np.sum(lengths)), int(np.sum(padded))
    return {
        "slots": slots,
        "real": real,
        "alignment_padding": aligned - real,
        "tail_padding": slots - aligned,
        "waste": (slots - real) / slots if slots else 0.0,
    }


def length_histogram(lengths: np.ndarray, T: int, bins: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(edges [bins + 1], counts [bins]) of document lengths over equal-width bins of 0..T."""
    edges = np.unique(np.linspace(0, T, bins + 1).round().astype(np.int64))
    counts, _ = np.histogram(np.asarray(lengths), bins=edges)
    return edges, counts.astype(np.int64)


def format_report(summary: dict, edges: np.ndarray, counts: np.ndarray, width: int = 40) -> str:
    """The report as text: the padding split, then one bar per length bin."""
    s = summary
    lines = [
        f"token slots {s['slots']}: real {s['real']}, alignment padding {s['alignment_padding']}, "
        f"row tail padding {s['tail_padding']} -> padding waste {100 * s['waste']:.2f} %",
        "document lengths:",
    ]
    top = max(int(counts.max()), 1) if counts.size else 1
    for lo, hi, n in zip(edges[:-1].tolist(), edges[1:].tolist(), counts.tolist()):
        lines.append(f"  [{lo:>7}, {hi:>7}) {n:>8}  {'#' * round(width * n / top)}")
    return "\n".join(lines)


# ============================================================================ PNG
BAR_WIDTH, PLOT_HEIGHT, MARGIN = 12, 120, 4
"""Geometry of the fallback chart: one bar of BAR_WIDTH pixels per bin, the tallest PLOT_HEIGHT high."""


def bar_heights(counts: np.ndarray) -> np.ndarray:
    """Pixel height of each bar of the fallback chart (the tallest bar is PLOT_HEIGHT)."""
    top = max(int(np.max(counts)), 1) if counts.size else 1
    return np.round(np.asarray(counts) * PLOT_HEIGHT / top).astype(np.int64)


def png_bytes(gray: np.ndarray) -> bytes:
    """An 8-bit grayscale PNG of `gray` ([H, W] uint8)."""
    h, w = gray.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), gray.astype(np.uint8)], axis=1)  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)  # 8-bit, grayscale, deflate, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def bars_png(counts: np.ndarray) -> bytes:
    """The fallback chart: black bars on white, bin i in columns MARGIN + i*BAR_WIDTH + [1, BAR_WIDTH - 1)."""
    heights = bar_heights(counts)
    h, w = PLOT_HEIGHT + 2 * MARGIN, len(heights) * BAR_WIDTH + 2 * MARGIN
    img = np.full((h, w), 255, np.uint8)
    base = MARGIN + PLOT_HEIGHT  # first row below the plot
    for i, bar in enumerate(heights.tolist()):
        x = MARGIN + i * BAR_WIDTH
        img[base - bar : base, x + 1 : x + BAR_WIDTH - 1] = 0
    img[base, MARGIN : w - MARGIN] = 128  # axis line
    return png_bytes(img)


def write_histogram_png(path: str | Path, edges: np.ndarray, counts: np.ndarray, title: str = "") -> str:
    """Write the histogram to `path`; returns which writer made it (`matplotlib` or `builtin`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        Path(path).write_bytes(bars_png(counts))
        return "builtin"
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", edgecolor="black")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"
