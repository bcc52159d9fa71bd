"""The charts of the state browser, drawn on the server as SVG with matplotlib.

Each chart is a figure on matplotlib's Agg canvas saved as SVG (``savefig(format="svg")``),
its text left as text (``svg.fonttype: none``: small, and in the page's font), inlined in the
page: no script draws anything in the browser. A series of more than ``MAX_BARS`` positions
(thousands of key groups) is an image inside the SVG, which one path would make megabytes.
The figures are made without pyplot, so no global figure state is shared between the
server's threads; the style is applied under a lock because matplotlib's settings are global.
Bytes are plotted in the binary unit that suits the largest value (KiB, MiB...), so the ticks
fall on round numbers of it.

* ``timeline``: bytes and rows of the table at each retained checkpoint;
* ``key_group_skew``: rows and bytes per key group at one checkpoint;
* ``files_per_unit``: segment files per unit (partition) at one checkpoint.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Sequence

import matplotlib
import numpy as np
from markupsafe import Markup
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

ROWS_COLOR = "#2f6fb0"
BYTES_COLOR = "#d9822b"
FILES_COLOR = "#4c9a6a"
MARK_COLOR = "#9a3b3b"
MEAN_COLOR = "#39424a"
# Above this many bars a series is drawn as one filled step line, as an image (thousands of bars are heavy SVG).
MAX_BARS = 256
WIDTH_IN = 9.0
# A bar chart of few positions is narrower than the page, this much per position (and a margin).
BAR_WIDTH_IN, MARGIN_IN = 0.45, 1.6
BYTE_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")
_STYLE = {
    "svg.fonttype": "none", "svg.hashsalt": "icestate", "font.size": 9, "font.family": "sans-serif",
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "axes.axisbelow": True,
    "grid.color": "#e3e6ea", "grid.linewidth": 0.8, "axes.edgecolor": "#8a939c", "axes.labelcolor": "#39424a",
    "xtick.color": "#5a636b", "ytick.color": "#5a636b", "legend.frameon": False, "figure.facecolor": "none",
    "axes.facecolor": "none",
}
_DRAWING = threading.Lock()


def timeline(checkpoint_ids: Sequence[int], rows: Sequence[int | None], sizes: Sequence[int | None],
             selected: int | None = None) -> Markup:
    """Bytes (left axis) and rows (right axis) of the whole table at each checkpoint, the
    ``selected`` one marked."""
    x = np.asarray(checkpoint_ids)
    scale, unit = byte_unit(max(_numbers(sizes), default=0))

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        ax.plot(x, _numbers(sizes) / scale, marker="o", markersize=4, color=BYTES_COLOR, label=f"bytes ({unit})")
        ax.set_ylabel(unit, color=BYTES_COLOR)
        right = ax.twinx()
        right.plot(x, _numbers(rows), marker="s", markersize=4, color=ROWS_COLOR, label="rows")
        right.set_ylabel("rows", color=ROWS_COLOR)
        right.yaxis.set_major_locator(MaxNLocator(integer=True))
        right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_count(v)))
        right.spines["right"].set_visible(True)
        right.grid(False)
        for axis in (ax, right):
            axis.set_ylim(bottom=0)
        ax.set_xlabel("checkpoint")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if selected is not None:
            ax.axvline(selected, color=MARK_COLOR, linestyle="--", linewidth=1, label=f"checkpoint {selected}")
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1), ncols=3, borderaxespad=0.2)
    return _svg(draw, WIDTH_IN, 2.8)


def key_group_skew(key_groups: Sequence[int], rows: Sequence[int], sizes: Sequence[int]) -> Markup:
    """Rows (top) and bytes (bottom) per key group, each with its mean."""
    x = np.asarray(key_groups)
    scale, unit = byte_unit(max(sizes, default=0))

    def draw(fig: Figure) -> None:
        top, bottom = fig.subplots(2, 1, sharex=True)
        _series(top, x, _numbers(rows), ROWS_COLOR, "rows", human_count)
        top.yaxis.set_major_locator(MaxNLocator(integer=True))
        _series(bottom, x, _numbers(sizes) / scale, BYTES_COLOR, unit, lambda v: human_bytes(v * scale))
        bottom.set_xlabel("key group")
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _svg(draw, _bar_chart_width(len(x)), 3.8)


def files_per_unit(units: Sequence[int], unit_count: int) -> Markup:
    """Segment files per unit: ``units`` holds each file's unit, ``unit_count`` is how many
    units the table has (those without files show as 0)."""
    counts = np.bincount(np.asarray(units, dtype=np.int64), minlength=unit_count)

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        _series(ax, np.arange(len(counts)), counts, FILES_COLOR, "files", human_count)
        ax.set_xlabel("unit")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return _svg(draw, _bar_chart_width(len(counts)), 2.4)


def _series(ax: Axes, x: np.ndarray, y: np.ndarray, color: str, label: str, mean_text: Callable[[float], str]) -> None:
    """One quantity over positions ``x``: bars, or a filled step line when there are many, and
    a dashed line at its mean (labelled by ``mean_text``); the legend above the plot."""
    if len(x) <= MAX_BARS:
        ax.bar(x, y, width=0.75, color=color, label=label)
    else:  # drawn as an image inside the SVG: one path of thousands of steps would weigh megabytes
        ax.fill_between(x, y, step="mid", color=color, alpha=0.85, linewidth=0, label=label, rasterized=True)
    ax.set_xlim(-0.6, len(x) - 0.4)
    if len(y):
        mean = float(np.mean(y))
        ax.axhline(mean, color=MEAN_COLOR, linestyle="--", linewidth=0.8, label=f"mean {mean_text(mean)}")
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)
    ax.grid(axis="x", visible=False)
    ax.legend(loc="lower right", bbox_to_anchor=(1, 1), ncols=2, borderaxespad=0.2)


def _bar_chart_width(positions: int) -> float:
    return min(WIDTH_IN, MARGIN_IN + BAR_WIDTH_IN * max(positions, 4))


def _svg(draw: Callable[[Figure], None], width: float, height: float) -> Markup:
    """The SVG element of a figure ``draw`` fills, ready to inline (no XML prologue)."""
    with _DRAWING, matplotlib.rc_context(_STYLE):
        fig = Figure(figsize=(width, height), layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", dpi=150, metadata={"Date": None})
    text = buffer.getvalue()
    # Made here from numbers and fixed labels (matplotlib escapes its text): safe to inline.
    return Markup(text[text.index("<svg"):])


def _numbers(values: Sequence[int | float | None]) -> np.ndarray:
    """Values with nulls as 0."""
    return np.asarray([0 if v is None else v for v in values], dtype=np.float64)


def byte_unit(largest: float) -> tuple[int, str]:
    """The binary unit to show sizes up to ``largest`` in, and its size in bytes."""
    power = 0
    while largest >= 1024 ** (power + 1) and power < len(BYTE_UNITS) - 1:
        power += 1
    return 1024 ** power, BYTE_UNITS[power]


def human_bytes(value: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    scale, unit = byte_unit(abs(value))
    return f"{value:.0f} B" if scale == 1 else f"{value / scale:.1f} {unit}"


def human_count(value: float) -> str:
    """``12500`` -> ``12.5k``."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
