"""Charts (matplotlib, no pyplot state): per-device memory stacked by state, and sweeps.

Every chart reads rows of the JSON report (``memory.per_device``), never an ``Analysis``, so the
chart and the numbers printed beside it cannot disagree. Sizes are plotted in GB (1e9 bytes).
Titles and labels are drawn as plain text: a model name from a user's config.json may hold
``$``, which matplotlib would otherwise parse as mathematics (and fail on).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from formal.errors import InputError

STACK = ("parameters", "gradients", "optimizer", "activations", "buffers")
COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",
    "buffers": "#8172b3",
}
GB = 1e9


def _stack(
    ax: object, labels: Sequence[str], rows: Sequence[Mapping[str, int | None]], device_memory: int | None
) -> None:
    bottoms = [0.0] * len(rows)
    for state in STACK:
        heights = [(row.get(state) or 0) / GB for row in rows]
        ax.bar(labels, heights, bottom=bottoms, label=state, color=COLORS[state])  # type: ignore[attr-defined]
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    if device_memory:
        ax.axhline(  # type: ignore[attr-defined]
            device_memory / GB,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"device memory {device_memory / GB:.0f} GB",
        )
    ax.set_ylabel("GB per device (1e9 bytes)")  # type: ignore[attr-defined]
    # beside the bars, never over them (a bar of activations reaches the top of the axes)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # type: ignore[attr-defined]
    ax.tick_params(axis="x", labelrotation=20)  # type: ignore[attr-defined]


def memory_chart(
    labels: Sequence[str],
    rows: Sequence[Mapping[str, int | None]],
    device_memory: int | None,
    title: str,
    fmt: str = "png",
) -> bytes:
    """A stacked bar per composition: bytes per device by state (most loaded device)."""
    with rc_context({"text.parse_math": False, "text.usetex": False}):
        fig = Figure(figsize=(max(7.0, 1.2 * len(labels) + 3), 4.5), layout="constrained")
        ax = fig.add_subplot()
        _stack(ax, labels, rows, device_memory)
        ax.set_title(title)
        return _render(fig, fmt)


def stage_chart(
    rows: Sequence[Mapping[str, int | None]], device_memory: int | None, title: str, fmt: str = "png"
) -> bytes:
    """A stacked bar per pipeline stage (``memory.per_stage`` rows, stage 0 first): what a device
    of each stage holds, by state."""
    labels = [f"stage {row['stage']}" for row in rows]
    with rc_context({"text.parse_math": False, "text.usetex": False}):
        fig = Figure(figsize=(min(16.0, max(7.0, 0.6 * len(labels) + 4)), 4.5), layout="constrained")
        ax = fig.add_subplot()
        _stack(ax, labels, rows, device_memory)
        ax.set_xlabel("pipeline stage")
        ax.set_title(title)
        return _render(fig, fmt)


def sweep_chart(
    labels: Sequence[str],
    rows: Sequence[Mapping[str, int | None]],
    traffic: Sequence[int],
    device_memory: int | None,
    title: str,
    fmt: str = "png",
) -> bytes:
    """Memory (stacked) and network bytes per device per step, against the swept degree."""
    with rc_context({"text.parse_math": False, "text.usetex": False}):
        fig = Figure(figsize=(max(7.0, 1.2 * len(labels) + 4), 7.5), layout="constrained")
        top, bottom = fig.subplots(2, 1)
        _stack(top, labels, rows, device_memory)
        top.set_title(title)
        bottom.plot(labels, [t / GB for t in traffic], marker="o", color="#333333")
        bottom.set_ylabel("network GB per device per step")
        bottom.set_xlabel("swept value")
        bottom.grid(True, alpha=0.3)
        return _render(fig, fmt)


def _render(fig: Figure, fmt: str) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=110)
    return buffer.getvalue()


def chart_format(path: Path) -> str:
    """PNG or SVG from the file name; anything else is refused (one line, exit 2)."""
    match path.suffix.lower():
        case ".png":
            return "png"
        case ".svg":
            return "svg"
        case _:
            raise InputError(f"--chart {path}: expected a .png or .svg file name")
