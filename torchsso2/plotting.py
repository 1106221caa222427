"""Plotting helpers (optional dependency: ``pip install matplotlib``).

matplotlib is imported lazily inside each function, and figures are rendered
with the Agg canvas directly (``matplotlib.figure.Figure`` +
``FigureCanvasAgg``), so neither pyplot's global figure registry nor the
process-wide backend is touched.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping, Optional, Union

from torchsso2.metrics import ReliabilityData

__all__ = ["save_reliability_diagram"]

_INSTALL_HINT = "pip install matplotlib (or, from a checkout, pip install -e \".[plot]\")"


def _import_matplotlib():
    """Return ``(Figure, FigureCanvasAgg)`` or raise ImportError with the install hint."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            f"save_reliability_diagram requires matplotlib: {_INSTALL_HINT}"
        ) from exc
    return Figure, FigureCanvasAgg


def save_reliability_diagram(
    data: Union[ReliabilityData, Mapping[str, ReliabilityData]],
    path: Union[str, "os.PathLike[str]"],
    title: Optional[str] = None,
) -> Path:
    """Draw a reliability diagram (or several side by side) and save it (PNG, or the suffix's format).

    Each panel shows, per confidence bin, a bar whose height is the bin's
    accuracy, the shaded gap between accuracy and the bin's mean confidence,
    and the diagonal of perfect calibration; the ECE is given in the legend.
    Empty bins are left blank.

    Args:
        data: one :class:`~torchsso2.metrics.ReliabilityData` (from
            :func:`torchsso2.metrics.reliability_diagram_data`) or a non-empty
            mapping ``name -> ReliabilityData`` to draw one panel per model.
        path: output file; its suffix picks the format where it is one matplotlib writes (``.png``,
            ``.pdf``, ``.svg``, ...), else PNG (no suffix, or a dotted name like ``rel_lr0.1``). The parent
            directory must exist.
        title: optional figure title.

    Returns:
        ``Path(path)``.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
        TypeError: ``data`` is not a ReliabilityData or a mapping of them.
        ValueError: ``data`` is an empty mapping, or two of its names are the same as strings (``1`` and
            ``"1"``: one panel would hide the other).
    """
    if isinstance(data, ReliabilityData):
        panels = {"": data}
    elif isinstance(data, Mapping):
        if len(data) == 0:
            raise ValueError("data must be a ReliabilityData or a non-empty dict name -> ReliabilityData, got {}")
        panels = {}
        for name, d in data.items():
            if not isinstance(d, ReliabilityData):
                raise TypeError(
                    f"data[{name!r}] must be a ReliabilityData (from metrics.reliability_diagram_data), "
                    f"got {type(d).__name__}"
                )
            if str(name) in panels:
                raise ValueError(f"data has two panels named {str(name)!r} (as strings): one would hide the other")
            panels[str(name)] = d
    else:
        raise TypeError(
            f"data must be a ReliabilityData or a dict name -> ReliabilityData, got {type(data).__name__}"
        )

    Figure, FigureCanvasAgg = _import_matplotlib()

    n = len(panels)
    fig = Figure(figsize=(4.0 * n, 4.3 if title else 4.0), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for i, (ax, (name, d)) in enumerate(zip(axes, panels.items())):
        edges = d.bin_edges.double().cpu().tolist()
        lefts = edges[:-1]
        widths = [hi - lo for lo, hi in zip(edges[:-1], edges[1:])]
        acc = d.bin_accuracy.double().cpu().tolist()
        conf = d.bin_confidence.double().cpu().tolist()
        keep = [j for j, cnt in enumerate(d.bin_count.tolist()) if cnt > 0]

        ax.bar(
            [lefts[j] for j in keep], [acc[j] for j in keep], width=[widths[j] for j in keep],
            align="edge", color="tab:blue", edgecolor="black", linewidth=0.6, label="Accuracy",
        )
        ax.bar(
            [lefts[j] for j in keep], [conf[j] - acc[j] for j in keep], bottom=[acc[j] for j in keep],
            width=[widths[j] for j in keep], align="edge", color="tab:red", alpha=0.3,
            edgecolor="tab:red", hatch="//", linewidth=0.6, label="Gap",
        )
        ax.plot([0.0, 1.0], [0.0, 1.0], linestyle="--", color="gray", linewidth=1.0, label="Perfect calibration")
        ece = d.ece if d.n_examples > 0 else math.nan
        # Invisible handle so that the ECE shows up as a legend entry.
        ax.plot([], [], " ", label=f"ECE = {100.0 * ece:.2f}%")
        ax.set_xlim(0.0, 1.0)
        ax.set_ylim(0.0, 1.0)
        ax.set_aspect("equal")
        ax.set_xlabel("Confidence")
        if i == 0:
            ax.set_ylabel("Accuracy")
        if name:
            ax.set_title(name)
        ax.legend(loc="upper left", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fmt = out.suffix[1:].lower()
    if fmt not in fig.canvas.get_supported_filetypes():
        fmt = "png"
    fig.savefig(out, format=fmt, bbox_inches="tight")  # tight_layout alone clips the x label under equal aspect
    return out
